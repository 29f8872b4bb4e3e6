#!/usr/bin/env python3
"""Sending a volume to another spoold (issue 36; docs/transfer.md): how fast `volume send`
copies a volume, idle and under a guest-like write load, and what keeping the remote copy
in step costs the writes (4K random writes, QD1 and QD32, before the send and while the
copy on the other host is current).

Two spoolds (release build) on this machine, A sending to B's `volume receive` export over
a Unix socket, their devices files under DIR (a disk: each of B's writes is durable before
it is acknowledged). The resync rate is unlimited (`[pool] resync_rate = "0"`).

    scripts/bench-send.py              # 1 GiB, DIR /var/tmp
    scripts/bench-send.py --quick      # 64 MiB, 1 s runs (checks it works)
    scripts/bench-send.py --encrypted  # an encrypted volume, through B's transfer listener
Results: docs/benchmarks/send.{json,md} (send-encrypted.{json,md} with --encrypted).
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bin_dir, cpu_model, ctl, log, run_spoold, save, spool_bench  # noqa: E402


def config(work, mib, encrypted=False, volume=True):
    """A spoold's config; `encrypted`: with a key-encryption key (the same on both hosts)
    and the volume encrypted; without `volume`, a transfer listener instead (B)."""
    c = f"""state_dir = "{work}/state"
[pool]
resync_rate = "0"
[[devices]]
path = "{work}/d0.img"
create_size = "{mib + 64}M"
"""
    if encrypted:
        key = os.path.join(work, "kek")
        with open(key, "w") as f:
            f.write("5a" * 32)
        os.chmod(key, 0o600)
        c += f'[encryption]\nkey_file = "{key}"\n'
    if volume:
        c += f'[[volumes]]\nname = "v"\nsize = "{mib}M"\nnum_queues = 1\n'
        c += "encrypt = true\n" if encrypted else ""
    else:
        c += '[transfer]\nlisten = "127.0.0.1:0"\npeers = ["127.0.0.1"]\n'
    return c


def listener_port(work, timeout=30):
    """The port B's transfer listener got (from its log)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        with open(os.path.join(work, "spoold.log")) as f:
            m = re.search(r"transfer listener.*listen=127\.0\.0\.1:(\d+)", f.read())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise RuntimeError("no transfer listener in B's log")


def writes(sock, qd, secs, label):
    """4K random writes at queue depth `qd` for `secs`: IOPS and latency percentiles (µs)."""
    r = spool_bench(["--socket", sock, "--rw", "randwrite", "--iodepth", str(qd),
                     "--runtime", str(secs), "--label", label])
    return {"label": label, "qd": qd, "iops": r["iops"], "p50_us": r["lat_p50_us"],
            "p99_us": r["lat_p99_us"]}


