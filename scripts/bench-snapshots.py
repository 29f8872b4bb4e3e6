#!/usr/bin/env python3
"""What snapshots, clones and backups cost (issue 34), measured side by side in one run.

One spoold (release build, keeper, journal on tmpfs) serves, from one pool with 4 MiB
chunks on a file on tmpfs (the software path: the worst case for ratios), a thick volume and
a thin volume "v" of 1 GiB, each with one queue, both written whole first.

1. Snapshot stall under load: spool-bench drives 4K random writes at QD32 on "v" while a
   snapshot is taken every 0.5 s (then deleted); the client's p99 and maximum latency
   against the same run without snapshots, and how long each `spoolctl volume snapshot`
   call took (process start and RPC included).
2. The copy-on-write cost: the volume written whole with 4 MiB writes at QD1 right after a
   snapshot (each write first copies the chunk it overwrites) against the same without one.
3. A clone after its first writes (every chunk copied) against the thick volume: spool-bench's
   A/B mode, 4K random reads and writes at QD32, 128K sequential reads and writes.
4. Incremental backup over NBD: a full copy of a snapshot with nbdcopy, against reading only
   what changed since the previous snapshot (10% of the volume rewritten) with nbdinfo's
   dirty-bitmap map and qemu-img convert of just those ranges; bytes and seconds.

    scripts/bench-snapshots.py            # 1 GiB, 5 s runs
    scripts/bench-snapshots.py --quick    # 256 MiB, 1 s runs (checks it works)
Results: docs/benchmarks/snapshots.{json,md}.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, bin_dir, cpu_model, log, run_spoold  # noqa: E402
from benchlib import spool_bench as bench  # noqa: E402

MIB = 1 << 20


def ctl(rpc, *args):
    t = time.monotonic()
    r = subprocess.run([os.path.join(bin_dir(), "spoolctl"), "--socket", rpc, "--json", *args],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"spoolctl {' '.join(args)}: {r.stderr.strip()}")
    return json.loads(r.stdout), (time.monotonic() - t) * 1e3


def run(cmd):
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stdout}{r.stderr}")
    return r.stdout, time.monotonic() - t


def lat(o):
    return {k: o[k] for k in ("iops", "lat_mean_us", "lat_p99_us", "lat_max_us")}


def stall(socks, rpc, secs, size):
    """Random 4K writes at QD32 with and without snapshots taken every 0.5 s."""
    args = ["--socket", socks["v"], "--rw", "randwrite", "--bs", "4096", "--iodepth", "32",
            "--runtime", str(secs), "--warmup", "0", "--size", str(size)]
    quiet = bench(args)
    calls, done = [], threading.Event()

    def snapshots():
        i = 0
        time.sleep(0.25)
        while not done.is_set():
            _, ms = ctl(rpc, "volume", "snapshot", "v", f"load{i}")
            calls.append(ms)
            ctl(rpc, "snapshot", "delete", f"v@load{i}")
            i += 1
            done.wait(0.5)

    t = threading.Thread(target=snapshots)
    t.start()
    loaded = bench(args)
    done.set()
    t.join()
    return {"without": lat(quiet), "with": lat(loaded), "snapshots": len(calls),
            "snapshot_call_ms": {"median": sorted(calls)[len(calls) // 2] if calls else None,
                                 "max": max(calls, default=None)}}


def cow(socks, rpc, secs, size):
    """Every chunk written once with 4 MiB writes at QD1, right after a snapshot (each write
    first copies the chunk it overwrites) and without one: the difference in mean latency is
    the copy-on-write cost per chunk."""
    args = ["--socket", socks["v"], "--rw", "write", "--bs", str(4 * MIB), "--iodepth", "1",
            "--fill", "--size", str(size)]
    plain = bench(args)
    ctl(rpc, "volume", "snapshot", "v", "cow")
    after = bench(args)
    ctl(rpc, "snapshot", "delete", "v@cow")
    return {"without": lat(plain), "after_snapshot": lat(after),
            "cost_per_chunk_us": after["lat_mean_us"] - plain["lat_mean_us"]}


def clone(work, socks, rpc, secs, size):
    """A clone whose every chunk was written once, against the thick volume (A/B)."""
    ctl(rpc, "volume", "snapshot", "v", "base")
    ctl(rpc, "volume", "clone", "v@base", "c")
    c = os.path.join(work, "state", "vhost", "c.sock")
    bench(["--socket", c, "--rw", "write", "--bs", str(4 * MIB), "--iodepth", "1", "--fill",
           "--size", str(size)])
    rows = []
    for rw, bs, qd in [("randread", 4096, 32), ("randwrite", 4096, 32), ("read", 131072, 8),
                       ("write", 131072, 8)]:
        ab = bench(["--socket", c, "--compare", socks["thick"], "--rw", rw, "--bs", str(bs),
                    "--iodepth", str(qd), "--queues", "1", "--runtime", str(secs),
                    "--warmup", "0" if secs == 1 else "1", "--size", str(size)])
        ratio = ab["iops_ratio"]
        rows.append({"rw": rw, "bs": bs, "iodepth": qd, "clone_over_thick_iops": ratio,
                     "a_iops": ab["a_iops"], "b_iops": ab["b_iops"]})
        log(f"clone/thick {rw} {bs}: {json.dumps(ratio)}")
    ctl(rpc, "volume", "delete", "c")
    ctl(rpc, "snapshot", "delete", "v@base")
    return rows


def backup(work, socks, rpc, size):
    """A full nbdcopy of a snapshot against an incremental copy of 10% changed."""
    sock = os.path.join(work, "nbd.sock")
    img = os.path.join(work, "backup.img")
    ctl(rpc, "volume", "snapshot", "v", "b1")
    ctl(rpc, "volume", "export", "v@b1", "--nbd", f"unix:{sock}")
    _, full1 = run(["nbdcopy", f"nbd+unix:///v@b1?socket={sock}", img])
    ctl(rpc, "volume", "unexport", "v@b1")
    bench(["--socket", socks["v"], "--rw", "write", "--bs", str(MIB), "--iodepth", "4", "--fill",
           "--size", str(size // 10)])
    ctl(rpc, "volume", "snapshot", "v", "b2")
    ctl(rpc, "volume", "export", "v@b2", "--nbd", f"unix:{sock}", "--since", "b1")
    uri = f"nbd+unix:///v@b2?socket={sock}"
    t = time.monotonic()
    out, _ = run(["nbdinfo", "--map=qemu:dirty-bitmap:b1", uri])
    dirty = [(int(f[0]), int(f[1])) for f in (l.split() for l in out.splitlines()) if f[2] == "1"]
    for off, length in dirty:
        run(["qemu-img", "convert", "-n", "--image-opts",
             f"driver=raw,offset={off},size={length},file.driver=nbd,file.server.type=unix,"
             f"file.server.path={sock},file.export=v@b2",
             "--target-image-opts",
             f"driver=raw,offset={off},size={length},file.driver=file,file.filename={img}"])
    incremental = time.monotonic() - t
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", img, uri])
    full2_img = os.path.join(work, "full2.img")
    _, full2 = run(["nbdcopy", uri, full2_img])
    ctl(rpc, "snapshot", "delete", "v@b2")
    ctl(rpc, "snapshot", "delete", "v@b1")
    return {"volume_bytes": size, "changed_bytes": sum(d[1] for d in dirty), "ranges": len(dirty),
            "full_copy_s": full2, "first_full_copy_s": full1, "incremental_s": incremental,
            "identical": True}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    secs, size = (1, 256 * MIB) if a.quick else (5, 1024 * MIB)
    for tool in ("nbdcopy", "nbdinfo", "qemu-img"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: scripts/install-deps.sh installs it")
    work = tempfile.mkdtemp(prefix="spool-snap-")
    shm = tempfile.mkdtemp(prefix="spool-snap-", dir="/dev/shm")
    p, socks = run_spoold(work, f"""state_dir = "{work}/state"
