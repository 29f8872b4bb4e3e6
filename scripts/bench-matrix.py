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

import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, bin_dir, cpu_model, log, wait_socket  # noqa: E402

NVOLS = 3
QUEUES = 4
# Rows: (block size, rw). 4K is random, 128K sequential.
WORKLOADS = [(4096, "randread"), (4096, "randwrite"), (131072, "read"), (131072, "write")]
QUICK_ROWS = [(4096, "randread", 1, 1, 1), (4096, "randwrite", 32, 4, 3), (131072, "read", 32, 1, 1)]
BACKENDS = ["spoold", "qsd", "qsd-iot"]
LABELS = {"spoold": "spoold", "qsd": "qsd aio=native,direct",
          "qsd-iot": "qsd aio=native,direct,iothread"}


SPOOLD_EXTRA = ""


def all_rows():
    return [(bs, rw, qd, q, v) for bs, rw in WORKLOADS for qd in (1, 32) for q in (1, 4)
            for v in (1, NVOLS)]


def row_name(r):
    bs, rw, qd, q, v = r
    return f"{bs // 1024}K {rw} QD{qd} {q}q {v}vol"


def stop(proc):
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Backend:
    def __init__(self, name, work, vol, bins, shared=None):
        """spoold, or a qsd setup serving the bytes of spoold's volumes in place (`shared`:
        spoold's device file and each volume's offset in it)."""
        self.name, self.dir = name, os.path.join(work, name)
        os.makedirs(self.dir)
        self.log = open(os.path.join(self.dir, "log"), "w")
        if name == "spoold":
            vols = "".join(f'[[volumes]]\nname = "v{i}"\nsize = {vol}\nnum_queues = {QUEUES}\n'
                           for i in range(NVOLS))
            cfg = os.path.join(self.dir, "spoold.toml")
            self.device = f"{self.dir}/dev.img"
            with open(cfg, "w") as f:
                f.write(f'state_dir = "{self.dir}/state"\n[journal]\ndir = "{self.dir}/journal"\n'
                        f'[[devices]]\npath = "{self.device}"\n'
                        f'create_size = "{NVOLS * vol + (16 << 20)}"\n{vols}\n{SPOOLD_EXTRA}\n')
            cmd = [os.path.join(bins, "spoold"), "-c", cfg]
            self.sockets = [os.path.join(self.dir, "state", "vhost", f"v{i}.sock") for i in range(NVOLS)]
        else:
            img, offsets = shared
            # locking=off: spoold holds the file; the runs take turns, never overlap.
            cmd = ["qemu-storage-daemon", "--blockdev",
                   f"driver=file,node-name=base,filename={img},cache.direct=on,aio=native,locking=off"]
            if name == "qsd-iot":
                cmd += ["--object", "iothread,id=io0"]
            self.sockets = [os.path.join(self.dir, f"v{i}.sock") for i in range(NVOLS)]
            # Every node before any export: QEMU 7.2 aborts (qemu_mutex_unlock_impl) when a raw
            # node is added on a file node an iothread export already moved to its context.
            for i in range(NVOLS):
                cmd += ["--blockdev", f"driver=raw,node-name=v{i},file=base,offset={offsets[i]},size={vol}"]
            for i, sock in enumerate(self.sockets):
                cmd += ["--export", f"type=vhost-user-blk,id=e{i},node-name=v{i},addr.type=unix,"
                        f"addr.path={sock},writable=on,num-queues={QUEUES}"
                        + (",iothread=io0" if name == "qsd-iot" else "")]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for s in self.sockets:
            wait_socket(s, self.proc, name)

    def volume_offsets(self, bins, vol):
        """Where each of spoold's volumes lies in its device file (`volume show` extent map)."""
        offsets = []
        for i in range(NVOLS):
            r = subprocess.run([os.path.join(bins, "spoolctl"), "--socket",
                                os.path.join(self.dir, "state", "spoold.sock"), "--json", "volume", "show",
                                f"v{i}"], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"spoolctl volume show v{i}: {r.stderr.strip()}")
            m = json.loads(r.stdout)["extent_map"]
            if len(m) != 1 or m[0]["len"] < vol:
                raise RuntimeError(f"volume v{i} is not one extent: {m}")
            offsets.append(m[0]["offset"])
        return offsets

    def tail(self):
        with open(os.path.join(self.dir, "log")) as f:
            return f.read()[-3000:]


