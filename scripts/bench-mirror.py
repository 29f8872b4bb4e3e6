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
    scripts/bench-mirror.py --quick    # 1 s per run, small volumes, for CI (checks it works)
Results: docs/benchmarks/mirror.{json,md}.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BIN, OUT, ctl, log  # noqa: E402


def start_spoold(work, size_mb):
    cfg = os.path.join(work, "spoold.toml")
    dev_mb = size_mb * 3
    with open(cfg, "w") as f:
        f.write(f"""state_dir = "{work}/state"
[journal]
enabled = true
dir = "{work}/journal"
[pool]
resync_rate = 0
auto_rebuild = false
""")
        for i in range(3):
            f.write(f'[[devices]]\npath = "{work}/d{i}.img"\ncreate_size = "{dev_mb}M"\n')
        f.write(f"""[[volumes]]
name = "plain"
size = "{size_mb}M"
num_queues = 1
[[volumes]]
name = "m"
size = "{size_mb}M"
num_queues = 1
mirror = 2
""")
    log_f = open(os.path.join(work, "spoold.log"), "w")
    p = subprocess.Popen([os.path.join(BIN, "spoold"), "-c", cfg, "--no-keeper"],
                         stdout=log_f, stderr=subprocess.STDOUT)
    rpc = os.path.join(work, "state", "spoold.sock")
    socks = {v: os.path.join(work, "state", "vhost", f"{v}.sock") for v in ("plain", "m")}
    for _ in range(200):
        if all(os.path.exists(s) for s in [rpc, *socks.values()]):
            return p, socks, rpc
        time.sleep(0.05)
    p.kill()
    sys.exit(f"spoold did not start (log: {work}/spoold.log)")


