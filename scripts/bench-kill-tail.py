#!/usr/bin/env python3
"""Worker-kill stalls as clients see them (issue 33): the longest request of a libblkio
client across each kill, over 100+ kills in the cases where outliers were seen or could hide:

  first     the first kill after spoold starts (a fresh spoold each time, the kill 1 s after
            its volume answers)
  spaced    single kills 300-600 ms apart, one busy volume
  burst     five kills 50 ms apart (the stall of the burst's worst kill is what the client
            saw; each counts as five kills)
  upgrade   a kill of the worker while a live upgrade is under way
  volumes8  single kills with 8 volumes busy, one client each (the stall: the worst client)

The client is spool-bench (real libblkio, one queue, 4K randread QD8, interrupt-driven) on
tmpfs-backed volumes, one process per event: its slowest request is the stall. A baseline
without any event is measured the same way in the same invocation, since on a small shared
host the client's slowest request has a floor of its own. The keeper's own measurement of
each restart (from the death to the successor serving) is reported next to it.

    scripts/bench-kill-tail.py               # about 4 minutes on 2 cores
    scripts/bench-kill-tail.py --scale 0.2   # a fifth of the events, to try it
    scripts/bench-kill-tail.py --only volumes8,baseline8 --json   # some cases, printed
The binaries are target/release's, or $SPOOL_TARGET_DIR/release's (an A/B of two builds).
Results: docs/benchmarks/kill-tail.{json,md}. Run by hand, not in CI.
"""

import json
import os
import random
import signal
import threading
import time

import benchlib as b
from benchlib import Spoold, daemon_status, dev, log, vol

def spoold(volumes):
    work = b.workdir("spool-kill-tail-")
    d = Spoold(work, [dev(f"{work}/dev0.img", "1G")], [vol(f"v{i}", "64M") for i in range(volumes)])
    d.status()
    return d


def kill(d, rng):
    return lambda: [d.kill_worker()]


def spaced(d, rng):
    time.sleep(rng.uniform(0.0, 0.3))
    return kill(d, rng)


def burst(d, rng):
    def five():
        reports, t = [], time.monotonic()
        for k in range(5):
            reports.append(d.kill_worker())
            t += 0.05
            time.sleep(max(0.0, t - time.monotonic()))
        return reports
    return five


def upgrade(d, rng):
    def upgrade_now():
        try:
            d.ctl("upgrade")
        except RuntimeError:  # the upgrade may fail: its worker was killed under it
            pass

    def kill_during():
        for attempt in range(11):
            if attempt == 10:
                raise RuntimeError("10 upgrades in a row ended before their kill")
            pid = daemon_status(d.rpc)["pid"]
            t = threading.Thread(target=upgrade_now)
            t.start()
            time.sleep(rng.uniform(0.0, 0.004))
            try:
                os.kill(pid, signal.SIGKILL)
                break
            except ProcessLookupError:
                # The upgrade was over before the kill: no kill during it; again.
                t.join(timeout=60)
        t.join(timeout=60)
        return [b.wait_restart(d.rpc, pid)]
    return kill_during


# Each case: on a spoold of `volumes` (first: a fresh one per event), `events` times (--scale), each a
# client run of `runtime` s with the event (made by `event` before the run) at `at` s.
CASES = b.table(("name", "volumes", "events", "runtime", "at", "event"), [
    ("first", None, 10, 1.6, 1.0, kill), ("baseline", 1, 20, 0.6, 0.3, None), ("spaced", 1, 30, 0.6, 0.3, spaced),
    ("burst", 1, 8, 0.8, 0.2, burst), ("upgrade", 1, 10, 0.8, 0.3, upgrade), ("baseline8", 8, 10, 0.6, 0.3, None),
    ("volumes8", 8, 25, 0.6, 0.3, spaced)])


