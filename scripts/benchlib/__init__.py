"""The benchmark harness (issue 37): what every scripts/bench*.py shares.

- Fixtures: work directories removed on every exit path (`workdir`, `on_exit`), spoold started
  from parameters (`Spoold`, `dev`, `vol`), qemu-storage-daemon (`Qsd`), spool-bench command
  lines and their JSON (`spool_bench`, `start_bench`, `results`, `fill`), fio, `ctl`,
  `daemon_status` and `kill_worker`.
- Statistics in one place (`median`, `mean`, `pct`, `dist`, `middle`, `spread`), CPU time from
  /proc and spool-bench's completion timelines.
- One result schema: `save` writes docs/benchmarks/NAME.json as {date, machine: {cpu, cores},
  command, git, results} and NAME.md, the script's markdown under one common header line.
- Scenarios as data: `run_cases` runs a list of case dicts (`table` makes them from tuples).

The scripts run as `python3 scripts/bench-x.py`, which finds this module next to them.
"""
import argparse
import atexit
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "docs", "benchmarks")
BINS = None  # --bin-dir of the scripts that have it
HZ = os.sysconf("SC_CLK_TCK")
median, mean = statistics.median, statistics.mean
_cleanups, _page = [], {}  # what to do at exit; the result page being written


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def on_exit(f):
    """Runs `f` when the script ends however it ends (exception, exit, SIGTERM, ^C); newest first."""
    _cleanups.append(f)
    return f


@atexit.register
def _cleanup():
    while _cleanups:
        try:
            _cleanups.pop()()
        except Exception as e:  # the others still run
            log(f"cleanup: {e}")


for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, lambda n, _: sys.exit(128 + n))


def workdir(prefix="spool-bench-", base="/dev/shm"):
    """A new directory under `base` (tmpfs unless told), removed when the script ends."""
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    on_exit(lambda: shutil.rmtree(d, ignore_errors=True))
    return d


def prebuilt():
    """The binaries' directory when one was named (--bin-dir, $SPOOL_BIN_DIR or $SPOOL_TARGET_DIR),
    else None: the scripts then build target/release themselves."""
    t = os.environ.get("SPOOL_TARGET_DIR")
    return BINS or os.environ.get("SPOOL_BIN_DIR") or (os.path.join(t, "release") if t else None)


def bin_dir():
    """Where the binaries are: --bin-dir, else $SPOOL_BIN_DIR (any build's directory: CI's smoke
    runs use the debug build its tests made, target/debug), else $SPOOL_TARGET_DIR/release when set
    (a build outside the work tree, e.g. `CARGO_TARGET_DIR=/work/target-bench cargo build
    --release`), else target/release of this checkout."""
    return prebuilt() or os.path.join(REPO, "target", "release")


def binary(name):
    return os.path.join(bin_dir(), name)


def build(bins=("spoold", "spoolctl", "spool-bench")):
    """`cargo build --release` of the binaries, unless a build was named (see prebuilt), which must
    then have them."""
    flags = [x for b in bins for x in ("--bin", b)]
    if not prebuilt():
        subprocess.run(["cargo", "build", "--release", "-q", *flags], cwd=REPO, check=True)
    elif not all(os.access(binary(b), os.X_OK) for b in bins):
        sys.exit(f"{bin_dir()} lacks one of {bins}: cargo build --release {' '.join(flags)} there")


