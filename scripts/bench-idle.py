#!/usr/bin/env python3
"""What idle costs (issue 33): spoold's CPU while 8 volumes are served and 8 connected
clients do no I/O, against the same with no client connected.

One spoold (release build, with its keeper, journal on tmpfs) serves 8 volumes of one queue
on one tmpfs file. Each client is `spool-bench --idle`: a real libblkio client that connects,
starts its queue and then asks for nothing. The CPU time of every spoold process (keeper,
worker, standby worker) is read from /proc over the measuring window; the result is the share
of one core. Target: under 1% of a core with 8 connected idle clients.

    scripts/bench-idle.py              # 20 s windows
    scripts/bench-idle.py --quick      # 3 s windows (checks it works)
Results: docs/benchmarks/idle.{json,md}.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import OUT, bin_dir, cpu_model, log, wait_socket  # noqa: E402

VOLUMES = 8


def start_spoold(work, shm):
    cfg = os.path.join(work, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(f"""state_dir = "{work}/state"
[journal]
enabled = true
dir = "{shm}/journal"
[[devices]]
path = "{shm}/d0.img"
create_size = "{VOLUMES * 64 + 64}M"
""")
        for i in range(VOLUMES):
            f.write(f'[[volumes]]\nname = "v{i}"\nsize = "64M"\nnum_queues = 1\n')
    log_f = open(os.path.join(work, "spoold.log"), "w")
    p = subprocess.Popen([os.path.join(bin_dir(), "spoold"), "-c", cfg],
                         stdout=log_f, stderr=subprocess.STDOUT)
    socks = [os.path.join(work, "state", "vhost", f"v{i}.sock") for i in range(VOLUMES)]
    for s in socks:
        wait_socket(s, p, "spoold")
    return p, socks


def tree(pid):
    """`pid` and its descendants."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pids):
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total / hz


def measure(pid, secs):
    pids = tree(pid)
    c0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(secs)
    pids = tree(pid)
    return (cpu_seconds(pids) - c0) / (time.monotonic() - t0) * 100.0, len(pids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    secs = 3 if a.quick else 20
    work = tempfile.mkdtemp(prefix="spool-idle-")
    shm = tempfile.mkdtemp(prefix="spool-idle-", dir="/dev/shm")
    p, socks = start_spoold(work, shm)
    clients = []
    try:
        time.sleep(2)  # the standby worker starts, the first housekeeping rounds pass
        none, procs = measure(p.pid, secs)
        log(f"no client: {none:.2f}% of a core ({procs} spoold processes)")
        for s in socks:
            clients.append(subprocess.Popen(
                [os.path.join(bin_dir(), "spool-bench"), "--socket", s, "--idle",
                 "--warmup", "0", "--runtime", str(secs + 6), "--json"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(3)
        for c in clients:
            if c.poll() is not None:
                sys.exit(f"an idle client ended early: {c.stderr.read().decode()}")
        idle, procs = measure(p.pid, secs)
        log(f"{VOLUMES} idle clients connected: {idle:.2f}% of a core ({procs} spoold processes)")
    finally:
        for c in clients:
            c.kill()
        p.terminate()
        p.wait(timeout=30)
        subprocess.run(["rm", "-rf", work, shm])
    res = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "cores": os.cpu_count(),
           "window_s": secs, "volumes": VOLUMES, "no_client_pct": none,
           "idle_clients_pct": idle, "target_pct": 1.0}
    if a.quick:
        print(json.dumps(res))
        return
    with open(os.path.join(OUT, "idle.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(OUT, "idle.md"), "w") as f:
        f.write(f"""# What idle costs

Measured {res['date']} by `scripts/bench-idle.py` on {res['cpu']} ({res['cores']} cores, shared):
one spoold (release build, keeper, standby worker, journal on tmpfs) serving {VOLUMES} volumes
of one queue on a tmpfs file; CPU time of every spoold process over {secs} s, as a share of
one core.

| | spoold CPU (% of one core) |
|---|---|
| {VOLUMES} volumes, no client | {none:.2f} |
| {VOLUMES} connected `spool-bench --idle` clients (libblkio, rings started, no I/O) | {idle:.2f} |

Target: under 1% of a core with {VOLUMES} connected idle clients.
""")
    log(f"written {OUT}/idle.{{json,md}}")


if __name__ == "__main__":
    main()
