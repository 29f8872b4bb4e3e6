#!/usr/bin/env bash
# A single-node Ceph cluster for tests and benchmarks (issue 20), entirely inside one
# directory: one monitor and one BlueStore OSD on a sparse file, cephx on, pool `rbd` with one
# copy. No manager is started (nothing here needs one). Nothing outside DIR is touched apart
# from the two TCP ports on 127.0.0.1, and the daemons are stopped by their pid files.
#
#   scripts/ceph-cluster.sh start DIR [PORT]   start (creating it on first use); prints the
#                                              ceph.conf path; PORT is the monitor's (v2) port
#   scripts/ceph-cluster.sh stop DIR           stop the daemons (the data stays)
#   scripts/ceph-cluster.sh status DIR         `ceph -s`
#   scripts/ceph-cluster.sh stop-osd DIR       stop the OSD only (clients' I/O then waits)
#   scripts/ceph-cluster.sh start-osd DIR      start it again and wait until it is up
#
# Clients use `-c DIR/ceph.conf` (the admin keyring is named there). Needs Debian's ceph-mon,
# ceph-osd, ceph-common (scripts/install-deps.sh installs them).
set -Eeuo pipefail
cmd=${1:?usage: ceph-cluster.sh start|stop|status DIR [PORT]}
dir=${2:?usage: ceph-cluster.sh start|stop|status DIR [PORT]}
port=${3:-3300}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/ceph.conf

# Any failing step names itself and shows the daemons' logs: the daemons' own stderr goes to
# DIR/log, so without this a failed start would print nothing at all.
failed() {
    echo "ceph-cluster: '$2' failed (exit $1, line $3); logs in $dir/log" >&2
    tail -n 30 "$dir"/log/*.log >&2 2>/dev/null || true
}
trap 'failed $? "$BASH_COMMAND" $LINENO' ERR

stop() {
    for p in "$dir"/run/*.pid; do
        [[ -e $p ]] || continue
        pid=$(cat "$p")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$p"
    done
}

wait_for() { # what, command...
    local what=$1; shift
    for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "ceph-cluster: $what did not come up; logs in $dir/log" >&2
    tail -20 "$dir"/log/*.log >&2 || true
    exit 1
}

create() {
    local fsid
    fsid=$(cat /proc/sys/kernel/random/uuid)
    mkdir -p "$dir/run" "$dir/log" "$dir/mon.a" "$dir/osd.0"
    cat > "$conf" <<EOF
[global]
fsid = $fsid
mon_host = [v2:127.0.0.1:$port]
public_network = 127.0.0.0/8
ms_bind_msgr1 = false
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = $dir/admin.keyring
run_dir = $dir/run
pid_file = $dir/run/\$name.pid
log_file = $dir/log/\$name.log
admin_socket = $dir/run/\$name.asok
mon_data = $dir/mon.\$id
osd_data = $dir/osd.\$id
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
osd_crush_chooseleaf_type = 0
mon_warn_on_pool_no_redundancy = false
# The monitor refuses to start (exit 28, silently) and stops itself when the filesystem of its
# store has less than 5% free: a guard for production stores that grow. This one lives in a
# temporary directory and stays small; the build machines' disks are often that full.
mon_data_avail_crit = 0
mon_data_avail_warn = 0
[mon]
keyring = $dir/mon.keyring
[osd]
keyring = $dir/osd.\$id/keyring
osd_objectstore = bluestore
bluestore_block_path = $dir/osd.0.block
bluestore_block_create = true
bluestore_block_size = 10737418240
osd_memory_target = 939524096
bluestore_cache_autotune = false
bluestore_cache_size = 134217728
osd_op_num_shards = 1
osd_op_num_threads_per_shard = 2
EOF
    ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool --create-keyring "$dir/admin.keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
    ceph-authtool "$dir/mon.keyring" --import-keyring "$dir/admin.keyring" >/dev/null
    monmaptool --create --addv a "[v2:127.0.0.1:$port]" --fsid "$fsid" "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.keyring"
    ceph-mon -c "$conf" -i a 2>>"$dir/log/start.log"
    wait_for monitor ceph -c "$conf" --connect-timeout 5 mon stat
    local uuid
    uuid=$(cat /proc/sys/kernel/random/uuid)
    ceph -c "$conf" osd new "$uuid" >/dev/null
    ceph -c "$conf" auth get-or-create osd.0 osd 'allow *' mon 'allow profile osd' \
        -o "$dir/osd.0/keyring"
    ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid" 2>>"$dir/log/mkfs.log"
    ceph-osd -c "$conf" -i 0 2>>"$dir/log/start.log"
    wait_for OSD bash -c "ceph -c '$conf' osd stat | grep -q '1 up'"
    ceph -c "$conf" osd pool create rbd 8 8 >/dev/null
    ceph -c "$conf" osd pool set rbd size 1 --yes-i-really-mean-it >/dev/null
    rbd -c "$conf" pool init rbd
    touch "$dir/created"
}

case $cmd in
start)
    if [[ -e $dir/created ]]; then
        stop
        ceph-mon -c "$conf" -i a 2>>"$dir/log/start.log"
        wait_for monitor ceph -c "$conf" --connect-timeout 5 mon stat
        ceph-osd -c "$conf" -i 0 2>>"$dir/log/start.log"
        wait_for OSD bash -c "ceph -c '$conf' osd stat | grep -q '1 up'"
    else
        create
    fi
    wait_for "pool rbd" rbd -c "$conf" ls rbd
    echo "$conf"
    ;;
stop) stop ;;
stop-osd)
    pid=$(cat "$dir/run/osd.0.pid")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    ;;
start-osd)
    ceph-osd -c "$conf" -i 0 2>>"$dir/log/start.log"
    wait_for OSD bash -c "ceph -c '$conf' osd stat | grep -q '1 up'"
    ;;
status) ceph -c "$conf" -s ;;
*) echo "usage: ceph-cluster.sh start|stop|status|stop-osd|start-osd DIR [PORT]" >&2; exit 2 ;;
esac
