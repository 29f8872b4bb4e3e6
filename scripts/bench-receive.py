#!/usr/bin/env python3
"""The rate of receiving a volume over NBD (issue 36; docs/transfer.md): `qemu-img convert -n`
of one image into `spoolctl volume receive` exports, a plain and a mirrored volume, against
the same copy into a raw file on the same filesystem (what the disk gives a local copy).

One spoold (release build) on two file devices under DIR (a disk, not tmpfs: the export's
writes are durable one by one, and that is what is measured). The image is random data.

    scripts/bench-receive.py              # 1 GiB, DIR /var/tmp
    scripts/bench-receive.py --quick      # 64 MiB (checks it works; receive-quick.*)
Results: docs/benchmarks/receive.{json,md}.
"""

import os

import benchlib as b
from benchlib import Spoold, dev, vol


def main():
    a = b.args(__doc__, {"--dir": dict(default="/var/tmp"), "--runs": dict(type=int, default=2)})
    mib = 64 if a.quick else 1024
    work = b.workdir("spool-bench-receive-", a.dir)
    src, local = os.path.join(work, "src.img"), os.path.join(work, "local.img")
    with open(src, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    with open(local, "wb") as f:
        f.truncate(mib << 20)
    d = Spoold(work, [dev(f"{work}/d{i}.img", f"{2 * mib + 64}M") for i in range(2)],
               [vol("plain", f"{mib}M"), vol("mirror", f"{mib}M", mirror=2)])

    def copy(dst):
        """`qemu-img convert -n` of the image into `dst` (a file or an NBD URI): seconds."""
        return b.run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, dst], 3600)[1]
    rows = []
    for run in range(a.runs):
        rows.append({"target": "raw file (local copy)", "run": run, "s": copy(local)})
        for v, sock in ((v, f"{work}/{v}-in.sock") for v in ("plain", "mirror")):
            d.ctl("volume", "receive", v, "--nbd", f"unix:{sock}")
            rows.append({"target": f"volume receive ({v})", "run": run, "s": copy(f"nbd+unix:///{v}?socket={sock}")})
            d.ctl("volume", "receive", v, "--stop")
    for r in rows:
        r["mib_s"] = mib / r["s"]
    d.stop()
    b.save("receive", {"mib": mib, "dir": a.dir, "rows": rows}, md, a.quick)


def md(r):
    return b.notes("receive", **r, table=b.md_table(["target", "run", "seconds", "MiB/s"], [
        (x["target"], x["run"], f"{x['s']:.2f}", f"{x['mib_s']:.0f}") for x in r["rows"]]))


if __name__ == "__main__":
    main()
