#!/usr/bin/env python3
"""The rate of receiving a volume over NBD (issue 36; docs/transfer.md): `qemu-img convert -n`
of one image into `spoolctl volume receive` exports, a plain and a mirrored volume, against
the same copy into a raw file on the same filesystem (what the disk gives a local copy).

One spoold (release build) on two file devices under DIR (a disk, not tmpfs: the export's
writes are durable one by one, and that is what is measured). The image is random data.

    scripts/bench-receive.py              # 1 GiB, DIR /var/tmp
    scripts/bench-receive.py --quick      # 64 MiB (checks it works)
Results: docs/benchmarks/receive.{json,md}.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bin_dir, cpu_model, ctl, log, run_spoold, save  # noqa: E402


def copy(src, dst):
    """`qemu-img convert -n` of `src` into `dst` (a file or an NBD URI): seconds."""
    t = time.monotonic()
    subprocess.run(["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, dst],
                   check=True, capture_output=True, timeout=3600)
    return time.monotonic() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    mib = 64 if a.quick else 1024
    work = tempfile.mkdtemp(prefix="spool-bench-receive-", dir=a.dir)
    p = None
    try:
        src = os.path.join(work, "src.img")
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        local = os.path.join(work, "local.img")
        with open(local, "wb") as f:
            f.truncate(mib << 20)
        p, _ = run_spoold(work, f"""state_dir = "{work}/state"
[[devices]]
path = "{work}/d0.img"
create_size = "{2 * mib + 64}M"
[[devices]]
path = "{work}/d1.img"
create_size = "{2 * mib + 64}M"
[[volumes]]
name = "plain"
size = "{mib}M"
num_queues = 1
[[volumes]]
name = "mirror"
size = "{mib}M"
num_queues = 1
mirror = 2
""", ["plain", "mirror"])
        rpc = os.path.join(work, "state", "spoold.sock")
        rows = []
        for run in range(a.runs):
            secs = copy(src, local)
            rows.append({"target": "raw file (local copy)", "run": run, "s": secs})
            for v in ["plain", "mirror"]:
                sock = os.path.join(work, f"{v}-in.sock")
                ctl(rpc, "volume", "receive", v, "--nbd", f"unix:{sock}")
                secs = copy(src, f"nbd+unix:///{v}?socket={sock}")
                ctl(rpc, "volume", "receive", v, "--stop")
                rows.append({"target": f"volume receive ({v})", "run": run, "s": secs})
        for r in rows:
            r["mib_s"] = mib / r["s"]
            log(f'{r["target"]:28} run {r["run"]}: {r["s"]:.2f} s, {r["mib_s"]:.0f} MiB/s')
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "cpu": cpu_model(), "cores": os.cpu_count(), "mib": mib, "dir": a.dir,
                  "rows": rows}
        if not a.quick:
            save("receive", result, md(result))
        print(json.dumps(result))
    finally:
        if p:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def md(r):
    """The result as markdown lines."""
    lines = [
        "# Receiving a volume over NBD",
        "",
        f"`scripts/bench-receive.py`, {r['date'][:10]}, {r['cpu']} ({r['cores']} cores), "
        f"a {r['mib']} MiB image of random data copied with `qemu-img convert -n` from a file "
        f"under {r['dir']} into each target (spoold's devices are files there too).",
        "",
        "| target | run | seconds | MiB/s |",
        "|---|---|---|---|",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['target']} | {x['run']} | {x['s']:.2f} | {x['mib_s']:.0f} |")
    lines += [
        "",
        "Each write to a received volume is made durable (written, then `fdatasync` on a file",
        "device) before it is acknowledged (docs/transfer.md), spool-nbd serves one connection's",
        "requests one at a time, and a mirrored volume writes both copies. The raw-file rows",
        "are a local `qemu-img convert` into a file (page cache, one flush at the end). Run 0 of",
        "every row also allocates the files' blocks (sparse until written); run 1 rewrites them.",
        "A disk whose flushes cost more than this VM's makes the receive rows slower, not the",
        "local copy.",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
