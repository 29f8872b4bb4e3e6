#!/usr/bin/env bash
# Long soak (run by hand, not in CI): a QEMU guest verifies with fio on a 2-way mirrored
# volume while spoold's worker is SIGKILLed KILLS times (default 100), half before one leg's
# device fails and half during the online rebuild that follows; the copies must end identical.
#   usage: scripts/soak-mirror.sh [KILLS]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build-guest.sh
SPOOL_E2E=1 SPOOL_MIRROR_KILLS=${1:-100} cargo test --release -p spool-control --test e2e_qemu \
    vm_on_a_mirrored_volume -- --nocapture
