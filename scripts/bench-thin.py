#!/usr/bin/env python3
"""What thin provisioning costs (issue 34): a thin volume against a thick one, side by side.

One spoold (release build, keeper, journal on tmpfs) serves two volumes of one queue from one
pool with 4 MiB chunks: "thick" and "thin" (`thin = true`). First each is written whole with
4 MiB writes at QD1, so every write to the thin volume is a first write that waits for its
chunk (taken from the pool, zeroed, its map entry written durably): the difference in mean
latency is the first-write cost per chunk. Then spool-bench's A/B mode drives both from one
libblkio client thread, switching every slice (ABBA), and reports thin/thick ratios of IOPS
with a 95% interval: 4K random reads and writes at QD32, 128K sequential reads and writes.
Two devices: a file on tmpfs (the software path at memory speed: the worst case for the
ratio) and a file on the machine's disk through O_DIRECT (--quick skips it).

    scripts/bench-thin.py             # 10 s per case
    scripts/bench-thin.py --quick     # 1 s per case, tmpfs only (checks it works; thin-quick.json)
    scripts/bench-thin.py --mirror    # both volumes 2-way mirrors on two devices (thin-mirror.json)
Results: docs/benchmarks/thin.json (docs/benchmarks/thin.md discusses them); with --mirror,
docs/benchmarks/thin-mirror.json: a mirrored thin volume (a map per copy) against a mirrored
thick one.
"""

import shutil

import benchlib as b
from benchlib import Spoold, dev, log, vol


def run_device(c, secs, mirror):
    shm, data = b.workdir("spool-thin-"), b.workdir("spool-thin-", c["dir"])
    copies = dict(mirror=2) if mirror else {}
    devices = [dev(f"{data}/d{i}.img", "2200M") for i in range(2 if mirror else 1)]
    with Spoold(shm, devices, [vol("thick", "1G", **copies), vol("thin", "1G", thin=True, **copies)],
                sections={"pool": {"min_extent": "4M"}}) as d:
        # Every write of the thin volume's fill is the first write of its chunk.
        first = {"device": c["name"], "fill": {v: b.fill(d.socks[v], bs=4 << 20, qd=1) for v in d.socks}}
        log(f"{c['name']} first writes: {str(first['fill'])[:400]}")
        rows = [dict(device=c["name"], rw=x["rw"], bs=x["bs"], iodepth=x["qd"],
                     ab=b.spool_bench(d.socks["thin"], compare=d.socks["thick"], **b.ab_opts(x, secs)))
                for x in b.AB_CASES]
    shutil.rmtree(shm)
    shutil.rmtree(data, ignore_errors=True)
    return first, rows


def main():
    a = b.args(__doc__, {"--mirror": dict(action="store_true", help="both volumes 2-way mirrors")})
    secs = 1 if a.quick else 10
    runs = b.run_cases([dict(name="tmpfs", dir="/dev/shm"), dict(name="disk", dir="/var/tmp", quick=False)],
                       lambda c: run_device(c, secs, a.mirror), a.quick)
    b.save("thin-mirror" if a.mirror else "thin", {"runtime_s": secs, "mirror": 2 if a.mirror else 1,
                                                    "first_writes": [f for f, _ in runs],
                                                    "cases": [r for _, rs in runs for r in rs]}, quick=a.quick)


if __name__ == "__main__":
    main()