[journal]
dir = "{shm}/journal"
[pool]
min_extent = "4M"
[[devices]]
path = "{shm}/d0.img"
create_size = "{size * 5 // MIB}M"
[[volumes]]
name = "thick"
size = "{size // MIB}M"
num_queues = 1
[[volumes]]
name = "v"
size = "{size // MIB}M"
num_queues = 1
thin = true
""", ("thick", "v"))
    rpc = os.path.join(work, "state", "spoold.sock")
    try:
        for v in ("thick", "v"):
            bench(["--socket", socks[v], "--rw", "write", "--bs", str(4 * MIB), "--iodepth", "1",
                   "--fill", "--size", str(size)])
        res = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
               "cores": os.cpu_count(), "runtime_s": secs, "volume_bytes": size}
        res["stall"] = stall(socks, rpc, secs, size)
        log(f"stall: {json.dumps(res['stall'])}")
        res["cow"] = cow(socks, rpc, secs, size)
        log(f"cow: {json.dumps(res['cow'])}")
        res["clone"] = clone(work, socks, rpc, secs, size)
        res["backup"] = backup(work, socks, rpc, size)
        log(f"backup: {json.dumps(res['backup'])}")
    finally:
        p.terminate()
        p.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(res) if a.quick else "")
    if not a.quick:
        with open(os.path.join(OUT, "snapshots.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