POLL_SINGLE = False  # --poll-single: bench.py's rule (poll queues when the row has one client thread)


def bench_cmd(bins, sock, row, runtime, warmup, vol):
    bs, rw, qd, q, v = row
    cmd = [os.path.join(bins, "spool-bench"), "--socket", sock, "--rw", rw, "--bs", str(bs),
           "--iodepth", str(qd), "--queues", str(q), "--runtime", str(runtime), "--warmup", str(warmup),
           "--size", str(vol), "--json"]
    if POLL_SINGLE and q * v == 1:
        cmd.append("--poll")
    return cmd


def fill(bins, sock, vol):
    """Every block written once, sequentially (see the module doc: the layout of a tmpfs file
    decides how fast it reads)."""
    r = subprocess.run([os.path.join(bins, "spool-bench"), "--socket", sock, "--rw", "write", "--bs",
                        "1048576", "--iodepth", "4", "--fill", "--warmup", "0", "--size", str(vol), "--json"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"filling {sock}: {r.stderr.strip()} {r.stdout.strip()}")


def measure(bins, b, row, runtime, warmup, vol):
    """One run of `row` against backend b: total IOPS of all its clients, mean latency."""
    v = row[4]
    procs = [subprocess.Popen(bench_cmd(bins, s, row, runtime, warmup, vol), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s in b.sockets[:v]]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=runtime * 4 + 60)
        if p.returncode != 0:
            raise RuntimeError(f"spool-bench on {b.name} {row_name(row)}: {e.strip()}\n{b.tail()}")
        outs.append(json.loads(o))
    iops = sum(o["iops"] for o in outs)
    lat = sum(o["lat_mean_us"] * o["iops"] for o in outs) / iops if iops else 0
    return iops, lat


def busy_jiffies():
    """CPU time of the whole machine (all cores), in seconds."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def tree_cpu(root):
    """utime + stime of `root` and its descendants (threads that ended included), seconds."""
    kids, stats = {}, {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(rest[1]), []).append(int(p))
            stats[int(p)] = int(rest[11]) + int(rest[12])
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0)
        todo += kids.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


def ours(backends):
    """CPU seconds used by this benchmark: backends' trees, finished clients, this script."""
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(tree_cpu(b.proc.pid) for b in backends.values()) + c.ru_utime + c.ru_stime
            + m.ru_utime + m.ru_stime)


