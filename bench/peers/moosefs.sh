#!/usr/bin/env bash
# MooseFS as a benchmark peer for `freeflow bench`.
#
#   moosefs.sh up     [--base DIR]   install if needed, start, mount; prints the mount path
#   moosefs.sh down   [--base DIR]   unmount, stop, kill what is left, delete all state
#   moosefs.sh status [--base DIR]   says whether the file system is mounted (exit 0 if so, 1 if not)
#
# Layout: one master and three chunkservers on this host, listening only on addresses of the
# loopback interface (see "Addresses" below), and one mfsmount. Goal (number of copies) is 1, so each byte is stored once, as on the other
# targets. Everything lives under DIR (default /tmp/freeflow-peers/moosefs):
#
#   DIR/master/           master config, exports and metadata (its DATA_PATH)
#   DIR/csN/              chunkserver N: config, mfshdd.cfg, lock file, and chunks/ with the data
#   DIR/mnt               the FUSE mount that the benchmark writes to
#   DIR/log/              each daemon's output (they run in the foreground and we keep stderr,
#                         because MooseFS otherwise logs only to syslog, which is absent here)
#
# Addresses and ports: the master listens for clients (mfsmount, mfscli) on 127.0.0.1:9421 and
# for metaloggers on 127.0.0.1:9419. Chunkservers cannot use 127.0.0.1: mfschunkserver refuses
# any master address in 127.0.0.0/8 ("localhost can't be used for connecting with master"), a
# check compiled in with no option to turn it off. So the chunkserver side runs on a second
# address that we put on the loopback interface, 198.18.0.1/32 (RFC 2544's benchmarking range;
# PEER_MOOSEFS_ADDR overrides), labelled lo:ffmfs so that `down` removes exactly it: master
# 198.18.0.1:9420 for chunkservers, chunkservers on 198.18.0.1:9422, 9423 and 9424. Nothing
# listens on a real network interface. No metalogger: it only keeps a metadata backup.
#
# No systemd here: we start the daemons directly, each in its own session.
set -euo pipefail

readonly ME="moosefs.sh"
readonly HOST=127.0.0.1                              # master, client side
readonly CS_ADDR=${PEER_MOOSEFS_ADDR:-198.18.0.1}    # master's chunkserver side; chunkservers
readonly ADDR_LABEL=lo:ffmfs
readonly MASTER_ML_PORT=9419
readonly MASTER_CS_PORT=9420
readonly MASTER_CL_PORT=9421
readonly CS_PORTS=(9422 9423 9424)
readonly WAIT_SECS=${PEER_WAIT_SECS:-30}   # upper bound for every wait below
readonly STOP_GRACE_SECS=15
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

BASE=/tmp/freeflow-peers/moosefs

# ---------------------------------------------------------------------------------------------
# Small helpers

# Detach the mount and stop its client (used when the mount is stale).
drop_mount() {
    local pid
    umount -l "$MNT" 2>/dev/null || true
    if pid=$(find_pid mfsmount "$MNT"); then stop_pids "$pid"; fi
}

# All MooseFS processes whose command line names our base directory.
our_pids() {
    pids_naming "$BASE/" mfsmaster mfschunkserver mfsmount
}

# Refuse to start a daemon on a port someone else holds, naming the port and its owner.
require_free_port() {
    local port=$1 what=$2
    if port_in_use "$port"; then
        ss -Hltnp "sport = :$port" >&2 || true
        die "port $port ($what) is already in use by another process (above)"
    fi
}

listening_or_gone() { port_in_use "$2" || ! kill -0 "$1" 2>/dev/null; }

# Start a daemon in the foreground of its own session, output to LOG, and wait until it
# listens on PORT. Dies with the log tail if it exits or does not listen in time.
start_daemon() {
    local what=$1 port=$2 log=$3
    shift 3
    setsid "$@" </dev/null >>"$log" 2>&1 &
    local pid=$!
    # Stop waiting as soon as it listens or exits.
    if ! wait_until "$WAIT_SECS" listening_or_gone "$pid" "$port" || ! port_in_use "$port"; then
        log_tail "$log"
        if kill -0 "$pid" 2>/dev/null; then
            die "$what (pid $pid) does not listen on port $port after ${WAIT_SECS}s"
        fi
        die "$what died during startup"
    fi
    kill -0 "$pid" 2>/dev/null || { log_tail "$log"; die "$what died during startup"; }
}

# ---------------------------------------------------------------------------------------------
# Installation

ensure_installed() {
    local tool missing=0
    for tool in mfsmaster mfschunkserver mfsmount mfscli mfssetgoal; do
        command -v "$tool" >/dev/null || missing=1
    done
    ((missing)) || return 0
    [[ $(id -u) -eq 0 ]] || die "MooseFS is not installed and installing needs root"
    local pkgs=(moosefs-master moosefs-chunkserver moosefs-client moosefs-cli)
    say "installing ${pkgs[*]} from Debian packages"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y "${pkgs[@]}" >"$LOGDIR/apt.log" 2>&1; then
        log_tail "$LOGDIR/apt.log"
        apt-cache policy "${pkgs[@]}" >&2 || true
        die "apt-get install ${pkgs[*]} failed (see above)"
    fi
    for tool in mfsmaster mfschunkserver mfsmount mfscli mfssetgoal; do
        command -v "$tool" >/dev/null || die "$tool still missing after installing ${pkgs[*]}"
    done
}

