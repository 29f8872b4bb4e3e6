#!/usr/bin/env bash
# Long soak (run by hand, not in CI): SIGKILL spoold N times (default 1000) under a verifying
# QEMU guest workload. Prints the seed; replay a failure with SPOOL_SEED=... .
#   usage: scripts/soak-kill.sh [KILLS]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build-guest.sh
SPOOL_E2E=1 SPOOL_KILLS=${1:-1000} cargo test --release -p spool-control --test e2e_qemu \
    vm_survives_spoold_sigkill_under_load -- --include-ignored --nocapture
