#!/usr/bin/env python3
"""Userspace NVMe driver test: boots a TCG guest with two emulated NVMe controllers behind a
virtual IOMMU (QEMU's intel-iommu), plus a third as the replacement, ships spoold/spoolctl/spool-bench into it as an extra
initramfs archive, and runs scripts/guest/nvme-job.sh there (VFIO bind, spoold on the
controllers, verified I/O, upgrade, worker kill, media errors and replacement, SMART
warning, hot removal). The host side only starts QEMU, answers the guest's "MEDIA", "SMART"
and "REMOVE" requests over QMP (blkdebug switched in with blockdev-reopen, qom-set
smart_critical_warning, device_del) and checks the verdict.

Usage: scripts/test-nvme.py [--release] [--no-hotremove] [--no-smart] [--no-media] [--timeout SECONDS]
Exit status 0 when the guest prints "SPOOL-NVME: PASS". The console log is kept in
.cache/nvme-guest.log.
"""
import argparse
import gzip
import json
import re
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("SPOOL_CACHE", os.path.join(REPO, ".cache"))
BINS = ["spoold", "spoolctl", "spool-bench"]


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def build(profile):
    args = ["cargo", "build", "--quiet", "--bins"] + (["--release"] if profile == "release" else [])
    sh(*args, cwd=REPO)
    sh(os.path.join(REPO, "scripts", "build-guest.sh"))


def extra_initramfs(profile, work):
    """An initramfs archive with the binaries (debug info stripped), their libraries and the job."""
    root = os.path.join(work, "root")
    opt = os.path.join(root, "opt", "spool")
    os.makedirs(opt)
    libs = set()
    for b in BINS:
        src = os.path.join(REPO, "target", profile, b)
        dst = os.path.join(opt, b)
        sh("objcopy", "--strip-debug", src, dst)
        out = subprocess.run(["ldd", src], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1:
                libs.add(parts[parts.index("=>") + 1])
            elif parts and parts[0].startswith("/"):
                libs.add(parts[0])
    for lib in libs:
        if not os.path.isfile(lib):
            continue
        dst = root + lib
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(lib, dst)
    shutil.copy(os.path.join(REPO, "scripts", "guest", "nvme-job.sh"), os.path.join(opt, "job.sh"))
    os.chmod(os.path.join(opt, "job.sh"), 0o755)
    cpio = os.path.join(work, "extra.cpio")
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, text=True, check=True).stdout
    with open(cpio, "wb") as f:
        subprocess.run(["busybox", "cpio", "-o", "-H", "newc"], cwd=root, input=files.encode(),
                       stdout=f, stderr=subprocess.DEVNULL, check=True)
    base = os.path.join(CACHE, "guest", "initramfs.cpio.gz")
    combined = os.path.join(work, "initramfs.cpio.gz")
    # The kernel unpacks concatenated archives in order: the second adds /opt/spool.
    with open(combined, "wb") as out:
        with open(base, "rb") as f:
            shutil.copyfileobj(f, out)
        with open(cpio, "rb") as f, gzip.open(out, "wb", compresslevel=1) as g:
            shutil.copyfileobj(f, g)
    return combined


