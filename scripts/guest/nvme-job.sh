#!/bin/sh
# Runs inside the NVMe test guest (scripts/test-nvme.py): binds every emulated NVMe
# controller to vfio-pci, runs spoold on them with Spool's userspace driver and drives two
# volumes with spool-bench (libblkio) verifying every byte: identify, writes and reads of
# several sizes (PRP lists, commands split at the transfer limit), several queues, a graceful
# upgrade, a worker SIGKILL under load, and (when the host does the device_del) a hot
# removal. Prints "SPOOL-NVME: PASS" or "SPOOL-NVME: FAIL <why>".
export PATH=/bin:/sbin:/opt/spool
say() { echo "SPOOL-NVME: $*"; }
t() { cut -d' ' -f1 /proc/uptime; }
fail() {
    say "FAIL $*"
    timeout 10 spoolctl --socket /tmp/spool/spoldd.sock device health 2>&1
    timeout 10 spoolctl --socket /tmp/spool/spoldd.sock events 2>&1 | tail -n 20
    [ -f /tmp/spoold.log ] && tail -n 80 /tmp/spoold.log
    sync
    poweroff -f
}
ctl() { timeout 60 spoolctl --socket /tmp/spool/spoldd.sock "$@"; }
# Every client run is bounded: a request that never completes fails the test with the
# daemon's log instead of hanging it until the host's timeout.
bench() { timeout 120 spool-bench --size 33554432 "$@" || fail "spool-bench $*"; }
# waitfor PID WHAT: waits for a background client, bounded.
waitfor() {
    n=0
    while kill -0 "$1" 2>/dev/null; do
        n=$((n + 1))
        [ $n -lt 1200 ] || { kill -9 "$1"; fail "$2: the client hung (no completion in 120 s)"; }
        sleep 0.1
    done
    wait "$1"
}

mount -t tmpfs tmpfs /tmp
mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm
for m in irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci; do
    if [ -f /lib/modules/$m.ko ]; then
        insmod /lib/modules/$m.ko || fail "insmod $m"
    fi
done
bdfs=""
for d in /sys/bus/pci/devices/*; do
    [ "$(cat $d/class)" = "0x010802" ] || continue
    b=${d##*/}
    [ -e $d/driver ] && echo "$b" > $d/driver/unbind
    echo vfio-pci > $d/driver_override
    echo "$b" > /sys/bus/pci/drivers_probe
    bdfs="$bdfs $b"
