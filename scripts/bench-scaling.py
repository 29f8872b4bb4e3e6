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

import os
import signal
import sys
import time

import benchlib as b
from benchlib import HZ, Spoold, dev, log, median, vol

NVOLS = 4
QUEUES = 2
QD = 16
VOL = 256 << 20
PLACEMENTS = b.table(("name", "spoold", "clients"), [  # the clients' CPUs: None for all
    ("M=1, clients on the other core", "1", "0"),
    ("M=1, clients on both cores", "1", None),
    ("M=2, clients on both cores", "0,1", None)])


def sample(root):
    """Per thread of spoold's tree: (comm, cpu ticks, run ns, voluntary switches, cpus)."""
    out = {}
    for pid in b.proc_tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            d = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{d}/stat") as f, open(f"{d}/schedstat") as g, open(f"{d}/status") as h:
                    s, ns, st = f.read(), int(g.read().split()[0]), dict(x.split(":", 1) for x in h if ":" in x)
            except OSError:
                continue
            rest = s[s.rfind(")") + 2:].split()
            out[(pid, int(tid))] = dict(comm=s[s.find("(") + 1:s.rfind(")")],
                                        ticks=int(rest[11]) + int(rest[12]), ns=ns,
                                        vcsw=int(st["voluntary_ctxt_switches"]),
                                        cpus=st["Cpus_allowed_list"].strip())
    return out


def delta(a, z):
    """CPU between two samples: totals and per thread name (threads born in between count
    from zero; threads gone by the end are lost, none are while clients stay connected)."""
    tot = dict(cpu_s=0.0, run_s=0.0, wakeups=0)
    by = {}
    for k, t in z.items():
        t0 = a.get(k, dict(ticks=0, ns=0, vcsw=0))
        d = dict(cpu_s=(t["ticks"] - t0["ticks"]) / HZ, run_s=(t["ns"] - t0["ns"]) / 1e9,
                 wakeups=t["vcsw"] - t0["vcsw"])
        g = by.setdefault(t["comm"], dict(threads=0, cpu_s=0.0, run_s=0.0, wakeups=0))
        g["threads"] += 1
        for x in d:
            tot[x] += d[x]
            g[x] += d[x]
    return dict(tot, by_thread=by, cpus_allowed=sorted({t["cpus"] for t in z.values()}))


def spoold(work, cpus):
    sp = Spoold(work, [dev(f"{work}/dev.img", NVOLS * VOL + (16 << 20))],
                [vol(f"v{i}", VOL, QUEUES) for i in range(NVOLS)], cpus=cpus)
    time.sleep(0.5)  # the standby worker comes up after the first
    return sp


def clients(socks, cpus, runtime, warmup, qd=QD):
    return [b.start_bench(s, cpus, rw="randread", bs=4096, qd=qd, queues=QUEUES, runtime=runtime, warmup=warmup,
                          size=VOL) for s in socks]


def busy_run(sp, n, ccpus, runtime, warmup):
    """N clients at once; spoold's CPU over their measured window."""
    t = time.time()
    procs = clients(sp.sockets[:n], ccpus, runtime, warmup)
    # Inside the clients' window: their queue threads end with the connection.
    time.sleep(max(0.0, t + warmup + 0.05 - time.time()))
    a, ta, ba, ca = sample(sp.pid), time.time(), b.busy_s(), b.cpu_s([p.pid for p in procs])
    time.sleep(max(0.0, t + warmup + runtime - 0.1 - time.time()))
    z, tb, bb, cb = sample(sp.pid), time.time(), b.busy_s(), b.cpu_s([p.pid for p in procs])
    res = b.results(procs, timeout=runtime * 4 + 60)
    d = delta(a, z)
    iops = sum(r["iops"] for r in res)
    ios = iops * (tb - ta)  # the I/Os of the sampled window, at the clients' measured rate
    return dict(iops=iops, per_volume=[r["iops"] for r in res], ios=round(ios),
                lat_mean_us=b.mean(r["lat_mean_us"] for r in res),
                spoold_cpu_s=d["cpu_s"], spoold_run_s=d["run_s"], window_s=tb - ta,
                cpu_us_per_io=1e6 * d["run_s"] / ios if ios else None,
                cpu_us_per_io_ticks=1e6 * d["cpu_s"] / ios if ios else None,
                cpus_allowed=d["cpus_allowed"], clients_cores=(cb - ca) / (tb - ta),
                others_cores=max(0.0, (bb - ba) - d["cpu_s"] - (cb - ca)) / (tb - ta))


def idle_run(sp, secs, connected):
    """spoold's CPU over `secs` with every volume connected but idle (clients stopped), or
    with no client at all."""
    procs = clients(sp.sockets, None, secs + 60, 0.2, qd=1) if connected else []
    if connected:
        time.sleep(0.7)
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # in-flight requests complete, poll_idle passes
    a = sample(sp.pid)
    time.sleep(secs)
    d = delta(a, sample(sp.pid))
    for p in procs:
        p.kill()
        p.wait()
    return dict(connected=connected, secs=secs, cpu_s=d["cpu_s"], run_s=d["run_s"],
                core_pct=100 * d["run_s"] / secs, wakeups_per_s=d["wakeups"] / secs,
                by_thread={k: dict(v, run_ms_per_s=1e3 * v["run_s"] / secs, wakeups_per_s=v["wakeups"] / secs)
                           for k, v in d["by_thread"].items()},
                cpus_allowed=d["cpus_allowed"])


