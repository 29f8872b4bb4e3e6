#!/usr/bin/env python3
"""Scaling study (issue 18): total IOPS of N busy volumes (1..4, one client each) with
spoold's threads confined to M cores (1 or 2), spoold's CPU per I/O, and the CPU spoold
burns while every volume is connected but idle.

spoold: one tmpfs device, 4 volumes of 2 queues (256 MiB each, written once in full first),
the default config (poll_idle_us = 50, fair_share on). It is started under `taskset -c`
(spoold sets no affinity of its own, so the keeper, its worker and standby processes and
every thread they start inherit the mask; the script checks every thread's
Cpus_allowed_list). The machine has 2 cores, so the placements are:

  M=1, clients on the other core   spoold on cpu 1, clients on cpu 0
  M=1, clients on both cores       spoold on cpu 1, clients anywhere (they share cpu 1)
  M=2, clients on both cores       spoold and clients anywhere: there is no core left over

Client per volume: spool-bench (libblkio), 4 KiB random reads, 2 interrupt-driven queues of
QD16. spoold's CPU: utime+stime (and schedstat run time, in ns) of every thread of every
process of its tree, from /proc/PID/task/*/{stat,schedstat}, sampled at the start and end of
the clients' measured window, divided by the I/Os completed in it (the clients' rate x its
length). Idle: all 4
clients connected, then stopped (SIGSTOP) so nothing is in flight, for 5 s; then with no
client at all.

    scripts/bench-scaling.py           # about 4 minutes
    scripts/bench-scaling.py --quick   # smoke run (CI), about 20 s
Binaries: $SPOOL_TARGET_DIR/release (or target/release); --bin-dir overrides.
Results: docs/benchmarks/scaling.{md,json} (--quick: a temporary directory, or --out).
"""

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, bin_dir, cpu_model, log, wait_socket  # noqa: E402

NVOLS = 4
QUEUES = 2
QD = 16
VOL = 256 << 20
HZ = os.sysconf("SC_CLK_TCK")
# (name, spoold's cpus, clients' cpus or None for all)
PLACEMENTS = [("M=1, clients on the other core", "1", "0"),
              ("M=1, clients on both cores", "1", None),
              ("M=2, clients on both cores", "0,1", None)]