done
set -- $bdfs
[ $# -ge 2 ] || fail "expected 2 NVMe controllers, found $#"
c1=$1
c2=$2
c3=${3:-}
for b in $c1 $c2 $c3; do
    g=$(readlink /sys/bus/pci/devices/$b/iommu_group)
    [ -c /dev/vfio/${g##*/} ] || fail "$b: no /dev/vfio/${g##*/} (vIOMMU or vfio-pci missing)"
done
say "controllers $c1 $c2 bound to vfio-pci at $(t)s"

mkdir -p /tmp/spool
cat > /tmp/spool.toml <<CONF
state_dir = "/tmp/spool"
rpc_socket = "/tmp/spool/spoldd.sock"
[[devices]]
path = "nvme:$c1"
[[devices]]
path = "nvme:$c2"
[[volumes]]
name = "vol1"
size = "64M"
num_queues = 2
[[volumes]]
name = "vol2"
size = "64M"
[[volumes]]
name = "mv"
size = "32M"
mirror = 2
[health]
poll_interval_ms = 200
io_timeout_ms = 1500
CONF
spoold --config /tmp/spool.toml > /tmp/spoold.log 2>&1 &
keeper=$!
i=0
while [ ! -S /tmp/spool/vhost/vol2.sock ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
[ -S /tmp/spool/vhost/vol2.sock ] || fail "spoold did not start"
grep -q "NVMe controller ready" /tmp/spoold.log || fail "no controller came up"
grep "NVMe controller ready" /tmp/spoold.log | sed 's/^.*INFO //' | head -2
say "spoold serving at $(t)s"
ctl device health || fail "device health"
v1=/tmp/spool/vhost/vol1.sock
v2=/tmp/spool/vhost/vol2.sock

# Lay patterns down with several request sizes (4K: one PRP entry; 128K: a PRP list; 1M:
# split at the controller's transfer limit) and two queues, then read everything back.
bench --socket $v1 --rw write --fill --verify --seed 11 --bs 131072 --iodepth 4 --queues 2
bench --socket $v2 --rw write --fill --verify --seed 22 --bs 1048576 --iodepth 2
bench --socket $v1 --rw randwrite --verify --seed 11 --bs 4096 --iodepth 16 --runtime 2
bench --socket $v1 --rw read --fill --verify --seed 11 --bs 65536 --iodepth 8 --queues 2
# Write Zeroes, deallocate (discard) and flushes: zeroed blocks must read back as zeroes;
# then the pattern is laid down again with a flush after every 16 writes.
bench --socket $v2 --rw zero --fill --bs 65536 --iodepth 8
bench --socket $v2 --rw read --fill --verify --expect-zeroes --bs 131072 --iodepth 4
bench --socket $v2 --rw trim --fill --bs 1048576 --iodepth 4
bench --socket $v2 --rw write --fill --verify --seed 22 --bs 4096 --iodepth 32 --fsync 16
bench --socket $v2 --rw read --fill --verify --seed 22 --bs 4096 --iodepth 32
say "write/read verify passed at $(t)s"

# A 2-way mirrored volume across both controllers: every later fault of vol2's controller
# (hung commands, media errors and its replacement, SMART, hot removal) hits one of its legs
# and must cost it nothing: its data is read back and rewritten, verified, after each.
mv=/tmp/spool/vhost/mv.sock
mvcheck() {
    bench --socket $mv --rw read --fill --verify --seed 44 --bs 131072 --iodepth 4
    bench --socket $mv --rw randwrite --verify --seed 44 --runtime 1 --iodepth 8
    ctl volume show mv | grep "^mirror:"
    say "mirrored volume intact after $1 at $(t)s"
}
bench --socket $mv --rw write --fill --verify --seed 44 --bs 131072 --iodepth 4
ctl volume show mv | grep -q "mirror: 2 copies, 2 current" || fail "mv is not a current 2-way mirror: $(ctl volume show mv)"
mvcheck "writing it"
# Zero copy: libblkio's buffers are page-aligned guest (shared) memory, registered with the
# IOMMU when the client sent its memory table; no request may have needed a bounce buffer.
ctl device health
sum() { ctl device --json health | grep "\"$1\"" | tr -dc '0-9\n' | awk '{s+=$1} END {print s+0}'; }
zc=$(sum zero_copy_requests)
bo=$(sum bounced_requests)
say "requests zero-copy $zc, bounced $bo"
[ "$zc" -gt 1000 ] || fail "too few zero-copy requests ($zc)"
[ "$bo" = 0 ] || fail "$bo requests were bounced"
for k in flush_commands deallocate_commands write_zeroes_commands; do
    n=$(sum $k)
    say "$k $n"
    [ "$n" -gt 0 ] || fail "no $k reached the controller"
done
# Scatter lists PRPs cannot describe (3 and 5 unaligned pieces per request) go as SGLs:
# still zero copy.
bench --socket $v1 --rw write --fill --verify --seed 11 --bs 8192 --iovecs 3 --iodepth 8
bench --socket $v1 --rw read --fill --verify --seed 11 --bs 8192 --iovecs 5 --iodepth 8
sg=$(sum sgl_requests)
bo=$(sum bounced_requests)
say "scatter lists: SGL requests $sg, bounced $bo"
[ "$sg" -gt 1000 ] || fail "scatter lists were not sent as SGLs"
[ "$bo" = 0 ] || fail "$bo requests were bounced"
live() {
    n=$(ctl device --json health | grep -c '"attached": true')
    [ "$n" = 2 ] || fail "$1: $n of 2 controllers were taken over live (the rest were reset)"
    grep "re-attached" /tmp/spoold.log | tail -n 2 | sed 's/^.*INFO //'
}

# Graceful upgrade (same binary): the new worker takes the controllers over. It also reads
# the config again, now with SGLs off: the same scatter lists must go through bounce buffers.
printf '[io]\nnvme_sgl = false\n' >> /tmp/spool.toml
ctl upgrade || fail "upgrade"
bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
bench --socket $v2 --rw read --fill --verify --seed 22 --bs 131072 --iodepth 4
live "upgrade"
bench --socket $v1 --rw write --fill --verify --seed 11 --bs 8192 --iovecs 3 --iodepth 8
bench --socket $v1 --rw read --fill --verify --seed 11 --bs 8192 --iovecs 5 --iodepth 8
sg=$(sum sgl_requests)
bo=$(sum bounced_requests)
say "scatter lists without SGLs: SGL requests $sg, bounced $bo"
[ "$sg" = 0 ] || fail "SGLs used although disabled"
[ "$bo" -gt 1000 ] || fail "scatter lists were not bounced"
say "upgrade passed at $(t)s"

# Worker SIGKILL under a verifying random-write load on both volumes.
spool-bench --socket $v1 --size 33554432 --rw randwrite --verify --seed 11 --iodepth 16 --runtime 8 > /tmp/b1 2>&1 &
b1=$!
spool-bench --socket $v2 --size 33554432 --rw randrw --verify --seed 22 --iodepth 8 --runtime 8 > /tmp/b2 2>&1 &
b2=$!
sleep 3
worker=""
for p in $(pidof spoold); do [ "$p" != "$keeper" ] && worker=$p; done
[ -n "$worker" ] || fail "no worker process"
kill -9 "$worker"
say "killed worker $worker at $(t)s"
waitfor $b1 "vol1 load across the worker kill" || { cat /tmp/b1; fail "vol1 load across the worker kill"; }
waitfor $b2 "vol2 load across the worker kill" || { cat /tmp/b2; fail "vol2 load across the worker kill"; }
cat /tmp/b1 /tmp/b2
bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
bench --socket $v2 --rw read --fill --verify --seed 22 --bs 131072 --iodepth 4
live "worker kill"
say "worker kill passed at $(t)s"

# Which controller holds vol2 (the volumes are on different controllers).
v2dev=$(ctl volume --json show vol2 | grep -A1 '"devices"' | tail -n 1 | tr -d ' ",')
v1dev=$(ctl volume --json show vol1 | grep -A1 '"devices"' | tail -n 1 | tr -d ' ",')
[ "$v1dev" != "$v2dev" ] || fail "vol1 and vol2 share a device"
gone=$(ctl device list | grep "$v2dev" | grep -o 'nvme:[0-9a-f:.]*' | cut -d: -f2-)
case "$gone" in
"$c1") gone_id=nvme0 ;;
"$c2") gone_id=nvme1 ;;
*) fail "cannot find vol2's controller ($v2dev: '$gone')" ;;
esac

if grep -q "spool.hang=1" /proc/cmdline; then
    # The host throttles vol2's controller to 2 commands a second for 3 s: commands outlive
    # io_timeout, spoold aborts them by deleting and recreating the queue pair, holds,
    # checks the controller and resubmits; the client sees latency, not errors.
    spool-bench --socket $v2 --size 33554432 --rw randread --verify --seed 22 --iodepth 8 --runtime 10 --json > /tmp/bh 2>&1 &
    bh=$!
    sleep 1
    say "HANG $gone_id"
    waitfor $bh "vol2 across a hung command" || { cat /tmp/bh; fail "vol2 saw errors across a hung command"; }
    cat /tmp/bh
    ctl device health
    ctl events | tail -n 3
    ctl device health | grep "$v2dev" | grep -q HEALTHY || fail "vol2's device is not healthy after the hang"
    to=$(ctl device health | grep "$v2dev" | awk '{print $6}')
    [ "${to:-0}" -ge 1 ] || fail "no timeout was counted"
    grep -q "aborted outstanding commands by deleting the I/O queue pair" /tmp/spoold.log \
        || fail "the hung commands were not aborted"
    grep "aborted outstanding commands" /tmp/spoold.log | tail -n 1 | sed 's/^.*INFO //'
    say "hung commands: $to timeouts, aborted and resubmitted without an error, at $(t)s"
    mvcheck "hung commands on a leg"
    creset() { ctl device health | grep -A1 "^nvme:$1 NVMe" | grep -o 'controller resets by this worker [0-9]*' | awk '{print $NF}'; }
    r=$(creset "$gone")
    say "controller $gone reset $r times by this worker"
    [ "${r:-0}" -ge 1 ] || fail "the hang did not reset the controller"
    # An operator's reset of vol1's controller under a verifying write load: the controller
    # is really reset (CC.EN), every queue pair is re-created, nothing is lost.
    v1c=$(ctl device list | grep "$v1dev" | grep -o 'nvme:[0-9a-f:.]*' | cut -d: -f2-)
    before=$(creset "$v1c")
    spool-bench --socket $v1 --size 33554432 --rw randwrite --verify --seed 11 --iodepth 16 --runtime 6 > /tmp/b1 2>&1 &
    b1=$!
    sleep 2
    ctl device reset "$v1dev" || fail "device reset"
    waitfor $b1 "vol1 across a controller reset" || { cat /tmp/b1; fail "vol1 saw errors across a controller reset"; }
    cat /tmp/b1
    after=$(creset "$v1c")
    [ "$after" -gt "$before" ] || fail "device reset did not reset controller $v1c ($before -> $after)"
    bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
    say "operator controller reset under load passed ($before -> $after resets) at $(t)s"
fi

if grep -q "spool.media=1" /proc/cmdline; then
    # The host makes every read of vol2's controller fail (QEMU reports Unrecovered Read
    # Error, SCT 2 SC 0x81): spoold must classify it as a media error and isolate the
    # device, vol2 gets clean errors, vol1 is untouched. Then vol2 moves to the blank third
    # controller with `spoolctl device replace` and is usable again (its old data is gone).
    [ -n "$c3" ] || fail "no third controller for the replacement"
    say "MEDIA $gone_id"
    sleep 0.5
    timeout 60 spool-bench --socket $v2 --rw randread --runtime 1 --iodepth 4 > /tmp/b2 2>&1
    i=0
    while ! ctl device health | grep "$v2dev" | grep -q FAILED && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
    ctl device health | grep "$v2dev" | grep -q FAILED || { cat /tmp/b2; fail "media errors did not fail the device"; }
    grep -q "errors=0 " /tmp/b2 && fail "vol2 saw no errors on a failing medium: $(cat /tmp/b2)"
    ctl device health | grep "$v2dev"
    bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
    ctl device replace "$v2dev" "nvme:$c3" || fail "device replace"
    bench --socket $v2 --rw write --fill --verify --seed 33 --bs 131072 --iodepth 4
    bench --socket $v2 --rw read --fill --verify --seed 33 --bs 65536 --iodepth 8
    v2dev=$(ctl volume --json show vol2 | grep -A1 '"devices"' | tail -n 1 | tr -d ' ",')
    gone=$c3
    gone_id=nvme2
    ctl device health
    say "media error, isolation and replacement passed at $(t)s"
    # The replacement got mv's leg too: it is rebuilt online from the other controller.
    i=0
    while ! ctl volume show mv | grep -q "mirror: 2 copies, 2 current" && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    ctl volume show mv | grep -q "mirror: 2 copies, 2 current" || fail "mv was not rebuilt onto $c3: $(ctl volume show mv)"
    mvcheck "a media error on a leg and the rebuild onto the replacement"
fi

if grep -q "spool.smart=1" /proc/cmdline; then
    # The host sets SMART critical warning 0x04 (NVM subsystem reliability degraded) on
    # vol2's controller: spoold reads it from the SMART log and isolates that device.
    say "SMART $gone_id 4"
    i=0
    while ! ctl device health | grep "$v2dev" | grep -q FAILED && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
    ctl device health | grep "$v2dev" | grep -q FAILED || fail "SMART warning 0x04 did not fail the device"
    if timeout 60 spool-bench --socket $v2 --rw randread --runtime 1 --iodepth 4 > /tmp/b2 2>&1; then
        fail "I/O to the failed device's volume succeeded"
    fi
    bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
    ctl events | tail -n 1
    say "SMART isolation passed at $(t)s"
    mvcheck "a SMART warning on a leg"
fi

if grep -q "spool.hotremove=1" /proc/cmdline; then
    # The host removes vol2's controller (device_del): spoold must release it, isolate vol2
    # (clean errors, no hang) and keep serving vol1 on the other controller.
    say "REMOVE $gone_id"
    i=0
    while [ -e /sys/bus/pci/devices/$gone ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
    [ -e /sys/bus/pci/devices/$gone ] && fail "controller $gone was not released"
    say "controller $gone removed at $(t)s"
    bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
    if timeout 60 spool-bench --socket $v2 --rw randread --runtime 1 --iodepth 4 > /tmp/b2 2>&1; then
        cat /tmp/b2
        fail "I/O to the removed controller's volume succeeded"
    fi
    grep -q "errors=0 " /tmp/b2 && fail "vol2 saw no errors: $(cat /tmp/b2)"
    tail -n 1 /tmp/b2
    ctl device health
    ctl events | tail -n 4
    kill -0 $keeper || fail "spoold exited"
    say "hot removal passed at $(t)s"
    mvcheck "a leg's controller removed"
    # A worker restart now must not trip over the controller that is gone: vol1 keeps
    # being served, vol2 is offline until its device is replaced.
    worker=""
    for p in $(pidof spoold); do [ "$p" != "$keeper" ] && worker=$p; done
    kill -9 "$worker"
    i=0
    while [ $i -lt 100 ]; do
        sleep 0.2
        i=$((i+1))
        nw=""
        for p in $(pidof spoold); do [ "$p" != "$keeper" ] && nw=$p; done
        [ -n "$nw" ] && [ "$nw" != "$worker" ] && ctl volume list > /tmp/vl 2>&1 && break
    done
    cat /tmp/vl
    grep vol1 /tmp/vl | grep -q ready || fail "vol1 is not served after a worker restart without controller 2"
    bench --socket $v1 --rw read --fill --verify --seed 11 --bs 131072 --iodepth 4
    say "worker restart after the removal passed at $(t)s"
    mvcheck "a worker restart without the removed leg"
fi
ctl status | head -n 20
kill $keeper
wait $keeper
say "PASS"
sync
poweroff -f
