#!/usr/bin/env python3
"""Fair share benchmark (issue 18, the paper's Figure 16 with weights): three volumes on one
tmpfs-backed device, one spool-bench client each (real libblkio, 4 KiB random reads, QD32,
one queue), all three at once. Each volume's share of the total IOPS against the share its
weight entitles it to: equal weights, then 1:2:4 (set at run time with `volume qos --weight`).

    scripts/bench-share.py            # 10 s per case
    scripts/bench-share.py --quick    # 2 s per case, for CI (checks it works)
Results: docs/benchmarks/share.{json,md}.
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
from benchlib import BIN, OUT, ctl, log  # noqa: E402

VOLS = ["a", "b", "c"]


def pinned(cmd, cpus):
    """`cmd` run on the CPUs `cpus` (a taskset list), or anywhere when None."""
    return ["taskset", "-c", cpus] + cmd if cpus else cmd


def start_spoold(work, bin_dir, fair=True, cpus=None):
    cfg = os.path.join(work, "spoold.toml")
    vols = "".join(f'[[volumes]]\nname = "{v}"\nsize = "512M"\nnum_queues = 2\n' for v in VOLS)
    with open(cfg, "w") as f:
        f.write(f'state_dir = "{work}/state"\n[io]\nfair_share = {str(fair).lower()}\n'
                f'[journal]\ndir = "{work}/journal"\n'
                f'[[devices]]\npath = "{work}/dev.img"\ncreate_size = "2G"\n{vols}')
    log_f = open(os.path.join(work, "spoold.log"), "w")
    p = subprocess.Popen(pinned([os.path.join(bin_dir, "spoold"), "-c", cfg, "--no-keeper"], cpus),
                         stdout=log_f, stderr=subprocess.STDOUT)
    rpc = os.path.join(work, "state", "spoold.sock")
    for _ in range(200):
        if os.path.exists(rpc) and all(os.path.exists(sock(work, v)) for v in VOLS):
            return p, rpc
        time.sleep(0.05)
    p.kill()
    sys.exit(f"spoold did not start (log: {work}/spoold.log)")


def sock(work, v):
    return os.path.join(work, "state", "vhost", f"{v}.sock")


def case(work, rpc, weights, secs, cpus=None):
    if set(weights) != {100}:
        for v, w in zip(VOLS, weights):
            ctl(rpc, "rpc", "volume_qos", json.dumps({"id": v, "weight": w}))
    cmds = [pinned([os.path.join(BIN, "spool-bench"), "--socket", sock(work, v), "--rw", "randread",
             "--bs", "4096", "--iodepth", "32", "--queues", "2", "--runtime", str(secs), "--size", str(256 << 20),
             "--json"], cpus) for v in VOLS]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    iops = [json.loads(p.communicate(timeout=secs * 3 + 60)[0])["iops"] for p in procs]
    total = sum(iops)
    want = [w / sum(weights) for w in weights]
    got = [i / total for i in iops]
    dev = [100 * (g - w) / w for g, w in zip(got, want)]
    r = {"weights": weights, "iops": iops, "total": total, "share": got, "entitled": want,
         "deviation_pct": dev, "max_abs_deviation_pct": max(abs(d) for d in dev)}
    log(f"weights {weights}: IOPS {[round(i) for i in iops]} (total {total:.0f}), shares "
        f"{[round(100 * g, 1) for g in got]}% vs {[round(100 * w, 1) for w in want]}%, "
        f"worst {r['max_abs_deviation_pct']:.1f}% off")
    return r


def run_cases(secs, weight_sets, bin_dir, fair=True, layout=None):
    """`layout`: None (everything on every CPU) or (spoold's CPUs, the clients' CPUs)."""
    server, clients = layout or (None, None)
    work = tempfile.mkdtemp(prefix="spool-share.", dir="/dev/shm")
    p, rpc = start_spoold(work, bin_dir, fair, server)
    try:
        return [case(work, rpc, w, secs, clients) for w in weight_sets]
    finally:
        p.terminate()
        p.wait(timeout=60)
        subprocess.run(["rm", "-rf", work])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 s per case (CI smoke)")
    args = ap.parse_args()
    secs = 2 if args.quick else 10
    shared = "all CPUs"
    rows = [dict(run_cases(secs, [[100, 100, 100]], BIN, fair=False)[0],
                 binary="`fair_share = false`", cpus=shared)]
    rows += [dict(r, cpus=shared)
             for r in run_cases(secs, [[100, 100, 100], [100, 200, 400]], BIN)]
    if (os.cpu_count() or 1) >= 2:
        split = "spoold on CPU 0, clients on CPU 1"
        rows += [dict(r, cpus=split)
                 for r in run_cases(secs, [[100, 100, 100], [100, 200, 400]], BIN,
                                    layout=("0", "1"))]
    doc = {"date": datetime.date.today().isoformat(), "seconds": secs, "cases": rows}
    name = "share-quick" if args.quick else "share"
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(OUT, f"{name}.md"), "w") as f:
        f.write("# Fair share between volumes (Figure 16 with weights)\n\n")
        f.write(f"`scripts/bench-share.py{' --quick' if args.quick else ''}` ({doc['date']}, "
                f"{secs} s per case): three volumes of 2 queues on one tmpfs-backed device, one "
                "client each (4 KiB random reads, QD32 over 2 queues), all at once; `[io] "
                "fair_share` off, then on (the default) with equal weights and 1:2:4. First "
                "with spoold and the clients on all CPUs, then with spoold on CPU 0 and the "
                "clients on CPU 1 (the volumes share one worker core; the clients, like VMs on "
                "their own vCPUs, do not take it).\n\n")
        f.write("| spoold | CPUs | weights | IOPS per volume | total | share (entitled) "
                "| worst deviation |\n")
        f.write("|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r.get('binary', 'fair share (default)')} | {r['cpus']} ")
            shares = ", ".join(f"{100 * g:.1f}% ({100 * w:.1f}%)"
                               for g, w in zip(r["share"], r["entitled"]))
            f.write(f"| {':'.join(str(w) for w in r['weights'])} | "
                    f"{', '.join(f'{i / 1000:.0f}K' for i in r['iops'])} | "
                    f"{r['total'] / 1000:.0f}K | {shares} | "
                    f"{r['max_abs_deviation_pct']:.1f}% |\n")


if __name__ == "__main__":
    main()
