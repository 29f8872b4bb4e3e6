#!/usr/bin/env python3
"""Spool benchmark suite: the paper's evaluation (Table 2, Figures 16 and 17), side by side
with qemu-storage-daemon and native fio io_uring, in one run, on the same backing stores,
through the same real client (spool-bench on libblkio).

Every backend runs alone (one at a time) so the two cores are shared only by the client and
the server under test. Results: docs/benchmarks/results.json, summary.md, and PNG plots.

    scripts/bench.py            # full suite (about 12 minutes on 2 cores)
    scripts/bench.py --quick    # smoke run for CI: checks the suite works, not its numbers
"""

import os
import re

import benchlib as b
from benchlib import OUT, REPO, Qsd, Spoold, dev, log, median, vol

VOL = 512 << 20
IMG = VOL + (8 << 20)
# The paper's Table 2 cases; quick: in the smoke run. The quick cases are the ones the targets
# are read from: a full run measures them three times and keeps the median run (one 3 s run
# can land in a slow spell of this shared machine).
CASES = b.table(("name", "rw", "bs", "qd", "queues", "poll", "quick"), [
    ("128K read QD128", "read", 131072, 128, 1, True, False),
    ("4K randread QD32x4", "randread", 4096, 32, 4, False, False),
    ("4K randrw70 QD32x4", "randrw", 4096, 32, 4, False, False),
    ("4K randwrite QD32x4", "randwrite", 4096, 32, 4, False, False),
    ("4K randread QD32", "randread", 4096, 32, 1, True, True),
    ("4K randread QD1", "randread", 4096, 1, 1, True, True),
    ("4K randwrite QD1", "randwrite", 4096, 1, 1, True, False),
    ("4K read QD1", "read", 4096, 1, 1, True, False),
    ("4K write QD1", "write", 4096, 1, 1, True, False),
])
NULL = "driver=null-co,node-name=base,size=1073741824,read-zeroes="
FILE = "driver=file,node-name=base,filename={},cache.direct=on,aio="
# Backends, one at a time: (a) RAM, the software stack alone; (b) a file on the local disk.
# spoold: its device; qsd: its blockdev; fio: its store ({tmpfs} and {disk} are directories).
BACKENDS = [
    dict(name="spoold null (untouched)", store="null", spoold=dev("n0", "1G", null="untouched")),
    dict(name="qsd null-co read-zeroes=off", store="null", qsd=NULL + "off"),
    dict(name="spoold null (zeroes reads)", store="null", spoold=dev("n0", "1G", null="zero"), quick=False),
    dict(name="qsd null-co read-zeroes=on", store="null", qsd=NULL + "on", quick=False),
    dict(name="spoold tmpfs", store="tmpfs", spoold=dev("{tmpfs}/s.img", IMG), fill=True),
    dict(name="qsd tmpfs aio=native,direct", store="tmpfs", qsd=FILE + "native", fill=True),
    dict(name="qsd tmpfs aio=native,direct,iothread", store="tmpfs", qsd=FILE + "native", iothread=True,
         fill=True, quick=False),
    dict(name="qsd tmpfs aio=io_uring", store="tmpfs", qsd=FILE + "io_uring", fill=True, quick=False),
    dict(name="fio io_uring tmpfs", store="tmpfs", fio=True),
    dict(name="spoold disk", store="disk", spoold=dev("{disk}/s.img", IMG), fill=True, quick=False),
    dict(name="qsd disk aio=native,direct", store="disk", qsd=FILE + "native", fill=True, quick=False),
    dict(name="fio io_uring disk", store="disk", fio=True, quick=False),
]


def spoold(dir, device, volumes=1, queues=4, journal=True, poll_idle_us=1000000):
    return Spoold(dir, [device], [vol(f"v{i}", VOL, queues) for i in range(volumes)], journal,
                  {"io": {"poll_idle_us": poll_idle_us}})


