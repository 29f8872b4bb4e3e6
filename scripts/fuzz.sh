#!/usr/bin/env bash
# Builds and runs the request-parser fuzz target for SECONDS (default 60).
# cargo-fuzz needs nightly features; on this stable-only machine RUSTC_BOOTSTRAP=1 enables them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p corpus/request_parser
log=$(mktemp)
if RUSTC_BOOTSTRAP=1 cargo fuzz run request_parser -- -max_total_time="$secs" -max_len=4096 \
    corpus/request_parser >"$log" 2>&1; then
    grep -E "^Done|^#[0-9]+.*DONE" "$log" | tail -1
else
    grep -E "panicked|assert|ERROR|SUMMARY" -A3 "$log" | head -40; tail -15 "$log"
    echo "fuzz: request_parser found a failure (artifact under fuzz/artifacts/)" >&2
    exit 1
fi
