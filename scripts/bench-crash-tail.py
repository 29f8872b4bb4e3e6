#!/usr/bin/env python3
"""Crash-restart tail (issue 19): the distribution of the stall of a worker SIGKILL restart
under a real guest's verifying load, with and without the keeper's standby worker, side by
side in one invocation.

For each mode, spoold (release build, with its keeper) serves one volume to a QEMU guest (TCG)
running the `killtest` fio job (random writes at two depths and sizes, crc32c-verified).
The worker is SIGKILLed N times at random moments 300-800 ms apart; after each kill the
keeper's restart report (`daemon_status.last_restart`: from the death to the new worker
serving, with its phases) is read back. The guest must pass (zero fio errors) and QEMU must
never reconnect, or the run fails.

    scripts/bench-crash-tail.py            # 110 kills per mode (about 5 minutes here)
    scripts/bench-crash-tail.py --kills 20
    scripts/bench-crash-tail.py --systemd  # the keeper itself SIGKILLed under systemd
Results: docs/benchmarks/restart-tail.{json,md} (--systemd: restart-systemd.{json,md}). Run by
hand: too long for CI.

With --systemd, spoold runs as contrib/spoold.service (binary and config of this run, a start
limit that allows the kills) under a private `systemd --user` in its own mount namespace, and
the keeper (the unit's main process) is SIGKILLed 1.5-2 s apart: its worker dies with it,
systemd restarts the service and hands back its descriptor store. The stall is measured from
the SIGKILL to the new worker answering `daemon_status` over a socket held open by this
script's own JSON-RPC client (no process started per poll).
"""

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BIN, OUT, REPO, ctl, daemon_status, kill_worker, log  # noqa: E402

CACHE = os.environ.get("SPOOL_CACHE", os.path.join(REPO, ".cache"))
CONFIG = """state_dir = "{d}/state"
[journal]
dir = "/dev/shm/spool-tail-{mode}"
[io]
poll_idle_us = 20
[[devices]]
path = "{d}/d0.img"
create_size = "128M"
[[volumes]]
name = "vm"
size = "96M"
num_queues = 2
"""


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * p))]


def rpc_status(path):
    """daemon_status over the RPC socket, or None while nobody answers."""
    import socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(2)
            c.connect(path)
            c.sendall(b'{"jsonrpc":"2.0","id":1,"method":"daemon_status"}\n')
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = c.recv(65536)
                if not chunk:
                    return None
                buf += chunk
            return json.loads(buf).get("result")
    except OSError:
        return None


def start_guest(d, runtime):
    g = os.path.join(CACHE, "guest")
    console = open(os.path.join(d, "console"), "w")
    vm = subprocess.Popen(
        ["timeout", str(runtime + 300), "qemu-system-x86_64", "-machine", "q35",
         "-accel", "tcg,thread=multi", "-smp", "2", "-m", "512M", "-nographic", "-no-reboot",
         "-nic", "none", "-object", "memory-backend-memfd,id=mem,size=512M,share=on",
         "-numa", "node,memdev=mem", "-kernel", os.path.join(g, "vmlinuz"),
         "-initrd", os.path.join(g, "initramfs.cpio.gz"),
         "-append", f"console=ttyS0 quiet panic=-1 spool.job=killtest spool.runtime={runtime}",
         "-chardev", f"socket,id=c0,path={d}/state/vhost/vm.sock,reconnect=1",
         "-device", "vhost-user-blk-pci,chardev=c0,num-queues=2"],
        stdout=console, stderr=subprocess.DEVNULL)
    con = os.path.join(d, "console")
    deadline = time.time() + 240
    while "SPOOL-E2E: disk" not in open(con).read():
        if time.time() > deadline or vm.poll() is not None:
            raise RuntimeError(f"guest did not start:\n{open(con).read()}")
        time.sleep(0.1)
    return vm, con


