#!/usr/bin/env bash
# CephFS as a benchmark peer for `freeflow bench`.
#
#   cephfs.sh up     [--base DIR]   install if needed, start, mount; prints the mount path
#   cephfs.sh down   [--base DIR]   unmount, stop, kill what is left, delete all state
#   cephfs.sh status [--base DIR]   says whether the file system is mounted (exit 0 if so, 1 if not)
#
# Layout: one monitor, one manager, one OSD (BlueStore on a sparse file of 16 GiB), one MDS
# and a ceph-fuse client, all on this host, from Debian's packages (Ceph 16, "pacific").
# Pools keep one copy of each object, as the other targets store each byte once. The kernel
# here has no CephFS client (no `ceph` module), so the mount is ceph-fuse. Authentication is
# off (cephx "none"): nothing listens beyond the loopback interface. Everything lives under
# DIR (default /tmp/freeflow-peers/cephfs):
#
#   DIR/ceph.conf         the cluster's one configuration file (every command is given it)
#   DIR/mon, osd, mds, mgr the daemons' data; DIR/osd/block-0 is the OSD's sparse block file
#   DIR/run               admin sockets and pid files
#   DIR/log               each daemon's log
#   DIR/mnt               the FUSE mount that the benchmark writes to
#
# Ports: the monitor on 127.0.0.1:3300 (msgr2) and 6789 (msgr1); the OSD, MDS and manager
# take free ports of their own on 127.0.0.1 (6800-7300).
#
# No systemd here: the daemons are started directly and daemonise themselves.
set -euo pipefail

readonly ME="cephfs.sh"
readonly MON_PORTS=(3300 6789)
readonly WAIT_SECS=${PEER_WAIT_SECS:-60}   # upper bound for every wait below (the OSD is slow)
readonly STOP_GRACE_SECS=15
readonly BLOCK_BYTES=$((16 << 30))
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

BASE=/tmp/freeflow-peers/cephfs

ceph_cli() { timeout "$WAIT_SECS" ceph -c "$CONF" "$@"; }

# All Ceph processes whose command line names our configuration file.
our_pids() {
    pids_naming "$BASE/" ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse
}

# The pid of our daemon NAME (ceph-mon, ...), if it runs.
daemon_pid() { find_pid "$1" "$CONF"; }

# ---------------------------------------------------------------------------------------------
# Installation

ensure_installed() {
    local tool missing=0
    for tool in ceph ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse monmaptool; do
        command -v "$tool" >/dev/null || missing=1
    done
    ((missing)) || return 0
    [[ $(id -u) -eq 0 ]] || die "Ceph is not installed and installing needs root"
    local pkgs=(ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common)
    say "installing ${pkgs[*]} from Debian packages"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}" \
        >"$LOGDIR/apt.log" 2>&1; then
        log_tail "$LOGDIR/apt.log"
        apt-cache policy "${pkgs[@]}" >&2 || true
        die "apt-get install ${pkgs[*]} failed (see above)"
    fi
    for tool in ceph ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse monmaptool; do
        command -v "$tool" >/dev/null || die "$tool still missing after installing ${pkgs[*]}"
    done
}

# ---------------------------------------------------------------------------------------------
# The cluster, made once per base directory (its fsid is kept in the configuration)

write_config() {
    local fsid=$1
    cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:${MON_PORTS[0]},v1:127.0.0.1:${MON_PORTS[1]}]
mon initial members = a
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
run dir = $BASE/run
admin socket = $BASE/run/\$name.asok
pid file = $BASE/run/\$name.pid
log file = $LOGDIR/\$name.log
[mon]
mon data = $BASE/mon/\$cluster-\$id
mon allow pool delete = true
[osd]
osd data = $BASE/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block path = $BASE/osd/block-\$id
bluestore block create = true
bluestore block size = $BLOCK_BYTES
osd memory target = 2147483648
[mds]
mds data = $BASE/mds/\$cluster-\$id
[mgr]
mgr data = $BASE/mgr/\$cluster-\$id
EOF
}