def run_backend(be, dirs, work, cases, runtime, quick):
    """Table 2's cases on one backend, alone."""
    img, d = f"{dirs[be['store']]}/q.img", os.path.join(work, re.sub(r"\W", "_", be["name"]))
    if be.get("fio"):
        server = None
    elif "spoold" in be:
        server = spoold(d, dict(be["spoold"], path=be["spoold"]["path"].format(**dirs)))
    else:
        server = Qsd(d, be["qsd"].format(img), iothread=be.get("iothread"), queues=4)
    rows = []
    try:
        if be.get("fill"):
            b.fill(server.sock, VOL)
        for c in cases:
            if server:
                runs = [b.spool_bench(server.sock, rw=c["rw"], bs=c["bs"], qd=c["qd"], queues=c["queues"],
                                      runtime=runtime, warmup=min(0.5, runtime / 2), size=VOL, poll=c["poll"],
                                      server_pid=server.pid, label=be["name"])
                        for _ in range(1 if quick or not c.get("quick", True) else 3)]
                r = dict(b.middle(runs, lambda x: x["iops"]), iops_runs=sorted(round(x["iops"]) for x in runs))
            else:
                r = b.fio(img, c["rw"], c["bs"], c["qd"], c["queues"], VOL, runtime)
                if not r:
                    continue
                r.update(label=be["name"], rw=c["rw"], bs=c["bs"], iodepth=c["qd"], queues=c["queues"],
                         mib_s=r["iops"] * c["bs"] / (1 << 20))
            rows.append(dict(r, case=c["name"], store=be["store"]))
            log(f"   {c['name']:22} {r['iops']:>10.0f} IOPS  {r['lat_mean_us']:8.1f} us")
    except Exception:
        log(f"--- {be['name']}: end of the server's log\n{server.tail(4000) if server else ''}")
        raise
    finally:
        if server:
            server.stop()
    return rows


def sparse(path, size=IMG):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def figure16(work, runtime):
    """One device shared by three volumes, three clients at once."""
    out = []
    for label, start in [
        ("spoold tmpfs", lambda: spoold(f"{work}/s3", dev(f"{work}/s3.img", 3 * VOL + (16 << 20)), 3)),
        ("qsd tmpfs aio=native,direct", lambda: Qsd(f"{work}/q3", FILE.format(sparse(f"{work}/q3.img", 3 * VOL))
                                                     + "native", [(i * VOL, VOL) for i in range(3)], queues=4)),
    ]:
        log(f"== figure 16: {label}, 3 volumes")
        with start() as server:
            per = b.results([b.start_bench(s, rw="randread", bs=4096, qd=32, queues=1, runtime=runtime, size=VOL,
                                           label=f"{label} v{i}") for i, s in enumerate(server.sockets)])
        out.append(dict(backend=label, per_volume=[p["iops"] for p in per], total=sum(p["iops"] for p in per)))
        log(f"   total {out[-1]['total']:.0f} IOPS, per volume {[round(x) for x in out[-1]['per_volume']]}")
    return out


def figure17(work, runtime, quick):
    """Journal on vs off, both spoold running, measured by spool-bench's A/B mode (one client
    switching between them every 100 ms): separate runs differ by more than the journal costs.
    Two connections per case, the sides swapped for the second; an idle spoold sleeps after
    2 ms, so only the measured one runs. scripts/bench-journal.sh does the same at length,
    with a control."""
    on, off = (spoold(f"{work}/j{j}", dev(f"{work}/j{j}.img", IMG), queues=1, journal=j,
                      poll_idle_us=2000) for j in (True, False))
    for server in (on, off):
        b.fill(server.sock, VOL)
    out = []
    for c in CASES:
        if c["name"] not in ("4K randread QD32", "4K randread QD1", "4K randwrite QD1") or (quick and not c["quick"]):
            continue
        log(f"== figure 17: {c['name']}, journal against no journal")
        runs = [b.spool_bench(x.sock, compare=y.sock, rw=c["rw"], bs=c["bs"], qd=c["qd"], poll=True,
                              runtime=max(runtime, 0.5), size=VOL, label=label)
                for x, y, label in ((on, off, "journal-nojournal"), (off, on, "nojournal-journal"))]
        out.append(dict(case=c["name"], **journal_ab(runs)))
        log(f"   IOPS loss {out[-1]['iops_loss_pct']:+.2f}%, latency {out[-1]['lat_increase_pct']:+.2f}%")
    on.stop()
    off.stop()
    return out


def journal_ab(runs):
    """Figure 17 from A/B runs, either way round: per-pair journal/no-journal ratios pooled."""
    on_i, off_i, on_l, off_l = [], [], [], []
    for r in runs:
        for s in r["slices"]:
            if min(s[:4]) > 0:
                ai, bi, al, bl = s[:4] if r["label"] == "journal-nojournal" else (s[1], s[0], s[3], s[2])
                on_i.append(ai), off_i.append(bi), on_l.append(al), off_l.append(bl)
    return dict(pairs=len(on_i), iops_on=median(on_i), iops_off=median(off_i), lat_on_us=median(on_l),
                lat_off_us=median(off_l), iops_loss_pct=100 * (1 - median([a / x for a, x in zip(on_i, off_i)])),
                lat_increase_pct=100 * (median([a / x for a, x in zip(on_l, off_l)]) - 1))


