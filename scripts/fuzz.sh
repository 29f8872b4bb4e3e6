#!/usr/bin/env bash
# Builds and runs the request-parser fuzz target for SECONDS (default 60).
# cargo-fuzz needs nightly features; on this stable-only machine RUSTC_BOOTSTRAP=1 enables them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
mkdir -p corpus/request_parser
RUSTC_BOOTSTRAP=1 cargo fuzz run request_parser -- -max_total_time="$secs" -max_len=4096 corpus/request_parser
