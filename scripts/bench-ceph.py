#!/usr/bin/env python3
"""spoold on Ceph RBD against qemu-storage-daemon's rbd driver (issue 20), side by side in
one run on one private single-node cluster (scripts/ceph-cluster.sh), through the same
client (spool-bench on libblkio):

- IOPS and latency at QD1 and QD32, 4 KiB random reads and writes, each server alone in
  turn, two rounds (A B A B) so drift hits both;
- what each one's own restart costs a client: spoold's worker SIGKILLed under load (the
  stall from its phase log; the client keeps its connection), qemu-storage-daemon SIGKILLed
  and started again (the time until a new client's first request completes on the new
  process; QEMU would add its reconnect delay, at least 1 s, on top).

Both images are written in full first: an RBD object never written reads as a hole the OSD
answers without I/O. qemu-storage-daemon runs with cache.direct=on, which turns librbd's
cache off as spoold has it (a write acknowledged from librbd's cache would be lost with a
killed process). Results: docs/benchmarks/ceph.json and ceph.md.

    scripts/bench-ceph.py            # about 4 minutes
    scripts/bench-ceph.py --quick    # smoke run
"""

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import shutil
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BIN, OUT, REPO, ctl, log, wait_socket  # noqa: E402

SIZE = 256 << 20
CASES = [("4K randread QD1", "randread", 1), ("4K randwrite QD1", "randwrite", 1),
         ("4K randread QD32", "randread", 32), ("4K randwrite QD32", "randwrite", 32)]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster(cmd, d, *extra):
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), cmd, d, *extra],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"ceph-cluster.sh {cmd}: {r.stdout}{r.stderr}")
    return r.stdout.strip()


def bench(sock, rw, bs, qd, runtime, extra=()):
    cmd = [f"{BIN}/spool-bench", "--socket", sock, "--rw", rw, "--bs", str(bs), "--iodepth", str(qd),
           "--runtime", str(runtime), "--size", str(SIZE), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime * 4 + 120)
    if r.returncode != 0:
        raise RuntimeError(f"spool-bench {rw} QD{qd}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def start_qsd(work, conf, sock):
    blockdev = (f"driver=rbd,node-name=base,pool=rbd,image=q,conf={conf},user=admin,"
                "cache.direct=on")
    exp = f"type=vhost-user-blk,id=e0,node-name=base,addr.type=unix,addr.path={sock},writable=on"
    if os.path.exists(sock):
        os.unlink(sock)
    return subprocess.Popen(["qemu-storage-daemon", "--blockdev", blockdev, "--export", exp],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "qsd.log"), "a"))


