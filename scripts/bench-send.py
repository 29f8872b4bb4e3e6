#!/usr/bin/env python3
"""Sending a volume to another spoold (issue 36; docs/transfer.md): how fast `volume send`
copies a volume, idle and under a guest-like write load, and what keeping the remote copy
in step costs the writes (4K random writes, QD1 and QD32, before the send and while the
copy on the other host is current).

Two spoolds (release build) on this machine, A sending to B's `volume receive` export over
a Unix socket, their devices files under DIR (a disk: each of B's writes is durable before
it is acknowledged). The resync rate is unlimited (`[pool] resync_rate = "0"`).

    scripts/bench-send.py              # 1 GiB, DIR /var/tmp
    scripts/bench-send.py --quick      # 64 MiB, 1 s runs (checks it works; send-quick.*)
    scripts/bench-send.py --encrypted  # an encrypted volume, through B's transfer listener
Results: docs/benchmarks/send.{json,md} (send-encrypted.{json,md} with --encrypted).
"""

import re
import time

import benchlib as b
from benchlib import Spoold, dev, vol

TOKEN = "0123456789abcdef0123"


def spoold(work, mib, encrypted=False, volume=True):
    """A spoold; `encrypted`: with a key-encryption key (the same on both hosts) and the volume
    encrypted; without `volume`, a transfer listener instead (B)."""
    return Spoold(work, [dev(f"{work}/d0.img", f"{mib + 64}M")],
                  [vol("v", f"{mib}M", **({"encrypt": True} if encrypted else {}))] if volume else [],
                  sections={"pool": {"resync_rate": "0"}} if volume else {
                      "pool": {"resync_rate": "0"}, "transfer": {"listen": "127.0.0.1:0", "peers": ["127.0.0.1"]}},
                  key="5a" * 32 if encrypted else None)


def listener_port(d, timeout=30):
    """The port B's transfer listener got (from its log)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        m = re.search(r"transfer listener.*listen=127\.0\.0\.1:(\d+)", d.tail(1 << 30))
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise RuntimeError("no transfer listener in B's log")


def writes(sock, qd, secs, label):
    """4K random writes at queue depth `qd` for `secs`: IOPS and latency percentiles (µs)."""
    r = b.spool_bench(sock, rw="randwrite", qd=qd, runtime=secs, label=label)
    return {"label": label, "qd": qd, "iops": r["iops"], "p50_us": r["lat_p50_us"], "p99_us": r["lat_p99_us"]}


def wait_current(d, timeout=3600):
    """Seconds until `volume send v` says the copy is current."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if d.ctl("volume", "send", "v")["state"] == "current":
            return time.monotonic() - t
        time.sleep(0.05)
    raise RuntimeError("the copy never became current")


def main():
    a = b.args(__doc__, {"--dir": dict(default="/var/tmp"), "--encrypted": dict(action="store_true")})
    mib, secs = (64, 1) if a.quick else (1024, 5)
    enc = a.encrypted
    work = b.workdir("spool-bench-send-", a.dir)
    da, db = spoold(f"{work}/a", mib, enc), spoold(f"{work}/b", mib, enc, volume=not enc)
    if enc:
        # Through B's listener, which creates the volume under A's data key.
        to = ["--to", f"127.0.0.1:{listener_port(db)}", "--token", TOKEN]
        db.ctl("volume", "receive", "v", "--token", TOKEN)
    else:
        to = ["--to", f"nbd+unix:///v?socket={work}/b/in.sock"]
        db.ctl("volume", "receive", "v", "--nbd", f"unix:{work}/b/in.sock")

    def again():
        """Cancels the send, and has B expect the volume again."""
        da.ctl("volume", "send", "v", "--cancel")
        if enc:
            # A token opens one transfer: B expects the volume (which it has) again.
            db.ctl("volume", "receive", "v", "--stop")
            db.ctl("volume", "receive", "v", "--token", TOKEN)

    # The volume as created, never written: all zeroes, which cross as write-zeroes.
    da.ctl("volume", "send", "v", *to)
    copies = [{"copy": "idle, a fresh volume (zeroes)", "s": wait_current(da),
               "zeroed": da.ctl("volume", "show", "v")["mirror"].get("zeroed_bytes", 0)}]
    again()
    rows = [writes(da.sock, qd, secs, "encrypted, not sent" if enc else "plain volume") for qd in (1, 32)]
    da.ctl("volume", "send", "v", *to)
    copies.append({"copy": "idle, after the writes", "s": wait_current(da)})
    label = "encrypted, sending, copy current" if enc else "sending, copy current"
    rows += [writes(da.sock, qd, secs, label) for qd in (1, 32)]
    # The copy again, under a QD8 write load for its whole length.
    again()
    da.ctl("volume", "send", "v", *to)
    load = b.start_bench(da.sock, rw="randwrite", qd=8, runtime=3600)
    copies.append({"copy": "under 4K QD8 random writes", "s": wait_current(da)})
    load.terminate()
    load.wait()
    for c in copies:
        c["mib_s"] = mib / c["s"]
    b.save("send-encrypted" if enc else "send", {"mib": mib, "dir": a.dir, "encrypted": enc, "copies": copies,
                                                   "writes": rows}, md, a.quick)


def md(r):
    zeroed = r["copies"][0].get("zeroed")
    return b.notes("send", mib=r["mib"], dir=r["dir"], what="an encrypted volume" if r.get("encrypted") else "a volume",
                   how="an encrypted volume (`scripts/bench-send.py --encrypted`) through B's transfer listener over "
                   "TCP on 127.0.0.1 (B creates it under A's data key, both having the same key-encryption key; the "
                   "copy moves A's ciphertext as it is)" if r.get("encrypted") else
                   "a volume to B's `volume receive` export over a Unix socket",
        zeroed=f" ({zeroed >> 20} MiB zeroed)" if zeroed is not None else "",
        copies=b.md_table(["copy", "seconds", "MiB/s"], [(c["copy"], f"{c['s']:.2f}", f"{c['mib_s']:.0f}")
                                                         for c in r["copies"]]),
        writes=b.md_table(["volume", "QD", "IOPS", "p50 µs", "p99 µs"], [
            (x["label"], x["qd"], f"{x['iops']:.0f}", f"{x['p50_us']:.0f}", f"{x['p99_us']:.0f}")
            for x in r["writes"]]))


if __name__ == "__main__":
    main()