class Qmp:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        for _ in range(100):
            try:
                self.s.connect(path)
                break
            except OSError:
                time.sleep(0.1)
        self.f = self.s.makefile("rw")
        self.lock = threading.Lock()
        json.loads(self.f.readline())
        self.cmd("qmp_capabilities")

    def cmd(self, name, **args):
        with self.lock:
            return self._cmd(name, **args)

    def _cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r or "error" in r:
                return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", action="store_true", help="test release binaries (default: debug)")
    ap.add_argument("--no-hotremove", action="store_true", help="skip the device_del step")
    ap.add_argument("--no-smart", action="store_true", help="skip the SMART critical-warning step")
    ap.add_argument("--no-media", action="store_true", help="skip the media-error and replacement step")
    ap.add_argument("--no-hang", action="store_true", help="skip the hung-command step")
    ap.add_argument("--timeout", type=int, default=900, help="seconds before the guest is killed")
    a = ap.parse_args()
    profile = "release" if a.release else "debug"
    build(profile)
    work = tempfile.mkdtemp(prefix="spool-nvme-")
    try:
        initrd = extra_initramfs(profile, work)
        disks = []
        for i in range(3):
            p = os.path.join(work, f"nvme{i}.img")
            with open(p, "wb") as f:
                f.truncate(256 << 20)
            disks.append(p)
        qmp_path = os.path.join(work, "qmp.sock")
        append = "console=ttyS0 quiet panic=-1 intel_iommu=on iommu=pt spool.job=script"
        if not a.no_hotremove:
            append += " spool.hotremove=1"
        if not a.no_smart:
            append += " spool.smart=1"
        if not a.no_media:
            append += " spool.media=1"
        if not a.no_hang:
            append += " spool.hang=1"
        cmd = ["timeout", str(a.timeout), "qemu-system-x86_64",
               "-machine", "q35", "-accel", "tcg,thread=multi", "-smp", "2", "-m", "1G",
               "-device", "intel-iommu,intremap=on,caching-mode=on",
               "-nographic", "-no-reboot", "-nic", "none",
               "-kernel", os.path.join(CACHE, "guest", "vmlinuz"), "-initrd", initrd,
               "-append", append,
               "-qmp", f"unix:{qmp_path},server=on,wait=off"]
        # Controllers 0 and 1 hold the pool, 2 is the blank replacement. Each disk is a raw
        # node over a file node, so a blkdebug node can be switched in for media errors.
        for i, d in enumerate(disks):
            cmd += ["-blockdev", f"driver=file,node-name=f{i},filename={d},cache.no-flush=on",
                    "-blockdev", f"driver=raw,node-name=d{i},file=f{i}",
                    "-device", f"pcie-root-port,id=rp{i},chassis={i + 1},slot={i + 1}",
                    "-device", f"nvme,id=nvme{i},serial=spool{i},drive=d{i},bus=rp{i}"]
        log_path = os.path.join(CACHE, "nvme-guest.log")
        start = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
        qmp = None
        verdict = None
        with open(log_path, "w") as log:
            for line in p.stdout:
                log.write(line)
                log.flush()
                if "SPOOL-NVME:" in line or "SPOOL-E2E:" in line:
                    print(f"[{time.time() - start:6.1f}s] {line.rstrip()}", flush=True)
                m = re.search(r"SPOOL-NVME: REMOVE (nvme\d+)\s*$", line)
                if m:
                    dev = m.group(1)
                    qmp = qmp or Qmp(qmp_path)
                    r = qmp.cmd("device_del", id=dev)
                    print(f"  host: device_del {dev}: {r}", flush=True)
                m = re.search(r"SPOOL-NVME: HANG nvme(\d+)\s*$", line)
                if m:
                    # The controller's disk is throttled to 2 requests a second for 3 s, so
                    # commands sit far longer than spoold's io_timeout, the way a controller
                    # that stops answering for a while looks. (A blkdebug breakpoint cannot be
                    # used: QEMU's Delete SQ waits for the suspended request inside its main
                    # loop, and the monitor command that would resume it never runs.)
                    i = m.group(1)
                    qmp = qmp or Qmp(qmp_path)
                    r1 = qmp.cmd("object-add", **{"qom-type": "throttle-group", "id": f"tg{i}", "limits": {"iops-total": 2}})
                    r2 = qmp.cmd("blockdev-add", **{"driver": "throttle", "node-name": f"thr{i}", "throttle-group": f"tg{i}", "file": f"f{i}"})
                    r3 = qmp.cmd("blockdev-reopen", options=[{"driver": "raw", "node-name": f"d{i}", "file": f"thr{i}"}])
                    print(f"  host: nvme{i} throttled: {r1} {r2} {r3}", flush=True)

                    def unthrottle(i=i):
                        time.sleep(3)
                        r = qmp.cmd("blockdev-reopen", options=[{"driver": "raw", "node-name": f"d{i}", "file": f"f{i}"}])
                        print(f"  host: nvme{i} unthrottled: {r}", flush=True)
                    threading.Thread(target=unthrottle, daemon=True).start()
                m = re.search(r"SPOOL-NVME: MEDIA nvme(\d+)\s*$", line)
                if m:
                    # Every read of that controller's disk now fails with EIO, which QEMU's
                    # NVMe model reports as Unrecovered Read Error (SCT 2, SC 0x81).
                    i = m.group(1)
                    qmp = qmp or Qmp(qmp_path)
                    r1 = qmp.cmd("blockdev-add", **{"driver": "blkdebug", "node-name": f"dbg{i}", "image": f"f{i}",
                                                     "inject-error": [{"event": "read_aio", "errno": 5}]})
                    r2 = qmp.cmd("blockdev-reopen", options=[{"driver": "raw", "node-name": f"d{i}", "file": f"dbg{i}"}])
                    print(f"  host: media errors on nvme{i}: {r1} {r2}", flush=True)
                m = re.search(r"SPOOL-NVME: SMART (nvme\d+) (\d+)\s*$", line)
                if m:
                    dev, value = m.groups()
                    qmp = qmp or Qmp(qmp_path)
                    r = qmp.cmd("qom-set", path=f"/machine/peripheral/{dev}",
                                property="smart_critical_warning", value=int(value))
                    print(f"  host: qom-set {dev} smart_critical_warning={value}: {r}", flush=True)
                if "SPOOL-NVME: PASS" in line:
                    verdict = True
                elif "SPOOL-NVME: FAIL" in line:
                    verdict = False
        p.wait()
        elapsed = time.time() - start
        if verdict:
            print(f"test-nvme: PASS in {elapsed:.0f} s (log: {log_path})")
            return 0
        print(f"test-nvme: FAIL after {elapsed:.0f} s (qemu exit {p.returncode}); last lines of {log_path}:")
        with open(log_path) as f:
            print("".join(f.readlines()[-60:]))
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
