#!/usr/bin/env python3
"""Failure-handling benchmark (the paper's Figure 12): two volumes on two devices, a client on
each; device 2 fails in the middle of the run (each failure class in turn) and, for the classes
that isolate it, is replaced 1.5 s later. Reports volume 1's throughput during the failure
against its own baseline (target: within 10%, no errors), and what volume 2 saw: the longest
stall (link errors: held I/O, no errors) or errors then recovery after the replacement.

Devices are tmpfs files; media and link errors, hangs and SMART warnings come from spoold's
fault-injection layer (file devices cannot produce them on demand); hot-removal is real (the
backing file is deleted). Clients: spool-bench (real libblkio), 4K randrw 70/30 QD8, one queue,
interrupt-driven (two clients and two polling workers share the two cores).

    scripts/bench-failures.py            # 5 scenarios x 6 s (about 45 s)
    scripts/bench-failures.py --quick    # 2 scenarios x 3 s, for CI (failures-quick.*)
    scripts/bench-failures.py --mirror   # volume 2 is a 2-way mirror on devices 2 and 3
Results: docs/benchmarks/failures.{json,md}, failures.png (--mirror: failures-mirror.*).
With --mirror the failing device holds one of volume 2's copies: volume 2 must see no error at
all (and the run fails if it does), and its copy is rebuilt on the replacement.
"""

import os
import signal
import sys
import time

import benchlib as b
from benchlib import OUT, Spoold, dev, log, rate, vol

BIN_MS = 100
# What to do at the fault, and whether to replace the device afterwards; quick: in the smoke run.
# Why a control: benchlib/notes/failures.md (on this VM: volume 1 alone ~160 K IOPS, ~400 K next to volume 2).
SCENARIOS = b.table(("name", "inject", "replace", "quick"), [
    ("control: vol2 client paused 1.5 s, no failure", "pause", False, False),
    ("link error (link down 500 ms)", {"kind": "link-down", "duration_ms": 500}, False, True),
    ("command timeout (2 hung commands)", {"kind": "timeout", "count": 2}, False, False),
    ("media error", {"kind": "media"}, True, True),
    ("hot-removal (file deleted)", None, True, False),
    ("SMART wear warning", {"kind": "smart", "bits": 4}, True, False),
])
CLIENT = ("spool-bench (libblkio), 4K randrw 70/30 QD8, 1 queue per volume, interrupt-driven; tmpfs file "
          "devices; release build")
TARGET = ("volume 1 within 10% of its baseline with no errors; volume 2 held then recovered (link) or clean "
          "errors then recovered after replacement")


def longest_gap_ms(series, t0, t1):
    """Longest run of milliseconds without a successful completion in [t0, t1)."""
    best = cur = 0
    for c in series[int(t0 * 1000):int(t1 * 1000)]:
        cur = cur + 1 if c == 0 else 0
        best = max(best, cur)
    return best