def args(doc, flags=None, quick=True, out=None):
    """The command line: the script's docstring as help, --quick, `flags` (name: add_argument's keywords),
    with `out` (the results' name) --bin-dir, --out and --summary-only; then the binaries built unless
    --summary-only (see build). A --quick run with --out writes to a temporary directory unless told."""
    global BINS
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags = dict({"--quick": dict(action="store_true", help="smoke run (CI): checks the script works, not its "
                                  "numbers")} if quick else {}, **(flags or {}))
    if out:
        flags.update({"--bin-dir": dict(help=f"where spoold and spool-bench are (default: {bin_dir()})"),
                      "--out": dict(help="results directory (default docs/benchmarks; --quick: a temporary one)"),
                      "--summary-only": dict(action="store_true", help=f"run nothing: write {out}.md again from "
                                             f"{out}.json (in --out or docs/benchmarks)")})
    for name, kw in flags.items():
        ap.add_argument(name, **kw)
    a = ap.parse_args()
    BINS = getattr(a, "bin_dir", None)
    if not getattr(a, "summary_only", False):
        build()
        if getattr(a, "quick", False) and "out" in a and not a.out:
            a.out = tempfile.mkdtemp(prefix=f"spool-{os.path.basename(sys.argv[0])[:-3]}-quick.")
    return a


def table(keys, rows):
    """Scenarios as data: tuples (one per case) to dicts of `keys`."""
    return [dict(zip(keys, r)) for r in rows]


def run_cases(cases, run, quick=False, only=None):
    """Runs `run(case)` for each case dict in order, leaving out cases with quick=False from a
    --quick run and, with `only`, cases whose name does not contain it; returns the results."""
    out = []
    for c in cases:
        if not (quick and not c.get("quick", True)) and not (only and only not in c["name"]):
            log(f"== {c['name']}")
            out.append(run(c))
    return out


def dev(path, size=None, **keys):
    """A [[devices]] entry: a file (created sparse at `size`), or with null="untouched"/"zero" a null one."""
    return dict(path=path, **({"create_size": size} if size else {}), **keys)


def vol(name, size, queues=1, **keys):
    """A [[volumes]] entry (keys: mirror, thin, encrypt, ...)."""
    return dict(name=name, size=size, num_queues=queues, **keys)


