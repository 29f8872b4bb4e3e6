#!/usr/bin/env bash
# Instruction counts of spoold's request path under load (callgrind: repeatable where
# wall-clock time on a shared machine is not). Runs a release spoold on the null device under
# valgrind, drives it with spool-bench (4K randread QD32, polling client) for SECONDS, and
# prints the instructions per request of each stage of the worker (take, parse, dispatch,
# reap, complete) and of the whole worker loop (idle polling rounds included).
#   usage: scripts/profile-request-path.sh [SECONDS] [OUT.callgrind]
# See docs/benchmarks/request-path.md.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-8}
out=${2:-$(mktemp /tmp/spool-callgrind.XXXXXX)}
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
cargo build --release -q --bin spoold --bin spool-bench --manifest-path "$repo/Cargo.toml"
work=$(mktemp -d /dev/shm/spool-prof.XXXXXX)
pid=
cleanup() { [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
cat > "$work/spoold.toml" <<EOC
state_dir = "$work/st"
[journal]
enabled = true
dir = "$work/journal"
[io]
poll_idle_us = 1000000
[[devices]]
path = "n0"
null = "untouched"
create_size = "1G"
[[volumes]]
name = "v0"
size = "512M"
num_queues = 1
EOC
valgrind --tool=callgrind --callgrind-out-file="$out" "$repo/target/release/spoold" \
    -c "$work/spoold.toml" --no-keeper > "$work/log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do [[ -S "$work/st/vhost/v0.sock" ]] && break; sleep 0.1; done
"$repo/target/release/spool-bench" --socket "$work/st/vhost/v0.sock" --rw randread --bs 4096 \
    --iodepth 32 --poll --runtime "$secs"
kill -INT "$pid"; wait "$pid" || true; pid=
python3 - "$out" <<'EOP'
import collections, re, subprocess, sys
f = sys.argv[1]
ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", f], capture_output=True, text=True).stdout
incl = {}
for line in ann.splitlines():
    m = re.match(r"^\s*([\d,]+) \([^)]*\)\s+(\S.*?)(?: \[.*\])?$", line)
    if m:
        fn = m.group(2).split(":", 1)[-1]
        # Methods defined in a submodule are named `mod::<impl path::Type>::method`: keep
        # the type's last segment so `Type::method` matches wherever the method lives.
        fn = re.sub(r"<impl [^<>]*?(\w+)>", r"\1", fn)
        incl[fn] = max(incl.get(fn, 0), int(m.group(1).replace(",", "")))
names, calls, cur = {}, collections.Counter(), None
for line in open(f):
    m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
    if m:
        kind, i, n = m.groups()
        if n:
            names[i] = n
        if kind == "cfn":
            cur = i
    elif line.startswith("calls="):
        calls[names.get(cur, "?")] += int(line.split("=")[1].split()[0])
reqs = max((n for k, n in calls.items() if k.endswith("request::parse")), default=0)
if not reqs:
    sys.exit("no request was parsed: did the client run?")
print(f"{reqs} requests under callgrind ({f})")
for key, what in [("QueueWorker::run", "whole worker loop, idle rounds included"),
                  ("JournaledQueue::pop", "take from the avail ring + journal (all polls)"),
                  ("request::parse", "descriptor walk and validation"),
                  ("QueueWorker::dispatch", "layout, health gate, device submit"),
                  ("QueueWorker::reap", "device completions (all polls)"),
                  ("JournaledQueue::complete_batch", "journal, used ring (batches)")]:
    v = max((v for fn, v in incl.items() if fn.endswith(key)), default=0)
    print(f"  {key:28} {v / reqs:7.0f} instructions/request  ({what})")
EOP
