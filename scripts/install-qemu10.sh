#!/usr/bin/env bash
# Puts QEMU 10.0 (Debian bookworm-backports) beside the system's QEMU 7.2, unpacked under
# .cache/qemu10, so the guest tests can run against both (scripts/test.sh runs the kill and
# upgrade tests on each). Debian installs one qemu-system-x86 at a time, and the suite's other
# tools (qemu-storage-daemon, qemu-img) stay on 7.2; so QEMU 10's binary and its data files are
# unpacked rather than installed, and its libraries (all of them bookworm packages) installed.
#   usage: scripts/install-qemu10.sh        prints the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${SPOOL_CACHE:-$PWD/.cache}
dest=$cache/qemu10
bin=$dest/usr/bin/qemu-system-x86_64
if [[ -x $bin ]] && "$bin" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi
list=/etc/apt/sources.list.d/spool-bookworm-backports.list
if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    # The Debian mirror this machine's apt already uses (a one-line or a deb822 source,
    # not the security archive); deb.debian.org when none is found.
    mirror=$(grep -rhsE '^[[:space:]]*(deb[[:space:]]|URIs:)' /etc/apt/sources.list \
            /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
        | grep -oE 'https?://[^[:space:]]+' | grep -v -e security -e snapshot.debian.org \
        | grep -E '/debian/?$' | head -n1 || true)
    echo "deb ${mirror:-http://deb.debian.org/debian} bookworm-backports main" >"$list"
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || apt-get update >&2
version=$(apt-cache policy qemu-system-x86 | awk '/bpo12/ {print $1; exit}')
version=${version#\*\*\*}
[[ $version == *10.* ]] || { echo "install-qemu10: no QEMU 10 in bookworm-backports (found '$version')" >&2; exit 1; }
# Its shared libraries, from bookworm (backports builds link against the stable release).
libs=$(apt-cache depends "qemu-system-x86=$version" | awk '/Depends: lib/ {print $2}')
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $libs >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -qq "qemu-system-x86=$version" "qemu-system-data=$version" 2>/dev/null)
rm -rf "$dest"
mkdir -p "$dest"
for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dest"; done
"$bin" --version | head -1 >&2
echo "$bin"
