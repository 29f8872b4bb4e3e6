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

import json
import os
import random
import signal
import subprocess
import time

import benchlib as b
from benchlib import REPO, Spoold, dev, log, median, pct, vol

CACHE = os.environ.get("SPOOL_CACHE", os.path.join(REPO, ".cache"))
GUEST = "PASS, 0 fio errors, no reconnect"


def config(d):
    """spoold's configuration (as keyword arguments of Spoold) for one run in D."""
    return dict(devices=[dev(f"{d}/d0.img", "128M")], volumes=[vol("vm", "96M", 2)],
                sections={"io": {"poll_idle_us": 20}})


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
    b.on_exit(lambda: vm.poll() is None and vm.kill())
    con = os.path.join(d, "console")
    deadline = time.time() + 240
    while "SPOOL-E2E: disk" not in open(con).read():
        if time.time() > deadline or vm.poll() is not None:
            raise RuntimeError(f"guest did not start:\n{open(con).read()}")
        time.sleep(0.1)
    return vm, con


def under_guest(d, what, kills, seed, spacing, kill, log_path):
    """The guest's verifying job while `kill()` runs `kills` times at random moments `spacing` to
    `spacing` + 0.5 s apart; the guest must pass and QEMU never reconnect. Returns what kill() did."""
    vm, con = start_guest(d, 30 + kills * round(spacing + 0.5))  # 30 s more than the kills can take
    rng = random.Random(seed)
    out = []
    for k in range(kills):
        time.sleep(spacing + rng.random() * 0.5)
        out.append(kill())
        if vm.poll() is not None:
            raise RuntimeError(f"{what}: guest exited early after {k} kills")
    vm.wait()
    with open(con) as f, open(log_path) as g:
        text, slog = f.read(), g.read()
    if "SPOOL-E2E: PASS" not in text:
        raise RuntimeError(f"{what}: the guest's fio failed:\n{text[-3000:]}")
    if slog.count("frontend connected") != 1:
        raise RuntimeError(f"{what}: QEMU reconnected")
    return out