def wait_current(rpc, timeout=3600):
    """Seconds until `volume send v` says the copy is current."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        s = ctl(rpc, "volume", "send", "v")
        if s["state"] == "current":
            return time.monotonic() - t
        time.sleep(0.05)
    raise RuntimeError("the copy never became current")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--encrypted", action="store_true")
    a = ap.parse_args()
    mib, secs = (64, 1) if a.quick else (1024, 5)
    work = tempfile.mkdtemp(prefix="spool-bench-send-", dir=a.dir)
    procs = []
    try:
        wa, wb = os.path.join(work, "a"), os.path.join(work, "b")
        os.makedirs(wa)
        os.makedirs(wb)
        enc = a.encrypted
        pa, sa = run_spoold(wa, config(wa, mib, enc), ["v"])
        pb, _ = run_spoold(wb, config(wb, mib, enc, volume=not enc), [] if enc else ["v"])
        procs = [pa, pb]
        rpc_a, rpc_b = (os.path.join(w, "state", "spoold.sock") for w in (wa, wb))
        if enc:
            # Through B's listener, which creates the volume under A's data key.
            token = "0123456789abcdef0123"
            to = ["--to", f"127.0.0.1:{listener_port(wb)}", "--token", token]
            ctl(rpc_b, "volume", "receive", "v", "--token", token)
        else:
            sock = os.path.join(wb, "in.sock")
            to = ["--to", f"nbd+unix:///v?socket={sock}"]
            ctl(rpc_b, "volume", "receive", "v", "--nbd", f"unix:{sock}")
        def again():
            """Cancels the send, and has B expect the volume again."""
            ctl(rpc_a, "volume", "send", "v", "--cancel")
            if enc:
                # A token opens one transfer: B expects the volume (which it has) again.
                ctl(rpc_b, "volume", "receive", "v", "--stop")
                ctl(rpc_b, "volume", "receive", "v", "--token", token)

        # The volume as created, never written: all zeroes, which cross as write-zeroes.
        copies = []
        ctl(rpc_a, "volume", "send", "v", *to)
        copies.append({"copy": "idle, a fresh volume (zeroes)", "s": wait_current(rpc_a),
                       "zeroed": ctl(rpc_a, "volume", "show", "v")["mirror"].get("zeroed_bytes", 0)})
        again()
        rows = []
        for qd in (1, 32):
            rows.append(writes(sa["v"], qd, secs, "encrypted, not sent" if enc else "plain volume"))
        ctl(rpc_a, "volume", "send", "v", *to)
        copies.append({"copy": "idle, after the writes", "s": wait_current(rpc_a)})
        for qd in (1, 32):
            label = "encrypted, sending, copy current" if enc else "sending, copy current"
            rows.append(writes(sa["v"], qd, secs, label))
        # The copy again, under a QD8 write load for its whole length.
        again()
        ctl(rpc_a, "volume", "send", "v", *to)
        load = spool_bench_background(sa["v"])
        copies.append({"copy": "under 4K QD8 random writes", "s": wait_current(rpc_a)})
        load.terminate()
        load.wait()
        for c in copies:
            c["mib_s"] = mib / c["s"]
            log(f'copy {c["copy"]:28}: {c["s"]:.2f} s, {c["mib_s"]:.0f} MiB/s')
        for r in rows:
            log(f'{r["label"]:24} QD{r["qd"]:<3}: {r["iops"]:.0f} IOPS, p50 {r["p50_us"]:.0f} µs, '
                f'p99 {r["p99_us"]:.0f} µs')
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "cpu": cpu_model(), "cores": os.cpu_count(), "mib": mib, "dir": a.dir,
                  "encrypted": enc, "copies": copies, "writes": rows}
        if not a.quick:
            save("send-encrypted" if enc else "send", result, md(result))
        print(json.dumps(result))
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)


def spool_bench_background(sock):
    """A 4K QD8 random-write load on `sock` for up to an hour (terminated by the caller)."""
    return subprocess.Popen([os.path.join(bin_dir(), "spool-bench"), "--socket", sock,
                             "--rw", "randwrite", "--iodepth", "8", "--runtime", "3600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def md(r):
    """The result as markdown lines."""
    how = ("an encrypted volume (`scripts/bench-send.py --encrypted`) through B's transfer "
           "listener over TCP on 127.0.0.1 (B creates it under A's data key, both having the "
           "same key-encryption key; the copy moves A's ciphertext as it is)"
           if r.get("encrypted") else
           "a volume to B's `volume receive` export over a Unix socket")
    lines = [
        "# Sending " + ("an encrypted volume" if r.get("encrypted") else "a volume")
        + " to another spoold",
        "",
        f"`scripts/bench-send.py`, {r['date'][:10]}, {r['cpu']} ({r['cores']} cores): two "
        f"spoolds on this machine, A sending {how}; {r['mib']} MiB, devices are files under "
        f"{r['dir']}, resync rate unlimited.",
        "",
        "| copy | seconds | MiB/s |",
        "|---|---|---|",
    ]
    for c in r["copies"]:
        lines.append(f"| {c['copy']} | {c['s']:.2f} | {c['mib_s']:.0f} |")
    lines += [
        "",
        "4K random writes on A (spool-bench, libblkio), before the send and while B's copy is",
        "current (every write then completes only once B made it durable):",
        "",
        "| volume | QD | IOPS | p50 µs | p99 µs |",
        "|---|---|---|---|---|",
    ]
    for x in r["writes"]:
        lines.append(f"| {x['label']} | {x['qd']} | {x['iops']:.0f} | {x['p50_us']:.0f} | "
                     f"{x['p99_us']:.0f} |")
    lines += [
        "",
        "The copy is the mirror's rebuild, region by region (1 MiB, in pieces of 256 KiB that",
        "writes to the region wait for, writes first), each piece read from A's device and",
        "written to B through one NBD connection, where B makes it durable before the reply.",
        "A piece that reads as zeroes goes to B as write-zeroes, not data: a fresh volume",
        "(the first row) crosses with no data at all"
        + (f" ({r['copies'][0]['zeroed'] >> 20} MiB zeroed)" if "zeroed" in r["copies"][0]
           else "") + ". The copies after the writes",
        "move data: 5 s of 4K random writes at QD1 and QD32 leave few pieces of zeroes.",
        "B's device files stay sparse where the first copy wrote zeroes (as a new volume's",
        "extents are), so B allocates file blocks for the writes and copies that land there",
        "later, which the rows after the first pay; before zero pieces went as write-zeroes,",
        "the first copy allocated all of them.",
        "A write while the copy is current goes to both legs, A's device and B's export, and",
        "completes when both have it.",
        "",
        "What limits the writes while sending: B makes each write durable (`fdatasync`) before",
        "its reply, and serves each connection's requests four at a time (before stop 45 one",
        "at a time: QD32 then ran at 5.4k IOPS, now about 10k). NBD lets a server reply before",
        "the data is durable and make it so at `NBD_CMD_FLUSH`, which A's mirror sends B for",
        "every flush of the guest; but then a crash of B's host would lose writes A counts as",
        "on B, and A would have to copy again everything written since B's last flush: not",
        "done.",
        "",
        "A VM's downtime when it moves with its volume is QEMU's migration downtime: the",
        "guest test (`tests/migration.rs`, a 512 MiB TCG guest, 96 MiB volume) measured",
        "17–143 ms on this machine (docs/transfer.md).",
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
