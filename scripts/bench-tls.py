#!/usr/bin/env python3
"""What TLS costs a snapshot export over TCP (issue 55), measured side by side in one run.

One spoold (release build, keeper, journal on tmpfs) serves a thin volume of 1 GiB written
whole, on a file on tmpfs. Its snapshot is exported over TCP on 127.0.0.1 twice: in the
clear (`--plaintext`) and with TLS (`[tls] dir`, credentials from scripts/tls-certs.sh,
client certificates required). Each is read whole by `nbdcopy` to `null:` (libnbd, 4
connections: its default), rounds alternating; per round the MB/s and the CPU seconds
spoold's processes and nbdcopy spent per GiB. Loopback: the network costs nothing, so this
is TLS's CPU cost on both ends (rustls with ring on spoold's side, GnuTLS on nbdcopy's).

    scripts/bench-tls.py            # 1 GiB, 3 rounds
    scripts/bench-tls.py --quick    # 128 MiB, 1 round (checks it works; tls-quick.json)
Results: docs/benchmarks/tls.json and tls.md.
"""

import os
import shutil
import subprocess
import sys
import time

import benchlib as b
from benchlib import Spoold, dev, log, vol

MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy(uri, spoold_pid):
    """nbdcopy of `uri` to null: seconds, spoold's CPU seconds, nbdcopy's CPU seconds."""
    pids = b.proc_tree(spoold_pid)
    before, t = b.cpu_s(pids), time.monotonic()
    r = subprocess.run(["nbdcopy", uri, "null:"], capture_output=True, text=True)
    took = time.monotonic() - t
    if r.returncode != 0:
        raise RuntimeError(f"nbdcopy {uri}: {r.stderr}")
    client = os.times().children_user + os.times().children_system
    return took, b.cpu_s(pids) - before, client


def md(r):
    rows = ["| export | MB/s | spoold CPU s per GiB | nbdcopy CPU s per GiB |", "|---|---|---|---|"]
    for k in ("plaintext", "tls"):
        x = r[k]
        rows.append(f"| {k} | {x['mb_s']:.0f} | {x['spoold_cpu_s_per_gib']:.2f} | {x['client_cpu_s_per_gib']:.2f} |")
    rows += ["", f"TLS / plaintext throughput: {r['tls_over_plaintext']:.2f}"]
    return ["# Snapshot export over TCP: TLS against plaintext", "", *rows]


def main():
    a = b.args(__doc__)
    size, rounds = (128 * MIB, 1) if a.quick else (1024 * MIB, 3)
    for tool in ("nbdcopy", "openssl"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: scripts/install-deps.sh installs it")
    b.build()
    work = b.workdir("spool-tls-")
    certs = os.path.join(work, "tls")
    subprocess.run([os.path.join(REPO, "scripts", "tls-certs.sh"), certs], check=True, capture_output=True)
    d = Spoold(work, [dev(f"{work}/d0.img", f"{size * 3 // MIB}M")], [vol("v", f"{size // MIB}M", thin=True)],
               sections={"tls": {"dir": certs}})
    b.fill(d.socks["v"], size, 4 * MIB, 1)
    d.ctl("volume", "snapshot", "v", "s")
    res = {"volume_bytes": size, "rounds": rounds}
    runs = {"plaintext": [], "tls": []}
    for _ in range(rounds):
        for kind in ("plaintext", "tls"):
            extra = ["--plaintext"] if kind == "plaintext" else []
            out = d.ctl("volume", "export", "v@s", "--nbd", "127.0.0.1:0", *extra)
            uri = out["uri"]
            if kind == "tls":
                uri += f"?tls-certificates={certs}"
            c0 = os.times().children_user + os.times().children_system
            took, server, client = copy(uri, d.proc.pid)
            runs[kind].append((took, server, client - c0))
            d.ctl("volume", "unexport", "v@s")
    gib = size / (1 << 30)
    for kind, xs in runs.items():
        took, server, client = (b.middle(xs, key=lambda x: x[0]))
        res[kind] = {"mb_s": size / MIB / took, "seconds": took, "spoold_cpu_s_per_gib": server / gib,
                     "client_cpu_s_per_gib": client / gib}
        log(f"{kind}: {res[kind]}")
    res["tls_over_plaintext"] = res["tls"]["mb_s"] / res["plaintext"]["mb_s"]
    d.stop()
    b.save("tls", res, md=md, quick=a.quick)


if __name__ == "__main__":
    main()
