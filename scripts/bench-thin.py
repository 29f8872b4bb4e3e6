#!/usr/bin/env python3
"""What thin provisioning costs (issue 34): a thin volume against a thick one, side by side.

One spoold (release build, keeper, journal on tmpfs) serves two volumes of one queue from one
pool with 4 MiB chunks: "thick" and "thin" (`thin = true`). First each is written whole with
4 MiB writes at QD1, so every write to the thin volume is a first write that waits for its
chunk (taken from the pool, zeroed, its map entry written durably): the difference in mean
latency is the first-write cost per chunk. Then spool-bench's A/B mode drives both from one
libblkio client thread, switching every slice (ABBA), and reports thin/thick ratios of IOPS
with a 95% interval: 4K random reads and writes at QD32, 128K sequential reads and writes.
Two devices: a file on tmpfs (the software path at memory speed: the worst case for the
ratio) and a file on the machine's disk through O_DIRECT (--quick skips it).

    scripts/bench-thin.py             # 10 s per case
    scripts/bench-thin.py --quick     # 1 s per case, tmpfs only (checks it works)
Results: docs/benchmarks/thin.json (docs/benchmarks/thin.md discusses them).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, cpu_model, log, run_spoold  # noqa: E402
from benchlib import spool_bench as bench  # noqa: E402

DEVICES = {
    "tmpfs": '[[devices]]\npath = "{shm}/d0.img"\ncreate_size = "2200M"',
    "disk": '[[devices]]\npath = "{disk}/d0.img"\ncreate_size = "2200M"',
}
CASES = [("randread", 4096, 32), ("randwrite", 4096, 32), ("read", 131072, 8), ("write", 131072, 8)]
VOLUMES = ("thick", "thin")


def start_spoold(work, shm, device):
    return run_spoold(work, f"""state_dir = "{work}/state"
[journal]
dir = "{shm}/journal"
[pool]
min_extent = "4M"
{device}
[[volumes]]
name = "thick"
size = "1G"
num_queues = 1
[[volumes]]
name = "thin"
size = "1G"
num_queues = 1
thin = true
""", VOLUMES)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    secs = 1 if a.quick else 10
    work = tempfile.mkdtemp(prefix="spool-thin-")
    shm = tempfile.mkdtemp(prefix="spool-thin-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="spool-thin-", dir="/var/tmp")
    rows, first = [], []
    for kind, device in DEVICES.items():
        if a.quick and kind == "disk":
            continue
        f, r = run_device(work, shm, kind, device.format(shm=shm, disk=disk), secs)
        first.append(f)
        rows += r
        subprocess.run(["rm", "-rf", disk + "/d0.img", shm + "/d0.img"])
        subprocess.run(["rm", "-rf", os.path.join(work, "state"), os.path.join(shm, "journal")])
    subprocess.run(["rm", "-rf", work, shm, disk])
    finish(a, first, rows, secs)


def run_device(work, shm, kind, device, secs):
    p, socks = start_spoold(work, shm, device)
    rows = []
    try:
        # Every write of the thin volume's fill is the first write of its chunk.
        fill = {v: bench(["--socket", socks[v], "--rw", "write", "--bs", str(4 << 20),
                          "--iodepth", "1", "--fill"]) for v in VOLUMES}
        first = {"device": kind, "fill": fill}
        log(f"{kind} first writes: {json.dumps(fill)[:400]}")
        for rw, bs, qd in CASES:
            common = ["--rw", rw, "--bs", str(bs), "--iodepth", str(qd), "--queues", "1",
                      "--warmup", "0" if secs == 1 else "1", "--runtime", str(secs)]
            ab = bench(["--socket", socks["thin"], "--compare", socks["thick"], *common])
            rows.append({"device": kind, "rw": rw, "bs": bs, "iodepth": qd, "ab": ab})
            log(f"{kind} {rw} {bs}: A/B {json.dumps(ab)[:300]}")
    finally:
        p.terminate()
        p.wait(timeout=30)
    return first, rows


def finish(a, first, rows, secs):
    res = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
           "cores": os.cpu_count(), "runtime_s": secs, "first_writes": first, "cases": rows}
    print(json.dumps(res) if a.quick else "")
    if not a.quick:
        with open(os.path.join(OUT, "thin.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
