#!/usr/bin/env python3
"""What idle costs (issue 33): spoold's CPU while 8 volumes are served and 8 connected
clients do no I/O, against the same with no client connected.

One spoold (release build, with its keeper, journal on tmpfs) serves 8 volumes of one queue
on one tmpfs file. Each client is `spool-bench --idle`: a real libblkio client that connects,
starts its queue and then asks for nothing. The CPU time of every spoold process (keeper,
worker, standby worker) is read from /proc over the measuring window; the result is the share
of one core. Target: under 1% of a core with 8 connected idle clients.

    scripts/bench-idle.py              # 20 s windows
    scripts/bench-idle.py --quick      # 3 s windows (checks it works; idle-quick.*)
Results: docs/benchmarks/idle.{json,md}.
"""

import sys
import time

import benchlib as b
from benchlib import Spoold, dev, log, vol

VOLUMES = 8


def measure(pid, secs):
    """spoold's CPU (all its processes) over `secs`, % of one core; and how many processes."""
    pids = b.proc_tree(pid)
    c0, t0 = b.cpu_s(pids), time.monotonic()
    time.sleep(secs)
    pids = b.proc_tree(pid)
    return (b.cpu_s(pids) - c0) / (time.monotonic() - t0) * 100.0, len(pids)


def main():
    a = b.args(__doc__)
    secs = 3 if a.quick else 20
    work = b.workdir("spool-idle-")
    d = Spoold(work, [dev(f"{work}/d0.img", f"{VOLUMES * 64 + 64}M")], [vol(f"v{i}", "64M") for i in range(VOLUMES)])
    time.sleep(2)  # the standby worker starts, the first housekeeping rounds pass
    none, procs = measure(d.pid, secs)
    log(f"no client: {none:.2f}% of a core ({procs} spoold processes)")
    clients = [b.start_bench(s, idle=True, warmup=0, runtime=secs + 6) for s in d.sockets]
    time.sleep(3)
    for c in clients:
        if c.poll() is not None:
            sys.exit(f"an idle client ended early: {c.stderr.read()}")
    idle, procs = measure(d.pid, secs)
    log(f"{VOLUMES} idle clients connected: {idle:.2f}% of a core ({procs} spoold processes)")
    b.save("idle", {"window_s": secs, "volumes": VOLUMES, "no_client_pct": none, "idle_clients_pct": idle,
                    "target_pct": 1.0}, md, a.quick)


def md(r):
    return b.notes("idle", **r, table=b.md_table(["", "spoold CPU (% of one core)"], [
        (f"{r['volumes']} volumes, no client", f"{r['no_client_pct']:.2f}"),
        (f"{r['volumes']} connected `spool-bench --idle` clients (libblkio, rings started, no I/O)",
         f"{r['idle_clients_pct']:.2f}")]))


if __name__ == "__main__":
    main()
