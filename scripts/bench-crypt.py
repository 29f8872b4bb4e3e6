#!/usr/bin/env python3
"""What encryption costs (issue 35): an encrypted volume against a plain one, side by side.

One spoold (release build, keeper, journal on tmpfs) serves two volumes of one queue from one
pool: "plain" and "enc" (`encrypt = true`). spool-bench's A/B mode drives both from one
libblkio client thread, switching every slice (ABBA), and reports enc/plain ratios of IOPS
with a 95% interval: 4K random reads and writes at QD32, 128K sequential reads and writes.
Three devices: a null device (stores nothing: spoold's software path and the cipher alone, the
worst case for the ratio), a file on tmpfs (data copied in and out at memory speed), and a file
on the machine's disk through O_DIRECT (a real device, written whole first; --quick skips
it). Then each volume alone with the server's CPU time per I/O, from which the cipher's rate
per core of spoold follows.

    scripts/bench-crypt.py             # 10 s per case
    scripts/bench-crypt.py --quick     # 1 s per case (checks it works; encryption-quick.json)
Results: docs/benchmarks/encryption.json (docs/benchmarks/encryption.md discusses them).
"""

import os
import shutil

import benchlib as b
from benchlib import Spoold, dev, log, vol

DEVICES = [  # the device of each spoold ({disk}: a directory on this machine's disk)
    dict(name="null", device=dev("null0", "4G", null="untouched")),
    dict(name="tmpfs", device=dev("{shm}/d0.img", "2200M")),
    # A file on this machine's virtio disk, O_DIRECT through io_uring: a real device, whose
    # time per request dwarfs spoold's (the volumes are written whole first: reads of holes
    # would not reach it).
    dict(name="disk", device=dev("{disk}/d0.img", "2200M"), quick=False),
]


def run_device(c, secs):
    shm, disk = b.workdir("spool-crypt-"), b.workdir("spool-crypt-", "/var/tmp")
    rows = []
    with Spoold(shm, [dict(c["device"], path=c["device"]["path"].format(shm=shm, disk=disk))],
                [vol("plain", "1G"), vol("enc", "1G", encrypt=True)], key=os.urandom(32).hex()) as d:
        pid = d.status()["pid"]
        for sock in d.sockets if c["name"] == "disk" else []:
            b.fill(sock)
        for x in b.AB_CASES:
            ab = b.spool_bench(d.socks["plain"], compare=d.socks["enc"], **b.ab_opts(x, secs))
            alone = {v: b.spool_bench(d.socks[v], server_pid=pid, **b.ab_opts(x, secs)) for v in ("plain", "enc")}
            rows.append(dict(device=c["name"], rw=x["rw"], bs=x["bs"], iodepth=x["qd"], ab=ab, alone=alone))
            log(f"{x['rw']} {x['bs']}: A/B {str(ab)[:300]}\n  alone {str(alone)[:400]}")
    shutil.rmtree(shm)
    shutil.rmtree(disk)
    return rows


def main():
    a = b.args(__doc__)
    secs = 1 if a.quick else 10
    rows = b.run_cases(DEVICES, lambda c: run_device(c, secs), a.quick)
    b.save("encryption", {"runtime_s": secs, "cases": [r for rs in rows for r in rs]}, quick=a.quick)


if __name__ == "__main__":
    main()