def tree(root):
    """PIDs of `root` and all its descendants."""
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        ppid = int(s[s.rfind(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def sample(root):
    """Per thread of spoold's tree: (comm, cpu ticks, run ns, voluntary switches, cpus)."""
    out = {}
    for pid in tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            d = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{d}/stat") as f:
                    s = f.read()
                with open(f"{d}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"{d}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            rest = s[s.rfind(")") + 2:].split()
            out[(pid, int(tid))] = dict(comm=s[s.find("(") + 1:s.rfind(")")],
                                        ticks=int(rest[11]) + int(rest[12]), ns=ns,
                                        vcsw=int(st["voluntary_ctxt_switches"]),
                                        cpus=st["Cpus_allowed_list"].strip())
    return out


def delta(a, b):
    """CPU between two samples: totals and per thread name (threads born in between count
    from zero; threads gone by the end are lost, none are while clients stay connected)."""
    tot = dict(cpu_s=0.0, run_s=0.0, wakeups=0)
    by = {}
    for k, t in b.items():
        t0 = a.get(k, dict(ticks=0, ns=0, vcsw=0))
        d = dict(cpu_s=(t["ticks"] - t0["ticks"]) / HZ, run_s=(t["ns"] - t0["ns"]) / 1e9,
                 wakeups=t["vcsw"] - t0["vcsw"])
        g = by.setdefault(t["comm"], dict(threads=0, cpu_s=0.0, run_s=0.0, wakeups=0))
        g["threads"] += 1
        for x in d:
            tot[x] += d[x]
            g[x] += d[x]
    tot["by_thread"] = by
    tot["cpus_allowed"] = sorted({t["cpus"] for t in b.values()})
    return tot


def busy_s():
    """Busy CPU time of the whole machine (all but idle and iowait), seconds."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / HZ


def procs_cpu(procs):
    """utime + stime of the running processes `procs` (all their threads), seconds."""
    t = 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            t += int(rest[11]) + int(rest[12])
        except OSError:
            pass
    return t / HZ


class Spoold:
    def __init__(self, work, bins, cpus):
        vols = "".join(f'[[volumes]]\nname = "v{i}"\nsize = {VOL}\nnum_queues = {QUEUES}\n'
                       for i in range(NVOLS))
        cfg = os.path.join(work, "spoold.toml")
        with open(cfg, "w") as f:
            f.write(f'state_dir = "{work}/state"\n[journal]\ndir = "{work}/journal"\n'
                    f'[[devices]]\npath = "{work}/dev.img"\ncreate_size = "{NVOLS * VOL + (16 << 20)}"\n{vols}')
        self.log = open(os.path.join(work, "spoold.log"), "a")
        self.proc = subprocess.Popen(["taskset", "-c", cpus, os.path.join(bins, "spoold"), "-c", cfg],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.sockets = [os.path.join(work, "state", "vhost", f"v{i}.sock") for i in range(NVOLS)]
        for s in self.sockets:
            wait_socket(s, self.proc, "spoold")
        time.sleep(0.5)  # the standby worker comes up after the first

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def clients(bins, socks, cpus, runtime, warmup, rw="randread", bs=4096, qd=QD):
    out = []
    for s in socks:
        cmd = [os.path.join(bins, "spool-bench"), "--socket", s, "--rw", rw, "--bs", str(bs),
               "--iodepth", str(qd), "--queues", str(QUEUES), "--runtime", str(runtime),
               "--warmup", str(warmup), "--size", str(VOL), "--json"]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus] + cmd
        out.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return out


def busy_run(bins, sp, n, ccpus, runtime, warmup):
    """N clients at once; spoold's CPU over their measured window."""
    t = time.time()
    procs = clients(bins, sp.sockets[:n], ccpus, runtime, warmup)
    # Inside the clients' window: their queue threads end with the connection.
    time.sleep(max(0.0, t + warmup + 0.05 - time.time()))
    a, ta, ba, ca = sample(sp.proc.pid), time.time(), busy_s(), procs_cpu(procs)
    time.sleep(max(0.0, t + warmup + runtime - 0.1 - time.time()))
    b, tb, bb, cb = sample(sp.proc.pid), time.time(), busy_s(), procs_cpu(procs)
    res = []
    for p in procs:
        o, e = p.communicate(timeout=runtime * 4 + 60)
        if p.returncode != 0:
            raise RuntimeError(f"spool-bench: {e.strip()}")
        res.append(json.loads(o))
    d = delta(a, b)
    iops = sum(r["iops"] for r in res)
    ios = iops * (tb - ta)  # the I/Os of the sampled window, at the clients' measured rate
    return dict(iops=iops, per_volume=[r["iops"] for r in res], ios=round(ios),
                lat_mean_us=statistics.mean(r["lat_mean_us"] for r in res),
                spoold_cpu_s=d["cpu_s"], spoold_run_s=d["run_s"], window_s=tb - ta,
                cpu_us_per_io=1e6 * d["run_s"] / ios if ios else None,
                cpu_us_per_io_ticks=1e6 * d["cpu_s"] / ios if ios else None,
                cpus_allowed=d["cpus_allowed"], clients_cores=(cb - ca) / (tb - ta),
                others_cores=max(0.0, (bb - ba) - d["cpu_s"] - (cb - ca)) / (tb - ta))


def idle_run(bins, sp, secs, connected):
    """spoold's CPU over `secs` with every volume connected but idle (clients stopped), or
    with no client at all."""
    procs = []
    if connected:
        procs = clients(bins, sp.sockets, None, secs + 60, 0.2, qd=1)
        time.sleep(0.7)
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # in-flight requests complete, poll_idle passes
    try:
        a = sample(sp.proc.pid)
        time.sleep(secs)
        b = sample(sp.proc.pid)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    d = delta(a, b)
    return dict(connected=connected, secs=secs, cpu_s=d["cpu_s"], run_s=d["run_s"],
                core_pct=100 * d["run_s"] / secs, wakeups_per_s=d["wakeups"] / secs,
                by_thread={k: dict(v, run_ms_per_s=1e3 * v["run_s"] / secs, wakeups_per_s=v["wakeups"] / secs)
                           for k, v in d["by_thread"].items()},
                cpus_allowed=d["cpus_allowed"])


def fill(bins, sock):
    r = subprocess.run([os.path.join(bins, "spool-bench"), "--socket", sock, "--rw", "write", "--bs", "1048576",
                        "--iodepth", "4", "--fill", "--warmup", "0", "--size", str(VOL), "--json"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"filling {sock}: {r.stderr.strip()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run (CI): N = 1 and 4, short runs")
    ap.add_argument("--runtime", type=float, help="seconds per measured run (default 5; quick 0.5)")
    ap.add_argument("--reps", type=int, help="repetitions, placements in A B C / C B A order (default 2)")
    ap.add_argument("--bin-dir", default=bin_dir(), help="where spoold and spool-bench are")
    ap.add_argument("--out", help="results directory (default docs/benchmarks; --quick: a temporary one)")
    ap.add_argument("--summary-only", action="store_true",
                    help="run nothing: write scaling.md again from scaling.json (in --out or docs/benchmarks)")
    args = ap.parse_args()
    if args.summary_only:
        d = args.out or OUT
        with open(os.path.join(d, "scaling.json")) as f:
            write_md(json.load(f), os.path.join(d, "scaling.md"), False)
        return
    out = args.out or (tempfile.mkdtemp(prefix="spool-scaling-quick.") if args.quick else OUT)
    runtime = args.runtime or (0.5 if args.quick else 5.0)
    warmup = 0.2 if args.quick else 1.0
    reps = args.reps or (1 if args.quick else 2)
    idle_s = 1.0 if args.quick else 5.0
    ns = [1, NVOLS] if args.quick else list(range(1, NVOLS + 1))
    if os.cpu_count() < 2:
        sys.exit("needs at least 2 cores")
    work = tempfile.mkdtemp(prefix="spool-scaling.", dir="/dev/shm")
    t0 = time.time()
    runs, idle = [], []
    try:
        sp = Spoold(work, args.bin_dir, "0,1")
        try:
            for s in sp.sockets:
                fill(args.bin_dir, s)
        finally:
            sp.stop()
        for rep in range(reps):
            order = PLACEMENTS if rep % 2 == 0 else PLACEMENTS[::-1]
            for name, scpus, ccpus in order:
                sp = Spoold(work, args.bin_dir, scpus)
                try:
                    for n in ns:
                        r = dict(placement=name, m=len(scpus.split(",")), n=n, rep=rep,
                                 **busy_run(args.bin_dir, sp, n, ccpus, runtime, warmup))
                        runs.append(r)
                        log(f"   {name:32} N={n}: {r['iops'] / 1e3:7.1f}K IOPS, {r['cpu_us_per_io']:.2f} µs CPU/IO, "
                            f"spoold {r['spoold_run_s'] / r['window_s']:.2f} cores, allowed {r['cpus_allowed']}, "
                            f"others {r['others_cores']:.2f} cores")
                    if rep == 0 and ccpus is None:
                        for connected in (True, False):
                            idle.append(dict(placement=name, m=len(scpus.split(",")),
                                             **idle_run(args.bin_dir, sp, idle_s, connected)))
                            i = idle[-1]
                            log(f"   idle ({'4 connected' if connected else 'none connected'}): "
                                f"{i['core_pct']:.3f}% of a core, {i['wakeups_per_s']:.0f} wake-ups/s")
                finally:
                    sp.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=f"{os.cpu_count()} cores, {cpu_model()}", runtime_s=runtime, warmup_s=warmup, reps=reps,
               queues_per_volume=QUEUES, iodepth_per_queue=QD, volume_bytes=VOL, poll_idle_us=50,
               wall_s=round(time.time() - t0, 1), runs=runs, summary=summarize(runs), idle=idle)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump(doc, f, indent=1)
    write_md(doc, os.path.join(out, "scaling.md"), args.quick)
    log(f"{time.time() - t0:.0f} s; results in {out}/scaling.*")


def summarize(runs):
    keys = []
    for r in runs:
        if (r["placement"], r["n"]) not in keys:
            keys.append((r["placement"], r["n"]))
    out = []
    for p, n in keys:
        rs = [r for r in runs if r["placement"] == p and r["n"] == n]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        out.append(dict(placement=p, m=rs[0]["m"], n=n, iops=med("iops"), iops_runs=[round(r["iops"]) for r in rs],
                        cpu_us_per_io=med("cpu_us_per_io"),
                        spoold_cores=statistics.median(r["spoold_run_s"] / r["window_s"] for r in rs),
                        lat_mean_us=med("lat_mean_us"),
                        others_cores=statistics.median(r.get("others_cores", 0) for r in rs)))
    return out


def write_md(doc, path, quick):
    s = doc["summary"]
    with open(path, "w") as f:
        f.write("# Scaling across volumes and cores (issue 18)\n\n")
        f.write(f"`scripts/bench-scaling.py{' --quick' if quick else ''}`, {doc['date']} ({doc['machine']}), "
                f"{doc['wall_s']:.0f} s in all. spoold on one tmpfs device with 4 volumes of "
                f"{doc['queues_per_volume']} queues, default config (poll_idle_us = {doc['poll_idle_us']}, "
                "fair share on), started under `taskset -c` (every thread of the keeper, worker and standby "
                "inherits it; checked from /proc). N volumes busy, one spool-bench client each: 4 KiB random "
                f"reads, {doc['queues_per_volume']} interrupt-driven queues of QD{doc['iodepth_per_queue']}. "
                f"{doc['runtime_s']} s measured after {doc['warmup_s']} s warm-up, {doc['reps']} repetition(s) "
                "(placements in A B C, then C B A order), medians. CPU per I/O: spoold's run time (schedstat, "
                "every thread of its process tree) over most of the clients' measured window / the I/Os completed "
                "in it (their rate × its length).\n\n")
        f.write("| placement | N | total IOPS | runs | per I/O spoold CPU | spoold cores busy | mean latency "
                "| others |\n|---|---|---|---|---|---|---|---|\n")
        for r in s:
            f.write(f"| {r['placement']} | {r['n']} | {r['iops'] / 1e3:.0f}K | "
                    f"{', '.join(f'{x / 1e3:.0f}K' for x in r['iops_runs'])} | {r['cpu_us_per_io']:.2f} µs | "
                    f"{r['spoold_cores']:.2f} | {r['lat_mean_us']:.0f} µs | {r.get('others_cores', 0):.2f} |\n")
        f.write("\nOthers: cores used by processes outside this benchmark during the window (the machine is "
                "shared; /proc/stat busy time less spoold's and the clients').\n")
        if doc["idle"]:
            f.write("\n## Idle: all 4 volumes connected (clients stopped, nothing in flight), and none\n\n"
                    "| spoold on | clients | CPU | wake-ups/s | by thread (run ms/s, wake-ups/s) |\n"
                    "|---|---|---|---|---|\n")
            for i in doc["idle"]:
                by = ", ".join(f"{k}×{v['threads']} {v['run_ms_per_s']:.3f}/{v['wakeups_per_s']:.1f}"
                               for k, v in sorted(i["by_thread"].items(), key=lambda kv: -kv[1]["run_s"])
                               if v["wakeups"] or v["run_s"] > 0)
                f.write(f"| M={i['m']} | {'4 connected, idle' if i['connected'] else 'none'} | "
                        f"{i['core_pct']:.3f}% of a core ({1e3 * i['run_s'] / i['secs']:.2f} ms/s) | "
                        f"{i['wakeups_per_s']:.0f} | {by} |\n")
        f.write(NOTES)


NOTES = """
## Reading it

- **What M means here.** The machine has 2 cores, so "the remaining cores" exist only for M=1
  (clients on cpu 0, spoold on cpu 1). For M=2 spoold and the clients share both cores; the
  row "M=1, clients on both cores" shows what confining spoold alone does. A wider machine
  would give each side its own cores; this one cannot.
- **One polling thread per queue.** Every queue of a connected volume has its own worker
  thread, which polls while it has work and for `poll_idle` after. N volumes of 2 queues are
  2N polling threads: on M cores with 2N > M they time-share the cores in scheduler slices
  (milliseconds), and a queue whose thread is off the core waits. That is why total IOPS falls
  as N grows and why the CPU per I/O rises: spoold's cores stay busy (the "cores busy"
  column) while fewer of their cycles move requests.
- **CPU per I/O** counts everything spoold's threads ran, polling included: at a polled
  server it is (cores busy) / IOPS, not the cost of a request (request-path.md has that).
- **Idle.** A worker without work polls for `poll_idle` (default 50 µs), then sleeps in
  epoll on its kick eventfd with a 1000 ms timeout when nothing is in flight
  (`crates/spool-frontend/src/worker/run.rs`, `sleep_ms`): one wake-up a second per queue,
  each running a timeout sweep and publishing stats. The rest is fixed, whatever the number
  of volumes: the health monitor ticks every 50 ms (`TICK_IDLE`, spool-health), the keeper's
  supervisor loop waits on its channel 50 ms at a time, the mirror settler every 500 ms. So
  idle spoold costs about 0.1-0.2% of one core, and connected but idle queues add about
  0.06 ms/s each.
"""


if __name__ == "__main__":
    main()
