#!/usr/bin/env python3
"""spoold against qemu-storage-daemon, side by side (issue 18): a matrix of block size,
direction, queue depth, queues per client and volumes, interleaved so that the noise of this
shared machine hits both equally.

Backends, all running for the whole run on tmpfs (/dev/shm) and serving the same bytes:
spoold's device file, whose 3 volumes are written once in full, sequentially, through spoold
(1 MiB writes, QD4) before anything is measured. qsd serves that same file at the offsets
`spoolctl volume show` gives (the extent map), so every backend reads and writes the same
physical pages (a tmpfs file's page layout alone moves 128K rows by up to 2x):

  spoold                      one device file, volumes v0..v2 (4 queues each), default config
  qsd aio=native,direct       spoold's file, three raw nodes at the volumes' offsets, exported
                              over vhost-user-blk (4 queues each), no iothread, locking=off
                              (the runs take turns, never overlap)
  qsd aio=native,direct,iot   the same with one iothread for every export (QEMU 7.2 keeps a
                              node graph in one AioContext: exports of one file share it)

Each row runs in rounds of A B C C B A (A = spoold, B/C = the two qsd setups; the order
flips each round) of short runs; the table keeps each backend's median and compares spoold
with the better qsd setup of the row. Client: spool-bench (libblkio) with interrupt-driven
queues in every row, as a VM's driver (--poll-single: poll queues in rows with one client
thread, as bench.py does; on this shared 2-core machine a spinning client and a spinning
server then measure the scheduler: 128K runs of either backend ranged 8-29K IOPS that way,
against a steady 47-79K interrupt-driven). 3 volumes = three spool-bench processes at once,
one per volume, total IOPS.

    scripts/bench-matrix.py           # 32 rows, about 7 minutes on 2 cores
    scripts/bench-matrix.py --quick   # smoke run (CI): 3 rows, tiny runs, under a minute
Binaries: $SPOOL_TARGET_DIR/release (or target/release); --bin-dir overrides.
Results: docs/benchmarks/matrix.{md,json,png} (--quick: in a temporary directory, or --out).
"""

import os
import resource
import time

import benchlib as b
from benchlib import OUT, Qsd, Spoold, dev, log, median, vol

NVOLS = 3
QUEUES = 4
# Rows: (block size, rw, QD, queues per client, volumes). 4K is random, 128K sequential.
WORKLOADS = [(4096, "randread"), (4096, "randwrite"), (131072, "read"), (131072, "write")]
ROWS = [(bs, rw, qd, q, v) for bs, rw in WORKLOADS for qd in (1, 32) for q in (1, 4) for v in (1, NVOLS)]
QUICK_ROWS = [(4096, "randread", 1, 1, 1), (4096, "randwrite", 32, 4, 3), (131072, "read", 32, 1, 1)]
BACKENDS = ["spoold", "qsd", "qsd-iot"]
LABELS = {"spoold": "spoold", "qsd": "qsd aio=native,direct", "qsd-iot": "qsd aio=native,direct,iothread"}


def row_name(r):
    bs, rw, qd, q, v = r
    return f"{bs // 1024}K {rw} QD{qd} {q}q {v}vol"


def start(work, vol_bytes, extra):
    """spoold, whose volumes are written once in full, then the two qsd setups serving the bytes
    of spoold's volumes in place: its device file at each volume's offset (`volume show`)."""
    sp = Spoold(f"{work}/spoold", [dev(f"{work}/spoold/dev.img", NVOLS * vol_bytes + (16 << 20))],
                [vol(f"v{i}", vol_bytes, QUEUES) for i in range(NVOLS)], extra=extra)
    offsets = []
    for s in sp.sockets:
        b.fill(s, vol_bytes)
    for i in range(NVOLS):
        m = sp.ctl("volume", "show", f"v{i}")["extent_map"]
        if len(m) != 1 or m[0]["len"] < vol_bytes:
            raise RuntimeError(f"volume v{i} is not one extent: {m}")
        offsets.append((m[0]["offset"], vol_bytes))
    # locking=off: spoold holds the file; the runs take turns, never overlap.
    blockdev = f"driver=file,node-name=base,filename={work}/spoold/dev.img,cache.direct=on,aio=native,locking=off"
    return dict(spoold=sp, **{n: Qsd(f"{work}/{n}", blockdev, offsets, n == "qsd-iot", QUEUES) for n in BACKENDS[1:]})


def measure(server, name, row, runtime, warmup, vol_bytes, poll_single):
    """One run of `row` against a backend: total IOPS of all its clients, mean latency."""
    bs, rw, qd, q, v = row
    try:
        outs = b.results([b.start_bench(s, rw=rw, bs=bs, qd=qd, queues=q, runtime=runtime, warmup=warmup,
                                        size=vol_bytes, poll=poll_single and q * v == 1) for s in server.sockets[:v]],
                         f"spool-bench on {name} {row_name(row)}", runtime * 4 + 60)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{server.tail()}")
    iops = sum(o["iops"] for o in outs)
    return iops, sum(o["lat_mean_us"] * o["iops"] for o in outs) / iops if iops else 0


def ours(backends):
    """CPU seconds used by this benchmark: backends' trees, finished clients, this script."""
    c, m = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    return (sum(b.cpu_s(b.proc_tree(x.pid)) for x in backends.values()) + c.ru_utime + c.ru_stime
            + m.ru_utime + m.ru_stime)


