#!/usr/bin/env bash
# Long soak (run by hand, not in CI): a QEMU guest verifies with fio on a 2-way mirrored
# volume through EVENTS mixed events (default 300: worker SIGKILLs, upgrades, link-downs
# and transient errors on the legs' devices) with, every FAIL_EVERY events (default 100),
# the device of the leg serving the reads of the regions a kill just left in doubt failing
# for good (the leg is rebuilt on a spare; the failed device is then replaced by a fresh
# file). The copies must end identical, fio must see no error.
#   usage: scripts/soak-mirror.sh [EVENTS] [FAIL_EVERY]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build-guest.sh
SPOOL_E2E=1 SPOOL_MIRROR_EVENTS=${1:-300} SPOOL_MIRROR_FAIL_EVERY=${2:-100} \
    cargo test --release -p spool-control --test e2e_qemu vm_on_a_mirrored_volume -- --include-ignored --nocapture