def bench(sock, secs, rw, qd, bs=4096):
    cmd = [os.path.join(BIN, "spool-bench"), "--socket", sock, "--rw", rw, "--bs", str(bs),
           "--iodepth", str(qd), "--runtime", str(secs), "--warmup", "0", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def mirror(rpc):
    return ctl(rpc, "volume", "show", "m")["mirror"]


def wait_current(rpc, timeout=600):
    t0 = time.monotonic()
    while True:
        m = mirror(rpc)
        if m["state"] == "healthy" and all(l["state"] == "current" for l in m["legs"]):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            sys.exit(f"mirror never rebuilt: {m}")
        time.sleep(0.05)


def side_by_side(socks, secs):
    rows = []
    for rw, qd in [("randwrite", 32), ("randread", 32), ("randwrite", 1), ("randread", 1)]:
        runs = {"plain": [], "m": []}
        for _ in range(3):
            for v in ("plain", "m"):
                runs[v].append(bench(socks[v], secs, rw, qd))
        med = {v: {k: statistics.median(r[k] for r in runs[v])
                   for k in ("iops", "lat_p50_us", "lat_p99_us")} for v in runs}
        row = {"rw": rw, "qd": qd, "plain": med["plain"], "mirror": med["m"],
               "ratio": med["m"]["iops"] / med["plain"]["iops"]}
        log(f"{rw} QD{qd}: plain {med['plain']['iops']:.0f} IOPS, mirrored "
            f"{med['m']['iops']:.0f} ({row['ratio']:.2f}x); p99 {med['plain']['lat_p99_us']:.1f}"
            f" vs {med['m']['lat_p99_us']:.1f} us")
        rows.append(row)
    return rows


def rebuild_under_load(socks, rpc, secs):
    """Foreground randwrite QD32 on m alone, then during a rebuild of one of its copies at
    the default rate (the copy rate of a rebuild is read when the mirror opens: a volume
    mirror add after the rate changed uses the new one)."""
    base = bench(socks["m"], secs, "randwrite", 32)["iops"]
    ctl(rpc, "volume", "mirror", "remove", "m")
    ctl(rpc, "volume", "mirror", "add", "m")
    t0 = time.monotonic()
    during = bench(socks["m"], secs, "randwrite", 32)
    took = wait_current(rpc) + (time.monotonic() - t0 - secs)
    share = during["iops"] / base
    log(f"foreground during a rebuild: {during['iops']:.0f} of {base:.0f} IOPS ({share:.0%})")
    return {"baseline_iops": base, "during_iops": during["iops"], "share": share,
            "rebuild_s_under_load": took}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s runs, small volumes (CI smoke)")
    args = ap.parse_args()
    secs, size_mb = (1, 64) if args.quick else (5, 1024)
    work = tempfile.mkdtemp(prefix="spool-mirror.", dir="/dev/shm")
    p, socks, rpc = start_spoold(work, size_mb)
    out = {"date": datetime.date.today().isoformat(), "runtime_s": secs, "size_mb": size_mb}
    try:
        for v in ("plain", "m"):  # the same layout for both: every block written once
            bench(socks[v], max(secs, 2), "write", 32, bs=1 << 20)
        wait_current(rpc)
        out["side_by_side"] = side_by_side(socks, secs)
        # Rebuild time per GiB, unlimited rate, no load.
        ctl(rpc, "volume", "mirror", "remove", "m")
        ctl(rpc, "volume", "mirror", "add", "m")
        took = wait_current(rpc)
        out["rebuild_s_per_gib"] = took * 1024 / size_mb
        log(f"rebuild of {size_mb} MiB (no load, unlimited rate): {took:.2f} s "
            f"({out['rebuild_s_per_gib']:.2f} s/GiB)")
    finally:
        p.terminate()
        p.wait()
    # Foreground share at the default copy rate: a spoold whose config keeps the default.
    with open(os.path.join(work, "spoold.toml")) as f:
        cfg = f.read().replace("resync_rate = 0\n", "")
    with open(os.path.join(work, "spoold.toml"), "w") as f:
        f.write(cfg)
    p = subprocess.Popen([os.path.join(BIN, "spoold"), "-c", os.path.join(work, "spoold.toml"),
                          "--no-keeper"], stdout=open(os.path.join(work, "spoold2.log"), "w"),
                         stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if os.path.exists(socks["m"]) and os.path.exists(rpc):
                break
            time.sleep(0.05)
        time.sleep(0.5)
        wait_current(rpc)
        out["rebuild_under_load"] = rebuild_under_load(socks, rpc, secs)
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(work, ignore_errors=True)  # the legs' files in /dev/shm otherwise
    if not args.quick:
        write_report(out)


def write_report(out):
    with open(os.path.join(OUT, "mirror.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"""# Mirrored volumes

Measured {out['date']} by `scripts/bench-mirror.py` on this 2-core machine (shared, noisy):
one spoold (release, journal on) on three tmpfs files, a plain and a 2-way mirrored volume
of {out['size_mb']} MiB each (both written once first), one spool-bench client (libblkio,
one queue), {out['runtime_s']} s per run, 3 runs per volume in ABAB order, medians.

| workload | plain IOPS | mirrored IOPS | mirrored/plain | p50 plain / mirrored (us) | p99 plain / mirrored (us) |
|---|---|---|---|---|---|"""]
    for r in out["side_by_side"]:
        a, b = r["plain"], r["mirror"]
        lines.append(f"| 4 KiB {r['rw']} QD{r['qd']} | {a['iops']:.0f} | {b['iops']:.0f} | "
                     f"{r['ratio']:.2f}x | {a['lat_p50_us']:.1f} / {b['lat_p50_us']:.1f} | "
                     f"{a['lat_p99_us']:.1f} / {b['lat_p99_us']:.1f} |")
    u = out["rebuild_under_load"]
    lines.append(f"""
Rebuild: a new copy of the {out['size_mb']} MiB volume, copy rate unlimited, no foreground
load: **{out['rebuild_s_per_gib']:.2f} s per GiB** (tmpfs: memory bandwidth and the worker's
CPU share, not a disk, bound it).

Foreground during a rebuild at the default copy rate (64 MiB/s): 4 KiB random writes at QD32
on the mirrored volume kept **{u['share']:.0%}** of their baseline ({u['during_iops']:.0f}
of {u['baseline_iops']:.0f} IOPS; target >= 70%); the rebuild took {u['rebuild_s_under_load']:.1f} s
under that load.
""")
    with open(os.path.join(OUT, "mirror.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
