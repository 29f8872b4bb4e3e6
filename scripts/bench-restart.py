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
    scripts/bench-restart.py --quick    # 2 runs per scenario, for CI (restart-quick.*)
Results: docs/benchmarks/restart.{json,md}, restart-timeline.png, restart-phases.png.
"""

import os
import time

import benchlib as b
from benchlib import OUT, Spoold, dev, log, median, vol



def event(kind, d):
    return d.ctl("upgrade") if kind == "upgrade" else d.kill_worker()


def main():
    a = b.args(__doc__)
    work = b.workdir("spool-restart-")
    d = Spoold(work, [dev(f"{work}/dev0.img", "1G")], [vol("vol", "512M")])
    d.status()
    stalls = {"baseline": [], "upgrade": [], "worker-kill": []}
    reports = {"upgrade": [], "worker-kill": []}
    for i in range(2 if a.quick else 10):
        for kind in stalls:
            s, report = b.stall([d.sock], 1.2, 0.7, None if kind == "baseline" else lambda: event(kind, d), kind,
                                warmup=0.2, label="restart")
            stalls[kind].append(s)
            reports.get(kind, []).append(report)
            log(f"run {i} {kind}: client max latency {s:.2f} ms")
    # Figure 13: one run, an upgrade at 1 s and a worker kill at 2 s.
    tl = os.path.join(work, "timeline.csv")
    b.stall([d.sock], 2.8, 1.2, lambda: (event("upgrade", d), time.sleep(1.0), event("worker-kill", d)), "timeline",
            warmup=0.2, label="restart", timeline=tl)
    d.stop()
    phases = {}
    for kind, rs in reports.items():
        names = dict.fromkeys(ph["name"] for r in rs for ph in r["phases"])
        phases[kind] = {n: median([next((ph["ms"] for ph in r["phases"] if ph["name"] == n), 0.0) for r in rs])
                        for n in names}
    res = dict(client_max_latency={k: b.dist(v) for k, v in stalls.items()},
               keeper_stall={k: b.dist([r["stall_ms"] for r in rs]) for k, rs in reports.items()},
               phases_median_ms=phases, targets_ms={"upgrade": 20, "worker-kill": 50})
    b.save("restart", res, md, a.quick)
    plots(res, b.timeline(tl)[0], "restart-quick" if a.quick else "restart")


def md(r):
    cm, ks, target = r["client_max_latency"], r["keeper_stall"], r["targets_ms"]
    return b.notes("restart", tail=crash_tail(), phases="\n\n".join(
        f"**{kind}**: " + ", ".join(f"{n} {v:.2f}" for n, v in ph.items())
        for kind, ph in r["phases_median_ms"].items()),
        table=b.md_table(["scenario", "client max latency, median", "max", "keeper-measured stall, median", "target"], [
            (name, f"{cm[k]['median_ms']:.2f} ms", f"{cm[k]['max_ms']:.2f} ms",
             *((f"{ks[k]['median_ms']:.2f} ms", f"<= {target[k]} ms") if k in ks else ("-", "-")))
            for name, k in (("no event (baseline)", "baseline"), ("(a) graceful upgrade", "upgrade"),
                            ("(b) worker SIGKILL, keeper restarts it", "worker-kill"))] + [
            ("(c) no keeper: QEMU reconnect=1, and qemu-storage-daemon restarted",
             ">= 1000 ms (QEMU's reconnect timer counts whole seconds)", "", "", "")]))


def crash_tail():
    """The crash-restart distribution under a guest's load, from the last run of
    scripts/bench-crash-tail.py (too long for this script: it is run by hand)."""
    if not os.path.exists(os.path.join(OUT, "restart-tail.json")):
        return ""
    t = b.load("restart-tail")
    names = {"spawn": "before: a worker process started at the death (`--no-standby`)",
             "standby": "after: the standby worker takes over (default)"}
    return "\n".join(b.notes("restart-tail-section", date=t["date"][:10], table=b.md_table(
        ["mode", "kills", "median", "p90", "p99", "max"], [
            [names[r["mode"]], r["kills"]] + [f"{r[k]:.1f} ms" for k in ("median_ms", "p90_ms", "p99_ms", "max_ms")]
            for r in t["results"].get("modes") or t["results"]["results"]])))


def plots(res, timeline, name):
    plt = b.pyplot()
    if not plt:
        return
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(range(len(timeline)), timeline, lw=0.6)
    ax.set_xlabel("ms since start")
    ax.set_ylabel("completions per ms")
    ax.set_title("4K randread QD8: graceful upgrade near 1.2 s, worker SIGKILL near 2.2 s")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{name}-timeline.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    phases = res["phases_median_ms"]
    for i, ph in enumerate(phases.values()):
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
    fig.savefig(os.path.join(OUT, f"{name}-phases.png"), dpi=110)


if __name__ == "__main__":
    main()