# ---------------------------------------------------------------------------------------------
# Configuration (rewritten on every `up`; it only depends on the base directory)

write_configs() {
    local i dir
    mkdir -p "$MASTER_DIR" "$LOGDIR"
    # Daemons run as root: they then read and write anywhere the caller put --base.
    cat >"$MASTER_DIR/mfsmaster.cfg" <<EOF
# Written by bench/peers/moosefs.sh: a loopback-only master for benchmarks.
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = ff-mfsmaster
DATA_PATH = $MASTER_DIR
EXPORTS_FILENAME = $MASTER_DIR/mfsexports.cfg
TOPOLOGY_FILENAME = $MASTER_DIR/mfstopology.cfg
MATOML_LISTEN_HOST = $HOST
MATOML_LISTEN_PORT = $MASTER_ML_PORT
MATOCS_LISTEN_HOST = $CS_ADDR
MATOCS_LISTEN_PORT = $MASTER_CS_PORT
MATOCL_LISTEN_HOST = $HOST
MATOCL_LISTEN_PORT = $MASTER_CL_PORT
EOF
    # Only this host may mount, as root with root's identity kept (as on a local disk).
    echo "$HOST / rw,alldirs,maproot=0:0" >"$MASTER_DIR/mfsexports.cfg"
    : >"$MASTER_DIR/mfstopology.cfg"
    # A new file system starts from the empty metadata file shipped in the package.
    if [[ ! -e $MASTER_DIR/metadata.mfs && ! -e $MASTER_DIR/metadata.mfs.back ]]; then
        cp /var/lib/mfs/metadata.mfs.empty "$MASTER_DIR/metadata.mfs" \
            || die "cannot copy /var/lib/mfs/metadata.mfs.empty (is moosefs-master installed?)"
    fi

    for i in 1 2 3; do
        dir=$BASE/cs$i
        mkdir -p "$dir/chunks"
        cat >"$dir/mfschunkserver.cfg" <<EOF
# Written by bench/peers/moosefs.sh: chunkserver $i of 3, loopback only.
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = ff-mfscs$i
DATA_PATH = $dir
HDD_CONF_FILENAME = $dir/mfshdd.cfg
BIND_HOST = $CS_ADDR
MASTER_HOST = $CS_ADDR
MASTER_PORT = $MASTER_CS_PORT
CSSERV_LISTEN_HOST = $CS_ADDR
CSSERV_LISTEN_PORT = ${CS_PORTS[i - 1]}
# Store blocks of zeros as written: by default a chunkserver punches holes for them, so a
# benchmark writing zeros would not touch the disk at all.
HDD_SPARSIFY_ON_WRITE = 0
EOF
        echo "$dir/chunks" >"$dir/mfshdd.cfg"
    done
}

# ---------------------------------------------------------------------------------------------
# The chunkserver address on the loopback interface (see the top of this file)

address_present() { [[ -n $(ip -o -4 addr show to "$CS_ADDR/32") ]]; }

add_address() {
    address_present && return 0
    if ! ip addr add "$CS_ADDR/32" dev lo label "$ADDR_LABEL" 2>"$LOGDIR/ip.log"; then
        log_tail "$LOGDIR/ip.log"
        die "cannot add $CS_ADDR/32 to the loopback interface (needs root / CAP_NET_ADMIN)"
    fi
}

remove_address() {
    # Only the address we added (recognised by its label), never one that was there before.
    if [[ -n $(ip -o -4 addr show dev lo label "$ADDR_LABEL" to "$CS_ADDR/32") ]]; then
        ip addr del "$CS_ADDR/32" dev lo label "$ADDR_LABEL" || say "could not remove $CS_ADDR from lo"
    fi
}

# ---------------------------------------------------------------------------------------------
# up

start_master() {
    local cfg=$MASTER_DIR/mfsmaster.cfg
    find_pid mfsmaster "$cfg" >/dev/null && return 0
    require_free_port "$MASTER_ML_PORT" "mfsmaster, metaloggers"
    require_free_port "$MASTER_CS_PORT" "mfsmaster, chunkservers"
    require_free_port "$MASTER_CL_PORT" "mfsmaster, clients"
    # -a: if a previous master was killed, replay its change logs instead of refusing to start.
    start_daemon mfsmaster "$MASTER_CL_PORT" "$LOGDIR/mfsmaster.log" \
        mfsmaster -f -a -c "$cfg" start
}

start_chunkservers() {
    local i cfg
    for i in 1 2 3; do
        cfg=$BASE/cs$i/mfschunkserver.cfg
        find_pid mfschunkserver "$cfg" >/dev/null && continue
        require_free_port "${CS_PORTS[i - 1]}" "mfschunkserver $i"
        start_daemon "mfschunkserver $i" "${CS_PORTS[i - 1]}" "$LOGDIR/mfschunkserver$i.log" \
            mfschunkserver -f -c "$cfg" start
    done
}

