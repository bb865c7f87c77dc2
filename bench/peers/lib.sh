# Helpers shared by the peer scripts (glusterfs.sh, moosefs.sh, cephfs.sh); sourced, not run.
# The sourcing script sets ME (its name, for messages), MNT (its mount point) and
# STOP_GRACE_SECS (how long a daemon gets between SIGTERM and SIGKILL), defines cmd_up,
# cmd_down and cmd_status, and ends with `peer_main SET_PATHS "$@"`.

say() { echo "$ME: $*" >&2; }

die() {
    echo "$ME: error: $*" >&2
    exit 1
}

# Show the end of a log file to explain a failure.
log_tail() {
    local file=$1
    if [[ -s $file ]]; then
        echo "---- last lines of $file ----" >&2
        tail -n 25 "$file" >&2
        echo "----" >&2
    else
        echo "($file is empty or missing)" >&2
    fi
}

# wait_until SECONDS COMMAND...: run COMMAND every 0.2 s until it succeeds; fail after SECONDS.
wait_until() {
    local limit=$1
    shift
    local deadline=$((SECONDS + limit))
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

port_in_use() { [[ -n $(ss -Hltn "sport = :$1") ]]; }

# findmnt reads the mount table only, so this never touches (nor hangs on) the mount itself.
is_mounted() { findmnt -rn -M "$MNT" >/dev/null 2>&1; }

# The mount answers a statfs within 5 s. A client whose servers are gone may block every
# request on the mount (MooseFS's retries for minutes).
mount_answers() { timeout -s KILL 5 stat -f "$MNT" >/dev/null 2>&1; }

# Stop the given pids: SIGTERM, up to STOP_GRACE_SECS, then SIGKILL.
stop_pids() {
    local pids=("$@") pid alive
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 $((STOP_GRACE_SECS * 5))); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || return 0
        sleep 0.2
    done
    say "processes ${pids[*]} ignored SIGTERM for $STOP_GRACE_SECS s, sending SIGKILL"
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

usage() {
    echo "usage: $ME up|down|status [--base DIR]" >&2
    exit 2
}

# peer_main SET_PATHS ARGS...: parse "up|down|status [--base DIR]", make BASE absolute and
# without a trailing slash (process command lines are matched against it), call SET_PATHS
# to set the script's paths under it, then run cmd_up, cmd_down or cmd_status.
peer_main() {
    local set_paths=$1
    shift
    local cmd=${1:-}
    [[ -n $cmd ]] || usage
    shift
    while (($#)); do
        case $1 in
            --base) [[ $# -ge 2 ]] || usage; BASE=$2; shift 2 ;;
            --base=*) BASE=${1#--base=}; shift ;;
            *) usage ;;
        esac
    done
    BASE=$(realpath -m -- "$BASE")
    [[ $BASE != / ]] || die "--base must not be /"
    "$set_paths"
    case $cmd in
        up) cmd_up ;;
        down) cmd_down ;;
        status) cmd_status ;;
        *) usage ;;
    esac
}

# find_pid NAME TEXT: the pid of a running process named NAME whose command line contains
# TEXT (its config file, or the mount point); nothing, and failure, if there is none.
find_pid() {
    local name=$1 text=$2 pid
    for pid in $(pgrep -x "$name" || true); do
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$text"; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

# pids_naming TEXT NAME...: every running process named one of NAME... whose command line
# contains TEXT, one pid a line.
pids_naming() {
    local text=$1 name pid
    shift
    for name in "$@"; do
        for pid in $(pgrep -x "$name" || true); do
            if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$text"; then
                echo "$pid"
            fi
        done
    done
}

