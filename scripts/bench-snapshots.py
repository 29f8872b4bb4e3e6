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
    scripts/bench-snapshots.py --quick    # 256 MiB, 1 s runs (checks it works; snapshots-quick.json)
Results: docs/benchmarks/snapshots.json (docs/benchmarks/snapshots.md discusses them).
"""

import os
import shutil
import sys
import threading
import time

import benchlib as b
from benchlib import Spoold, dev, log, run, vol

MIB = 1 << 20


def lat(o):
    return {k: o[k] for k in ("iops", "lat_mean_us", "lat_p99_us", "lat_max_us")}


def stall(d, secs, size, work):
    """Random 4K writes at QD32 with and without snapshots taken every 0.5 s."""
    def writes():
        return b.spool_bench(d.socks["v"], rw="randwrite", bs=4096, qd=32, runtime=secs, warmup=0, size=size)
    quiet = writes()
    calls, done = [], threading.Event()

    def snapshots():
        i = 0
        time.sleep(0.25)
        while not done.is_set():
            t = time.monotonic()
            d.ctl("volume", "snapshot", "v", f"load{i}")
            calls.append((time.monotonic() - t) * 1e3)
            d.ctl("snapshot", "delete", f"v@load{i}")
            i += 1
            done.wait(0.5)

    t = threading.Thread(target=snapshots)
    t.start()
    loaded = writes()
    done.set()
    t.join()
    return {"without": lat(quiet), "with": lat(loaded), "snapshots": len(calls),
            "snapshot_call_ms": {"median": b.median(calls) if calls else None, "max": max(calls, default=None)}}


def cow(d, secs, size, work):
    """Every chunk written once with 4 MiB writes at QD1, right after a snapshot (each write
    first copies the chunk it overwrites) and without one: the difference in mean latency is
    the copy-on-write cost per chunk."""
    plain = b.fill(d.socks["v"], size, 4 * MIB, 1)
    d.ctl("volume", "snapshot", "v", "cow")
    after = b.fill(d.socks["v"], size, 4 * MIB, 1)
    d.ctl("snapshot", "delete", "v@cow")
    return {"without": lat(plain), "after_snapshot": lat(after),
            "cost_per_chunk_us": after["lat_mean_us"] - plain["lat_mean_us"]}


def clone(d, secs, size, work):
    """A clone whose every chunk was written once, against the thick volume (A/B)."""
    d.ctl("volume", "snapshot", "v", "base")
    d.ctl("volume", "clone", "v@base", "c")
    b.fill(d.vhost("c"), size, 4 * MIB, 1)
    rows = []
    for x in b.AB_CASES:
        ab = b.spool_bench(d.vhost("c"), compare=d.socks["thick"], size=size, **b.ab_opts(x, secs))
        rows.append({"rw": x["rw"], "bs": x["bs"], "iodepth": x["qd"], "clone_over_thick_iops": ab["iops_ratio"],
                     "a_iops": ab["a_iops"], "b_iops": ab["b_iops"]})
    d.ctl("volume", "delete", "c")
    d.ctl("snapshot", "delete", "v@base")
    return rows


def backup(d, secs, size, work):
    """A full nbdcopy of a snapshot against an incremental copy of 10% changed."""
    sock, img = os.path.join(work, "nbd.sock"), os.path.join(work, "backup.img")
    d.ctl("volume", "snapshot", "v", "b1")
    d.ctl("volume", "export", "v@b1", "--nbd", f"unix:{sock}")
    _, full1 = run(["nbdcopy", f"nbd+unix:///v@b1?socket={sock}", img])
    d.ctl("volume", "unexport", "v@b1")
    b.fill(d.socks["v"], size // 10)
    d.ctl("volume", "snapshot", "v", "b2")
    d.ctl("volume", "export", "v@b2", "--nbd", f"unix:{sock}", "--since", "b1")
    uri = f"nbd+unix:///v@b2?socket={sock}"
    t = time.monotonic()
    out, _ = run(["nbdinfo", "--map=qemu:dirty-bitmap:b1", uri])
    dirty = [(int(f[0]), int(f[1])) for f in (line.split() for line in out.splitlines()) if f[2] == "1"]
    for off, length in dirty:
        run(["qemu-img", "convert", "-n", "--image-opts",
             f"driver=raw,offset={off},size={length},file.driver=nbd,file.server.type=unix,"
             f"file.server.path={sock},file.export=v@b2",
             "--target-image-opts",
             f"driver=raw,offset={off},size={length},file.driver=file,file.filename={img}"])
    incremental = time.monotonic() - t
    run(["qemu-img", "compare", "-f", "raw", "-F", "raw", img, uri])
    _, full2 = run(["nbdcopy", uri, os.path.join(work, "full2.img")])
    d.ctl("snapshot", "delete", "v@b2")
    d.ctl("snapshot", "delete", "v@b1")
    return {"volume_bytes": size, "changed_bytes": sum(x[1] for x in dirty), "ranges": len(dirty),
            "full_copy_s": full2, "first_full_copy_s": full1, "incremental_s": incremental, "identical": True}


def main():
    a = b.args(__doc__)
    secs, size = (1, 256 * MIB) if a.quick else (5, 1024 * MIB)
    for tool in ("nbdcopy", "nbdinfo", "qemu-img"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: scripts/install-deps.sh installs it")
    work, tmp = b.workdir("spool-snap-"), b.workdir("spool-snap-", "/tmp")  # the backups: not in memory
    d = Spoold(work, [dev(f"{work}/d0.img", f"{size * 5 // MIB}M")],
               [vol("thick", f"{size // MIB}M"), vol("v", f"{size // MIB}M", thin=True)],
               sections={"pool": {"min_extent": "4M"}})
    for sock in d.sockets:
        b.fill(sock, size, 4 * MIB, 1)
    res = {"runtime_s": secs, "volume_bytes": size}
    for name, f in (("stall", stall), ("cow", cow), ("clone", clone), ("backup", backup)):
        res[name] = f(d, secs, size, tmp)
        log(f"{name}: {res[name]}")
    d.stop()
    b.save("snapshots", res, quick=a.quick)


if __name__ == "__main__":
    main()