def main():
    a = b.args(__doc__, {
        "--runtime": dict(type=float, help="seconds per run"),
        "--disk-dir": dict(default=os.path.join(REPO, ".cache", "bench"),
                           help="directory on the local disk for the disk-file cases"),
        "--summary-only": dict(action="store_true", help="run nothing: write summary.md again from results.json "
                               "(and journal-overhead.json)")})
    if a.summary_only:
        return b.write_md(b.load("results"), summary, os.path.join(OUT, "summary.md"))
    runtime = a.runtime or (0.4 if a.quick else 3)
    work = b.workdir("spool-bench.")
    os.makedirs(a.disk_dir, exist_ok=True)
    dirs = dict(null=None, tmpfs=work, disk=b.workdir("run.", a.disk_dir))
    sparse(f"{work}/q.img")
    if not a.quick:
        sparse(f"{dirs['disk']}/q.img")
    cases = [c for c in CASES if not a.quick or c["quick"]]
    table2 = b.run_cases(BACKENDS, lambda be: run_backend(be, dirs, work, cases, runtime, a.quick), a.quick)
    doc = b.save("results", dict(runtime_s=runtime, table2=[r for rows in table2 for r in rows],
                                 figure16=figure16(work, runtime), figure17=figure17(work, runtime, a.quick)),
                 summary, a.quick, md_name="summary")
    plots(doc["results"], "quick-" if a.quick else "")


def find(results, label, case):
    return next((r for r in results if r["label"] == label and r["case"] == case), None)


RATIOS = [("spoold null (untouched)", "qsd null-co read-zeroes=off"), ("spoold null (zeroes reads)",
          "qsd null-co read-zeroes=on")] + [("spoold tmpfs", p) for p in (
          "qsd tmpfs aio=native,direct", "qsd tmpfs aio=native,direct,iothread", "qsd tmpfs aio=io_uring",
          "fio io_uring tmpfs")] + [("spoold disk", "qsd disk aio=native,direct"), ("spoold disk", "fio io_uring disk")]


def ratio(ra, rp, case):
    """spoold / peer: IOPS, or for QD1 cases peer latency / spoold latency."""
    if not ra or not rp or not rp["iops"]:
        return "–"
    if "QD1" in case and ra["lat_mean_us"]:
        return f"{rp['lat_mean_us'] / ra['lat_mean_us']:.2f}×"
    return f"{ra['iops'] / rp['iops']:.2f}×"


def summary(res):
    """summary.md: the tables, the ratios, the figures and issue 7's targets."""
    t2 = res["table2"]
    cases = list(dict.fromkeys(r["case"] for r in t2))
    ratios = [[f"{a} vs {p}"] + [ratio(find(t2, a, c), find(t2, p, c), c) for c in cases] for a, p in RATIOS]
    figures = "" if not res["figure16"] else (
        "\n## Figure 16: one device, three volumes, three clients (4K randread QD32 each)\n\n" + b.md_table(
            ["backend", "total IOPS", "per volume"], [
                (x["backend"], f"{x['total'] / 1000:.0f}K", ", ".join(f"{v / 1000:.0f}K" for v in x["per_volume"]))
                for x in res["figure16"]]) + "\n")
    if res["figure17"] and "iops_loss_pct" in res["figure17"][0]:
        figures += ("\n## Figure 17: journal on vs off (spool-bench `--compare`: both spoold running, one client "
                    "switching between them every 100 ms, two connections with the sides swapped; medians of the "
                    "per-pair ratios. journal-overhead.md has the longer measurement with intervals and a control)\n\n"
                    + b.md_table(["case", "journal IOPS", "no journal IOPS", "IOPS loss", "journal lat (µs)",
                                  "no journal lat (µs)", "latency increase", "pairs"], [
                        (r["case"], f"{r['iops_on']:.0f}", f"{r['iops_off']:.0f}", f"{r['iops_loss_pct']:+.2f}%",
                         f"{r['lat_on_us']:.2f}", f"{r['lat_off_us']:.2f}", f"{r['lat_increase_pct']:+.2f}%",
                         r["pairs"])
                        for r in res["figure17"]]) + "\n")
    rows = targets(t2) + journal_targets()
    return b.notes("summary", runtime_s=res["runtime_s"], figures=figures, table2=b.md_table(["backend"] + cases, [
        [label] + ["–" if r is None else f"{r['iops'] / 1000:.0f}K ({r['lat_mean_us']:.1f})"
                   for r in (find(t2, label, c) for c in cases)] for label in dict.fromkeys(r["label"] for r in t2)]),
        ratios=b.md_table(["spoold vs peer"] + cases, [r for r in ratios if any(x != "–" for x in r[1:])]),
        targets="" if not rows else "\n## Targets (issue 7), from this run\n\n" + b.md_table(
            ["target", "measured", "bar", "met"], [(what, got, bar, "—" if ok is None else "yes" if ok else "**no**")
                                                   for what, got, bar, ok in rows])
        + "\n\nWhere the server's time goes, and what was tried: [request-path.md](request-path.md).\n")