def run_row(backends, row, a):
    """Rounds of A B C C B A (the order flipped each round); medians."""
    t0, busy0, ours0 = time.time(), b.busy_s(), ours(backends)
    samples, lats = {n: [] for n in BACKENDS}, {n: [] for n in BACKENDS}
    for k in range(a.rounds):
        for n in (BACKENDS + BACKENDS[::-1])[::-1 if k % 2 else 1]:
            i, lat = measure(backends[n], n, row, a.runtime, a.warmup, a.vol, a.poll_single)
            samples[n].append(i)
            lats[n].append(lat)
    foreign = max(0.0, (b.busy_s() - busy0) - (ours(backends) - ours0)) / (time.time() - t0)
    med = {n: median(samples[n]) for n in BACKENDS}
    best = max(("qsd", "qsd-iot"), key=lambda n: med[n])
    bs, rw, qd, q, v = row
    target, ratio = 1.2 if bs == 4096 else 1.0, med["spoold"] / med[best]
    r = dict(row=row_name(row), bs=bs, rw=rw, iodepth=qd, queues=q, volumes=v, poll_client=a.poll_single and q * v == 1,
             iops=med, iops_runs={n: [round(x) for x in samples[n]] for n in BACKENDS},
             lat_mean_us={n: median(lats[n]) for n in BACKENDS}, best_qsd=best,
             ratio=ratio, ratio_qsd=med["spoold"] / med["qsd"], ratio_qsd_iot=med["spoold"] / med["qsd-iot"],
             target=target, met=ratio >= target, foreign_cores=foreign,
             spread={n: b.spread(samples[n]) for n in BACKENDS})
    log(f"   ratio {ratio:.2f} ({'met' if r['met'] else 'MISSED'} {target}), others {foreign:.2f} cores")
    return r


def main():
    a = b.args(__doc__, {
        "--runtime": dict(type=float, help="seconds per run (default 0.7; quick 0.15)"),
        "--rounds": dict(type=int, help="rounds of A B C C B A per row (default 2; quick 1)"),
        "--poll-single": dict(action="store_true", help="poll queues (a busy-polling client) in rows with one "
                              "client thread, as bench.py"),
        "--only": dict(help="run only the rows whose name contains this (e.g. '128K read')"),
        "--spoold-extra": dict(default="", help="TOML appended to spoold's config (e.g. '[io]\\nfair_share = false')")},
        out="matrix")
    if a.summary_only:
        b.write_md(b.load("matrix", a.out), md, os.path.join(a.out or OUT, "matrix.md"))
        return plot(b.load("matrix", a.out)["results"], os.path.join(a.out or OUT, "matrix.png"))
    a.runtime = a.runtime or (0.15 if a.quick else 0.7)
    a.warmup = 0.1 if a.quick else 0.25
    a.rounds = a.rounds or (1 if a.quick else 2)
    a.vol = (64 if a.quick else 256) << 20
    t0 = time.time()
    backends = start(b.workdir("spool-matrix."), a.vol, a.spoold_extra.replace("\\n", "\n"))
    rows = b.table(("name", "row"), [(row_name(r), r) for r in (QUICK_ROWS if a.quick else ROWS)])
    log(f"== {len(rows)} rows, {a.rounds} round(s), {a.runtime} s runs; setup {time.time() - t0:.1f} s")
    results = b.run_cases(rows, lambda c: run_row(backends, c["row"], a), only=a.only)
    for x in backends.values():
        x.stop()
    res = dict(runtime_s=a.runtime, warmup_s=a.warmup, rounds=a.rounds, samples_per_backend=2 * a.rounds,
               volume_bytes=a.vol, volumes=NVOLS, queues_per_volume=QUEUES, wall_s=round(time.time() - t0, 1),
               backends=LABELS, rows=results, qsd_version=b.qsd_version())
    b.save("matrix", res, md, out=a.out)
    plot(res, os.path.join(a.out or OUT, "matrix.png"))


def md(d):
    rows = d["rows"]
    four, big = [r for r in rows if r["bs"] == 4096], [r for r in rows if r["bs"] != 4096]
    return b.notes("matrix", **d, mib=d["volume_bytes"] >> 20, client=(
        "poll queues with one client thread (1q 1vol), interrupt-driven queues otherwise"
        if any(r["poll_client"] for r in rows) else "interrupt-driven in every row (as a VM's driver)"),
        met=sum(r["met"] for r in rows), n=len(rows), met4=sum(r["met"] for r in four), n4=len(four),
        met128=sum(r["met"] for r in big), n128=len(big), at1=sum(r["ratio"] >= 1.0 for r in rows), table=b.md_table(
            ["row", "spoold", "qsd", "qsd iothread", "ratio", "target", "met", "spread s/q/qi", "others"], [
                (r["row"], *(fmt(r["iops"][n]) for n in BACKENDS),
                 f"**{r['ratio']:.2f}×** ({'qsd' if r['best_qsd'] == 'qsd' else 'iot'})", f"{r['target']:.1f}",
                 "yes" if r["met"] else "**no**", "/".join(f"{100 * r['spread'][n]:.0f}" for n in BACKENDS) + "%",
                 f"{r.get('foreign_cores', 0):.2f}") for r in rows]))


def fmt(x):
    return f"{x / 1e3:.0f}K" if x >= 1e4 else f"{x / 1e3:.1f}K"


def plot(res, path):
    b.barh(path, [(r["row"], r["ratio"], "tab:green" if r["met"] else "tab:orange" if r["ratio"] >= 1.0 else "tab:red")
                  for r in res["rows"]],
           "spoold IOPS / best qemu-storage-daemon IOPS (median of interleaved runs)",
           "spoold vs qsd (tmpfs): green = target met (1.2x on 4K, 1.0x on 128K), orange = >= 1.0x only, red = < 1.0x",
           size=(10, 0.28, 1.5), marks=[(1.0, "1.0× (target, all rows)", "-"), (1.2, "1.2× (target, 4K rows)", "--")],
           fontsize=9)

if __name__ == "__main__":
    main()