# First `up` in this base directory: the monitor's store, the OSD's BlueStore, the pools and
# the file system. Marked done by DIR/made.
make_cluster() {
    [[ -e $BASE/made ]] && return 0
    local port fsid osd_uuid id
    for port in "${MON_PORTS[@]}"; do
        if port_in_use "$port"; then
            ss -Hltnp "sport = :$port" >&2 || true
            die "port $port (the monitor's) is already in use by another process (above)"
        fi
    done
    rm -rf "$BASE/mon" "$BASE/osd" "$BASE/mds" "$BASE/mgr" "$BASE/run"
    mkdir -p "$BASE"/{mon,osd,mds/ceph-a,mgr/ceph-a,run}
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_config "$fsid"
    monmaptool --create --fsid "$fsid" --addv a \
        "[v2:127.0.0.1:${MON_PORTS[0]},v1:127.0.0.1:${MON_PORTS[1]}]" "$BASE/monmap" \
        >>"$LOGDIR/make.log" 2>&1 || { log_tail "$LOGDIR/make.log"; die "monmaptool failed"; }
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$BASE/monmap" >>"$LOGDIR/make.log" 2>&1 \
        || { log_tail "$LOGDIR/make.log"; die "ceph-mon --mkfs failed"; }
    start_mon
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    id=$(ceph_cli osd new "$osd_uuid" 2>>"$LOGDIR/make.log") \
        || { log_tail "$LOGDIR/make.log"; die "ceph osd new failed"; }
    [[ $id == 0 ]] || die "the new OSD got id $id, expected 0"
    mkdir -p "$BASE/osd/ceph-0"
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$LOGDIR/make.log" 2>&1 \
        || { log_tail "$LOGDIR/make.log"; die "ceph-osd --mkfs failed"; }
    start_osd
    local pool pgs
    for pool in cephfs_data:32 cephfs_metadata:16; do
        pgs=${pool#*:}
        pool=${pool%:*}
        ceph_cli osd pool create "$pool" "$pgs" >>"$LOGDIR/make.log" 2>&1 \
            || { log_tail "$LOGDIR/make.log"; die "creating pool $pool failed"; }
        ceph_cli osd pool set "$pool" size 1 --yes-i-really-mean-it >>"$LOGDIR/make.log" 2>&1 \
            || { log_tail "$LOGDIR/make.log"; die "setting pool $pool to one copy failed"; }
    done
    ceph_cli fs new cephfs cephfs_metadata cephfs_data >>"$LOGDIR/make.log" 2>&1 \
        || { log_tail "$LOGDIR/make.log"; die "ceph fs new failed"; }
    touch "$BASE/made"
}

# Start a daemon unless it runs; it daemonises once it has read its configuration.
start_daemon() {
    local name=$1
    shift
    daemon_pid "$name" >/dev/null && return 0
    if ! "$name" -c "$CONF" "$@" >>"$LOGDIR/start.log" 2>&1; then
        log_tail "$LOGDIR/start.log"
        log_tail "$LOGDIR/${name#ceph-}.${*: -1}.log"
        die "$name $* failed to start"
    fi
}

start_mon() {
    start_daemon ceph-mon -i a
    if ! wait_until "$WAIT_SECS" ceph_cli mon stat >/dev/null 2>&1; then
        log_tail "$LOGDIR/mon.a.log"
        die "the monitor does not answer after ${WAIT_SECS}s"
    fi
}

osd_up() { ceph_cli osd stat 2>/dev/null | grep -q "1 up"; }

start_osd() {
    start_daemon ceph-osd -i 0
    if ! wait_until "$WAIT_SECS" osd_up; then
        log_tail "$LOGDIR/osd.0.log"
        die "the OSD is not up after ${WAIT_SECS}s"
    fi
}

fs_active() { ceph_cli fs status cephfs 2>/dev/null | grep -q "active"; }

mount_answers_data() { ceph_cli -s 2>/dev/null | grep -q "active+clean"; }

mount_fs() {
    is_mounted && return 0
    mkdir -p "$MNT"
    if ! timeout "$WAIT_SECS" ceph-fuse -c "$CONF" "$MNT" >>"$LOGDIR/ceph-fuse.out" 2>&1; then
        log_tail "$LOGDIR/ceph-fuse.out"
        die "ceph-fuse at $MNT failed"
    fi
    wait_until "$WAIT_SECS" is_mounted || die "ceph-fuse returned but $MNT is not mounted"
}

cmd_up() {
    mkdir -p "$LOGDIR"
    if is_mounted && ! mount_answers; then
        say "the mount at $MNT does not answer; detaching it"
        umount -l "$MNT" 2>/dev/null || true
        local pid
        if pid=$(daemon_pid ceph-fuse); then stop_pids "$pid"; fi
    fi
    ensure_installed
    make_cluster
    start_mon
    start_osd
    start_daemon ceph-mgr -i a
    start_daemon ceph-mds -i a
    if ! wait_until "$WAIT_SECS" fs_active; then
        ceph_cli fs status >&2 || true
        log_tail "$LOGDIR/mds.a.log"
        die "the file system has no active MDS after ${WAIT_SECS}s"
    fi
    wait_until "$WAIT_SECS" mount_answers_data || die "the placement groups are not active+clean after ${WAIT_SECS}s"
    mount_fs
    echo "$MNT"
}

cmd_down() {
    local left
    if is_mounted; then
        if ! timeout "$WAIT_SECS" umount "$MNT"; then
            say "umount $MNT failed or timed out; detaching it lazily"
            umount -l "$MNT" || true
        fi
    fi
    # shellcheck disable=SC2046  # word splitting of the pid list is intended
    stop_pids $(our_pids)
    left=$(our_pids)
    [[ -z $left ]] || die "Ceph processes still running after SIGKILL: $left"
    is_mounted && die "$MNT is still mounted; not deleting $BASE"
    rm -rf "$BASE"
    say "down: no Ceph processes, mounts or state left under $BASE"
}

cmd_status() {
    if is_mounted; then
        echo "cephfs: mounted at $MNT"
        return 0
    fi
    local pid
    if pid=$(daemon_pid ceph-mon); then
        echo "cephfs: not mounted (ceph-mon running, pid $pid)"
    else
        echo "cephfs: not mounted"
    fi
    return 1
}

set_paths() {
    CONF=$BASE/ceph.conf
    MNT=$BASE/mnt
    LOGDIR=$BASE/log
}

peer_main set_paths "$@"