# The master lists all three chunkservers as connected, each with its disk space counted (a
# chunkserver registers first and reports its space once it has scanned its folder).
# `mfscli -SCS -p` prints one tab-separated line per chunkserver:
#   chunk servers: | ip | port | id | labels | version | load | maintenance | chunks | used | total | ...
chunkservers_registered() {
    local n
    n=$(mfscli -H "$HOST" -P "$MASTER_CL_PORT" -SCS -p 2>/dev/null \
        | awk -F'\t' -v ip="$CS_ADDR" '$2 == ip && $11 > 0 { n++ } END { print n + 0 }')
    ((n == 3))
}

mount_fs() {
    if ! is_mounted; then
        mkdir -p "$MNT"
        # mfsmount forks into the background once it is connected to the master.
        if ! timeout "$WAIT_SECS" mfsmount "$MNT" -H "$HOST" -P "$MASTER_CL_PORT" \
            >>"$LOGDIR/mfsmount.log" 2>&1; then
            log_tail "$LOGDIR/mfsmount.log"
            die "mfsmount of $HOST:$MASTER_CL_PORT at $MNT failed"
        fi
        if ! wait_until "$WAIT_SECS" is_mounted; then
            log_tail "$LOGDIR/mfsmount.log"
            die "mfsmount returned but $MNT is not mounted"
        fi
    fi
    # One copy of each chunk (goal 1) and no trash (deleted files free their space at once).
    # Set on the root only: everything created below inherits it.
    timeout "$WAIT_SECS" mfssetgoal 1 "$MNT" >/dev/null || die "mfssetgoal 1 on $MNT failed"
    timeout "$WAIT_SECS" mfssettrashtime 0 "$MNT" >/dev/null \
        || die "mfssettrashtime 0 on $MNT failed"
}

cmd_up() {
    # A mount left from a master that died would hang everything below: drop it, remount later.
    if is_mounted && { ! find_pid mfsmaster "$MASTER_DIR/mfsmaster.cfg" >/dev/null || ! mount_answers; }; then
        say "the mount at $MNT is stale (its master is gone or it does not answer); remounting"
        drop_mount
    fi
    mkdir -p "$LOGDIR"
    ensure_installed
    write_configs
    add_address
    start_master
    start_chunkservers
    if ! wait_until "$WAIT_SECS" chunkservers_registered; then
        mfscli -H "$HOST" -P "$MASTER_CL_PORT" -SCS -p >&2 || true
        for f in "$LOGDIR"/mfschunkserver{1,2,3}.log "$LOGDIR/mfsmaster.log"; do log_tail "$f"; done
        die "the master does not list all 3 chunkservers after ${WAIT_SECS}s"
    fi
    mount_fs
    echo "$MNT"
}

# ---------------------------------------------------------------------------------------------
# down

cmd_down() {
    local i pid left

    if is_mounted; then
        if ! timeout "$WAIT_SECS" umount "$MNT"; then
            say "umount $MNT failed or timed out; detaching it lazily"
            umount -l "$MNT" || true
        fi
    fi
    # The client lingers a few seconds after the unmount; chunkservers are stopped meanwhile.
    local pids=()
    if pid=$(find_pid mfsmount "$MNT"); then pids+=("$pid"); fi
    for i in 1 2 3; do
        if pid=$(find_pid mfschunkserver "$BASE/cs$i/mfschunkserver.cfg"); then pids+=("$pid"); fi
    done
    stop_pids "${pids[@]}"
    # The master last (SIGTERM makes it save its metadata, which we delete anyway).
    if pid=$(find_pid mfsmaster "$MASTER_DIR/mfsmaster.cfg"); then stop_pids "$pid"; fi
    # Anything else of ours that is left (e.g. after a half-finished `up`).
    # shellcheck disable=SC2046  # word splitting of the pid list is intended
    stop_pids $(our_pids)

    left=$(our_pids)
    [[ -z $left ]] || die "MooseFS processes still running after SIGKILL: $left"
    is_mounted && die "$MNT is still mounted; not deleting $BASE"
    remove_address
    rm -rf "$BASE"
    say "down: no MooseFS processes, mounts or state left under $BASE"
}

# ---------------------------------------------------------------------------------------------
# status

cmd_status() {
    if is_mounted; then
        echo "moosefs: mounted at $MNT"
        return 0
    fi
    if pid=$(find_pid mfsmaster "$MASTER_DIR/mfsmaster.cfg"); then
        echo "moosefs: not mounted (mfsmaster running, pid $pid)"
    else
        echo "moosefs: not mounted"
    fi
    return 1
}

# ---------------------------------------------------------------------------------------------

set_paths() {
    MASTER_DIR=$BASE/master
    MNT=$BASE/mnt
    LOGDIR=$BASE/log
}

peer_main set_paths "$@"
