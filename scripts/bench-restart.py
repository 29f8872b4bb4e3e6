#!/usr/bin/env python3
"""Restart benchmark (the paper's Figures 13 and 14): the longest I/O stall a client sees
while spoold's worker is (a) upgraded gracefully and (b) SIGKILLed and restarted by the
keeper, with the keeper's phase breakdown of each restart.

The client is spool-bench (real libblkio, one queue, 4K randread QD8, interrupt-driven) on a
tmpfs-backed volume; one event happens in the middle of each run and the run's slowest request
is the stall. A baseline run without an event is measured in the same invocation.

Not measured here, and why: (c) a restart without the keeper and qemu-storage-daemon restarted
the same way both drop the vhost-user connection, and libblkio does not reconnect; QEMU's
`reconnect=N` option counts whole seconds, so those stalls are >= 1 s by construction (our
QEMU kill test exercises that path for correctness, see tests/e2e_qemu.rs).

    scripts/bench-restart.py            # 10 runs per scenario (about 1 minute)
    scripts/bench-restart.py --quick    # 2 runs per scenario, for CI
Results: docs/benchmarks/restart.{json,md}, restart-timeline.png, restart-phases.png.
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
from benchlib import BIN, OUT, REPO, ctl, daemon_status, kill_worker, log  # noqa: E402




def bench(vsock, runtime, timeline=None):
    cmd = [os.path.join(BIN, "spool-bench"), "--socket", vsock, "--rw", "randread",
           "--bs", "4096", "--iodepth", "8", "--runtime", str(runtime), "--warmup", "0.2",
           "--json", "--label", "restart"]
    if timeline:
        cmd += ["--timeline", timeline]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def event(kind, sock):
    if kind == "upgrade":
        return ctl(sock, "upgrade")
    return kill_worker(sock)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    runs = 2 if args.quick else 10
    subprocess.run(["cargo", "build", "--release", "-q", "--bin", "spoold", "--bin", "spoolctl",
                    "--bin", "spool-bench"], cwd=REPO, check=True)
    work = tempfile.mkdtemp(prefix="spool-restart-", dir="/dev/shm")
    cfg = os.path.join(work, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(f"""state_dir = "{work}/state"
