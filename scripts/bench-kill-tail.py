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

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (OUT, REPO, bin_dir, cpu_model, ctl, daemon_status, kill_worker,  # noqa: E402
                      log, run_spoold)


def config(work, volumes):
    vols = "".join(f'[[volumes]]\nname = "v{i}"\nsize = "64M"\nnum_queues = 1\n' for i in range(volumes))
    return f"""state_dir = "{work}/state"
[journal]
dir = "{work}/journal"
[[devices]]
path = "{work}/dev0.img"
create_size = "1G"
{vols}"""


def clients(socks, runtime):
    cmd = [os.path.join(bin_dir(), "spool-bench"), "--rw", "randread", "--bs", "4096",
           "--iodepth", "8", "--runtime", str(runtime), "--warmup", "0.1", "--json",
           "--label", "kill-tail"]
    return [subprocess.Popen(cmd + ["--socket", s], stdout=subprocess.PIPE, text=True) for s in socks]


def stall_of(procs, what):
    """The worst client's slowest request, ms."""
    worst = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{what}: spool-bench failed ({p.returncode})")
        r = json.loads(out)
        if r["errors"]:
            raise RuntimeError(f"{what}: a client saw {r['errors']} errors")
        worst = max(worst, r["lat_max_us"] / 1000)
    return worst


class Spoold:
    def __init__(self, volumes):
        self.work = tempfile.mkdtemp(prefix="spool-kill-tail-", dir="/dev/shm")
        names = [f"v{i}" for i in range(volumes)]
        self.proc, socks = run_spoold(self.work, config(self.work, volumes), names)
        self.socks = [socks[n] for n in names]
        self.ctl = os.path.join(self.work, "state", "spoold.sock")
        daemon_status(self.ctl)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.work, ignore_errors=True)


def one(d, runtime, at, event, what):
    """A client run of `runtime` s on every volume of `d` with `event` at `at` s; returns
    (client stall ms, the keeper's reports)."""
    procs = clients(d.socks, runtime)
    time.sleep(at)
    reports = event() if event else []
    return stall_of(procs, what), reports


def spaced(d, n, rng, what):
    out = []
    for i in range(n):
        time.sleep(rng.uniform(0.0, 0.3))
        out.append(one(d, 0.6, 0.3, lambda: [kill_worker(d.ctl)], f"{what} {i}"))
    return out


def burst(d, n):
    def five():
        reports, t = [], time.monotonic()
        for k in range(5):
            reports.append(kill_worker(d.ctl))
            t += 0.05
            time.sleep(max(0.0, t - time.monotonic()))
        return reports
    return [one(d, 0.8, 0.2, five, f"burst {i}") for i in range(n)]


def upgrade(d, n, rng):
    out = []
    for i in range(n):
        def kill_during():
            for attempt in range(11):
                if attempt == 10:
                    raise RuntimeError("10 upgrades in a row ended before their kill")
                pid = daemon_status(d.ctl)["pid"]
                done = {}
                t = threading.Thread(target=lambda: done.update(r=_try(lambda: ctl(d.ctl, "upgrade"))))
                t.start()
                time.sleep(rng.uniform(0.0, 0.004))
                try:
                    os.kill(pid, signal.SIGKILL)
                    break
                except ProcessLookupError:
                    # The upgrade was over before the kill: no kill during it; again.
                    t.join(timeout=60)
            t.join(timeout=60)
            while True:
                s = daemon_status(d.ctl)
                r = s.get("last_restart") or {}
                if s["pid"] != pid and r.get("new_pid") == s["pid"]:
                    return [r]
                time.sleep(0.002)
        out.append(one(d, 0.8, 0.3, kill_during, f"upgrade {i}"))
    return out


def _try(f):
    try:
        return f()
    except Exception as e:  # the upgrade may fail: its worker was killed under it
        return str(e)


def first(n):
    out = []
    for i in range(n):
        d = Spoold(1)
        try:
            out.append(one(d, 1.6, 1.0, lambda: [kill_worker(d.ctl)], f"first {i}"))
        finally:
            d.stop()
    return out


def slowest(reports):
    """The slowest restart of `reports` (keeper reports): its stall and its phases, in words."""
    if not reports:
        return None
    r = max(reports, key=lambda x: x["stall_ms"])
    return {"stall_ms": r["stall_ms"],
            "phases": ", ".join(f"{p['name']} {p['ms']:.2f} ms" for p in r.get("phases", []))}


