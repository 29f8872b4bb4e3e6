#!/usr/bin/env python3
"""spoold on Ceph RBD against qemu-storage-daemon's rbd driver (issue 20), side by side in
one run on one private single-node cluster (scripts/ceph-cluster.sh: one monitor, one
BlueStore OSD on a sparse file, one copy), through the same client (spool-bench on libblkio):

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
    scripts/bench-ceph.py --quick    # smoke run (ceph-quick.{json,md})
"""

import os
import signal
import socket
import time

import benchlib as b
from benchlib import REPO, Qsd, Spoold, dev, log, median, pct

SIZE = 256 << 20
CASES = b.table(("name", "rw", "qd"), [("4K randread QD1", "randread", 1), ("4K randwrite QD1", "randwrite", 1),
                                       ("4K randread QD32", "randread", 32), ("4K randwrite QD32", "randwrite", 32)])


def cluster(cmd, d, *extra):
    return b.run(["bash", os.path.join(REPO, "scripts", "ceph-cluster.sh"), cmd, d, *extra], 300)[0].strip()


def qsd(work, conf, settle=0.1):
    return Qsd(f"{work}/qsd", f"driver=rbd,node-name=base,pool=rbd,image=q,conf={conf},user=admin,cache.direct=on",
               settle=settle)


def spoold_stalls(d, kills):
    """Worker SIGKILLs under a running client: the keeper's report of each restart."""
    load = b.start_bench(d.vhost("v"), rw="randrw", qd=8, runtime=2 + kills * 1.5, size=SIZE)
    time.sleep(1)
    reports = []
    for _ in range(kills):
        reports.append(d.kill_worker())
        time.sleep(1.5)
    errors = b.results([load], "the client under kills")[0].get("errors", 0)
    opens = [p["ms"] for r in reports for p in r["phases"] if p["name"] == "open devices"]
    return [r["stall_ms"] for r in reports], opens, errors


def qsd_restarts(work, conf, n):
    """SIGKILL qemu-storage-daemon, start it again: ms until a new client's first request
    completes on the new process."""
    gaps = []
    for _ in range(n):
        q = qsd(work, conf)
        b.spool_bench(q.sock, rw="randread", bs=4096, qd=1, runtime=0.2, size=SIZE)
        q.proc.send_signal(signal.SIGKILL)
        q.proc.wait()
        t = time.monotonic()
        q = qsd(work, conf, settle=0)
        while True:
            try:
                b.spool_bench(q.sock, rw="randread", qd=1, runtime=0.01, warmup=0, size=SIZE)
                break
            except RuntimeError as e:
                if time.monotonic() - t > 60:
                    raise RuntimeError(f"qemu-storage-daemon did not serve again: {e}")
                time.sleep(0.005)
        gaps.append((time.monotonic() - t) * 1000)
        q.stop()
    return gaps


def main():
    a = b.args(__doc__)
    runtime, rounds, kills = (1, 1, 2) if a.quick else (5, 2, 10)
    work = b.workdir("spool-bench-ceph-", "/tmp")
    cdir = os.path.join(work, "ceph")
    # The cluster's OSD file holds about 1 GB after a run: never leave it behind.
    b.on_exit(lambda: cluster("stop", cdir))
    t = time.monotonic()
    with socket.socket() as s:  # a free port for the monitor
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = cluster("start", cdir, str(port))
    log(f"cluster up in {time.monotonic() - t:.1f} s")
    d = Spoold(f"{work}/spoold", [dev(f"{work}/spoold/d0.img", "64M")], sections={"ceph": {"conf": conf}})
    time.sleep(0.3)
    d.ctl("volume", "create", "v", str(SIZE), "--rbd", "rbd", "--queues", "1")
    b.run(["rbd", "-c", conf, "create", "rbd/q", "--size", f"{SIZE >> 20}M", "--image-feature", "layering"])
    q = qsd(work, conf)
    servers = {"spoold": d.vhost("v"), "qsd": q.sock}
    for s in servers.values():
        b.fill(s, SIZE, tries=1)
    rows = {}
    for r in range(rounds):
        for c in CASES:
            for who, s in servers.items():
                out = b.spool_bench(s, rw=c["rw"], bs=4096, qd=c["qd"], runtime=runtime, size=SIZE)
                rows.setdefault(c["name"], {}).setdefault(who, []).append(out)
                log(f"round {r} {c['name']} {who}: {out['iops']:.0f} IOPS, mean {out['lat_mean_us']:.0f} us")
    q.stop()
    stalls, opens, errors = spoold_stalls(d, kills)
    gaps = qsd_restarts(work, conf, kills)
    d.stop()
    table = {name: {who: dict(iops=median(o["iops"] for o in outs), lat_mean_us=median(o["lat_mean_us"] for o in outs),
                              p99_us=median(o["lat_p99_us"] for o in outs)) for who, outs in by.items()}
             for name, by in rows.items()}
    b.save("ceph", dict(runtime_s=runtime, rounds=rounds, cases=table, spoold_crash_stall_ms=stalls,
                        spoold_open_devices_ms=opens, spoold_client_errors=errors, qsd_restart_gap_ms=gaps),
           md, a.quick)


def md(r):
    stalls, opens, gaps = r["spoold_crash_stall_ms"], r["spoold_open_devices_ms"], r["qsd_restart_gap_ms"]
    return b.notes("ceph", **r, table=b.md_table(
        ["case", "spoold IOPS", "qsd IOPS", "ratio", "spoold mean / p99 µs", "qsd mean / p99 µs"], [
            (name, f"{s['iops']:.0f}", f"{q['iops']:.0f}", f"{s['iops'] / q['iops']:.2f}×",
             f"{s['lat_mean_us']:.0f} / {s['p99_us']:.0f}", f"{q['lat_mean_us']:.0f} / {q['p99_us']:.0f}")
            for name, (s, q) in ((n, (x["spoold"], x["qsd"])) for n, x in r["cases"].items())]), restarts=b.md_table(
        ["server", "restarts", "median ms", "max ms", "what the client sees"], [
            ("spoold, worker SIGKILL under load", len(stalls), f"{pct(stalls, 0.5):.1f}",
             f"{max(stalls, default=float('nan')):.1f}", f"a stall on the same connection, {r['spoold_client_errors']} "
             f"client errors (phase \"open devices\": median {pct(opens, 0.5):.1f} ms; the cluster connection was "
             "made ahead of need)"),
            ("qemu-storage-daemon, SIGKILL and start again", len(gaps), f"{pct(gaps, 0.5):.1f}",
             f"{max(gaps, default=float('nan')):.1f}", "its connection is gone: time until a new client's first "
             "request completes (QEMU adds its reconnect delay, ≥ 1 s)")]))


if __name__ == "__main__":
    main()