def run_systemd(kills, seed):
    d = b.workdir("spool-tail-systemd-", "/tmp")
    cfg = b.spoold_config(d, **config(d))
    for sub in ("run/system", "xdg", "config/systemd/user"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    os.chmod(os.path.join(d, "xdg"), 0o700)
    unit = []
    for line in open(os.path.join(REPO, "contrib", "spoold.service")):
        if line.startswith("ExecStart="):
            line = f"ExecStart={b.binary('spoold')} --config {cfg}\n"
        elif line.startswith("StartLimitBurst="):
            line = "StartLimitBurst=1000\n"
        unit.append(line)
        if line.strip() == "[Service]":
            unit.append(f"StandardError=append:{d}/spoold.log\n")
    with open(os.path.join(d, "config/systemd/user/spoold-bench.service"), "w") as f:
        f.write("".join(unit))
    env = dict(os.environ, XDG_RUNTIME_DIR=f"{d}/xdg", XDG_CONFIG_HOME=f"{d}/config")
    os.makedirs("/run/systemd", exist_ok=True)
    mgr = subprocess.Popen(["unshare", "-m", "sh", "-c",
                            f"mount --bind {d}/run /run/systemd && exec /lib/systemd/systemd --user"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sc = lambda *a: subprocess.run(["systemctl", "--user", *a], env=env, capture_output=True,  # noqa: E731
                                   text=True)
    b.on_exit(lambda: (sc("stop", "spoold-bench.service"), mgr.kill(), mgr.wait()))
    for _ in range(300):
        if sc("show-environment").returncode == 0:
            break
        time.sleep(0.05)
    r = sc("start", "spoold-bench.service")
    if r.returncode != 0:
        raise RuntimeError(f"systemctl start: {r.stderr}")
    rpc = f"{d}/state/spoold.sock"

    def kill():
        keeper = rpc_status(rpc)["keeper"]["pid"]
        t0 = time.monotonic()
        os.kill(keeper, signal.SIGKILL)
        while True:
            s = rpc_status(rpc)
            if s and s["keeper"]["pid"] != keeper and (s.get("last_restart") or {}).get("kind") == "keeper-restart":
                return (time.monotonic() - t0) * 1e3, s["last_restart"]["stall_ms"]
            time.sleep(0.001)
    walls, reported = zip(*under_guest(d, "systemd", kills, seed, 1.5, kill, f"{d}/spoold.log"))
    return {"kills": kills, "seed": seed, "guest": GUEST, "wall": b.dist(walls), "spoold": b.dist(reported),
            "walls_ms": walls}


def md_systemd(r):
    w, s = r["wall"], r["spoold"]
    return b.notes("restart-systemd", seed=r["seed"], table=b.md_table(
        ["kills", "wall median", "p90", "p99", "max", "spoold median", "spoold max", "guest"],
        [[r["kills"]] + [f"{w[k]:.1f} ms" for k in ("median_ms", "p90_ms", "p99_ms", "max_ms")]
         + [f"{s['median_ms']:.1f} ms", f"{s['max_ms']:.1f} ms", r["guest"]]]))


def run(mode, kills, seed):
    d = b.workdir(f"spool-tail-{mode}-", "/tmp")
    sp = Spoold(d, **config(d), args=["--no-standby"] if mode == "spawn" else [])
    sp.status()
    reports = [{"stall_ms": r["stall_ms"], "phases": {p["name"]: p["ms"] for p in r["phases"]}}
               for r in under_guest(d, mode, kills, seed, 0.3, sp.kill_worker, sp.log)]
    sp.stop()
    stalls = [r["stall_ms"] for r in reports]
    first = "wake standby" if mode == "standby" else "spawn worker"
    firsts = [r["phases"].get(first, r["phases"].get("spawn worker", 0.0)) for r in reports]
    res = dict(mode=mode, kills=kills, guest=GUEST, **{k: v for k, v in b.dist(stalls).items() if k != "n"},
               first_phase=first, first_phase_median_ms=median(firsts), first_phase_p99_ms=pct(firsts, 0.99),
               standby_used=sum(1 for r in reports if "wake standby" in r["phases"]), stalls_ms=stalls)
    log(f"{mode}: {kills} kills: median {res['median_ms']:.1f} ms, p99 {res['p99_ms']:.1f}, max {res['max_ms']:.1f}")
    return res


def md(r):
    names = {"spawn": "spawn a worker at the death (`--no-standby`, before)",
             "standby": "standby worker handed the store (default, after)"}
    return b.notes("restart-tail", seed=r["seed"], standby_used=r["modes"][1]["standby_used"],
                   kills=r["modes"][1]["kills"], table=b.md_table(
        ["mode", "kills", "median", "p90", "p99", "max", "process start phase (median / p99)", "guest"], [
        [names[x["mode"]], x["kills"]] + [f"{x[k]:.1f} ms" for k in ("median_ms", "p90_ms", "p99_ms", "max_ms")]
        + [f"{x['first_phase']}: {x['first_phase_median_ms']:.2f} / {x['first_phase_p99_ms']:.2f} ms", x["guest"]]
        for x in r["modes"]]))


def main():
    a = b.args(__doc__, {"--kills": dict(type=int, default=110), "--seed": dict(type=int, default=int(time.time())),
                         "--systemd": dict(action="store_true", help="kill the keeper under systemd")}, quick=False)
    if a.systemd:
        return b.save("restart-systemd", run_systemd(a.kills, a.seed), md_systemd)
    modes = b.run_cases(b.table(("name",), [("spawn",), ("standby",)]), lambda c: run(c["name"], a.kills, a.seed))
    b.save("restart-tail", {"seed": a.seed, "modes": modes}, md)


if __name__ == "__main__":
    main()
