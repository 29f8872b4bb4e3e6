#!/usr/bin/env bash
# Builds the end-to-end test guest from Debian packages and caches it:
#   $SPOOL_CACHE/guest/vmlinuz          Debian cloud kernel
#   $SPOOL_CACHE/guest/initramfs.cpio.gz busybox + fio (with its libraries) + virtio modules
# The guest's /init (scripts/guest/init) runs the job named by spool.job= on the kernel
# command line against /dev/vda and prints SPOOL-E2E: PASS or FAIL, then powers off.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${SPOOL_CACHE:-$repo/.cache}/guest
# The stamp names what the image is built from (the contents, not where the checkout is).
stamp="$cache/.stamp-$(cat "$here/build-guest.sh" "$here/guest/init" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && -f "$cache/vmlinuz" && -f "$cache/initramfs.cpio.gz" ]]; then
    echo "guest image cached in $cache"
    exit 0
fi
for tool in busybox fio; do
    command -v "$tool" >/dev/null || { echo "build-guest: $tool is missing (apt-get install busybox-static fio)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
[[ -n "$pkg" ]] || { echo "build-guest: cannot resolve the Debian cloud kernel package" >&2; exit 1; }
(cd "$work" && apt-get download "$pkg" >/dev/null)
dpkg-deb -x "$work"/linux-image-*.deb "$work/k"
kver=$(ls "$work/k/lib/modules")
root="$work/root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,lib/modules,lib64,usr/lib,etc}
cp "$(command -v busybox)" "$root/bin/busybox"
if ldd "$root/bin/busybox" >/dev/null 2>&1; then
    echo "build-guest: busybox must be static (apt-get install busybox-static)" >&2; exit 1
fi
for app in sh mount insmod poweroff cat grep sleep echo ls mkdir dd cmp sync head awk seq \
    tail sed tr cut wc kill pidof readlink basename rm cp timeout blkdiscard; do
    ln -sf busybox "$root/bin/$app"
done
# fio and every library it links, at the same paths.
cp "$(command -v fio)" "$root/bin/fio"
for lib in $(ldd "$(command -v fio)" | awk '/=>/ {print $3} /ld-linux/ {print $1}'); do
    [[ -f "$lib" ]] || continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
# libaio is dlopen'ed by fio's libaio engine on some builds: ship it if present.
for lib in /usr/lib/x86_64-linux-gnu/libaio.so.1*; do
    [[ -e "$lib" ]] && cp -L "$lib" "$root/usr/lib/x86_64-linux-gnu/" 2>/dev/null || true
done
# virtio for the vhost-user tests; VFIO for the userspace NVMe driver tests.
mods="virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk
      irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci"
for m in $mods; do
    f=$(find "$work/k/lib/modules/$kver" -name "$m.ko*" | head -1)
    if [[ -z "$f" ]]; then
        echo "  $m: built into the kernel"
        continue
    fi
    case "$f" in
        *.xz) xz -dc "$f" > "$root/lib/modules/$m.ko" ;;
        *.zst) zstd -qdc "$f" > "$root/lib/modules/$m.ko" ;;
        *) cp "$f" "$root/lib/modules/$m.ko" ;;
    esac
done
cp "$here/guest/init" "$root/init"
chmod +x "$root/init"
# Built beside the cache and renamed into it, the stamp last: a build killed half-way
# leaves the previous image whole, or no stamp, never a truncated image that looks cached.
mkdir -p "$cache"
rm -f "$cache"/.stamp-*
cp "$work"/k/boot/vmlinuz-* "$cache/.vmlinuz.new"
(cd "$root" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$cache/.initramfs.cpio.gz.new"
mv -f "$cache/.vmlinuz.new" "$cache/vmlinuz"
mv -f "$cache/.initramfs.cpio.gz.new" "$cache/initramfs.cpio.gz"
touch "$stamp"
echo "guest image built in $cache (kernel $kver)"