def run_systemd(kills, seed):
    d = tempfile.mkdtemp(prefix="spool-tail-systemd-")
    cfg = os.path.join(d, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(CONFIG.format(d=d, mode="systemd"))
    for sub in ("run/system", "xdg", "config/systemd/user"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    os.chmod(os.path.join(d, "xdg"), 0o700)
    unit = []
    for line in open(os.path.join(REPO, "contrib", "spoold.service")):
        if line.startswith("ExecStart="):
            line = f"ExecStart={BIN}/spoold --config {cfg}\n"
        elif line.startswith("StartLimitBurst="):
            line = "StartLimitBurst=1000\n"
        unit.append(line)
        if line.strip() == "[Service]":
            unit.append(f"StandardError=append:{d}/spoold.log\n")
    open(os.path.join(d, "config/systemd/user/spoold-bench.service"), "w").write("".join(unit))
    env = dict(os.environ, XDG_RUNTIME_DIR=f"{d}/xdg", XDG_CONFIG_HOME=f"{d}/config")
    os.makedirs("/run/systemd", exist_ok=True)
    mgr = subprocess.Popen(["unshare", "-m", "sh", "-c",
                            f"mount --bind {d}/run /run/systemd && exec /lib/systemd/systemd --user"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sc = lambda *a: subprocess.run(["systemctl", "--user", *a], env=env, capture_output=True,
                                   text=True)
    try:
        for _ in range(300):
            if sc("show-environment").returncode == 0:
                break
            time.sleep(0.05)
        r = sc("start", "spoold-bench.service")
        if r.returncode != 0:
            raise RuntimeError(f"systemctl start: {r.stderr}")
        rpc = f"{d}/state/spoold.sock"
        vm, con = start_guest(d, 30 + kills * 2)
        rng = random.Random(seed)
        walls, reported = [], []
        for k in range(kills):
            time.sleep(1.5 + rng.random() * 0.5)
            keeper = rpc_status(rpc)["keeper"]["pid"]
            t0 = time.monotonic()
            os.kill(keeper, signal.SIGKILL)
            while True:
                s = rpc_status(rpc)
                if s and s["keeper"]["pid"] != keeper and (s.get("last_restart") or {}).get("kind") == "keeper-restart":
                    break
                time.sleep(0.001)
            walls.append((time.monotonic() - t0) * 1e3)
            reported.append(s["last_restart"]["stall_ms"])
            if vm.poll() is not None:
                raise RuntimeError(f"guest exited early after {k} kills")
        vm.wait()
        text = open(con).read()
        slog = open(f"{d}/spoold.log").read()
        if "SPOOL-E2E: PASS" not in text:
            raise RuntimeError(f"the guest's fio failed:\n{text[-3000:]}")
        if slog.count("frontend connected") != 1:
            raise RuntimeError("QEMU reconnected")
        return {"kills": kills, "guest": "PASS, 0 fio errors, no reconnect",
                "wall_median_ms": statistics.median(walls), "wall_p90_ms": pct(walls, 0.9),
                "wall_p99_ms": pct(walls, 0.99), "wall_max_ms": max(walls),
                "spoold_median_ms": statistics.median(reported),
                "spoold_max_ms": max(reported), "walls_ms": walls}
    finally:
        sc("stop", "spoold-bench.service")
        mgr.kill()
        mgr.wait()


def write_systemd(r, seed):
    with open(os.path.join(OUT, "restart-systemd.json"), "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "seed": seed, **r}, f, indent=1)
    with open(os.path.join(OUT, "restart-systemd.md"), "w") as f:
        f.write("# The keeper SIGKILLed under systemd\n\n")
        f.write(f"`scripts/bench-crash-tail.py --systemd --kills {r['kills']}` "
                f"({datetime.date.today()}, seed {seed}), 2-core host, release build, "
                "contrib/spoold.service under systemd 252 (`systemd --user`). A QEMU guest "
                "(TCG) runs the verifying `killtest` fio job; the keeper is SIGKILLed 1.5-2 s "
                "apart and systemd restarts the service with its descriptor store. Wall: from "
                "the SIGKILL to the new worker answering `daemon_status` (systemd noticing "
                "the death, starting spoold, spoold serving). spoold: its own report, from "
                "the new keeper's start to serving.\n\n")
        f.write("| kills | wall median | p90 | p99 | max | spoold median | spoold max | guest |\n")
        f.write("|---|---|---|---|---|---|---|---|\n")
        f.write(f"| {r['kills']} | {r['wall_median_ms']:.1f} ms | {r['wall_p90_ms']:.1f} ms | "
                f"{r['wall_p99_ms']:.1f} ms | {r['wall_max_ms']:.1f} ms | "
                f"{r['spoold_median_ms']:.1f} ms | {r['spoold_max_ms']:.1f} ms | {r['guest']} |\n")


def run(mode, kills, seed):
    d = tempfile.mkdtemp(prefix=f"spool-tail-{mode}-")
    cfg = os.path.join(d, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(CONFIG.format(d=d, mode=mode))
    args = [os.path.join(BIN, "spoold"), "--config", cfg]
    if mode == "spawn":
        args.append("--no-standby")
    spoold_log = open(os.path.join(d, "spoold.log"), "w")
    sp = subprocess.Popen(args, stderr=spoold_log, stdout=subprocess.DEVNULL)
    sock = os.path.join(d, "state", "spoold.sock")
    daemon_status(sock)
    vm, con = start_guest(d, 30 + kills)
    rng = random.Random(seed)
    reports = []
    for k in range(kills):
        time.sleep(0.3 + rng.random() * 0.5)
        r = kill_worker(sock)
        reports.append({"stall_ms": r["stall_ms"],
                        "phases": {p["name"]: p["ms"] for p in r["phases"]}})
        if vm.poll() is not None:
            raise RuntimeError(f"{mode}: guest exited early after {k} kills")
    vm.wait()
    text = open(con).read()
    spoold_log.flush()
    slog = open(os.path.join(d, "spoold.log")).read()
    sp.send_signal(signal.SIGTERM)
    sp.wait(timeout=60)
    if "SPOOL-E2E: PASS" not in text:
        raise RuntimeError(f"{mode}: the guest's fio failed:\n{text[-3000:]}")
    if slog.count("frontend connected") != 1:
        raise RuntimeError(f"{mode}: QEMU reconnected")
    stalls = [r["stall_ms"] for r in reports]
    first = "wake standby" if mode == "standby" else "spawn worker"
    firsts = [r["phases"].get(first, r["phases"].get("spawn worker", 0.0)) for r in reports]
    res = {"mode": mode, "kills": kills, "guest": "PASS, 0 fio errors, no reconnect",
           "median_ms": statistics.median(stalls), "p90_ms": pct(stalls, 0.9),
           "p99_ms": pct(stalls, 0.99), "max_ms": max(stalls),
           "first_phase": first, "first_phase_median_ms": statistics.median(firsts),
           "first_phase_p99_ms": pct(firsts, 0.99),
           "standby_used": sum(1 for r in reports if "wake standby" in r["phases"]),
           "stalls_ms": stalls}
    log(f"{mode}: {kills} kills: median {res['median_ms']:.1f} ms, p90 {res['p90_ms']:.1f}, "
        f"p99 {res['p99_ms']:.1f}, max {res['max_ms']:.1f}; {first} median "
        f"{res['first_phase_median_ms']:.2f} ms, p99 {res['first_phase_p99_ms']:.2f}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=110)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--systemd", action="store_true", help="kill the keeper under systemd")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "--bin", "spoold", "--bin", "spoolctl"],
                   cwd=REPO, check=True)
    if a.systemd:
        r = run_systemd(a.kills, a.seed)
        log(f"systemd: {a.kills} keeper kills: wall median {r['wall_median_ms']:.1f} ms, p90 "
            f"{r['wall_p90_ms']:.1f}, p99 {r['wall_p99_ms']:.1f}, max {r['wall_max_ms']:.1f}; "
            f"spoold median {r['spoold_median_ms']:.1f}")
        write_systemd(r, a.seed)
        return
    res = [run(m, a.kills, a.seed) for m in ("spawn", "standby")]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "restart-tail.json"), "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "seed": a.seed, "results": res},
                  f, indent=1)
    with open(os.path.join(OUT, "restart-tail.md"), "w") as f:
        f.write("# Crash-restart tail under a guest's load\n\n")
        f.write(f"`scripts/bench-crash-tail.py --kills {a.kills}` ({datetime.date.today()}, "
                f"seed {a.seed}), 2-core host, release build. A QEMU guest (TCG) runs the "
                "verifying `killtest` fio job on a 2-queue volume while the worker is "
                "SIGKILLed at random moments 300-800 ms apart. Stall: the keeper's restart "
                "report, from the worker's death to the new worker serving. Both modes ran "
                "in this one invocation, one after the other.\n\n")
        f.write("| mode | kills | median | p90 | p99 | max | process start phase (median / p99) | guest |\n")
        f.write("|---|---|---|---|---|---|---|---|\n")
        for r in res:
            name = ("spawn a worker at the death (`--no-standby`, before)" if r["mode"] == "spawn"
                    else "standby worker handed the store (default, after)")
            f.write(f"| {name} | {r['kills']} | {r['median_ms']:.1f} ms | {r['p90_ms']:.1f} ms | "
                    f"{r['p99_ms']:.1f} ms | {r['max_ms']:.1f} ms | {r['first_phase']}: "
                    f"{r['first_phase_median_ms']:.2f} / {r['first_phase_p99_ms']:.2f} ms | "
                    f"{r['guest']} |\n")
        f.write("\nThe standby was ready at every kill it was used for "
                f"({res[1]['standby_used']} of {res[1]['kills']}); a kill that comes before "
                "the next standby has started falls back to spawning.\n")


if __name__ == "__main__":
    main()
