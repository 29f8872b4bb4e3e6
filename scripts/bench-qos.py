#!/usr/bin/env python3
"""QoS caps benchmark (issue 18): how exactly spoold holds a volume to its I/O limits.

One spoold (release build, journal on) serves one volume on a tmpfs file; one spool-bench
client (real libblkio, 4 KiB random reads, QD32, one queue) drives it.

1. Unlimited: the volume's own rate (the reference the caps are set from).
2. IOPS cap at a quarter of that, burst 100 ms: the rate over the run (the first second,
   which may use the burst, left out) against the cap; the completions in the first 100 ms
   against the burst allowance.
3. Bandwidth cap (64 KiB reads) at a quarter of the unlimited bandwidth.
4. A cap changed at run time (lowered 10x mid-run): how long after the RPC returned the
   client's completion rate drops to the new cap (from the client's per-millisecond
   timeline; the client's clock starts when it connects, a few ms after it is launched, so
   the delay is measured from the RPC and rounded up to the next 10 ms bin).
5. Noisy neighbour: the p99 latency of a QD1 reader alone, next to a QD128 writer on
   another volume of the same device, and next to that writer capped.

    scripts/bench-qos.py            # 10 s per case (about 40 s)
    scripts/bench-qos.py --quick    # 2 s per case, for CI (qos-quick.*)
Results: docs/benchmarks/qos.{json,md}.
"""

import time

import benchlib as b
from benchlib import Spoold, dev, log, rate, vol

# Noisy neighbour: the limits of the QD128 writer ("noisy") and of the QD1 reader (v).
NEIGHBOURS = b.table(("name", "noisy", "v"), [
    ("neighbour unlimited", None, None),
    ("neighbour capped", {"iops": 20000, "burst_ms": 100}, None),
    ("neighbour in the batch class", {"priority": "batch"}, None),
    ("v latency, neighbour batch", {"priority": "batch"}, {"priority": "latency"}),
])


def qos(d, vol="v", **limits):
    """Sets a volume's limits through the RPC (`volume_qos`)."""
    return d.call("volume_qos", id=vol, **limits)


def run(d, secs, bs=4096, timeline=None, qd=32):
    """4 KiB (or `bs`) random reads on v; with `timeline` (a file), its completions per ms too."""
    r = b.spool_bench(d.sock, rw="randread", bs=bs, qd=qd, runtime=secs, warmup=0, timeline=timeline)
    return (r, b.timeline(timeline)[0]) if timeline else r


def noisy_neighbour(d, secs):
    """Volume v at QD1 randread next to volume "noisy" at QD128 randwrite, same device:
    v's p99 latency alone, with the neighbour unlimited, and with it capped."""
    out = {"alone": run(d, secs, qd=1)["lat_p99_us"]}

    def case(c):
        for v, limits in (("noisy", c["noisy"]), ("v", c["v"])):
            qos(d, v, clear=True)
            if limits:
                qos(d, v, **limits)
        n = b.start_bench(d.socks["noisy"], rw="randwrite", bs=4096, qd=128, runtime=secs + 1, warmup=0)
        time.sleep(0.5)
        out[c["name"]] = run(d, secs, qd=1)["lat_p99_us"]
        out[c["name"] + " (its IOPS)"] = b.results([n], "noisy")[0]["iops"]
        log(f"   v p99 {out[c['name']]:.1f} us")
    b.run_cases(NEIGHBOURS, case)
    qos(d, "noisy", clear=True)
    qos(d, clear=True)
    return out


def main():
    a = b.args(__doc__)
    secs = 2 if a.quick else 10
    work = b.workdir("spool-qos.")
    d = Spoold(work, [dev(f"{work}/dev.img", "2G")], [vol("v", "1G"), vol("noisy", "512M")], args=["--no-keeper"])
    rows = {"runtime_s": secs, "unlimited_iops": run(d, min(secs, 3))["iops"]}
    cap = max(1000, int(rows["unlimited_iops"] / 4) // 1000 * 1000)
    qos(d, iops=cap, burst_ms=100)
    t = run(d, secs, timeline=f"{work}/cap.csv")[1]
    steady = rate(t, 1, secs)
    rows["iops_cap"] = {"cap": cap, "measured": steady, "error_pct": 100 * (steady - cap) / cap,
                        "first_100ms": sum(t[:100]), "burst_allowance": cap * 0.1}
    qos(d, clear=True)
    bw_cap = max(1 << 20, int(run(d, min(secs, 3), bs=65536)["iops"] * 65536 / 4) >> 20 << 20)
    qos(d, bps=bw_cap, burst_ms=100)
    bw = 65536 * rate(run(d, secs, bs=65536, timeline=f"{work}/bw.csv")[1], 1, secs)
    rows["bps_cap"] = {"cap": bw_cap, "measured": bw, "error_pct": 100 * (bw - bw_cap) / bw_cap}
    log(f"caps: {rows['iops_cap']}, {rows['bps_cap']}")
    high, low = cap, max(100, cap // 10)
    qos(d, clear=True)
    qos(d, iops=high, burst_ms=10)
    client = b.start_bench(d.sock, rw="randread", bs=4096, qd=32, runtime=3, warmup=0, timeline=f"{work}/change.csv")
    launched = time.monotonic()
    time.sleep(1.5)
    qos(d, iops=low, burst_ms=10)
    changed_ms = int((time.monotonic() - launched) * 1000)
    b.results([client], "cap change")
    t = b.timeline(f"{work}/change.csv")[0]
    # First 10 ms bin after the change whose rate is within 2x of the new cap.
    delay = next((x * 10 + 10 - changed_ms for x in range(changed_ms // 10, len(t) // 10)
                  if sum(t[x * 10:x * 10 + 10]) * 100 <= 2 * low), None)
    rows["runtime_change"] = {"from": high, "to": low, "delay_ms": delay}
    log(f"cap lowered {high} -> {low} IOPS: in effect {delay} ms after the RPC returned")
    qos(d, clear=True)
    rows["noisy_neighbour"] = noisy_neighbour(d, secs)
    d.stop()
    b.save("qos", rows, md, a.quick)


def md(r):
    c, bw, ch, n = r["iops_cap"], r["bps_cap"], r["runtime_change"], r["noisy_neighbour"]
    return b.notes("qos", **r, c=c, ch=ch, n=n, table=b.md_table(["case", "cap", "measured", "error"], [
        ("unlimited 4 KiB", "-", f"{r['unlimited_iops']:.0f} IOPS", "-"),
        ("IOPS cap, 4 KiB, burst 100 ms", f"{c['cap']} IOPS", f"{c['measured']:.0f} IOPS", f"{c['error_pct']:+.2f}%"),
        ("bandwidth cap, 64 KiB, burst 100 ms", f"{bw['cap'] >> 20} MiB/s", f"{bw['measured'] / 2**20:.1f} MiB/s",
         f"{bw['error_pct']:+.2f}%")]))


if __name__ == "__main__":
    main()