def spoold_config(dir, devices, volumes=(), journal=True, sections=None, extra="", key=None):
    """Writes DIR/spoold.toml (see Spoold) and returns its path."""
    os.makedirs(dir, exist_ok=True)
    tables = dict(sections or {})
    if key:
        with open(os.open(os.path.join(dir, "kek"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(key)
        tables["encryption"] = {"key_file": os.path.join(dir, "kek")}
    if journal is not None:
        jdir = os.path.join(dir, "journal") if dir.startswith("/dev/shm/") else workdir("spool-journal-")
        tables["journal"] = {"enabled": journal, "dir": jdir}
    lines = [f"state_dir = {json.dumps(os.path.join(dir, 'state'))}"]
    for header, keys in [(f"[{n}]", t) for n, t in tables.items()] + [("[[devices]]", d) for d in devices] + [
            ("[[volumes]]", v) for v in volumes]:
        lines += [header] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]  # JSON values are TOML ones
    with open(os.path.join(dir, "spoold.toml"), "w") as f:
        f.write("\n".join(lines) + "\n" + extra + "\n")
    return os.path.join(dir, "spoold.toml")


class Server:
    """A daemon under test: process, log, sockets (`socks`: name to path); stopped at the end if not before."""

    def start(self, cmd, what, sockets, settle=0.1):
        """Starts `cmd` (`what` in errors), waits (20 s at most) until it has made `sockets`, then `settle` s
        for it to listen."""
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        self.pid, t = self.proc.pid, time.time()
        on_exit(self.stop)
        for s in sockets:
            while not os.path.exists(s):
                if self.proc.poll() is not None or time.time() - t > 20:
                    raise RuntimeError(f"{what} exited ({self.proc.returncode}) or did not create {s}: {self.tail()}")
                time.sleep(0.01)
        time.sleep(settle)

    sockets = property(lambda self: list(self.socks.values()), doc="every volume's socket, in order")
    sock = property(lambda self: self.sockets[0], doc="the first volume's socket")

    def tail(self, n=3000):
        with open(self.log) as f:
            return f.read()[-n:]

    def stop(self):
        stop(self.proc, 30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Spoold(Server):
    """spoold in DIR (made if missing): config DIR/spoold.toml from the parameters, state in
    DIR/state, log DIR/spoold.log. `devices` and `volumes`: [[devices]] and [[volumes]] entries
    (`dev`, `vol`); `journal`: True (its files in DIR/journal, or in a tmpfs directory of its own
    when DIR is not on tmpfs), False (Spool-NoJ) or None (no [journal] section); `sections`: other
    tables ({"io": {...}, "pool": {...}}); `extra`: TOML appended as it is; `key`: a key-encryption key
    (DIR/kek); `args`: more options (--no-keeper); `cpus`: a taskset CPU list. Waits for the RPC socket
    and the volumes'."""

    def __init__(self, dir, devices, volumes=(), journal=True, sections=None, extra="", key=None, args=(), cpus=None):
        self.dir, self.rpc, self.log = dir, os.path.join(dir, "state", "spoold.sock"), os.path.join(dir, "spoold.log")
        self.config = spoold_config(dir, devices, volumes, journal, sections, extra, key)
        self.socks = {v["name"]: self.vhost(v["name"]) for v in volumes}
        self.start((["taskset", "-c", cpus] if cpus else []) + [binary("spoold"), "-c", self.config, *args], "spoold",
                   [self.rpc, *self.sockets])

    def vhost(self, volume):
        return os.path.join(self.dir, "state", "vhost", f"{volume}.sock")

    def ctl(self, *args):
        return ctl(self.rpc, *args)

    def call(self, method, **params):
        """A JSON-RPC call through `spoolctl rpc`."""
        return ctl(self.rpc, "rpc", method, json.dumps(params))

    def status(self):
        return daemon_status(self.rpc)

    def kill_worker(self):
        return kill_worker(self.rpc)


class Qsd(Server):
    """qemu-storage-daemon in DIR exporting `blockdev` (node "base") over vhost-user-blk: the whole
    node, or with `parts` [(offset, size), ...] one raw node on it and one export per part (every
    node before any export: QEMU 7.2 aborts when a raw node is added on a file node an iothread
    export already moved to its context). Sockets DIR/v{i}.sock, log DIR/qsd.log. `objects`: more
    --object values (a LUKS image's secret)."""

    def __init__(self, dir, blockdev, parts=None, iothread=False, queues=None, settle=0.1, objects=()):
        os.makedirs(dir, exist_ok=True)
        self.dir, self.log = dir, os.path.join(dir, "qsd.log")
        cmd = ["qemu-storage-daemon", *[x for o in objects for x in ("--object", o)], "--blockdev", blockdev]
        cmd += ["--object", "iothread,id=io0"] if iothread else []
        nodes = [f"v{i}" for i in range(len(parts))] if parts else ["base"]
        for node, (offset, size) in zip(nodes, parts or []):
            cmd += ["--blockdev", f"driver=raw,node-name={node},file=base,offset={offset},size={size}"]
        self.socks = {f"v{i}": os.path.join(dir, f"v{i}.sock") for i in range(len(nodes))}
        for i, (node, sock) in enumerate(zip(nodes, self.sockets)):
            if os.path.exists(sock):
                os.unlink(sock)
            cmd += ["--export", f"type=vhost-user-blk,id=e{i},node-name={node},addr.type=unix,addr.path={sock},"
                    "writable=on" + (f",num-queues={queues}" if queues else "") + (",iothread=io0" if iothread else "")]
        self.start(cmd, "qemu-storage-daemon", self.sockets, settle)


def run(cmd, timeout=600):
    """Runs `cmd`: its output and how many seconds it took; raises with its output if it failed."""
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stdout}{r.stderr}")
    return r.stdout, time.monotonic() - t


def qsd_version():
    r = subprocess.run(["qemu-storage-daemon", "--version"], capture_output=True, text=True)
    return r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else "unknown"


def stop(proc, timeout=20):
    """SIGTERM, then SIGKILL after `timeout` s."""
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ctl(sock, *args):
    """Runs `spoolctl --socket SOCK --json ARGS` and returns its JSON answer."""
    return json.loads(run([binary("spoolctl"), "--socket", sock, "--json", *args], 120)[0])


def daemon_status(sock):
    """`spoolctl status` of the spoold at `sock`, waiting up to 20 s while it does not answer."""
    for _ in range(4000):
        try:
            return ctl(sock, "status")
        except Exception:
            time.sleep(0.005)
    raise RuntimeError("daemon_status never answered")


def wait_restart(sock, pid):
    """Waits until a worker other than `pid` serves; returns the keeper's report of the restart."""
    while True:
        s = daemon_status(sock)
        if s["pid"] != pid and (s.get("last_restart") or {}).get("new_pid") == s["pid"]:
            return s["last_restart"]
        time.sleep(0.002)


def kill_worker(sock):
    """SIGKILLs spoold's worker and waits until its successor serves; returns the keeper's report."""
    pid = daemon_status(sock)["pid"]
    os.kill(pid, signal.SIGKILL)
    return wait_restart(sock, pid)


def bench_cmd(sock, cpus=None, **opts):
    """spool-bench's command line for `sock`: each option as --NAME VALUE (qd: --iodepth; True: the
    bare flag; None or False: left out), --json, under taskset when `cpus` is given."""
    cmd = (["taskset", "-c", cpus] if cpus else []) + [binary("spool-bench"), "--socket", sock, "--json"]
    for k, v in opts.items():
        if v is not None and v is not False:
            cmd += ["--" + {"qd": "iodepth"}.get(k, k).replace("_", "-")] + ([] if v is True else [str(v)])
    return cmd


def start_bench(sock, cpus=None, **opts):
    """spool-bench started in the background (`results` waits for it; killed at the end)."""
    p = subprocess.Popen(bench_cmd(sock, cpus, **opts), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_exit(lambda: p.poll() is None and p.kill())
    return p


def results(procs, what="spool-bench", timeout=900, check=True):
    """The JSON results of started spool-bench processes; raises if one failed (without `check`, only
    if it printed none: spool-bench exits 1 when requests failed)."""
    out = []
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        if p.returncode != 0 and (check or not o.strip()):
            raise RuntimeError(f"{what} failed ({p.returncode}): {e.strip()}")
        out.append(json.loads(o))
    return out


def spool_bench(sock, **opts):
    """Runs spool-bench on `sock` with `opts` (see bench_cmd) and returns its result."""
    return results([start_bench(sock, **opts)], f"spool-bench {sock} {opts}")[0]


def stall(socks, runtime, at, event=None, what="spool-bench", **opts):
    """4K random reads at QD8 on each of `socks` for `runtime` s with `event()` at `at` s: the worst
    client's slowest request in ms (the stall it saw), and what event() returned. Errors fail it."""
    procs = [start_bench(s, rw="randread", bs=4096, qd=8, runtime=runtime, **opts) for s in socks]
    time.sleep(at)
    done = event() if event else None
    res = results(procs, what, 120)
    if any(r["errors"] for r in res):
        raise RuntimeError(f"{what}: a client saw {max(r['errors'] for r in res)} errors")
    return max(r["lat_max_us"] for r in res) / 1000, done


# The A/B cases of the cost benchmarks (encryption, thin volumes, clones): spool-bench --compare.
AB_CASES = [dict(rw="randread", bs=4096, qd=32), dict(rw="randwrite", bs=4096, qd=32), dict(rw="read", bs=131072, qd=8),
            dict(rw="write", bs=131072, qd=8)]


def ab_opts(case, secs):
    """spool-bench's options for an AB_CASES case: one queue, `secs` s, 1 s warm-up (none in 1 s runs)."""
    return dict(case, queues=1, warmup=0 if secs == 1 else 1, runtime=secs)


def fill(sock, size=None, bs=1 << 20, qd=4, tries=2):
    """Every block of `sock` written once, sequentially: a read of a block never written is a hole
    the file system answers without I/O, so a partly filled volume flatters whoever was filled
    least (and a tmpfs file's page layout decides how fast it reads)."""
    for attempt in range(1, tries + 1):
        try:
            return spool_bench(sock, rw="write", bs=bs, qd=qd, fill=True, warmup=0, size=size)
        except RuntimeError as e:
            # Once seen failing in CI (2026-11-23): a second attempt tells a passing hiccup
            # from a broken backend.
            log(f"   filling {sock} failed (attempt {attempt}): {e}")
    raise RuntimeError(f"filling {sock} failed {tries} times")


def fio(path, rw, bs, qd, jobs, size, runtime):
    """Native fio with io_uring on the file `path`: {iops, lat_mean_us}, or None without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=n", f"--filename={path}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", f"--numjobs={jobs}", "--group_reporting", f"--size={size}", "--time_based",
           f"--runtime={max(1, int(runtime))}", "--output-format=json"] + (["--rwmixread=70"] if rw == "randrw" else [])
    j = json.loads(run(cmd, runtime * 3 + 60)[0])["jobs"][0]
    lat = [x["lat_ns"]["mean"] for x in (j["read"], j["write"]) if x["io_bytes"] > 0]
    return dict(iops=j["read"]["iops"] + j["write"]["iops"], lat_mean_us=mean(lat) / 1000 if lat else 0)


def pct(v, p):
    """The `p` quantile (0..1) of `v`: the value at rank int(p * n) of the sorted values."""
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def dist(v, unit="ms"):
    """n, mean, stdev, median, p90, p99 and max of `v` (keys suffixed with _UNIT); None if empty."""
    d = dict(mean=mean(v), stdev=statistics.stdev(v) if len(v) > 1 else 0.0, median=median(v), p90=pct(v, 0.9),
             p99=pct(v, 0.99), max=max(v)) if v else None
    return d and dict(n=len(v), **{f"{k}_{unit}": x for k, x in d.items()})


def middle(items, key):
    """The median item of `items` by `key` (an item, not an average)."""
    return sorted(items, key=key)[len(items) // 2]


def spread(v):
    """(max - min) / median."""
    return (max(v) - min(v)) / median(v) if median(v) else 0


def _stat(pid):
    """/proc/PID/stat's fields after the command name (ppid is [1], utime and stime [11:13])."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_tree(root):
    """`root` and its descendants' PIDs."""
    kids = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            kids.setdefault(int(_stat(p)[1]), []).append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


def cpu_s(pids):
    """utime + stime of the processes `pids` (all their threads), seconds."""
    total = 0
    for p in pids:
        try:
            total += sum(int(x) for x in _stat(p)[11:13])
        except (OSError, IndexError, ValueError):
            pass
    return total / HZ


def busy_s():
    """Busy CPU time of the whole machine (all but idle and iowait), seconds."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / HZ


def timeline(path):
    """spool-bench --timeline's CSV: (successful, failed) completions per millisecond."""
    with open(path) as f:
        rows = [line.split(",") for line in f.read().splitlines()[1:]]
    return [int(r[1]) for r in rows], [int(r[2]) for r in rows]


def rate(series, t0, t1):
    """Completions per second of a timeline series over [t0, t1) seconds."""
    a, b = int(t0 * 1000), min(int(t1 * 1000), len(series))
    return sum(series[a:b]) / max((b - a) / 1000, 1e-9)


def pyplot():
    """matplotlib.pyplot (Agg), or None when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        log("matplotlib not installed: no plots (pip install matplotlib)")


def barh(path, bars, xlabel, title, size=(9, 0.45, 1.2), marks=(), **title_kw):
    """A horizontal bar chart in PNG `path`, `bars` (label, value, colour) top down; `marks`: vertical
    lines (x, label, style); `size`: width, height per bar, height more. Nothing without matplotlib."""
    plt = pyplot()
    if not plt:
        return
    fig, ax = plt.subplots(figsize=(size[0], size[1] * len(bars) + size[2]))
    ax.barh(*zip(*[(label, value) for label, value, _ in bars]), color=[c for *_, c in bars])
    for x, label, style in marks:
        ax.axvline(x, color="black", lw=1, ls=style, label=label)
    if marks:
        ax.legend(loc="lower right", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, **title_kw)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def cpu_model():
    """The CPU's model name (results differ between the machines this runs on)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def notes(page, /, **fields):
    """The prose of a result page from notes/NAME.md, a str.format template of `fields` and
    {machine} (the run's): markdown lines."""
    with open(os.path.join(os.path.dirname(__file__), "notes", page + ".md")) as f:
        return f.read().format(**{"machine": _page["machine"], **fields}).splitlines()


def md_table(head, rows):
    """A markdown table (text): the header's cells, then each row's."""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(str(x) for x in r) + " |" for r in rows])


def _machine(doc):
    m = doc["machine"]
    return f"{m['cpu']}, {m['cores']} cores" if isinstance(m, dict) else m


def describe(doc):
    """The common header line of every result page: what was run, when, where, at which revision."""
    cmd = doc.get("command") or "scripts/" + os.path.basename(sys.argv[0])
    return f"`{cmd}`, {doc['date']} ({_machine(doc)}" + (f", git {doc['git']})." if doc.get("git") else ").")


def method():
    """How the running script measures: its docstring up to the usage lines, as markdown (each
    result page says it once, in the script's own words; indented lists become code blocks)."""
    out, fenced = [], False
    for line in (sys.modules["__main__"].__doc__ or "").split("\n    scripts/")[0].strip().splitlines():
        if line.startswith("  ") != fenced:
            out.append("```")
            fenced = not fenced
        out.append(line)
    return out + ["```"] * fenced


def write_md(doc, md, path):
    """Writes md(results) (lines, the title first) to `path`, with the header line and the method."""
    _page["machine"] = _machine(doc)
    lines = md(doc["results"])
    with open(path, "w") as f:
        f.write("\n".join([lines[0], "", describe(doc), "", *method(), *lines[1:]]).rstrip("\n") + "\n")
    return path


def save(name, results, md=None, quick=False, out=None, md_name=None):
    """The one writer of results: OUT/NAME.json, {date, machine: {cpu, cores}, command, git,
    results}, and with `md` (a function of the results returning markdown lines) OUT/MD_NAME.md
    (MD_NAME: NAME); -quick added to both names by a --quick run. Prints the markdown, or the JSON."""
    git = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True)
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=dict(cpu=cpu_model(), cores=os.cpu_count()),
               command=shlex.join(["scripts/" + os.path.basename(sys.argv[0]), *sys.argv[1:]]),
               git=git.stdout.strip() or None, results=results)
    out, suffix = out or OUT, "-quick" if quick else ""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + suffix + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    text = json.dumps(doc)
    if md:
        with open(write_md(doc, md, os.path.join(out, (md_name or name) + suffix + ".md"))) as f:
            text = f.read()
    print(text)
    log(f"results in {out}/{name}{suffix}.json" + (f" and {md_name or name}{suffix}.md" if md else ""))
    return doc


def load(name, out=None):
    """OUT/NAME.json as `save` writes it (a file from before the harness too: its keys, the results)."""
    with open(os.path.join(out or OUT, name + ".json")) as f:
        d = json.load(f)
    if isinstance(d.get("machine"), dict) and "results" in d:
        return d
    machine = d.get("machine") or f"{d.get('cpu', 'unknown CPU')}, {d.get('cores', '?')} cores"
    return dict(date=d.get("date"), machine=machine, command=None, git=None, results=d)
