#!/usr/bin/env bash
# Hot-path A/B of this checkout against an earlier revision, side by side in one run: both
# spoold binaries serve the same kind of volume (journal on, tmpfs-backed file device; and
# the null device, where the request path's software is all there is), and spool-bench's A/B
# mode keeps one client connected to both, switching every 100 ms in ABBA order, so the
# shared machine's drift hits both sides alike. Result: the median of the per-pair IOPS
# ratios (new/old) with a 95% bootstrap interval over connections (sides swapped between
# connections). The old revision is built in a git worktree with its own target directory.
# Sides: old, ctl (a second old), cur (this checkout) on tmpfs files; nold, nctl (a second
# old), ncur on the null device (names starting with n are the null-device sides). Writes docs/benchmarks/ab-REV.json
# and .md.
#   usage: scripts/bench-ab-rev.sh OLD_REV [SECONDS per case, default 24]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
old_rev=${1:?usage: scripts/bench-ab-rev.sh OLD_REV [SECONDS]}
runtime=${2:-24}
old_sha=$(git rev-parse --short "$old_rev")
new_sha=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+dirty")
tree=/work/ab-$old_sha
[[ -d $tree ]] || git worktree add -f "$tree" "$old_rev" >/dev/null
(cd "$tree" && CARGO_TARGET_DIR="$tree-target" cargo build --release -q --bin spoold)
cargo build --release -q --bin spoold --bin spool-bench
work=$(mktemp -d /dev/shm/spool-ab.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; [[ -n "${KEEP:-}" ]] || rm -rf "$work"; }
trap cleanup EXIT
sock() { echo "$work/$1/vhost/v.sock"; }
for side in old cur ctl nold ncur nctl; do
    bin=target/release/spoold
    [[ $side == old || $side == ctl || $side == nold || $side == nctl ]] && bin=$tree-target/release/spoold
    if [[ $side == n* ]]; then device="path = \"n-$side\"
null = \"untouched\""; else device="path = \"$work/$side.img\""; fi
    cat > "$work/$side.toml" <<EOC
state_dir = "$work/$side"
[journal]
enabled = true
dir = "$work/$side/journal"
[io]
poll_idle_us = 2000
[[devices]]
$device
create_size = "1G"
[[volumes]]
name = "v"
size = "512M"
num_queues = 1
EOC
    "$bin" -c "$work/$side.toml" --no-keeper >/dev/null 2>"$work/$side.log" &
    pids+=($!)
    for _ in $(seq 100); do [[ -S "$(sock $side)" ]] && break; sleep 0.05; done
    [[ -S "$(sock $side)" ]] || { echo "spoold ($side) did not start" >&2; cat "$work/$side.log" >&2; exit 1; }
    [[ $side == n* ]] || target/release/spool-bench --socket "$(sock $side)" --rw write --bs 1048576 --iodepth 4 --fill --json >/dev/null
done
out="$work/results.jsonl"
reps=8
cases=("cur old randread 32" "cur old randwrite 32" "cur old randread 1" "cur old randwrite 1"
       "ctl old randread 32" "ctl old randread 1" "ncur nold randread 32" "ncur nold randread 1"
       "nctl nold randread 32" "nctl nold randread 1")
for c in "${cases[@]}"; do
    set -- $c
    for rep in $(seq "$reps"); do
        a=$1; b=$2; (( rep % 2 == 0 )) && { a=$2; b=$1; }
        target/release/spool-bench --socket "$(sock "$a")" --compare "$(sock "$b")" --rw "$3" --iodepth "$4" \
            --poll --runtime "$(python3 -c "print(max(0.2, $runtime / $reps))")" --label "$a-$b" --json >> "$out" \
            || echo "case $a-$b $3 QD$4: spool-bench failed (left out)" >&2
    done
done
cp "$out" /tmp/ab-last.jsonl
python3 - "$out" "$repo/docs/benchmarks" "$old_sha" "$new_sha" "$runtime" <<'EOP'
import json, sys, os, random, statistics, datetime
rows = [json.loads(l) for l in open(sys.argv[1])]
outdir, old, new, runtime = sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])

def runs_of(subject, base, rw, qd):
    runs = []
    for r in rows:
        if r["rw"].lower() != rw or r["iodepth"] != qd or r["label"] not in (f"{subject}-{base}", f"{base}-{subject}"):
            continue
        flip = r["label"] == f"{base}-{subject}"
        run = [(b / a if flip else a / b) for a, b, *_ in r["slices"] if min(a, b) > 0]
        if run:
            runs.append(run)
    return runs

def med_ci(runs, n=2000):
    rnd = random.Random(7)
    meds = sorted(statistics.median([x for run in rnd.choices(runs, k=len(runs)) for x in run]) for _ in range(n))
    return statistics.median([x for run in runs for x in run]), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]

res = []
for subject, base, dev in (("cur", "old", "tmpfs file, journal on"), ("ctl", "old", "control: old against old"), ("ncur", "nold", "null device, journal on"), ("nctl", "nold", "control: null, old against old")):
    for rw in ("randread", "randwrite"):
        for qd in (32, 1):
            runs = runs_of(subject, base, rw, qd)
            if not runs:
                continue
            m, lo, hi = med_ci(runs)
            res.append(dict(device=dev, rw=rw, iodepth=qd, pairs=sum(map(len, runs)), connections=len(runs),
                            change_pct=round(100 * (m - 1), 2), ci_pct=[round(100 * (lo - 1), 2), round(100 * (hi - 1), 2)]))
os.makedirs(outdir, exist_ok=True)
doc = dict(date=datetime.date.today().isoformat(), old=old, new=new, runtime_s=runtime, results=res)
json.dump(doc, open(f"{outdir}/ab-{old}.json", "w"), indent=1)
with open(f"{outdir}/ab-{old}.md", "w") as f:
    f.write(f"# Hot path A/B: {new} against {old}\n\n")
    f.write(f"Measured {doc['date']} by `scripts/bench-ab-rev.sh {old} {runtime:g}` on this 2-core machine: both\n")
    f.write("binaries serve one volume (1 queue, journal on) side by side; one libblkio client switches between\n")
    f.write("them every 100 ms in ABBA order over 8 connections per case, sides swapped between connections.\n")
    f.write("IOPS change of the new binary: median of per-pair ratios, 95% bootstrap interval over connections.\n")
    f.write("The control row measures the old binary against a second copy of itself: what the instrument\n")
    f.write("reads when there is no difference.\n\n")
    f.write("| device | workload | QD | IOPS change | 95% interval | pairs |\n|---|---|---|---|---|---|\n")
    for r in res:
        f.write(f"| {r['device']} | 4 KiB {r['rw']} | {r['iodepth']} | {r['change_pct']:+.2f}% | {r['ci_pct'][0]:+.2f}% .. {r['ci_pct'][1]:+.2f}% | {r['pairs']} |\n")
for r in res:
    print(f"{r['device']:26} {r['rw']:9} QD{r['iodepth']:<3} {r['change_pct']:+6.2f}%  [{r['ci_pct'][0]:+.2f}, {r['ci_pct'][1]:+.2f}]")
EOP
