#!/usr/bin/env bash
# Torture by hand (docs/torture.md): fresh seeds from the clock for a while, tier 1 (the
# in-process tester, release build) and tier 2 (the real daemon and libblkio client), then a
# count of cases, failures and the work done per volume kind. Every case prints its seed,
# so a failure is replayed with `spool-torture --seed N --runs 1` (tier 1) or
# `SPOOL_TORTURE_DAEMON_SEEDS=N cargo test -p spool-control --test torture_daemon` (tier 2).
#
#   scripts/torture.sh --hours 2            # both tiers, half the time each
#   scripts/torture.sh --minutes 10 --tier 1
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=10
tier=both
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hours) minutes=$(( $2 * 60 )); shift 2 ;;
        --minutes) minutes=$2; shift 2 ;;
        --tier) tier=$2; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "torture.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$tier" in
    1|2) each=$minutes ;;
    both) each=$(( (minutes + 1) / 2 )) ;;
    *) echo "torture.sh: --tier is 1, 2 or both" >&2; exit 2 ;;
esac
logs=$(mktemp -d)
status=0

if [[ "$tier" != 2 ]]; then
    echo "== tier 1 for $each min (logs: $logs/tier1.log)"
    cargo build --release -q -p spool-torture
    target/release/spool-torture --minutes "$each" --runs 100000000 --keep-going \
        > "$logs/tier1.log" 2>&1 || status=1
    # "seed N: KIND of ... : ok (R requests, ..." per case.
    awk '/^seed [0-9]+: / {
            kind = $3; n[kind]++
            if ($0 ~ /: FAILED/) { f[kind]++ }
            for (i = 1; i < NF; i++) if ($(i+1) ~ /^requests/) { v = $i; gsub(/[^0-9]/, "", v); r[kind] += v }
        }
        END { for (k in n) printf "  %-18s %6d cases %4d failed %9d requests\n", k, n[k], f[k], r[k] }' \
        "$logs/tier1.log" | sort
    grep -E "FAILED" "$logs/tier1.log" | head -20 || true
fi

if [[ "$tier" != 1 ]]; then
    echo "== tier 2 for $each min (logs: $logs/tier2.log)"
    SPOOL_TORTURE_DAEMON_MINUTES=$each cargo test -q -p spool-control --test torture_daemon \
        -- --nocapture > "$logs/tier2.log" 2>&1 || status=1
    # "seed N: Kind, B bytes, Q queue(s): R requests, K worker kills, U upgrades, ..." per case.
    awk '/^seed [0-9]+: [A-Za-z]+, / {
            kind = $3; sub(",", "", kind); n[kind]++
            for (i = 1; i <= NF; i++) {
                if ($(i+1) ~ /^requests/) r[kind] += $i
                if ($(i+1) == "worker") k[kind] += $i
                if ($(i+1) ~ /^faults/) f[kind] += $i
            }
        }
        END { for (x in n) printf "  %-18s %6d cases %9d requests %6d worker kills %6d faults\n", x, n[x], r[x], k[x], f[x] }' \
        "$logs/tier2.log" | sort
    grep -E -A2 "panicked" "$logs/tier2.log" | head -6 || true
fi
exit $status
