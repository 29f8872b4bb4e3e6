#!/usr/bin/env python3
"""QoS caps benchmark (issue 18): how exactly spoold holds a volume to its I/O limits.

One spoold (release build, journal on) serves one volume on a tmpfs file; one spool-bench
client (real libblkio, 4 KiB random reads, QD32, one queue) drives it.

1. Unlimited: the volume's own rate (the reference the caps are set from).
2. IOPS cap at a quarter of that, burst 100 ms: the rate over the run (the first second,
   which may use the burst, left out) against the cap; the completions in the first 100 ms
   against the burst allowance.
3. Bandwidth cap (64 KiB reads) at a quarter of the unlimited bandwidth.
4. A cap changed at run time (lowered 10x mid-run): how long after the RPC returned the
   client's completion rate drops to the new cap (from the client's per-millisecond
   timeline; the client's clock starts when it connects, a few ms after it is launched, so
   the delay is measured from the RPC and rounded up to the next 10 ms bin).
5. Noisy neighbour: the p99 latency of a QD1 reader alone, next to a QD128 writer on
   another volume of the same device, and next to that writer capped.

    scripts/bench-qos.py            # 10 s per case (about 40 s)
    scripts/bench-qos.py --quick    # 2 s per case, for CI (checks it works)
Results: docs/benchmarks/qos.{json,md}.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BIN, OUT, ctl, log  # noqa: E402


def start_spoold(work):
    cfg = os.path.join(work, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(f"""state_dir = "{work}/state"
[journal]
enabled = true
dir = "{work}/journal"
[[devices]]
path = "{work}/dev.img"
create_size = "2G"
[[volumes]]
name = "v"
size = "1G"
num_queues = 1
[[volumes]]
name = "noisy"
size = "512M"
num_queues = 1
""")
    log_f = open(os.path.join(work, "spoold.log"), "w")
    p = subprocess.Popen([os.path.join(BIN, "spoold"), "-c", cfg, "--no-keeper"],
                         stdout=log_f, stderr=subprocess.STDOUT)
    sock = os.path.join(work, "state", "vhost", "v.sock")
    rpc_sock = os.path.join(work, "state", "spoold.sock")
    for _ in range(200):
        if os.path.exists(sock) and os.path.exists(rpc_sock):
            return p, sock, rpc_sock
        time.sleep(0.05)
    p.kill()
    sys.exit(f"spoold did not start (log: {work}/spoold.log)")


def set_qos(rpc_sock, vol="v", **limits):
    """Sets a volume's limits through the RPC (`volume_qos`)."""
    return ctl(rpc_sock, "rpc", "volume_qos", json.dumps({"id": vol, **limits}))