def event(c, d, rng, what):
    """One event of case `c` on `d`: (the worst client's slowest request in ms, the keeper's reports)."""
    stall, reports = b.stall(d.sockets, c["runtime"], c["at"], c["event"] and c["event"](d, rng), what, warmup=0.1,
                             label="kill-tail")
    return stall, reports or []


def slowest(reports):
    """The slowest restart of `reports` (keeper reports): its stall and its phases, in words."""
    if not reports:
        return None
    r = max(reports, key=lambda x: x["stall_ms"])
    return {"stall_ms": r["stall_ms"],
            "phases": ", ".join(f"{p['name']} {p['ms']:.2f} ms" for p in r.get("phases", []))}


def main():
    a = b.args(__doc__, {
        "--scale": dict(type=float, default=1.0, help="fraction of the events to run"), "--seed": dict(type=int),
        "--only": dict(help="comma-separated cases to run (first, baseline, spaced, burst, upgrade, baseline8, "
                            "volumes8); results are then printed, not written"),
        "--json": dict(action="store_true", help="print the results as JSON")}, quick=False)
    seed = a.seed if a.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    only = set(a.only.split(",")) if a.only else None
    runs, server = {}, {}

    def run(c):
        # Each case runs on the spoold it is about (the one-volume cases on the 8-volume spoold
        # would drive all 8 volumes).
        if c["volumes"] and c["volumes"] not in server:
            for d in server.values():
                d.stop()
            server.clear()
            server[c["volumes"]] = spoold(c["volumes"])
        runs[c["name"]] = []
        for i in range(max(1, round(c["events"] * a.scale))):
            d = server.get(c["volumes"]) or spoold(1)  # first: a fresh spoold each time
            runs[c["name"]].append(event(c, d, rng, f"{c['name']} {i}"))
            if c["volumes"] is None:
                d.stop()
    b.run_cases([c for c in CASES if only is None or c["name"] in only], run)
    res = {"seed": seed, "client": "spool-bench (libblkio), 4K randread QD8, 1 queue per volume, tmpfs", "cases": {}}
    for case, rs in runs.items():
        keeper = [x for _, r in rs for x in r]
        res["cases"][case] = {"events": len(rs), "kills": len(keeper), "client": b.dist([s for s, _ in rs]),
                              "keeper": b.dist([x["stall_ms"] for x in keeper]),
                              "outcomes": sorted({x.get("outcome", "?") for x in keeper}), "slowest": slowest(keeper)}
        c = res["cases"][case]["client"]
        log(f"{case}: {len(rs)} events, client median {c['median_ms']:.2f} ms, max {c['max_ms']:.2f} ms")
    every = [s for case, rs in runs.items() if not case.startswith("baseline") for s, _ in rs]
    res["all_kills"] = {"kills": sum(c["kills"] for n, c in res["cases"].items() if not n.startswith("baseline")),
                        "events": len(every), "client": b.dist(every)}
    if a.json:
        print(json.dumps(res, indent=1))
    if a.scale < 1.0 or only is not None:
        return log("--scale below 1 or --only: results not written")
    b.save("kill-tail", res, md)


def md(r):
    x = r["all_kills"]
    return b.notes("kill-tail", seed=r["seed"], events=x["events"], kills=x["kills"], p99=x["client"]["p99_ms"],
                   max=x["client"]["max_ms"], table=b.md_table(
        ["case", "events", "kills", "client median", "p90", "p99", "max", "keeper median", "keeper max"], [
            [case, c["events"], c["kills"]]
            + [f"{c['client'][k]:.1f} ms" for k in ("median_ms", "p90_ms", "p99_ms", "max_ms")]
            + ([f"{c['keeper'][k]:.1f} ms" for k in ("median_ms", "max_ms")] if c["keeper"] else ["-", "-"])
            for case, c in r["cases"].items()]), slowest="\n".join(
        f"- {case}: {c['slowest']['stall_ms']:.1f} ms: {c['slowest']['phases']}" for case, c in r["cases"].items()
        if c["slowest"]))


if __name__ == "__main__":
    main()