def binned(series):
    return [sum(series[i:i + BIN_MS]) * (1000 // BIN_MS) for i in range(0, len(series), BIN_MS)]


def scenario(work, case, mirror, runtime, fault_at, replace_at):
    d = os.path.join(work, case["name"].split()[0])
    with Spoold(d, [dev(f"{d}/d{i}.img", "256M") for i in range(3 if mirror else 2)],
                [vol("vol1", "128M"), vol("vol2", "128M", **({"mirror": 2} if mirror else {}))],
                sections={"pool": {"min_extent": "4M", "auto_rebuild": False}, "io": {"poll_idle_us": 200},
                          "health": {"io_timeout_ms": 300, "reset_timeout_ms": 3000, "poll_interval_ms": 50}},
                args=["--log-level", "warn"]) as daemon:
        time.sleep(0.1)
        # Device 2: vol2's (for a mirror, the device of its last copy, not vol1's).
        devs = {v["name"]: v["devices"] for v in daemon.ctl("volume", "list")}
        dev1 = devs["vol1"][0]
        dev2 = [x for x in devs["vol2"] if x != dev1][-1]
        assert dev1 != dev2, "volumes must sit on different devices"
        path2 = next(x["path"] for x in daemon.ctl("device", "list") if x["uuid"] == dev2)
        clients = [b.start_bench(daemon.socks[v], rw="randrw", bs=4096, qd=8, runtime=runtime, warmup=0, label=v,
                                 timeline=f"{d}/{v}.csv") for v in ("vol1", "vol2")]
        start = time.time()
        time.sleep(fault_at)
        if case["inject"] is None:
            os.unlink(path2)
        elif case["inject"] == "pause":
            clients[1].send_signal(signal.SIGSTOP)
            time.sleep(1.5)
            clients[1].send_signal(signal.SIGCONT)
        else:
            daemon.call("device_inject", **case["inject"], id=dev2)
        if case["replace"]:
            time.sleep(max(0.0, replace_at - (time.time() - start)))
            daemon.call("device_replace", old=dev2, new=os.path.join(d, "new.img"), create_size=256 << 20)
        r1, r2 = b.results(clients, case["name"], runtime + 60, check=False)  # errors are counted, not fatal
        (ok1, _), (ok2, err2) = (b.timeline(f"{d}/{v}.csv") for v in ("vol1", "vol2"))
        health = daemon.call("device_health")
        events = daemon.call("events_list", since=0)["events"]
        alive = daemon.proc.poll() is None
    base = rate(ok1, 0.5, fault_at)
    during_end = replace_at + 0.5 if case["replace"] else fault_at + 1.5
    during = rate(ok1, fault_at, during_end)
    return dict(
        scenario=case["name"], daemon_alive=alive, vol1_baseline_iops=round(base), vol1_during_iops=round(during),
        vol1_ratio=round(during / base, 3) if base else None, vol1_errors=r1["errors"], vol2_errors=r2["errors"],
        vol2_baseline_iops=round(rate(ok2, 0.5, fault_at)), vol2_after_iops=round(rate(ok2, during_end + 0.3, runtime)),
        vol2_longest_stall_ms=longest_gap_ms(ok2, fault_at - 0.2, runtime - 0.1),
        vol2_max_latency_ms=round(r2["lat_max_us"] / 1000, 1), vol1_max_latency_ms=round(r1["lat_max_us"] / 1000, 1),
        device2_events=[f'{e["from"]}->{e["to"]}: {e["reason"][:90]}' if e["kind"] == "state"
                        else f'{e["kind"]}: {e["reason"][:90]}' for e in events if e["device"] != dev1],
        fault_at_s=fault_at, replace_at_s=replace_at if case["replace"] else None, timeline_vol1=binned(ok1),
        timeline_vol2=binned(ok2), timeline_vol2_errors=binned(err2),
        health_after=[{k: h[k] for k in ("path", "state", "reason")} for h in health])


def main():
    a = b.args(__doc__, {"--mirror": dict(action="store_true", help="volume 2 is a 2-way mirror")})
    runtime, fault_at, replace_at = (3.0, 1.0, 1.8) if a.quick else (6.0, 2.0, 3.5)
    work = b.workdir("spool-failures.")
    rows = b.run_cases(SCENARIOS, lambda c: scenario(work, c, a.mirror, runtime, fault_at, replace_at), a.quick)
    control = next((r for r in rows if r["scenario"].startswith("control")), None)
    for r in rows:
        held = not r["replace_at_s"] and r is not control
        ref = control["vol1_during_iops"] if (held and control) else r["vol1_baseline_iops"]
        r["vol1_reference"] = "control (vol2 idle)" if (held and control) else "own baseline"
        r["vol1_ratio_vs_reference"] = round(r["vol1_during_iops"] / ref, 3) if ref else None
    bad = [r["scenario"] for r in rows if not r["daemon_alive"] or r["vol1_errors"] or (a.mirror and r["vol2_errors"])]
    if bad:
        log(f"FAILED: daemon died or volume 1 (or mirrored volume 2) saw errors in: {bad}")
        return 1
    name = ("failures-mirror" if a.mirror else "failures") + ("-quick" if a.quick else "")
    b.save(name, dict(client=CLIENT, target=TARGET, mirror=a.mirror, fault_at_s=fault_at, replace_at_s=replace_at,
                      scenarios=rows), lambda doc: md(doc, name))
    plot(rows, name)
    return 0


def md(r, name):
    return b.notes("failures", **r, name=name, title=" with volume 2 mirrored (Figure 12 again)" if r["mirror"] else
                   " (Figure 12)", mirror_setup=" Volume 2 is a 2-way mirror on devices 2 and 3; device 2 holds one "
                   "copy." if r["mirror"] else "", explain="\n".join(b.notes(
                       "failures-mirror" if r["mirror"] else "failures-plain")),
                   events="\n".join(f"- **{x['scenario']}**: " + "; ".join(x["device2_events"])
                                     for x in r["scenarios"]),
                   table=b.md_table(
        ["failure of device 2", "vol1 IOPS before", "vol1 IOPS during", "during / before", "during / reference",
         "vol1 errors", "vol1 slowest request", "vol2 errors", "vol2 longest stall", "vol2 slowest request",
         "vol2 IOPS after", "spoold"], [
            (x["scenario"], x["vol1_baseline_iops"], x["vol1_during_iops"], x["vol1_ratio"],
             f"{x['vol1_ratio_vs_reference']} ({x['vol1_reference']})", x["vol1_errors"],
             f"{x['vol1_max_latency_ms']} ms", x["vol2_errors"], f"{x['vol2_longest_stall_ms']} ms",
             f"{x['vol2_max_latency_ms']} ms", x["vol2_after_iops"], "alive" if x["daemon_alive"] else "DIED")
            for x in r["scenarios"]]))


def plot(rows, name):
    plt = b.pyplot()
    if not plt:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 2.0 * len(rows)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        for key, label, style in (("timeline_vol1", "vol1 (device 1)", "-"), ("timeline_vol2", "vol2 (device 2)", "-"),
                                  ("timeline_vol2_errors", "vol2 errors", ":")):
            ax.plot([i * BIN_MS / 1000 for i in range(len(r[key]))], [x / 1000 for x in r[key]], style, label=label)
        ax.axvline(r["fault_at_s"], color="red", lw=0.8)
        if r["replace_at_s"]:
            ax.axvline(r["replace_at_s"], color="green", lw=0.8)
        ax.set_title(r["scenario"], fontsize=9)
        ax.set_ylabel("kIOPS")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds (red: device 2 fails, green: replaced)")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, f"{name}.png"), dpi=100)


if __name__ == "__main__":
    sys.exit(main())