def run_row(bins, backends, row, rounds, runtime, warmup, vol):
    t0, busy0, ours0 = time.time(), busy_jiffies(), ours(backends)
    samples = {n: [] for n in BACKENDS}
    lats = {n: [] for n in BACKENDS}
    for k in range(rounds):
        order = BACKENDS + BACKENDS[::-1]
        if k % 2:
            order = order[::-1]
        for n in order:
            i, l = measure(bins, backends[n], row, runtime, warmup, vol)
            samples[n].append(i)
            lats[n].append(l)
    foreign = max(0.0, (busy_jiffies() - busy0) - (ours(backends) - ours0)) / (time.time() - t0)
    med = {n: statistics.median(samples[n]) for n in BACKENDS}
    best = max(("qsd", "qsd-iot"), key=lambda n: med[n])
    bs, rw, qd, q, v = row
    target = 1.2 if bs == 4096 else 1.0
    ratio = med["spoold"] / med[best]
    r = dict(row=row_name(row), bs=bs, rw=rw, iodepth=qd, queues=q, volumes=v, poll_client=POLL_SINGLE and q * v == 1,
             iops={n: med[n] for n in BACKENDS}, iops_runs={n: [round(x) for x in samples[n]] for n in BACKENDS},
             lat_mean_us={n: statistics.median(lats[n]) for n in BACKENDS}, best_qsd=best,
             ratio=ratio, ratio_qsd=med["spoold"] / med["qsd"], ratio_qsd_iot=med["spoold"] / med["qsd-iot"],
             target=target, met=ratio >= target, foreign_cores=foreign,
             spread={n: (max(samples[n]) - min(samples[n])) / med[n] if med[n] else 0 for n in BACKENDS})
    log(f"   {r['row']:28} spoold {med['spoold'] / 1e3:7.1f}K  qsd {med['qsd'] / 1e3:7.1f}K  "
        f"qsd-iot {med['qsd-iot'] / 1e3:7.1f}K  ratio {ratio:.2f} ({'met' if r['met'] else 'MISSED'} {target}), others {foreign:.2f} cores")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 rows, tiny runs (CI)")
    ap.add_argument("--runtime", type=float, help="seconds per run (default 0.7; quick 0.15)")
    ap.add_argument("--rounds", type=int, help="rounds of A B C C B A per row (default 2; quick 1)")
    ap.add_argument("--bin-dir", default=bin_dir(), help="where spoold and spool-bench are")
    ap.add_argument("--out", help="directory for the results (default docs/benchmarks; with --quick a "
                                  "temporary directory, so a smoke run never overwrites the real results)")
    ap.add_argument("--poll-single", action="store_true",
                    help="poll queues (a busy-polling client) in rows with one client thread, as bench.py")
    ap.add_argument("--only", help="run only the rows whose name contains this (e.g. '128K read')")
    ap.add_argument("--spoold-extra", default="",
                    help="TOML appended to spoold's config (e.g. '[io]\\nfair_share = false')")
    ap.add_argument("--summary-only", action="store_true",
                    help="run nothing: write matrix.md and matrix.png again from matrix.json (in --out or "
                         "docs/benchmarks)")
    args = ap.parse_args()
    if args.summary_only:
        d = args.out or OUT
        with open(os.path.join(d, "matrix.json")) as f:
            doc = json.load(f)
        write_md(doc, os.path.join(d, "matrix.md"), False)
        plot(doc, os.path.join(d, "matrix.png"))
        return
    global POLL_SINGLE
    POLL_SINGLE = args.poll_single
    out = args.out or (tempfile.mkdtemp(prefix="spool-matrix-quick.") if args.quick else OUT)
    runtime = args.runtime or (0.15 if args.quick else 0.7)
    warmup = 0.1 if args.quick else 0.25
    rounds = args.rounds or (1 if args.quick else 2)
    vol = (64 if args.quick else 256) << 20
    rows = QUICK_ROWS if args.quick else all_rows()
    if args.only:
        rows = [r for r in rows if args.only in row_name(r)]
    global SPOOLD_EXTRA
    SPOOLD_EXTRA = args.spoold_extra.replace("\\n", "\n")
    for b in ("spoold", "spoolctl", "spool-bench"):
        if not os.access(os.path.join(args.bin_dir, b), os.X_OK):
            sys.exit(f"{args.bin_dir}/{b} missing: cargo build --release --bin spoold --bin spoolctl --bin spool-bench "
                     "(set SPOOL_TARGET_DIR to its target directory)")
    work = tempfile.mkdtemp(prefix="spool-matrix.", dir="/dev/shm")
    backends, results = {}, []
    t0 = time.time()
    try:
        sp = backends["spoold"] = Backend("spoold", work, vol, args.bin_dir)
        for s in sp.sockets:
            fill(args.bin_dir, s, vol)
        shared = (sp.device, sp.volume_offsets(args.bin_dir, vol))
        for n in BACKENDS[1:]:
            backends[n] = Backend(n, work, vol, args.bin_dir, shared)
        log(f"== {len(rows)} rows, {rounds} round(s) of A B C C B A, {runtime} s runs "
            f"(+{warmup} s warm-up); setup {time.time() - t0:.1f} s")
        for row in rows:
            results.append(run_row(args.bin_dir, backends, row, rounds, runtime, warmup, vol))
    finally:
        for b in backends.values():
            stop(b.proc)
        shutil.rmtree(work, ignore_errors=True)
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=f"{os.cpu_count()} cores, {cpu_model()}", runtime_s=runtime, warmup_s=warmup,
               rounds=rounds, samples_per_backend=2 * rounds, volume_bytes=vol, volumes=NVOLS,
               queues_per_volume=QUEUES, wall_s=round(time.time() - t0, 1), backends=LABELS, rows=results,
               qsd_version=qsd_version())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "matrix.json"), "w") as f:
        json.dump(doc, f, indent=1)
    write_md(doc, os.path.join(out, "matrix.md"), args.quick)
    plot(doc, os.path.join(out, "matrix.png"))
    met = sum(r["met"] for r in results)
    log(f"{met} of {len(results)} rows meet the target; {time.time() - t0:.0f} s; results in {out}/matrix.*")