def stats(v):
    v = sorted(v)
    q = lambda p: v[min(len(v) - 1, int(p * len(v)))]
    return {"n": len(v), "median_ms": statistics.median(v), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": v[-1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the events to run")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default=None,
                    help="comma-separated cases to run (first, baseline, spaced, burst, upgrade, "
                         "baseline8, volumes8); results are then printed, not written")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    n = lambda k: max(1, round(k * args.scale))
    subprocess.run(["cargo", "build", "--release", "-q", "--bin", "spoold", "--bin", "spoolctl",
                    "--bin", "spool-bench"], cwd=REPO, check=True)
    only = set(args.only.split(",")) if args.only else None
    want = lambda case: only is None or case in only
    runs = {}
    if want("first"):
        runs["first"] = first(n(10))
    for volumes, cases in [(1, ["baseline", "spaced", "burst", "upgrade"]), (8, ["baseline8", "volumes8"])]:
        # Only this spoold's own cases: each case runs once, on the spoold it is about (the
        # one-volume cases on the 8-volume spoold would drive all 8 volumes).
        here = lambda case: case in cases and want(case)  # noqa: E731
        if not any(here(c) for c in cases):
            continue
        d = Spoold(volumes)
        try:
            if here("baseline"):
                runs["baseline"] = [one(d, 0.6, 0.3, None, f"baseline {i}") for i in range(n(20))]
            if here("spaced"):
                runs["spaced"] = spaced(d, n(30), rng, "spaced")
            if here("burst"):
                runs["burst"] = burst(d, n(8))
            if here("upgrade"):
                runs["upgrade"] = upgrade(d, n(10), rng)
            if here("baseline8"):
                runs["baseline8"] = [one(d, 0.6, 0.3, None, f"baseline8 {i}") for i in range(n(10))]
            if here("volumes8"):
                runs["volumes8"] = spaced(d, n(25), rng, "volumes8")
        finally:
            d.stop()
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "seed": seed, "cpu": cpu_model(), "cores": os.cpu_count(),
           "client": "spool-bench (libblkio), 4K randread QD8, 1 queue per volume, tmpfs, release build",
           "cases": {}}
    for case, rs in runs.items():
        kills = sum(len(r) for _, r in rs)
        keeper = [x["stall_ms"] for _, r in rs for x in r]
        res["cases"][case] = {"events": len(rs), "kills": kills,
                              "client": stats([s for s, _ in rs]),
                              "keeper": stats(keeper) if keeper else None,
                              "outcomes": sorted({x.get("outcome", "?") for _, r in rs for x in r}),
                              "slowest": slowest([x for _, r in rs for x in r])}
        c = res["cases"][case]["client"]
        log(f"{case}: {len(rs)} events, {kills} kills, client median {c['median_ms']:.2f} ms, "
            f"p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.2f} ms")
    every = [s for case, rs in runs.items() if not case.startswith("baseline") for s, _ in rs]
    res["all_kills"] = {"kills": sum(res["cases"][c]["kills"] for c in runs if not c.startswith("baseline")),
                        "events": len(every), "client": stats(every) if every else None}
    if args.json:
        print(json.dumps(res, indent=1))
    if args.scale < 1.0 or only is not None:
        log("--scale below 1 or --only: results not written")
        return
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "kill-tail.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = ["# Worker-kill stalls as clients see them", "",
          f"`scripts/bench-kill-tail.py` ({res['date']}, seed {seed}), {res['cores']} cores ({res['cpu']}); "
          f"{res['client']}. One client run per event; its slowest request is the stall. The "
          "keeper's column is its own measurement of each restart (death to successor serving).", "",
          "| case | events | kills | client median | p90 | p99 | max | keeper median | keeper max |",
          "|---|---|---|---|---|---|---|---|---|"]
    for case, c in res["cases"].items():
        k = c["keeper"]
        kcol = f"{k['median_ms']:.1f} ms | {k['max_ms']:.1f} ms" if k else "- | -"
        cl = c["client"]
        md.append(f"| {case} | {c['events']} | {c['kills']} | {cl['median_ms']:.1f} ms | {cl['p90_ms']:.1f} ms | "
                  f"{cl['p99_ms']:.1f} ms | {cl['max_ms']:.1f} ms | {kcol} |")
    md += ["", "The slowest restart of each case, by the keeper's phases (what it waited for):", ""]
    for case, c in res["cases"].items():
        if c["slowest"]:
            md.append(f"- {case}: {c['slowest']['stall_ms']:.1f} ms: {c['slowest']['phases']}")
    a = res["all_kills"]
    md += ["", f"Every kill event together: {a['events']} events ({a['kills']} kills), client p99 "
           f"{a['client']['p99_ms']:.1f} ms, max {a['client']['max_ms']:.1f} ms (issue 33's target: "
           "p99 <= 10 ms, max <= 20 ms).", ""]
    with open(os.path.join(OUT, "kill-tail.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
