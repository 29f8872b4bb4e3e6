#!/usr/bin/env python3
"""Fair share benchmark (issue 18, the paper's Figure 16 with weights): three volumes of 2 queues
on one tmpfs-backed device, one spool-bench client each (real libblkio, 4 KiB random reads, QD32
over 2 queues), all three at once. Each volume's share of the total IOPS against the share its
weight entitles it to: `[io] fair_share` off, then on (the default) with equal weights and
1:2:4 (set at run time with `volume qos --weight`). First with spoold and the clients on all
CPUs, then with spoold on CPU 0 and the clients on CPU 1 (the volumes share one worker core;
the clients, like VMs on their own vCPUs, do not take it).

    scripts/bench-share.py            # 10 s per case
    scripts/bench-share.py --quick    # 2 s per case, for CI (share-quick.*)
Results: docs/benchmarks/share.{json,md}.
"""

import os
import shutil

import benchlib as b
from benchlib import Spoold, dev, log, vol

VOLS = ["a", "b", "c"]
# Each spoold: `[io] fair_share`, where spoold and the clients run (None: every CPU), the
# weight sets measured one after the other; split: needs 2 cores.
RUNS = b.table(("name", "fair", "cpus", "server", "clients", "weights"), [
    ("`fair_share = false`", False, "all CPUs", None, None, [[100, 100, 100]]),
    ("fair share (default)", True, "all CPUs", None, None, [[100, 100, 100], [100, 200, 400]]),
    ("fair share (default)", True, "spoold on CPU 0, clients on CPU 1", "0", "1", [[100, 100, 100], [100, 200, 400]]),
])


def case(d, weights, secs, cpus=None):
    if set(weights) != {100}:
        for v, w in zip(VOLS, weights):
            d.call("volume_qos", id=v, weight=w)
    iops = [r["iops"] for r in b.results([b.start_bench(d.socks[v], cpus, rw="randread", bs=4096, qd=32, queues=2,
                                                        runtime=secs, size=256 << 20) for v in VOLS])]
    total = sum(iops)
    want = [w / sum(weights) for w in weights]
    got = [i / total for i in iops]
    dev = [100 * (g - w) / w for g, w in zip(got, want)]
    r = {"weights": weights, "iops": iops, "total": total, "share": got, "entitled": want,
         "deviation_pct": dev, "max_abs_deviation_pct": max(abs(x) for x in dev)}
    log(f"weights {weights}: IOPS {[round(i) for i in iops]}, worst {r['max_abs_deviation_pct']:.1f}% off")
    return r


def run(c, secs):
    work = b.workdir("spool-share.")
    with Spoold(work, [dev(f"{work}/dev.img", "2G")], [vol(v, "512M", 2) for v in VOLS],
                sections={"io": {"fair_share": c["fair"]}}, args=["--no-keeper"], cpus=c["server"]) as d:
        rows = [dict(case(d, w, secs, c["clients"]), binary=c["name"], cpus=c["cpus"]) for w in c["weights"]]
    shutil.rmtree(work)  # 768 MiB of /dev/shm otherwise
    return rows


def main():
    a = b.args(__doc__)
    secs = 2 if a.quick else 10
    runs = [c for c in RUNS if c["server"] is None or (os.cpu_count() or 1) >= 2]
    rows = [r for rs in b.run_cases(runs, lambda c: run(c, secs)) for r in rs]
    b.save("share", {"seconds": secs, "cases": rows}, md, a.quick)


def md(r):
    return b.notes("share", **r, table=b.md_table(
        ["spoold", "CPUs", "weights", "IOPS per volume", "total", "share (entitled)", "worst deviation"], [
            (x.get("binary", "fair share (default)"), x["cpus"], ":".join(str(w) for w in x["weights"]),
             ", ".join(f"{i / 1000:.0f}K" for i in x["iops"]), f"{x['total'] / 1000:.0f}K",
             ", ".join(f"{100 * g:.1f}% ({100 * w:.1f}%)" for g, w in zip(x["share"], x["entitled"])),
             f"{x['max_abs_deviation_pct']:.1f}%") for x in r["cases"]]))


if __name__ == "__main__":
    main()