def qsd_version():
    r = subprocess.run(["qemu-storage-daemon", "--version"], capture_output=True, text=True)
    return r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else "unknown"


def write_md(doc, path, quick):
    rows = doc["rows"]
    with open(path, "w") as f:
        f.write("# spoold against qemu-storage-daemon: the matrix (issue 18)\n\n")
        f.write(f"`scripts/bench-matrix.py{' --quick' if quick else ''}`, {doc['date']} ({doc['machine']}, "
                f"{doc['qsd_version']}), {doc['wall_s']:.0f} s in all. All three backends run at once on "
                f"tmpfs and serve the same bytes: spoold's device file of {doc['volumes']} volumes of "
                f"{doc['volume_bytes'] >> 20} MiB (spoold: default config; qsd: raw nodes at the volumes' "
                "offsets in that file, from `spoolctl volume show`, aio=native, cache.direct=on, without and "
                "with one iothread), each volume written once in full sequentially by the client first. "
                "Each row: "
                f"{doc['rounds']} round(s) of A B C C B A (order flipped each round), "
                f"{doc['runtime_s']} s runs after {doc['warmup_s']} s warm-up, so {doc['samples_per_backend']} "
                "runs per backend; the medians are shown. 4K is random, 128K sequential. Client: spool-bench "
                "(libblkio), " + ("poll queues with one client thread (1q 1vol), interrupt-driven queues "
                                  "otherwise" if any(r["poll_client"] for r in rows) else
                                  "interrupt-driven queues in every row (as a VM's driver)")
                + "; 3vol = three clients at once on three volumes of one device, total IOPS.\n\n")
        f.write("Ratio = spoold / the better qsd setup of the row. Target: at least 1.0 on every row, "
                "1.2 on 4K rows.\n\n")
        f.write("| row | spoold | qsd | qsd iothread | ratio | target | met | spread s/q/qi | others |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            i, sp = r["iops"], r["spread"]
            best = "qsd" if r["best_qsd"] == "qsd" else "iot"
            f.write(f"| {r['row']} | {fmt(i['spoold'])} | {fmt(i['qsd'])} | {fmt(i['qsd-iot'])} | "
                    f"**{r['ratio']:.2f}×** ({best}) | {r['target']:.1f} | {'yes' if r['met'] else '**no**'} | "
                    f"{100 * sp['spoold']:.0f}/{100 * sp['qsd']:.0f}/{100 * sp['qsd-iot']:.0f}% | "
                    f"{r.get('foreign_cores', 0):.2f} |\n")
        met = sum(r["met"] for r in rows)
        four = [r for r in rows if r["bs"] == 4096]
        big = [r for r in rows if r["bs"] != 4096]
        f.write(f"\nIOPS (K = 1000). Spread: (max - min) / median of each backend's runs in the row. "
                "Others: cores used on average by processes outside this benchmark during the row (the "
                "machine is shared; /proc/stat busy time less the backends', clients' and script's own).\n\n"
                f"**{met} of {len(rows)} rows meet the target**: {sum(r['met'] for r in four)} of {len(four)} "
                f"4K rows reach 1.2×, {sum(r['met'] for r in big)} of {len(big)} 128K rows reach 1.0×. "
                f"Rows at 1.0× or more: {sum(r['ratio'] >= 1.0 for r in rows)} of {len(rows)}.\n")
        f.write("\n![ratios](matrix.png)\n" if not quick else "")
        f.write(NOTES)


NOTES = """
## Reading it

- **The same bytes.** qemu-storage-daemon serves spoold's own device file, at the offsets
  `spoolctl volume show` gives for each volume (`extent_map`), so every backend reads and
  writes the same tmpfs pages. Until 2026-11-25 each backend had its own file, laid down the
  same way, and that alone decided 128K rows: tmpfs gives a file whatever physical pages are
  free, and a file whose pages were scattered (2.2 contiguous pages per run on average,
  against 10.2 for the other backend's, read through /proc/self/pagemap) read 128K at 57K
  IOPS where the other read 83K, whichever daemon served it. The 128K read rows went from
  0.53-0.70x to 0.86-2.56x with nothing else changed.
- **This machine changed.** Until 2026-11-25 01:34 the matrix ran on an AMD EPYC; from
  19:36 the same 2-core machine is an Intel Xeon, where both daemons run every row at other
  speeds (4K randread QD32 1q 1vol: spoold 577K and qsd 392K on the EPYC, 349K and 373K on
  the Xeon with the same build). Compare ratios within one run, and runs of one machine.
- **spoold polls, qsd sleeps.** spoold's threads spin while they have work and for
  `poll_idle` (50 µs) after; qemu-storage-daemon blocks in its event loop. Until 2026-11-25
  each connected queue had a thread: with 4 queues and 3 volumes at QD1 (12 worker and 12
  client threads on 2 cores) each request cost spoold two wake-ups where qsd's one thread
  took the requests of all twelve queues in one. Now a volume's queues share `[io]
  volume_threads` threads (default: the cores), each sleeping once for all its queues
  (docs/qos.md, Scaling): on the Xeon, in runs minutes apart, the 4q 3vol QD1 rows went from
  106K to 150-176K IOPS (4K randread) and 105K to 115-139K (4K randwrite).
- **Batches on inline devices.** On tmpfs a request is done when spoold submits it (the copy
  runs in the worker), and the guest sees it when the round completes it. A round that took
  a whole QD32 batch kept 32 done requests from the client until the last was copied, and the
  client from refilling its ring meanwhile; perf showed the worker idle while the client woke.
  A round now takes at most 4 requests on such devices while its thread has its core (it asks
  `getrusage` every 2048 rounds whether it was preempted; if so it takes everything, small
  batches then cost more wake-ups than they save): 4K QD32 1q 1vol went from 349K to 584K
  (randread) and 315K to 553K (randwrite). NVMe, io_uring and RBD queues complete
  asynchronously and keep taking everything.
- **Writes to one file from several threads.** tmpfs takes the file's inode lock
  (`i_rwsem`) for every write, so the writes to one device file were serial whoever made
  them, and a writer waiting for the lock spun on it while the holder ran (three volumes at
  128K write QD32 1q: 56K IOPS on one device file with 39% of spoold's CPU in
  `rwsem_spin_on_owner`, 100K on three files). Since 2026-11-25 spoold writes by copying into
  a shared mapping of the device file (spool-devices `file_map.rs`), which takes no lock:
  every write row went to 1.7-6.6x.
- **Reads by copy.** `preadv` of a tmpfs file looks each page up in the page cache and copies
  it with the kernel's per-page copy, which cost more than the copy itself on this machine
  (a C loop, one thread: 4K random reads 263K/s with `preadv`, 739K/s by `memcpy` out of a
  mapping; 128K sequential 17K/s and 36K/s). Since 2026-11-26 spoold reads out of the same
  mapping, over pages known to hold data only (a read fault on a hole would allocate it;
  holes are read with `preadv`). Alternating the build before and after twice on the QD32 4q
  read rows: 4K 1vol 510K/528K -> 875K/883K, 4K 3vol 462K/455K -> 701K/764K, 128K 1vol
  37K/36K -> 82K/73K, 128K 3vol 35K/31K -> 73K/55K. qsd reads with `preadv`.
- **Noise.** The machine is shared: compare rows by their "others" column. A row where others
  used a core measures spoold with one core for the clients, itself and everyone else.
- scaling.md has the same effect across volumes and cores, with spoold confined by taskset.
"""


def fmt(x):
    return f"{x / 1e3:.0f}K" if x >= 1e4 else f"{x / 1e3:.1f}K"


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot (pip install matplotlib)")
        return
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    names = [r["row"] for r in rows]
    colors = ["tab:green" if r["met"] else ("tab:orange" if r["ratio"] >= 1.0 else "tab:red") for r in rows]
    ax.barh(names, [r["ratio"] for r in rows], color=colors)
    ax.axvline(1.0, color="black", lw=1, label="1.0× (target, all rows)")
    ax.axvline(1.2, color="black", lw=1, ls="--", label="1.2× (target, 4K rows)")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("spoold IOPS / best qemu-storage-daemon IOPS (median of interleaved runs)")
    ax.set_title("spoold vs qsd (tmpfs): green = target met (1.2x on 4K, 1.0x on 128K), "
                 "orange = >= 1.0x only, red = < 1.0x", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
