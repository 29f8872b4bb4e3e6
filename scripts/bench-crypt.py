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
per core of spoold follows. On tmpfs, qemu-storage-daemon serves a LUKS image of the same size
(aes-xts-plain64, 256-bit; LUKS1 formatted by cryptsetup) through the same client: the
comparison with QEMU's own encryption.
First, the cipher alone on one core (spool-crypt's `xts_rate` example, 4 KiB and 128 KiB
buffers) beside `openssl speed -evp aes-256-xts` on the same machine: the gap to the best
implementation here, as a number.

    scripts/bench-crypt.py             # 10 s per case
    scripts/bench-crypt.py --quick     # 1 s per case (checks it works; encryption-quick.json)
Results: docs/benchmarks/encryption.json (docs/benchmarks/encryption.md discusses them).
"""

import json
import os
import shutil
import subprocess

import benchlib as b
from benchlib import Qsd, Spoold, dev, log, vol

DEVICES = [  # the device of each spoold ({disk}: a directory on this machine's disk)
    dict(name="null", device=dev("null0", "4G", null="untouched")),
    dict(name="tmpfs", device=dev("{shm}/d0.img", "2200M"), luks=True),
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
    if c.get("luks"):
        with luks_qsd(shm) as q:
            for row, x in zip(rows, b.AB_CASES):
                row["alone"]["luks"] = b.spool_bench(q.sock, server_pid=q.pid, **b.ab_opts(x, secs))
                log(f"{x['rw']} {x['bs']}: qsd LUKS {str(row['alone']['luks'])[:300]}")
    shutil.rmtree(shm)
    shutil.rmtree(disk)
    return rows


def luks_qsd(shm):
    """qemu-storage-daemon serving a new 1 GiB LUKS image on tmpfs (aes-xts-plain64, 256-bit: the
    cipher spoold uses; QEMU's LUKS runs it through its crypto backend, GnuTLS and nettle in Debian 12). Not written first, as spoold's tmpfs volumes are not: a read of a hole
    is decrypted all the same by both."""
    img, secret = f"{shm}/luks.img", "secret,id=sec0,data=spool-bench"
    # LUKS1 (what QEMU's driver reads) formatted by cryptsetup with a fixed PBKDF2 count: qemu-img
    # create times the PBKDF on the thread's CPU clock and, under load, refuses ("Unable to get
    # accurate CPU usage": a CI run failed so). The header's 2 MiB come before the 1 GiB.
    with open(f"{shm}/luks.key", "w") as k:
        k.write("spool-bench")
    with open(img, "wb") as f:
        f.truncate((1 << 30) + (2 << 20))
    cryptsetup = shutil.which("cryptsetup") or "/sbin/cryptsetup"
    subprocess.run([cryptsetup, "luksFormat", "-q", "--type", "luks1", "--cipher", "aes-xts-plain64",
                    "--key-size", "512", "--hash", "sha256", "--pbkdf-force-iterations", "1000",
                    "--key-file", f"{shm}/luks.key", img], check=True)
    # Its best configuration in bench.py: O_DIRECT, Linux AIO, the export in an iothread.
    blockdev = (f"driver=luks,node-name=base,key-secret=sec0,file.driver=file,file.filename={img},"
                "file.cache.direct=on,file.aio=native")
    return Qsd(f"{shm}/qsd", blockdev, iothread=True, objects=[secret])


def cipher_rates(secs):
    """spool-crypt's XTS on one core beside OpenSSL's, 4 KiB and 128 KiB, GB/s."""
    ex = os.path.join(b.bin_dir(), "examples", "xts_rate")
    if not b.prebuilt():
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "spool-crypt", "--example", "xts_rate"],
                       cwd=b.REPO, check=True)
    out = subprocess.run([ex, "--seconds", str(secs)], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    for r in rows:
        for op in ("encrypt", "decrypt"):
            cmd = ["openssl", "speed", "-seconds", str(max(1, round(secs))), "-bytes", str(r["bytes"]),
                   *(["-decrypt"] if op == "decrypt" else []), "-evp", "aes-256-xts"]
            p = subprocess.run(cmd, capture_output=True, text=True)
            last = p.stdout.strip().splitlines()[-1].split() if p.returncode == 0 and p.stdout.strip() else []
            ok = last and last[0].upper() == "AES-256-XTS" and last[-1].endswith("k")
            r[f"openssl_{op}_gbps"] = round(float(last[-1][:-1]) * 1000 / 1e9, 3) if ok else None
            if r[f"openssl_{op}_gbps"]:
                r[f"{op}_vs_openssl"] = round(r[f"{op}_gbps"] / r[f"openssl_{op}_gbps"], 3)
        log(f"cipher, {r['bytes']} bytes: {r}")
    return rows


def main():
    a = b.args(__doc__)
    secs = 1 if a.quick else 10
    cipher = cipher_rates(0.5 if a.quick else 3)
    rows = b.run_cases(DEVICES, lambda c: run_device(c, secs), a.quick)
    b.save("encryption", {"runtime_s": secs, "cipher": cipher, "cases": [r for rs in rows for r in rs]},
           quick=a.quick)


if __name__ == "__main__":
    main()