def placement(c, work, a, rep, runs, idle):
    """The N runs of one placement (and, on the first repetition with the clients anywhere,
    the idle ones) on a spoold started under taskset."""
    with spoold(work, c["spoold"]) as sp:
        m = len(c["spoold"].split(","))
        for n in a.ns:
            r = dict(placement=c["name"], m=m, n=n, rep=rep, **busy_run(sp, n, c["clients"], a.runtime, a.warmup))
            runs.append(r)
            log(f"   N={n}: {r['iops'] / 1e3:.1f}K IOPS, {r['cpu_us_per_io']:.2f} µs CPU/IO, {r['cpus_allowed']}")
        for connected in (True, False) if rep == 0 and c["clients"] is None else ():
            idle.append(dict(placement=c["name"], m=m, **idle_run(sp, a.idle_s, connected)))
            log(f"   idle, {'4' if connected else 'none'} connected: {idle[-1]['core_pct']:.3f}% of a core")


def main():
    a = b.args(__doc__, {"--runtime": dict(type=float, help="seconds per measured run (default 5; quick 0.5)"),
                         "--reps": dict(type=int, help="repetitions, placements in A B C / C B A order (default 2)")},
               out="scaling")
    if a.summary_only:
        return b.write_md(b.load("scaling", a.out), md, os.path.join(a.out or b.OUT, "scaling.md"))
    if os.cpu_count() < 2:
        sys.exit("needs at least 2 cores")
    a.runtime = a.runtime or (0.5 if a.quick else 5.0)
    a.warmup = 0.2 if a.quick else 1.0
    a.reps = a.reps or (1 if a.quick else 2)
    a.idle_s = 1.0 if a.quick else 5.0
    a.ns = [1, NVOLS] if a.quick else list(range(1, NVOLS + 1))
    work = b.workdir("spool-scaling.")
    t0 = time.time()
    with spoold(work, "0,1") as sp:
        for s in sp.sockets:
            b.fill(s, VOL)
    runs, idle = [], []
    for rep in range(a.reps):
        b.run_cases(PLACEMENTS[::-1] if rep % 2 else PLACEMENTS, lambda c: placement(c, work, a, rep, runs, idle))
    b.save("scaling", dict(runtime_s=a.runtime, warmup_s=a.warmup, reps=a.reps, queues_per_volume=QUEUES,
                           iodepth_per_queue=QD, volume_bytes=VOL, poll_idle_us=50, wall_s=round(time.time() - t0, 1),
                           runs=runs, summary=summarize(runs), idle=idle), md, out=a.out)


def summarize(runs):
    out = []
    for p, n in dict.fromkeys((r["placement"], r["n"]) for r in runs):
        rs = [r for r in runs if r["placement"] == p and r["n"] == n]
        out.append(dict(placement=p, m=rs[0]["m"], n=n, iops=median(r["iops"] for r in rs),
                        iops_runs=[round(r["iops"]) for r in rs], cpu_us_per_io=median(r["cpu_us_per_io"] for r in rs),
                        spoold_cores=median(r["spoold_run_s"] / r["window_s"] for r in rs),
                        lat_mean_us=median(r["lat_mean_us"] for r in rs),
                        others_cores=median(r.get("others_cores", 0) for r in rs)))
    return out


def md(d):
    idle = "" if not d["idle"] else "\n## Idle: all 4 volumes connected (clients stopped, nothing in flight), " \
        "and none\n\n" + b.md_table(["spoold on", "clients", "CPU", "wake-ups/s", "by thread (run ms/s, wake-ups/s)"], [
            (f"M={i['m']}", "4 connected, idle" if i["connected"] else "none",
             f"{i['core_pct']:.3f}% of a core ({1e3 * i['run_s'] / i['secs']:.2f} ms/s)", f"{i['wakeups_per_s']:.0f}",
             ", ".join(f"{k}×{v['threads']} {v['run_ms_per_s']:.3f}/{v['wakeups_per_s']:.1f}" for k, v in sorted(
                 i["by_thread"].items(), key=lambda kv: -kv[1]["run_s"]) if v["wakeups"] or v["run_s"] > 0))
            for i in d["idle"]]) + "\n"
    return b.notes("scaling", **dict(d, idle=idle), table=b.md_table(
        ["placement", "N", "total IOPS", "runs", "per I/O spoold CPU", "spoold cores busy", "mean latency", "others"], [
            (r["placement"], r["n"], f"{r['iops'] / 1e3:.0f}K", ", ".join(f"{x / 1e3:.0f}K" for x in r["iops_runs"]),
             f"{r['cpu_us_per_io']:.2f} µs", f"{r['spoold_cores']:.2f}", f"{r['lat_mean_us']:.0f} µs",
             f"{r.get('others_cores', 0):.2f}") for r in d["summary"]]))


if __name__ == "__main__":
    main()
