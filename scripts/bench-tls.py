#!/usr/bin/env python3
"""What TLS costs a snapshot export over TCP and a transfer between two spoolds (issue 55),
measured side by side in one run.

One spoold (release build, keeper, journal on tmpfs) serves a thin volume of 1 GiB written
whole, on a file on tmpfs. Its snapshot is exported over TCP on 127.0.0.1 twice: in the
clear (`--plaintext`) and with TLS (`[tls] dir`, credentials from scripts/tls-certs.sh,
client certificates required). Each is read whole by `nbdcopy` to `null:` (libnbd, 4
connections: its default), rounds alternating; per round the MB/s and the CPU seconds
spoold's processes and nbdcopy spent per GiB. Loopback: the network costs nothing, so this
is TLS's CPU cost on both ends (rustls with ring on spoold's side, GnuTLS on nbdcopy's).

Then a transfer: two pairs of spoolds (one pair with `[tls] dir`, one without), each sender
with a thick volume of 1 GiB written whole on tmpfs, sends it through its receiver's transfer
listener (`volume send --to HOST:PORT --token`) until the copy is current, rounds alternating
between the pairs; per round the MB/s and each side's CPU seconds per GiB.

    scripts/bench-tls.py            # 1 GiB, 3 rounds
    scripts/bench-tls.py --quick    # 128 MiB export, 64 MiB transfer, 1 round (checks it works)
Results: docs/benchmarks/tls.json and tls.md.
"""

import os
import re
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
    t = r.get("transfer")
    if t:
        rows += ["", "## A transfer between two spoolds (`volume send --to HOST:PORT --token`)", "",
                 f"A sends a volume of {t['volume_bytes'] >> 20} MiB of data to B through B's transfer listener, "
                 "each on a tmpfs device, until the copy is current; B creates the volume from the hello each "
                 "round. With TLS both hosts have `[tls] dir` (the hello and the copy over TLS, client certificates "
                 "required); without, neither. Median of the rounds by time.", "",
                 "| transfer | MB/s | sender CPU s per GiB | receiver CPU s per GiB |", "|---|---|---|---|"]
        for k in ("plaintext", "tls"):
            x = t[k]
            rows.append(f"| {k} | {x['mb_s']:.0f} | {x['sender_cpu_s_per_gib']:.2f} | "
                        f"{x['receiver_cpu_s_per_gib']:.2f} |")
        rows += ["", f"TLS / plaintext throughput: {t['tls_over_plaintext']:.2f}"]
    return ["# Snapshot export and transfer over TCP: TLS against plaintext", "", *rows]


TOKEN = "0123456789abcdef0123"


def transfer_pair(work, size, certs):
    """A sender with volume v written whole and a receiver with a transfer listener, both with
    `[tls] dir` when `certs` is given; B's listener port."""
    tls = {"tls": {"dir": certs}} if certs else {}
    mib = size // MIB
    a = Spoold(f"{work}/a", [dev(f"{work}/a/d0.img", f"{mib + 64}M")], [vol("v", f"{mib}M")],
               sections={"pool": {"resync_rate": "0"}, **tls})
    b.fill(a.socks["v"], size, 4 * MIB, 1)
    rb = Spoold(f"{work}/b", [dev(f"{work}/b/d0.img", f"{mib + 64}M")], [],
                sections={"transfer": {"listen": "127.0.0.1:0", "peers": ["127.0.0.1"]}, **tls})
    t0 = time.monotonic()
    while not (m := re.search(r"transfer listener.*listen=127\.0\.0\.1:(\d+)", rb.tail(1 << 30))):
        if time.monotonic() - t0 > 30:
            raise RuntimeError("no transfer listener in B's log")
        time.sleep(0.05)
    return a, rb, int(m.group(1))


def send_once(a, rb, port):
    """One send of v from `a` to `rb` until current: seconds, sender's and receiver's CPU s."""
    rb.ctl("volume", "receive", "v", "--token", TOKEN)
    pids = (b.proc_tree(a.proc.pid), b.proc_tree(rb.proc.pid))
    c0, t = [b.cpu_s(p) for p in pids], time.monotonic()
    a.ctl("volume", "send", "v", "--to", f"127.0.0.1:{port}", "--token", TOKEN)
    while a.ctl("volume", "send", "v")["state"] != "current":
        if time.monotonic() - t > 3600:
            raise RuntimeError("the copy never became current")
        time.sleep(0.02)
    took = time.monotonic() - t
    # The receiver's processes as they are now (its worker may have been restarted).
    c1 = [b.cpu_s(b.proc_tree(x.proc.pid)) for x in (a, rb)]
    a.ctl("volume", "send", "v", "--cancel")
    rb.ctl("volume", "receive", "v", "--stop")
    rb.ctl("volume", "delete", "v")
    return took, c1[0] - c0[0], c1[1] - c0[1]


def transfers(work, size, rounds, certs):
    """`volume send` of `size` bytes with and without TLS, rounds alternating."""
    pairs = {"plaintext": transfer_pair(f"{work}/plain", size, None),
             "tls": transfer_pair(f"{work}/tls", size, certs)}
    runs = {k: [] for k in pairs}
    for _ in range(rounds):
        for kind, (a, rb, port) in pairs.items():
            runs[kind].append(send_once(a, rb, port))
    gib = size / (1 << 30)
    res = {"volume_bytes": size, "rounds": rounds}
    for kind, xs in runs.items():
        took, sender, receiver = b.middle(xs, key=lambda x: x[0])
        res[kind] = {"mb_s": size / MIB / took, "seconds": took, "sender_cpu_s_per_gib": sender / gib,
                     "receiver_cpu_s_per_gib": receiver / gib}
        log(f"transfer {kind}: {res[kind]}")
    res["tls_over_plaintext"] = res["tls"]["mb_s"] / res["plaintext"]["mb_s"]
    for a, rb, _ in pairs.values():
        a.stop()
        rb.stop()
    return res


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
    res["transfer"] = transfers(work, 64 * MIB if a.quick else 1024 * MIB, rounds, certs)
    b.save("tls", res, md=md, quick=a.quick)


if __name__ == "__main__":
    main()