[journal]
dir = "{work}/journal"
[[devices]]
path = "{work}/dev0.img"
create_size = "1G"
[[volumes]]
name = "vol"
size = "512M"
num_queues = 1
""")
    logf = open(os.path.join(work, "spoold.log"), "w")
    d = subprocess.Popen([os.path.join(BIN, "spoold"), "--config", cfg], stdout=subprocess.DEVNULL,
                         stderr=logf)
    sock, vsock = f"{work}/state/spoold.sock", f"{work}/state/vhost/vol.sock"
    try:
        daemon_status(sock)
        results = {"baseline": [], "upgrade": [], "worker-kill": []}
        reports = {"upgrade": [], "worker-kill": []}
        for i in range(runs):
            for kind in results:
                p = bench(vsock, 1.2)
                time.sleep(0.7)
                if kind != "baseline":
                    reports[kind].append(event(kind, sock))
                out, _ = p.communicate(timeout=60)
                r = json.loads(out)
                if r["errors"]:
                    raise RuntimeError(f"{kind}: client saw {r['errors']} errors")
                results[kind].append(r["lat_max_us"] / 1000)
                log(f"run {i} {kind}: client max latency {r['lat_max_us'] / 1000:.2f} ms")
        # Figure 13: one run, an upgrade at 1 s and a worker kill at 2 s.
        tl = os.path.join(work, "timeline.csv")
        p = bench(vsock, 2.8, tl)
        time.sleep(1.2)
        event("upgrade", sock)
        time.sleep(1.0)
        event("worker-kill", sock)
        p.communicate(timeout=60)
        with open(tl) as f:
            timeline = [int(l.split(",")[1]) for l in f.read().splitlines()[1:]]
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=30)
        except subprocess.TimeoutExpired:
            d.kill()
        shutil.rmtree(work, ignore_errors=True)

    def summary(v):
        return {"median_ms": statistics.median(v), "max_ms": max(v), "runs": len(v)}

    phases = {}
    for kind, rs in reports.items():
        names = []
        for r in rs:
            for ph in r["phases"]:
                if ph["name"] not in names:
                    names.append(ph["name"])
        phases[kind] = {n: statistics.median([next((ph["ms"] for ph in r["phases"] if ph["name"] == n), 0.0)
                                              for r in rs]) for n in names}
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "client": "spool-bench (libblkio), 4K randread QD8, 1 queue, tmpfs-backed volume, release build",
        "client_max_latency": {k: summary(v) for k, v in results.items()},
        "keeper_stall": {k: summary([r["stall_ms"] for r in rs]) for k, rs in reports.items()},
        "phases_median_ms": phases,
        "targets_ms": {"upgrade": 20, "worker-kill": 50},
    }
    if args.quick:
        log(json.dumps(res, indent=1))
        log("quick mode: results not written")
        return
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "restart.json"), "w") as f:
        json.dump(res, f, indent=1)
    cm = res["client_max_latency"]
    ks = res["keeper_stall"]
    md = [
        "# Restart benchmark (Figures 13 and 14)",
        "",
        f"Run {res['date']} by `scripts/bench-restart.py` on this 2-core machine; {res['client']}.",
        "Each run lasts 1.4 s with one event in the middle; the client's slowest request is the stall it saw.",
        "",
        "| scenario | client max latency, median | max | keeper-measured stall, median | target |",
        "|---|---|---|---|---|",
        f"| no event (baseline) | {cm['baseline']['median_ms']:.2f} ms | {cm['baseline']['max_ms']:.2f} ms | - | - |",
        f"| (a) graceful upgrade | {cm['upgrade']['median_ms']:.2f} ms | {cm['upgrade']['max_ms']:.2f} ms | {ks['upgrade']['median_ms']:.2f} ms | <= 20 ms |",
        f"| (b) worker SIGKILL, keeper restarts it | {cm['worker-kill']['median_ms']:.2f} ms | {cm['worker-kill']['max_ms']:.2f} ms | {ks['worker-kill']['median_ms']:.2f} ms | <= 50 ms |",
        "| (c) no keeper: QEMU reconnect=1, and qemu-storage-daemon restarted | >= 1000 ms (QEMU's reconnect timer counts whole seconds) | | | |",
        "",
        "Spool (the paper) restarts in 115 ms, SPDK in 1,218 ms.",
        "",
        "## Phases (median ms)",
        "",
    ]
    for kind, ph in phases.items():
        md.append(f"**{kind}**: " + ", ".join(f"{n} {v:.2f}" for n, v in ph.items()))
        md.append("")
    md += ["![timeline](restart-timeline.png)", "", "![phases](restart-phases.png)", ""]
    md += crash_tail_section()
    with open(os.path.join(OUT, "restart.md"), "w") as f:
        f.write("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(range(len(timeline)), timeline, lw=0.6)
        ax.set_xlabel("ms since start")
        ax.set_ylabel("completions per ms")
        ax.set_title("4K randread QD8: graceful upgrade near 1.2 s, worker SIGKILL near 2.2 s")
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "restart-timeline.png"), dpi=110)
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for i, (kind, ph) in enumerate(phases.items()):
            left = 0.0
            for n, v in ph.items():
                if n.startswith("prepare") or n.startswith("preview") or n == "worker start total":
                    continue
                ax.barh(i, v, left=left)
                if v > 0.3:
                    ax.text(left + v / 2, i, n.split(",")[0], ha="center", va="center", fontsize=6, rotation=90)
                left += v
        ax.set_yticks(range(len(phases)), list(phases))
        ax.set_xlabel("ms (service stopped to serving again)")
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "restart-phases.png"), dpi=110)
    except ImportError:
        log("matplotlib missing: no plots")
    print("\n".join(md))


def crash_tail_section():
    """The crash-restart distribution under a guest's load, from the last run of
    scripts/bench-crash-tail.py (too long for this script: it is run by hand)."""
    path = os.path.join(OUT, "restart-tail.json")
    if not os.path.exists(path):
        return []
    t = json.load(open(path))
    md = ["## Crash-restart tail under a guest's load", "",
          f"From `scripts/bench-crash-tail.py` ({t['date']}; details in "
          "[restart-tail.md](restart-tail.md)): a QEMU guest runs a verifying fio job while the "
          "worker is SIGKILLed again and again; the keeper's report of each restart.", "",
          "| mode | kills | median | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for r in t["results"]:
        name = {"spawn": "before: a worker process started at the death (`--no-standby`)",
                "standby": "after: the standby worker takes over (default)"}[r["mode"]]
        md.append(f"| {name} | {r['kills']} | {r['median_ms']:.1f} ms | {r['p90_ms']:.1f} ms | "
                  f"{r['p99_ms']:.1f} ms | {r['max_ms']:.1f} ms |")
    return md + [""]


if __name__ == "__main__":
    main()