# Issue 7's fixed bars: (backend, case, target, bar, what it is)
BARS = [("spoold null (untouched)", "4K randread QD32", "null, untouched buffers: 4K randread QD32 IOPS", 4.2e6,
         "SPDK null bdev 4.2 M"),
        ("spoold null (untouched)", "4K randread QD1", "null, untouched buffers: 4K randread QD1 mean latency", 1.0,
         "SPDK null bdev 1.0 µs"),
        ("spoold tmpfs", "4K randread QD32", "tmpfs: 4K randread QD32 IOPS", 0.52e6, "SPDK AIO 0.52 M")]


def targets(res):
    """Issue 7's targets against this run's numbers: (target, measured, bar, met)."""
    out = []
    for label, case, what, bar, name in BARS:
        r = find(res, label, case)
        if r and "QD1" in case:
            out.append((what, f"{r['lat_mean_us']:.2f} µs", name, r["lat_mean_us"] <= bar))
        elif r:
            out.append((what, f"{r['iops'] / 1e6:.2f} M", name, r["iops"] >= bar))
    t32, t1 = (find(res, "spoold tmpfs", f"4K randread QD{q}") for q in (32, 1))
    q32, q1 = ([r for r in res if r["label"].startswith("qsd tmpfs") and r["case"] == f"4K randread QD{q}"]
               for q in (32, 1))
    if t32 and q32:
        best = max(q32, key=lambda r: r["iops"])
        out.append(("tmpfs: 4K randread QD32 vs qemu-storage-daemon's best setup",
                    f"{t32['iops'] / best['iops']:.2f}×", f"1.2× {best['label']}", t32["iops"] >= 1.2 * best["iops"]))
    if t1 and q1:
        best = min(q1, key=lambda r: r["lat_mean_us"])
        out.append(("tmpfs: 4K randread QD1 mean latency", f"{t1['lat_mean_us']:.2f} µs",
                    f"{best['lat_mean_us']:.2f} µs ({best['label']})", t1["lat_mean_us"] <= best["lat_mean_us"]))
    return out


def journal_targets():
    """Issue 7's journal targets from scripts/bench-journal.sh's latest results (worst case)."""
    try:
        j = b.load("journal-overhead")["results"]
    except (OSError, ValueError):
        return []
    rows = j.get("summary") or []
    if not rows or "iops_loss_ci" not in rows[0]:
        return []
    src = f"A/B, median of {j.get('pairs')} pairs of slices, worst case, journal-overhead.md"
    out = []
    for what, key, bar in (("IOPS loss", "iops_loss", 1.0), ("latency increase", "lat_increase", 3.0)):
        r = max(rows, key=lambda r: r[f"{key}_pct"])
        lo, hi = r[f"{key}_ci"]
        out.append((f"journal: {what} ({src}; 95% interval)", f"{r[key + '_pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}] "
                    f"(4K {r['rw']} QD{r['iodepth']})", f"≤ {bar:.0f}%", r[f"{key}_pct"] <= bar))
    return out + [(f"journal: instructions per request, rounds of {cg['batch']} (callgrind, deterministic)",
                   f"{cg['journal_instructions_per_request']:.0f} of {cg['instructions_per_request_journal']:.0f}",
                   "(no bar; see request-path.md)", None) for cg in j.get("callgrind") or []]


def plots(res, prefix):
    for case in ["4K randread QD32", "4K randread QD1"]:
        qd1, rows = "QD1" in case, [r for r in res["table2"] if r["case"] == case]
        if rows:
            b.barh(os.path.join(OUT, f"{prefix}{case.replace(' ', '_').lower()}.png"), [
                (r["label"], r["lat_mean_us"] if qd1 else r["iops"] / 1e3,
                 "tab:blue" if r["label"].startswith("spoold") else "tab:gray") for r in rows],
                "mean latency (µs, lower is better)" if qd1 else "kIOPS (higher is better)", case)

if __name__ == "__main__":
    main()
