"""What the benchmark scripts share: paths, logging and spoolctl calls."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, "target", "release")
OUT = os.path.join(REPO, "docs", "benchmarks")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def ctl(sock, *args):
    """Runs `spoolctl --socket SOCK --json ARGS` and returns its JSON answer."""
    r = subprocess.run([os.path.join(BIN, "spoolctl"), "--socket", sock, "--json", *args],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"spoolctl {' '.join(args)}: {r.stderr.strip()}")
    return json.loads(r.stdout)
