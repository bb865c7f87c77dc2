#!/usr/bin/env bash
# GlusterFS as a benchmark peer for `freeflow bench`.
#
#   glusterfs.sh up     [--base DIR]   install if needed, start, mount; prints the mount path
#   glusterfs.sh down   [--base DIR]   unmount, stop, kill what is left, delete all state
#   glusterfs.sh status [--base DIR]   says whether the volume is mounted (exit 0 if so, 1 if not)
#
# Layout: one glusterd and one distributed volume of three bricks, all on this host and on
# 127.0.0.1 only. Everything we own lives under DIR (default /tmp/freeflow-peers/glusterfs):
#
#   DIR/glusterd.vol      our own glusterd configuration (working dir and listen address)
#   DIR/state/            glusterd's working directory (instead of /var/lib/glusterd)
#   DIR/bricks/b1..b3     the three bricks
#   DIR/mnt               the FUSE mount that the benchmark writes to
#   DIR/log/              glusterd, CLI and FUSE client logs
#
# glusterd insists on writing a few things outside DIR: brick logs in
# /var/log/glusterfs/bricks/, brick pid files in /var/run/gluster/vols/VOLUME/, brick sockets in
# /var/run/gluster/ and its CLI socket /var/run/glusterd.socket. `down` removes the ones that
# belong to this volume. One glusterd per machine: it always owns port 24007 and that socket.
#
# No systemd here: glusterd is started directly and forks the brick daemons (glusterfsd) itself.
set -euo pipefail

readonly ME="glusterfs.sh"
readonly VOLUME="freeflow"
readonly GLUSTERD_PORT=24007
readonly NBRICKS=3
readonly WAIT_SECS=${PEER_WAIT_SECS:-30}   # upper bound for every wait below
readonly STOP_GRACE_SECS=10
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

BASE=/tmp/freeflow-peers/glusterfs

# ---------------------------------------------------------------------------------------------
# Small helpers

# The gluster CLI, talking to glusterd over its local socket, with a time limit so that a wedged
# glusterd cannot hang us.
gcli() {
    timeout "$WAIT_SECS" gluster --mode=script --glusterd-sock="$SOCK" \
        --log-file="$LOGDIR/cli.log" "$@"
}

