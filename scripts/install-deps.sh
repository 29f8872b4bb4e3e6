#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian 12 machine: QEMU 7.2 (system emulator
# and qemu-storage-daemon), fio and a static busybox for the test guest, systemd (run as a
# private user manager by the systemd test, never as this machine's init), libvirt, and Ceph's
# monitor, OSD and client tools (a private test cluster), libnbd's nbdinfo and nbdcopy, and
# qemu-utils, openssl (the TLS tests' credentials) and cryptsetup (a LUKS image for a benchmark). The machine may carry bookworm-backports' qemu-utils; Debian refuses to mix it
# with bookworm's qemu-system-x86, so the utilities are pinned to bookworm's 7.2 as well.
set -euo pipefail
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v fio >/dev/null || need+=(fio)
command -v busybox >/dev/null || need+=(busybox-static)
command -v xz >/dev/null || need+=(xz-utils)
command -v objcopy >/dev/null || need+=(binutils)
# The systemd test runs a real (user) service manager: tests/systemd.rs.
[ -x /lib/systemd/systemd ] || need+=(systemd)
command -v unshare >/dev/null || need+=(util-linux)
# The encryption test checks the on-device layout with OpenSSL's AES-XTS (tests/encryption.rs).
/usr/bin/python3 -c 'import cryptography' 2>/dev/null || need+=(python3-cryptography)
# The libvirt test runs a private libvirtd (tests/libvirt.rs).
[ -x /usr/sbin/libvirtd ] || need+=(libvirt-daemon-driver-qemu libvirt-daemon)
command -v virsh >/dev/null || need+=(libvirt-clients)
# The Ceph tests start a private single-node cluster (scripts/ceph-cluster.sh); spoold loads
# librbd1/librados2 (ceph-common's dependencies) at run time for rbd: devices.
command -v ceph-mon >/dev/null || need+=(ceph-mon)
command -v ceph-osd >/dev/null || need+=(ceph-osd)
command -v rbd >/dev/null || need+=(ceph-common)
# The snapshot export is read by libnbd's tools as a backup would (tests/snapshots.rs).
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
# The TLS tests make their x509 credentials with openssl (scripts/tls-certs.sh).
command -v openssl >/dev/null || need+=(openssl)
# bench-crypt.py formats qemu-storage-daemon's LUKS image with cryptsetup (a fixed PBKDF2
# count: qemu-img's own timing of it refuses under load, "Unable to get accurate CPU usage").
command -v cryptsetup >/dev/null || [ -x /sbin/cryptsetup ] || need+=(cryptsetup-bin)
# qemu-img, qemu-io and qemu-nbd (qemu-utils, pinned below with every install) write to and
# serve NBD exports in the nbd:// device and NBD server tests.
utils=ok
command -v qemu-nbd >/dev/null && command -v qemu-io >/dev/null && command -v qemu-img >/dev/null || utils=missing
# libvirtd's QEMU driver resolves its default user at start even when qemu.conf overrides it;
# libvirt-daemon-system's postinst would create it (we do not install that package: it wants
# systemd as init).
getent group libvirt-qemu >/dev/null || groupadd -r libvirt-qemu
id libvirt-qemu >/dev/null 2>&1 || useradd -r -M -g libvirt-qemu -s /usr/sbin/nologin libvirt-qemu
if ((${#need[@]} == 0)) && [ "$utils" = ok ]; then
    exit 0
fi
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
install() {
    apt-get install -y --no-install-recommends --allow-downgrades "${need[@]}" \
        qemu-utils/bookworm qemu-block-extra/bookworm
}
install >/tmp/spool-apt.log 2>&1 || { apt-get update >/dev/null 2>&1 && install >/tmp/spool-apt.log 2>&1; } || {
    tail -20 /tmp/spool-apt.log >&2
    echo "install-deps: apt-get failed (log above)" >&2
    exit 1
}
