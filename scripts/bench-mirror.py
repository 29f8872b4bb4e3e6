#!/usr/bin/env python3
"""Mirrored volumes benchmark (issue 17): what a 2-way mirror costs against a plain volume,
how fast a copy is rebuilt, and what the foreground keeps during a rebuild.

One spoold (release build, journal on) on three tmpfs files serves a plain volume and a
2-way mirrored one, the same size, both written once first so they have the same layout;
one spool-bench client (real libblkio, one queue) drives them.

1. Plain vs mirrored, side by side: for each workload (4 KiB random read/write, QD1 and
   QD32) the two volumes take turns, 3 runs each in ABAB order; medians of IOPS and p50/p99
   latency, and the mirrored/plain ratio.
2. Rebuild time per GiB: a copy added to the mirrored volume (`volume mirror add`) with the
   copy rate unlimited and no foreground load, timed until the new leg is current.
3. Foreground share during a rebuild: 4 KiB random writes at QD32 on the mirrored volume
   alone, then while one of its copies is rebuilt at the default rate (64 MiB/s): the share of
   the baseline IOPS it keeps (target >= 70%), and how long the rebuild took under load.

    scripts/bench-mirror.py            # 5 s per run (about 2 minutes)
    scripts/bench-mirror.py --quick    # 1 s per run, small volumes, for CI (mirror-quick.*)
Results: docs/benchmarks/mirror.{json,md}.
"""

import sys
import time

import benchlib as b
from benchlib import Spoold, dev, log, median, vol

WORKLOADS = b.table(("rw", "qd"), [("randwrite", 32), ("randread", 32), ("randwrite", 1), ("randread", 1)])


def spoold(work, size_mb, pool):
    return Spoold(work, [dev(f"{work}/d{i}.img", f"{size_mb * 3}M") for i in range(3)],
                  [vol("plain", f"{size_mb}M"), vol("m", f"{size_mb}M", mirror=2)], sections={"pool": pool},
                  args=["--no-keeper"])


def bench(d, v, secs, rw, qd, bs=4096):
    return b.spool_bench(d.socks[v], rw=rw, bs=bs, qd=qd, runtime=secs, warmup=0)


def rebuild(d):
    """A copy of m dropped and added again: rebuilt from the other."""
    d.ctl("volume", "mirror", "remove", "m")
    d.ctl("volume", "mirror", "add", "m")


def wait_current(d, timeout=600):
    t0 = time.monotonic()
    while True:
        m = d.ctl("volume", "show", "m")["mirror"]
        if m["state"] == "healthy" and all(leg["state"] == "current" for leg in m["legs"]):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            sys.exit(f"mirror never rebuilt: {m}")
        time.sleep(0.05)


def side_by_side(d, secs):
    def row(w):
        runs = {"plain": [], "m": []}
        for _ in range(3):
            for v in runs:
                runs[v].append(bench(d, v, secs, w["rw"], w["qd"]))
        med = {v: {k: median(r[k] for r in runs[v]) for k in ("iops", "lat_p50_us", "lat_p99_us")} for v in runs}
        r = {"rw": w["rw"], "qd": w["qd"], "plain": med["plain"], "mirror": med["m"],
             "ratio": med["m"]["iops"] / med["plain"]["iops"]}
        log(f"{w['rw']} QD{w['qd']}: plain {med['plain']['iops']:.0f} IOPS, mirrored {med['m']['iops']:.0f}")
        return r
    return [row(w) for w in WORKLOADS]


def rebuild_under_load(d, secs):
    """Foreground randwrite QD32 on m alone, then during a rebuild of one of its copies at
    the default rate (the copy rate of a rebuild is read when the mirror opens: a volume
    mirror add after the rate changed uses the new one)."""
    base = bench(d, "m", secs, "randwrite", 32)["iops"]
    rebuild(d)
    t0 = time.monotonic()
    during = bench(d, "m", secs, "randwrite", 32)
    took = wait_current(d) + (time.monotonic() - t0 - secs)
    share = during["iops"] / base
    log(f"foreground during a rebuild: {during['iops']:.0f} of {base:.0f} IOPS ({share:.0%})")
    return {"baseline_iops": base, "during_iops": during["iops"], "share": share, "rebuild_s_under_load": took}


def main():
    a = b.args(__doc__)
    secs, size_mb = (1, 64) if a.quick else (5, 1024)
    work = b.workdir("spool-mirror.")
    out = {"runtime_s": secs, "size_mb": size_mb}
    with spoold(work, size_mb, {"resync_rate": 0, "auto_rebuild": False}) as d:
        for v in ("plain", "m"):  # the same layout for both: every block written once
            bench(d, v, max(secs, 2), "write", 32, bs=1 << 20)
        wait_current(d)
        out["side_by_side"] = side_by_side(d, secs)
        took = rebuild(d) or wait_current(d)  # rebuild time per GiB, unlimited rate, no load
        out["rebuild_s_per_gib"] = took * 1024 / size_mb
        log(f"rebuild of {size_mb} MiB (no load, unlimited rate): {took:.2f} s ({out['rebuild_s_per_gib']:.2f} s/GiB)")
    # Foreground share at the default copy rate: a spoold whose config keeps the default.
    with spoold(work, size_mb, {"auto_rebuild": False}) as d:
        time.sleep(0.5)
        wait_current(d)
        out["rebuild_under_load"] = rebuild_under_load(d, secs)
    b.save("mirror", out, md, a.quick)


def md(r):
    return b.notes("mirror", **r, u=r["rebuild_under_load"], table=b.md_table(
        ["workload", "plain IOPS", "mirrored IOPS", "mirrored/plain", "p50 plain / mirrored (us)",
         "p99 plain / mirrored (us)"], [
            (f"4 KiB {x['rw']} QD{x['qd']}", f"{x['plain']['iops']:.0f}", f"{x['mirror']['iops']:.0f}",
             f"{x['ratio']:.2f}x", f"{x['plain']['lat_p50_us']:.1f} / {x['mirror']['lat_p50_us']:.1f}",
             f"{x['plain']['lat_p99_us']:.1f} / {x['mirror']['lat_p99_us']:.1f}") for x in r["side_by_side"]]))


if __name__ == "__main__":
    main()