glusterd_pid() {
    local pid
    [[ -f $PIDFILE ]] || return 1
    pid=$(<"$PIDFILE")
    # Make sure the pid is still our glusterd, not a recycled number.
    [[ -n $pid ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$VOLFILE" || return 1
    echo "$pid"
}

glusterd_running() { glusterd_pid >/dev/null; }

# Gluster processes (glusterd, brick daemons, FUSE client) whose command line names our base
# directory: these and only these are ours.
our_pids() {
    pids_naming "$BASE/" glusterd glusterfsd glusterfs
}

# gluster refuses "localhost" and "127.0.0.1" as brick hosts, even with force. We need a name
# that resolves to 127.0.0.1 so that the bricks, which we bind to 127.0.0.1, are reachable under
# it. The machine's host name does here (/etc/hosts maps it to 127.0.0.1); Debian's usual
# "127.0.1.1 host" would not do. PEER_GLUSTER_HOST overrides.
brick_host() {
    local name=${PEER_GLUSTER_HOST:-$(hostname)} addr
    addr=$(getent ahostsv4 "$name" | awk 'NR == 1 { print $1 }')
    if [[ $addr != 127.0.0.1 ]]; then
        die "gluster needs a brick host name other than 'localhost' that resolves to 127.0.0.1;" \
            "'$name' resolves to '${addr:-nothing}'. Add a line '127.0.0.1 <name>' to /etc/hosts" \
            "and set PEER_GLUSTER_HOST=<name>."
    fi
    echo "$name"
}

volume_exists() { gcli volume info "$VOLUME" >/dev/null 2>&1; }

volume_started() { gcli volume info "$VOLUME" 2>/dev/null | grep -q '^Status: Started'; }

# All bricks report online in `volume status` (the XML form: the table wraps long brick paths).
bricks_online() {
    local n
    n=$(gcli volume status "$VOLUME" --xml 2>/dev/null | grep -c '<status>1</status>' || true)
    ((n == NBRICKS))
}

brick_logs() {
    local i mangled
    for i in $(seq 1 "$NBRICKS"); do
        # glusterd names a brick's log after its path with "/" turned into "-".
        mangled=$(echo "${BRICKS}/b$i" | sed 's|^/||; s|/|-|g')
        echo "/var/log/glusterfs/bricks/$mangled.log"
    done
}

# ---------------------------------------------------------------------------------------------
# Installation

ensure_installed() {
    local missing=()
    command -v glusterd >/dev/null || missing+=(glusterfs-server)
    command -v gluster >/dev/null || missing+=(glusterfs-server)
    command -v mount.glusterfs >/dev/null || missing+=(glusterfs-client)
    ((${#missing[@]})) || return 0
    [[ $(id -u) -eq 0 ]] || die "GlusterFS is not installed and installing needs root"
    say "installing glusterfs-server glusterfs-client from Debian packages"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y glusterfs-server glusterfs-client \
        >"$LOGDIR/apt.log" 2>&1; then
        log_tail "$LOGDIR/apt.log"
        apt-cache policy glusterfs-server glusterfs-client >&2 || true
        die "apt-get install glusterfs-server glusterfs-client failed (see above)"
    fi
    # The package's post-install script may try to start glusterd through systemd; that fails
    # harmlessly without systemd, but if it did start one on port $GLUSTERD_PORT, say so.
    command -v glusterd >/dev/null || die "glusterd still missing after installing glusterfs-server"
}

# ---------------------------------------------------------------------------------------------
# up

write_glusterd_vol() {
    # Same as the packaged /etc/glusterfs/glusterd.vol, except the working directory lives under
    # our base and every socket (glusterd's and, through it, the bricks') binds to 127.0.0.1.
    cat >"$VOLFILE" <<EOF
volume management
    type mgmt/glusterd
    option working-directory $STATE
    option transport-type socket
    option transport.socket.bind-address 127.0.0.1
    option transport.socket.listen-port $GLUSTERD_PORT
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
EOF
}

glusterd_answers_or_gone() {
    gcli volume list >/dev/null 2>&1 && return 0
    # Once the pid file exists, a missing process means glusterd exited.
    [[ -s $PIDFILE ]] && ! glusterd_running
}

start_glusterd() {
    if glusterd_running; then
        return 0
    fi
    if port_in_use "$GLUSTERD_PORT"; then
        ss -Hltnp "sport = :$GLUSTERD_PORT" >&2 || true
        die "port $GLUSTERD_PORT (glusterd) is already in use by another process (above);" \
            "stop it first (a glusterd started by the package, or another base directory?)"
    fi
    write_glusterd_vol
    rm -f "$PIDFILE"
    glusterd -f "$VOLFILE" -p "$PIDFILE" -l "$LOGDIR/glusterd.log" \
        || { log_tail "$LOGDIR/glusterd.log"; die "glusterd failed to start"; }
    # glusterd daemonises before it listens; wait until the CLI gets an answer, or glusterd is
    # gone.
    if ! wait_until "$WAIT_SECS" glusterd_answers_or_gone || ! glusterd_running; then
        log_tail "$LOGDIR/glusterd.log"
        if glusterd_running; then
            die "glusterd runs but does not answer after ${WAIT_SECS}s"
        fi
        die "glusterd died during startup"
    fi
}

create_volume() {
    local host bricks=() i
    volume_exists && return 0
    host=$(brick_host)
    for i in $(seq 1 "$NBRICKS"); do
        mkdir -p "$BRICKS/b$i"
        bricks+=("$host:$BRICKS/b$i")
    done
    # `force`: gluster refuses bricks on the root file system without it.
    if ! gcli volume create "$VOLUME" transport tcp "${bricks[@]}" force >"$LOGDIR/create.out" 2>&1; then
        cat "$LOGDIR/create.out" >&2
        log_tail "$LOGDIR/glusterd.log"
        die "gluster volume create $VOLUME failed"
    fi
}

start_volume() {
    local f
    if ! volume_started; then
        if ! gcli volume start "$VOLUME" >"$LOGDIR/start.out" 2>&1; then
            cat "$LOGDIR/start.out" >&2
            log_tail "$LOGDIR/glusterd.log"
            die "gluster volume start $VOLUME failed"
        fi
    fi
    if ! wait_until "$WAIT_SECS" bricks_online; then
        gcli volume status "$VOLUME" >&2 || true
        for f in $(brick_logs); do log_tail "$f"; done
        die "not all $NBRICKS bricks came online within ${WAIT_SECS}s"
    fi
}

mount_volume() {
    is_mounted && return 0
    mkdir -p "$MNT"
    if ! timeout "$WAIT_SECS" mount -t glusterfs -o "log-file=$LOGDIR/mount.log" \
        "127.0.0.1:/$VOLUME" "$MNT"; then
        log_tail "$LOGDIR/mount.log"
        die "mounting 127.0.0.1:/$VOLUME at $MNT failed"
    fi
    # mount.glusterfs returns once the client forked; make sure the mount answers.
    if ! wait_until "$WAIT_SECS" mount_answers || ! is_mounted; then
        log_tail "$LOGDIR/mount.log"
        die "the GlusterFS mount at $MNT does not answer"
    fi
}

cmd_up() {
    local pid
    # A mount left from daemons that died is of no use: drop it and mount again below.
    if is_mounted && { ! glusterd_running || ! mount_answers; }; then
        say "the mount at $MNT is stale (glusterd is gone or it does not answer); remounting"
        umount -l "$MNT" 2>/dev/null || true
        for pid in $(pgrep -x glusterfs || true); do
            if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- " $MNT"; then
                stop_pids "$pid"
            fi
        done
    fi
    mkdir -p "$LOGDIR"
    ensure_installed
    start_glusterd
    create_volume
    start_volume
    mount_volume
    echo "$MNT"
}

# ---------------------------------------------------------------------------------------------
# down

cmd_down() {
    local sockets=() pid f left

    # Remember the brick sockets (the -S argument of each glusterfsd) before stopping them;
    # glusterd does not remove them itself.
    for pid in $(our_pids); do
        f=$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | awk 'prev == "-S" { print } { prev = $0 }')
        if [[ -n $f && $f == /var/run/gluster/* ]]; then sockets+=("$f"); fi
    done

    if is_mounted; then
        if ! timeout "$WAIT_SECS" umount "$MNT"; then
            say "umount $MNT failed or timed out; detaching it lazily"
            umount -l "$MNT" || true
        fi
    fi

    if glusterd_running; then
        gcli volume stop "$VOLUME" force >/dev/null 2>&1 || true
        gcli volume delete "$VOLUME" >/dev/null 2>&1 || true
    fi

    if pid=$(glusterd_pid); then stop_pids "$pid"; fi
    # shellcheck disable=SC2046  # word splitting of the pid list is intended
    stop_pids $(our_pids)

    left=$(our_pids)
    [[ -z $left ]] || die "gluster processes still running after SIGKILL: $left"
    is_mounted && die "$MNT is still mounted; not deleting $BASE"

    # State outside the base directory that belongs to this volume.
    rm -f "${sockets[@]}"
    rm -rf "/var/run/gluster/vols/$VOLUME" "/var/log/glusterfs/gfproxy/$VOLUME" \
        "/var/log/glusterfs/snaps/$VOLUME"
    for f in $(brick_logs); do rm -f "$f"; done
    # glusterd also listens on the default socket; drop it if no glusterd is left to own it.
    if [[ -S /var/run/glusterd.socket ]] && ! pgrep -x glusterd >/dev/null; then
        rm -f /var/run/glusterd.socket
    fi

    # Bricks carry a volume id in extended attributes: a new volume would refuse them, so the
    # whole base goes.
    rm -rf "$BASE"
    say "down: no GlusterFS processes, mounts or state left under $BASE"
}

# ---------------------------------------------------------------------------------------------
# status

cmd_status() {
    if is_mounted; then
        echo "glusterfs: mounted at $MNT (volume $VOLUME)"
        return 0
    fi
    if glusterd_running; then
        echo "glusterfs: not mounted (glusterd running, pid $(glusterd_pid))"
    else
        echo "glusterfs: not mounted"
    fi
    return 1
}

# ---------------------------------------------------------------------------------------------

set_paths() {
    VOLFILE=$BASE/glusterd.vol
    PIDFILE=$BASE/glusterd.pid
    # The CLI talks to glusterd only over its default socket (glusterd -S adds a second one that
    # does not serve CLI requests), so there can be one glusterd per machine.
    SOCK=/var/run/glusterd.socket
    STATE=$BASE/state
    BRICKS=$BASE/bricks
    MNT=$BASE/mnt
    LOGDIR=$BASE/log
}

peer_main set_paths "$@"
