#!/usr/bin/env bash
# Builds every fuzz target (AddressSanitizer, cargo fuzz's default) and, for each in turn:
#   1. replays fuzz/regressions/<target>/* (every crash ever found; must all pass now),
#   2. fuzzes it for SECONDS (default 60), growing the corpus in fuzz/corpus/<target>.
# A crash, leak, timeout or out-of-memory found is copied to fuzz/regressions/<target>/ (keep
# it: it becomes a regression input) and the script fails after the remaining targets ran.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# cargo-fuzz needs nightly features; on this stable-only machine RUSTC_BOOTSTRAP=1 enables them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
shift || true
all=(request_parser pool_metadata journal keeper_proto vhost_session nbd_server nbd_client thin_map)
if [ $# -gt 0 ]; then targets=("$@"); else targets=("${all[@]}"); fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
start=$(date +%s)
# A target that does not build must fail the run, never fuzz a stale binary of an earlier
# build; the full compiler output is shown then.
if ! cargo fuzz build > /tmp/spool-fuzz-build.log 2>&1; then
    cat /tmp/spool-fuzz-build.log >&2
    echo "fuzz: build failed" >&2
    exit 1
fi
grep -E "^(error|warning: unused)|Finished" /tmp/spool-fuzz-build.log || true
bin_dir=target/x86_64-unknown-linux-gnu/release
echo "fuzz: build took $(( $(date +%s) - start ))s"

# Per-target libFuzzer options: input size bounds and the per-input time limit (the session
# target runs a whole server per input; a hang there is a finding, not slowness).
opts() {
    case $1 in
        vhost_session) echo "-max_len=2048 -len_control=0 -timeout=20" ;;
        keeper_proto) echo "-max_len=8192 -timeout=10" ;;
        *) echo "-max_len=4096 -timeout=10" ;;
    esac
}

failed=()
for t in "${targets[@]}"; do
    [ -x "$bin_dir/$t" ] || { echo "fuzz: no binary for $t" >&2; failed+=("$t"); continue; }
    mkdir -p "corpus/$t" "artifacts/$t"
    log=$(mktemp)
    # 1. Regressions: every input that ever crashed must pass.
    if compgen -G "regressions/$t/*" >/dev/null; then
        # shellcheck disable=SC2046
        if ! "$bin_dir/$t" $(opts "$t") -runs=1 regressions/"$t"/* >"$log" 2>&1; then
            grep -E "panicked|ERROR|SUMMARY|Running:" -A2 "$log" | tail -30
            echo "fuzz: $t fails on a kept regression input (fuzz/regressions/$t/)" >&2
            failed+=("$t")
            rm -f "$log"
            continue
        fi
        echo "fuzz: $t: $(ls regressions/"$t" | wc -l) regression inputs pass"
    fi
    # 2. Fuzz.
    # shellcheck disable=SC2046
    if "$bin_dir/$t" $(opts "$t") -max_total_time="$secs" -print_final_stats=1 \
        -artifact_prefix="artifacts/$t/" "corpus/$t" >"$log" 2>&1; then
        echo "fuzz: $t: $(grep -E "^#[0-9]+" "$log" | tail -1 | sed -E 's/^(#[0-9]+)[[:space:]]+[A-Z]+[[:space:]]+/\1 /')"
    else
        grep -E "panicked|ERROR|SUMMARY|leaked|==[0-9]+==" -A3 "$log" | head -40
        tail -5 "$log"
        mkdir -p "regressions/$t"
        for a in artifacts/"$t"/*; do
            [ -e "$a" ] || continue
            cp "$a" "regressions/$t/"
            echo "fuzz: $t: kept $(basename "$a") as fuzz/regressions/$t/$(basename "$a")" >&2
        done
        rm -f artifacts/"$t"/*
        failed+=("$t")
    fi
    rm -f "$log"
done
echo "fuzz: total $(( $(date +%s) - start ))s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: failures in: ${failed[*]}" >&2
    exit 1
fi