def bench(sock, secs, bs=4096, timeline=None, rw="randread", qd=32):
    cmd = [os.path.join(BIN, "spool-bench"), "--socket", sock, "--rw", rw,
           "--bs", str(bs), "--iodepth", str(qd), "--runtime", str(secs), "--warmup", "0",
           "--json"]
    if timeline:
        cmd += ["--timeline", timeline]
    return cmd


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def noisy_neighbour(sock, rpc_sock, secs):
    """Volume v at QD1 randread next to volume "noisy" at QD128 randwrite, same device:
    v's p99 latency alone, with the neighbour unlimited, and with it capped."""
    set_qos(rpc_sock, clear=True)
    noisy_sock = os.path.join(os.path.dirname(sock), "noisy.sock")
    out = {"alone": run(bench(sock, secs, qd=1))["lat_p99_us"]}
    for case, limits in [("neighbour unlimited", None),
                         ("neighbour capped", {"iops": 20000, "burst_ms": 100}),
                         ("neighbour in the batch class", {"priority": "batch"}),
                         ("v latency, neighbour batch", {"priority": "batch"})]:
        set_qos(rpc_sock, vol="noisy", clear=True)
        set_qos(rpc_sock, clear=True)
        if limits:
            set_qos(rpc_sock, vol="noisy", **limits)
        if case.startswith("v latency"):
            set_qos(rpc_sock, priority="latency")
        n = subprocess.Popen(bench(noisy_sock, secs + 1, rw="randwrite", qd=128),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        out[case] = run(bench(sock, secs, qd=1))["lat_p99_us"]
        out[case + " (its IOPS)"] = json.loads(n.communicate(timeout=120)[0])["iops"]
    set_qos(rpc_sock, vol="noisy", clear=True)
    set_qos(rpc_sock, clear=True)
    log(f"noisy neighbour: v p99 {out['alone']:.1f} us alone, "
        f"{out['neighbour unlimited']:.1f} us next to an unlimited QD128 writer, "
        f"{out['neighbour capped']:.1f} us next to it capped at 20k IOPS, "
        f"{out['neighbour in the batch class']:.1f} us next to it in the batch class, "
        f"{out['v latency, neighbour batch']:.1f} us with v latency and it batch")
    return out


def read_timeline(path):
    with open(path) as f:
        return [int(line.split(",")[1]) for line in f.read().splitlines()[1:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 s per case (CI smoke)")
    args = ap.parse_args()
    secs = 2 if args.quick else 10
    work = tempfile.mkdtemp(prefix="spool-qos.", dir="/dev/shm")
    p, sock, rpc_sock = start_spoold(work)
    rows = {}
    try:
        base = run(bench(sock, min(secs, 3)))
        base_iops = base["iops"]
        log(f"unlimited: {base_iops:.0f} IOPS")
        rows["unlimited_iops"] = base_iops

        cap = max(1000, int(base_iops / 4) // 1000 * 1000)
        set_qos(rpc_sock, iops=cap, burst_ms=100)
        tl = os.path.join(work, "cap.csv")
        run(bench(sock, secs, timeline=tl))
        t = read_timeline(tl)
        steady = sum(t[1000:secs * 1000]) / max(len(t[1000:secs * 1000]) / 1000, 1e-9)
        first = sum(t[:100])
        rows["iops_cap"] = {"cap": cap, "measured": steady,
                            "error_pct": 100 * (steady - cap) / cap,
                            "first_100ms": first, "burst_allowance": cap * 0.1}
        log(f"iops cap {cap}: {steady:.0f} IOPS ({rows['iops_cap']['error_pct']:+.2f}%), "
            f"first 100 ms: {first} completions (burst allowance {cap * 0.1:.0f} + rate)")

        set_qos(rpc_sock, clear=True)
        big = run(bench(sock, min(secs, 3), bs=65536))
        bw_cap = max(1 << 20, int(big["iops"] * 65536 / 4) >> 20 << 20)
        set_qos(rpc_sock, bps=bw_cap, burst_ms=100)
        tl = os.path.join(work, "bw.csv")
        run(bench(sock, secs, bs=65536, timeline=tl))
        t = read_timeline(tl)
        bw = 65536 * sum(t[1000:secs * 1000]) / max(len(t[1000:secs * 1000]) / 1000, 1e-9)
        rows["bps_cap"] = {"cap": bw_cap, "measured": bw, "error_pct": 100 * (bw - bw_cap) / bw_cap}
        log(f"bandwidth cap {bw_cap >> 20} MiB/s: {bw / 2**20:.1f} MiB/s "
            f"({rows['bps_cap']['error_pct']:+.2f}%)")

        high, low = cap, max(100, cap // 10)
        set_qos(rpc_sock, clear=True)
        set_qos(rpc_sock, iops=high, burst_ms=10)
        tl = os.path.join(work, "change.csv")
        client = subprocess.Popen(bench(sock, 3, timeline=tl), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        launched = time.monotonic()
        time.sleep(1.5)
        set_qos(rpc_sock, iops=low, burst_ms=10)
        changed_ms = int((time.monotonic() - launched) * 1000)
        client.communicate(timeout=60)
        t = read_timeline(tl)
        # First 10 ms bin after the change whose rate is within 2x of the new cap.
        delay = None
        for b in range(changed_ms // 10, len(t) // 10):
            if sum(t[b * 10:b * 10 + 10]) * 100 <= 2 * low:
                delay = b * 10 + 10 - changed_ms
                break
        rows["runtime_change"] = {"from": high, "to": low, "delay_ms": delay}
        log(f"cap lowered {high} -> {low} IOPS: in effect {delay} ms after the RPC returned")
        rows["noisy_neighbour"] = noisy_neighbour(sock, rpc_sock, secs)
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(work, ignore_errors=True)  # 512 MiB of /dev/shm otherwise
    rows["date"] = datetime.date.today().isoformat()
    rows["runtime_s"] = secs
    if not args.quick:
        with open(os.path.join(OUT, "qos.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(OUT, "qos.md"), "w") as f:
            c, b, r = rows["iops_cap"], rows["bps_cap"], rows["runtime_change"]
            n = rows["noisy_neighbour"]
            f.write(f"""# QoS caps

Measured {rows['date']} by `scripts/bench-qos.py` on this 2-core machine: one spoold (release,
journal on, tmpfs file), one spool-bench client (libblkio), random reads at QD32, one queue,
{secs} s per case; the first second (which may use the burst) is left out of the rates.

| case | cap | measured | error |
|---|---|---|---|
| unlimited 4 KiB | - | {rows['unlimited_iops']:.0f} IOPS | - |
| IOPS cap, 4 KiB, burst 100 ms | {c['cap']} IOPS | {c['measured']:.0f} IOPS | {c['error_pct']:+.2f}% |
| bandwidth cap, 64 KiB, burst 100 ms | {b['cap'] >> 20} MiB/s | {b['measured'] / 2**20:.1f} MiB/s | {b['error_pct']:+.2f}% |

Burst: {c['first_100ms']} completions in the first 100 ms of the capped run, against an
allowance of {c['burst_allowance']:.0f} (100 ms of the rate) plus the rate itself over those
100 ms.

A cap lowered at run time ({r['from']} → {r['to']} IOPS): the client's rate is down to the
new cap {r['delay_ms']} ms after the `volume_qos` RPC returned (10 ms bins).

Noisy neighbour (same device, same machine): volume v at QD1 4 KiB random reads, p99
latency {n['alone']:.1f} µs alone; {n['neighbour unlimited']:.1f} µs next to a QD128 random
writer on another volume ({n['neighbour unlimited (its IOPS)']:.0f} IOPS, unlimited);
{n['neighbour capped']:.1f} µs with that writer capped at 20k IOPS
({n['neighbour capped (its IOPS)']:.0f} IOPS); {n['neighbour in the batch class']:.1f} µs with
the writer in the batch class ({n['neighbour in the batch class (its IOPS)']:.0f} IOPS), and
{n['v latency, neighbour batch']:.1f} µs with v in the latency class and the writer in the batch
class ({n['v latency, neighbour batch (its IOPS)']:.0f} IOPS). See docs/qos.md, "Priority classes".
""")
        log(f"wrote {OUT}/qos.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