def spoold_stalls(spool, kills):
    """Worker SIGKILLs under a running client; the stall of each from spoold's log."""
    load = subprocess.Popen([f"{BIN}/spool-bench", "--socket", spool["sock"], "--rw", "randrw",
                             "--iodepth", "8", "--runtime", str(2 + kills * 1.5), "--size", str(SIZE),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    for _ in range(kills):
        pid = ctl(spool["rpc"], "status")["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)
    out, err = load.communicate(timeout=120)
    if load.returncode != 0:
        raise RuntimeError(f"the client under kills failed: {err.strip()}")
    errors = json.loads(out).get("errors", 0)
    text = open(spool["log"]).read()
    stalls = [float(m) for m in re.findall(r'kind=crash-restart new_pid=\d+ stall_ms="([0-9.]+)"', text)]
    opens = [float(m) for m in re.findall(r"kind=crash-restart[^\n]*open devices ([0-9.]+) ms", text)]
    return stalls[-kills:], opens[-kills:], errors


def qsd_restarts(work, conf, sock, n):
    """SIGKILL qemu-storage-daemon, start it again: ms until a new client's first request
    completes on the new process."""
    gaps = []
    for _ in range(n):
        proc = start_qsd(work, conf, sock)
        wait_socket(sock, proc, "qemu-storage-daemon")
        bench(sock, "randread", 4096, 1, 0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t = time.monotonic()
        proc = start_qsd(work, conf, sock)
        wait_socket(sock, proc, "qemu-storage-daemon", settle=0)
        while True:
            r = subprocess.run([f"{BIN}/spool-bench", "--socket", sock, "--rw", "randread", "--iodepth", "1",
                                "--runtime", "0.01", "--warmup", "0", "--size", str(SIZE), "--json"],
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                break
            if time.monotonic() - t > 60:
                raise RuntimeError(f"qemu-storage-daemon did not serve again: {r.stderr}")
            time.sleep(0.005)
        gaps.append((time.monotonic() - t) * 1000)
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    return gaps


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    runtime, rounds, kills = (1, 1, 2) if a.quick else (5, 2, 10)
    subprocess.run(["cargo", "build", "--release", "-q", "--bin", "spoold", "--bin", "spoolctl",
                    "--bin", "spool-bench"], cwd=REPO, check=True)
    work = tempfile.mkdtemp(prefix="spool-bench-ceph-")
    cdir = os.path.join(work, "ceph")
    try:
        run(a, work, cdir, runtime, rounds, kills)
    finally:
        # The cluster's OSD file holds about 1 GB after a run: never leave it behind.
        cluster("stop", cdir)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(journal_dir(), ignore_errors=True)


def journal_dir():
    return f"/dev/shm/spool-bench-ceph-{os.getpid()}"


def run(a, work, cdir, runtime, rounds, kills):
    t = time.monotonic()
    conf = cluster("start", cdir, str(free_port()))
    log(f"cluster up in {time.monotonic() - t:.1f} s")
    spool = dict(dir=os.path.join(work, "spoold"))
    os.makedirs(spool["dir"])
    cfg = os.path.join(spool["dir"], "spoold.toml")
    with open(cfg, "w") as f:
        f.write(f'state_dir = "{spool["dir"]}"\n[ceph]\nconf = "{conf}"\n[journal]\nenabled = true\n'
                f'dir = "{journal_dir()}"\n[[devices]]\n'
                f'path = "{spool["dir"]}/d0.img"\ncreate_size = "64M"\n')
    spool["log"] = os.path.join(spool["dir"], "log")
    spool["rpc"] = os.path.join(spool["dir"], "spoold.sock")
    proc = subprocess.Popen([f"{BIN}/spoold", "-c", cfg], stdout=subprocess.DEVNULL, stderr=open(spool["log"], "w"))
    try:
        wait_socket(spool["rpc"], proc, "spoold")
        time.sleep(0.3)
        ctl(spool["rpc"], "volume", "create", "v", str(SIZE), "--rbd", "rbd", "--queues", "1")
        spool["sock"] = os.path.join(spool["dir"], "vhost", "v.sock")
        subprocess.run(["rbd", "-c", conf, "create", "rbd/q", "--size", f"{SIZE >> 20}M",
                        "--image-feature", "layering"], check=True, capture_output=True)
        qsock = os.path.join(work, "q.sock")
        qsd = start_qsd(work, conf, qsock)
        wait_socket(qsock, qsd, "qemu-storage-daemon")
        for s in (spool["sock"], qsock):
            bench(s, "write", 1 << 20, 4, 0, ["--fill"])
        rows = {}
        for r in range(rounds):
            for name, rw, qd in CASES:
                for who, s in (("spoold", spool["sock"]), ("qsd", qsock)):
                    out = bench(s, rw, 4096, qd, runtime)
                    rows.setdefault(name, {}).setdefault(who, []).append(out)
                    log(f"round {r} {name} {who}: {out['iops']:.0f} IOPS, mean {out['lat_mean_us']:.0f} us")
        qsd.send_signal(signal.SIGTERM)
        qsd.wait(20)
        stalls, opens, errors = spoold_stalls(spool, kills)
        gaps = qsd_restarts(work, conf, qsock, kills)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    table = {}
    for name, by in rows.items():
        table[name] = {who: dict(iops=statistics.median(o["iops"] for o in outs),
                                 lat_mean_us=statistics.median(o["lat_mean_us"] for o in outs),
                                 p99_us=statistics.median(o["lat_p99_us"] for o in outs))
                       for who, outs in by.items()}
    doc = dict(date=datetime.date.today().isoformat(), quick=a.quick, runtime_s=runtime, rounds=rounds,
               cases=table, spoold_crash_stall_ms=stalls, spoold_open_devices_ms=opens,
               spoold_client_errors=errors, qsd_restart_gap_ms=gaps)
    os.makedirs(OUT, exist_ok=True)
    suffix = "-quick" if a.quick else ""
    with open(os.path.join(OUT, f"ceph{suffix}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(OUT, f"ceph{suffix}.md"), "w") as f:
        f.write("# spoold on Ceph RBD against qemu-storage-daemon's rbd driver\n\n")
        f.write(f"Measured {doc['date']} by `scripts/bench-ceph.py{' --quick' if a.quick else ''}` on this 2-core "
                "machine against a private single-node cluster (one monitor, one BlueStore OSD on a sparse "
                "file, one copy), same client (spool-bench, libblkio), both images written in full first, "
                f"each server alone in turn, {rounds} round(s) of {runtime} s per case (medians). "
                "qemu-storage-daemon runs with cache.direct=on (librbd's cache off, as spoold has it).\n\n")
        f.write("| case | spoold IOPS | qsd IOPS | ratio | spoold mean / p99 µs | qsd mean / p99 µs |\n|---|---|---|---|---|---|\n")
        for name, by in table.items():
            s, q = by["spoold"], by["qsd"]
            f.write(f"| {name} | {s['iops']:.0f} | {q['iops']:.0f} | {s['iops'] / q['iops']:.2f}× | "
                    f"{s['lat_mean_us']:.0f} / {s['p99_us']:.0f} | {q['lat_mean_us']:.0f} / {q['p99_us']:.0f} |\n")
        f.write("\n## What a restart costs a client\n\n| server | restarts | median ms | max ms | what the client sees |\n|---|---|---|---|---|\n")
        f.write(f"| spoold, worker SIGKILL under load | {len(stalls)} | {pct(stalls, 0.5):.1f} | {max(stalls, default=float('nan')):.1f} | "
                f"a stall on the same connection, {errors} client errors (phase \"open devices\": median "
                f"{pct(opens, 0.5):.1f} ms; the cluster connection was made ahead of need) |\n")
        f.write(f"| qemu-storage-daemon, SIGKILL and start again | {len(gaps)} | {pct(gaps, 0.5):.1f} | {max(gaps, default=float('nan')):.1f} | "
                "its connection is gone: time until a new client's first request completes (QEMU adds its reconnect delay, ≥ 1 s) |\n")
    print(open(os.path.join(OUT, f"ceph{suffix}.md")).read())


if __name__ == "__main__":
    main()
