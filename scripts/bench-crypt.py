#!/usr/bin/env python3
"""What encryption costs (issue 35): an encrypted volume against a plain one, side by side.

One spoold (release build, keeper, journal on tmpfs) serves two volumes of one queue from one
pool: "plain" and "enc" (`encrypt = true`). spool-bench's A/B mode drives both from one
libblkio client thread, switching every slice (ABBA), and reports enc/plain ratios of IOPS
with a 95% interval: 4K random reads and writes at QD32, 128K sequential reads and writes.
Three devices: a null device (stores nothing: spoold's software path and the cipher alone, the
worst case for the ratio), a file on tmpfs (data copied in and out at memory speed), and a file
on the machine's disk through O_DIRECT (a real device, written whole first; --quick skips
it). Then each volume alone with the server's CPU time per I/O, from which the cipher's rate
per core of spoold follows.

    scripts/bench-crypt.py             # 10 s per case
    scripts/bench-crypt.py --quick     # 1 s per case (checks it works)
Results: docs/benchmarks/encryption.json (docs/benchmarks/encryption.md discusses them).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, bin_dir, cpu_model, log, run_spoold  # noqa: E402
from benchlib import spool_bench as bench  # noqa: E402

DEVICES = {
    "null": '[[devices]]\npath = "null0"\nnull = "untouched"\ncreate_size = "4G"',
    "tmpfs": '[[devices]]\npath = "{shm}/d0.img"\ncreate_size = "2200M"',
    # A file on this machine's virtio disk, O_DIRECT through io_uring: a real device, whose
    # time per request dwarfs spoold's (the volumes are written whole first: reads of holes
    # would not reach it).
    "disk": '[[devices]]\npath = "{disk}/d0.img"\ncreate_size = "2200M"',
}
CASES = [("randread", 4096, 32), ("randwrite", 4096, 32), ("read", 131072, 8), ("write", 131072, 8)]


def start_spoold(work, shm, device):
    with open(os.path.join(work, "kek"), "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(os.path.join(work, "kek"), 0o600)
    return run_spoold(work, f"""state_dir = "{work}/state"
[journal]
dir = "{shm}/journal"
[encryption]
key_file = "{work}/kek"
{device}
[[volumes]]
name = "plain"
size = "1G"
num_queues = 1
[[volumes]]
name = "enc"
size = "1G"
num_queues = 1
encrypt = true
""", ("plain", "enc"))


def worker_pid(ctl_sock):
    out = subprocess.run([os.path.join(bin_dir(), "spoolctl"), "--socket", ctl_sock, "--json",
                          "status"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["pid"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    secs = 1 if a.quick else 10
    work = tempfile.mkdtemp(prefix="spool-crypt-")
    shm = tempfile.mkdtemp(prefix="spool-crypt-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="spool-crypt-", dir="/var/tmp")
    rows = []
    for kind, device in DEVICES.items():
        if a.quick and kind == "disk":
            continue
        rows += run_device(work, shm, kind, device.format(shm=shm, disk=disk), secs)
        subprocess.run(["rm", "-rf", disk + "/d0.img"])
        subprocess.run(["rm", "-rf", os.path.join(work, "state"), os.path.join(shm, "journal")])
    subprocess.run(["rm", "-rf", work, shm, disk])
    finish(a, rows, secs)


def run_device(work, shm, kind, device, secs):
    p, socks = start_spoold(work, shm, device)
    rows = []
    try:
        pid = worker_pid(os.path.join(work, "state", "spoold.sock"))
        if kind == "disk":
            for sock in socks.values():
                bench(["--socket", sock, "--rw", "write", "--bs", "1048576", "--iodepth", "4",
                       "--fill"])
        for rw, bs, qd in CASES:
            common = ["--rw", rw, "--bs", str(bs), "--iodepth", str(qd), "--queues", "1",
                      "--warmup", "0" if secs == 1 else "1", "--runtime", str(secs)]
            ab = bench(["--socket", socks["plain"], "--compare", socks["enc"], *common])
            alone = {v: bench(["--socket", socks[v], "--server-pid", str(pid), *common])
                     for v in ("plain", "enc")}
            row = {"device": kind, "rw": rw, "bs": bs, "iodepth": qd, "ab": ab, "alone": alone}
            rows.append(row)
            log(f"{rw} {bs}: A/B {json.dumps(ab)[:300]}")
            log(f"  alone {json.dumps(alone)[:400]}")
    finally:
        p.terminate()
        p.wait(timeout=30)
    return rows


def finish(a, rows, secs):
    res = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
           "cores": os.cpu_count(), "runtime_s": secs, "cases": rows}
    print(json.dumps(res) if a.quick else "")
    if not a.quick:
        with open(os.path.join(OUT, "encryption.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
