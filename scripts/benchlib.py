"""What the benchmark scripts share: paths, logging, spoolctl calls, starting spoold and
running spool-bench."""
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, "target", "release")
OUT = os.path.join(REPO, "docs", "benchmarks")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def ctl(sock, *args):
    """Runs `spoolctl --socket SOCK --json ARGS` and returns its JSON answer."""
    r = subprocess.run([os.path.join(bin_dir(), "spoolctl"), "--socket", sock, "--json", *args],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"spoolctl {' '.join(args)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def daemon_status(sock):
    """`spoolctl status` of the spoold whose RPC socket is `sock`, waiting (up to 20 s) while
    it does not answer (a worker restarting)."""
    for _ in range(4000):
        try:
            return ctl(sock, "status")
        except Exception:
            time.sleep(0.005)
    raise RuntimeError("daemon_status never answered")


def kill_worker(sock):
    """SIGKILLs spoold's worker and waits until its successor serves; returns the keeper's
    report of that restart (stall and phases)."""
    import signal
    pid = daemon_status(sock)["pid"]
    os.kill(pid, signal.SIGKILL)
    while True:
        s = daemon_status(sock)
        r = s.get("last_restart") or {}
        if s["pid"] != pid and r.get("new_pid") == s["pid"]:
            return r
        time.sleep(0.002)


def wait_socket(path, proc, what, timeout=20, settle=0.1):
    """Waits until `proc` (named `what` in errors) has created the socket `path`, then `settle`
    seconds more (for it to start listening)."""
    t = time.time()
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.returncode}")
        if time.time() - t > timeout:
            raise RuntimeError(f"{what} did not create {path}")
        time.sleep(0.01)
    time.sleep(settle)


def bin_dir():
    """Where the release binaries are: $SPOOL_TARGET_DIR/release when set (a build outside the
    work tree, e.g. `CARGO_TARGET_DIR=/work/target-bench cargo build --release`), else
    target/release of this checkout (BIN)."""
    t = os.environ.get("SPOOL_TARGET_DIR")
    return os.path.join(t, "release") if t else BIN


def cpu_model():
    """The CPU's model name (results differ between the machines this runs on)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run_spoold(work, config, volumes):
    """Writes `config` to WORK/spoold.toml, starts spoold on it (log in WORK/spoold.log) and
    waits for the sockets of `volumes` (state_dir WORK/state); returns (process, sockets)."""
    cfg = os.path.join(work, "spoold.toml")
    with open(cfg, "w") as f:
        f.write(config)
    log_f = open(os.path.join(work, "spoold.log"), "w")
    p = subprocess.Popen([os.path.join(bin_dir(), "spoold"), "-c", cfg],
                         stdout=log_f, stderr=subprocess.STDOUT)
    socks = {v: os.path.join(work, "state", "vhost", f"{v}.sock") for v in volumes}
    for s in socks.values():
        wait_socket(s, p, "spoold")
    return p, socks


def spool_bench(args):
    """Runs `spool-bench ARGS --json` and returns its result; exits on failure."""
    out = subprocess.run([os.path.join(bin_dir(), "spool-bench"), *args, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"spool-bench {' '.join(args)} failed: {out.stderr}")
    return json.loads(out.stdout)


def save(name, result, md_lines):
    """Writes a benchmark's result to docs/benchmarks/NAME.json and its table and notes
    (`md_lines`) to NAME.md."""
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(OUT, f"{name}.md"), "w") as f:
        f.write("\n".join(md_lines))
