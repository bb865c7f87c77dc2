#!/usr/bin/env bash
# Failover pause and resync of replicated data (docs/replication.md), measured with real
# processes on loopback: a cluster from `freeflow init --replicas 2` (one meta server, three
# I/O servers, each its own process, default timeouts), a mount, and a writer that creates
# 64 KiB files with fsync in a loop. KILLS times, an I/O server (in turn) is killed with
# SIGKILL, started again after RESTART_AFTER seconds (default 8: past server_down_after_ms,
# 5 s, so the writer goes on without it), and waited for until it is back in service. The
# pause of a kill is the longest gap between the writer's completed files from the last one
# before it until the server is back.
#
#   bench/failover.sh                 # 10 kills; KILLS=N, RESTART_AFTER=s, FREEFLOW=path, DIR=scratch dir
#
# Prints each pause, their median and maximum, whether the writer saw an error, and each
# resync's line from the I/O server logs.
set -euo pipefail
cd "$(dirname "$0")/.."
FF=${FREEFLOW:-$PWD/target/release/freeflow}
DIR=${DIR:-/var/tmp/freeflow-failover}
KILLS=${KILLS:-10}
RESTART_AFTER=${RESTART_AFTER:-8}
MNT=$DIR/mnt

cleanup() {
  [ -n "${WRITER:-}" ] && kill "$WRITER" 2>/dev/null || true
  fusermount3 -u "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null || true
  for pid in "${PIDS[@]:-}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

rm -rf "$DIR"
mkdir -p "$DIR"
"$FF" init --out "$DIR" --meta-host 127.0.0.1 --io-hosts 127.0.0.1,127.0.0.1,127.0.0.1 \
  --key-path "$DIR/cluster.key" --data-root "$DIR/data" --replicas 2 >/dev/null
# Metrics endpoints, so that `freeflow status` can show a syncing server's progress.
for i in 0 1 2; do echo "metrics_address = \"127.0.0.1:$((7800 + i))\"" >>"$DIR/io-$i.toml"; done
declare -a PIDS
"$FF" meta --config "$DIR/meta.toml" >"$DIR/meta.log" 2>&1 &
PIDS[3]=$!
start_io() { "$FF" io --config "$DIR/io-$1.toml" >>"$DIR/io-$1.log" 2>&1 & PIDS[$1]=$!; }
for i in 0 1 2; do start_io "$i"; done
# Servers whose row in the status table says "in service" (not the lines after it).
in_service() { "$FF" --cluster "$DIR/client.toml" status 2>/dev/null | grep -cE '^[0-9]+ .* in service ' || true; }
for _ in $(seq 100); do [ "$(in_service)" = 3 ] && break; sleep 0.1; done
mkdir -p "$MNT"
"$FF" mount "$DIR/client.toml" "$MNT" >"$DIR/mount.log" 2>&1 &
PIDS[4]=$!
for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.1; done

python3 bench/fsync_writer.py "$MNT" "$DIR/done.txt" &
WRITER=$!
sleep 2
: >"$DIR/kills.txt"
for k in $(seq "$KILLS"); do
  victim=$(( (k - 1) % 3 ))
  date +%s.%N >>"$DIR/kills.txt"
  kill -9 "${PIDS[$victim]}"
  sleep "$RESTART_AFTER"
  start_io "$victim"
  for _ in $(seq 600); do
    "$FF" --cluster "$DIR/client.toml" status >"$DIR/status.txt" 2>/dev/null || true
    grep -q "resync" "$DIR/status.txt" && grep "resync" "$DIR/status.txt" >>"$DIR/resync-lines.txt"
    [ "$(grep -cE '^[0-9]+ .* in service ' "$DIR/status.txt")" = 3 ] && break
    sleep 0.1
  done
  sleep 1
done
kill "$WRITER"
WRITER=

python3 - "$DIR/done.txt" "$DIR/kills.txt" "$RESTART_AFTER" <<'EOF'
import statistics, sys
lines = open(sys.argv[1]).read().split("\n")
errors = [line for line in lines if line.startswith("ERROR")]
done = [float(line) for line in lines if line and not line.startswith("ERROR")]
kills = [float(line) for line in open(sys.argv[2]).read().split()]
window = float(sys.argv[3]) + 5
pauses = []
for kill in kills:
    # The longest gap between completions from the last one before the kill to the end of
    # the outage (the first files after a kill may still complete on other chains).
    before = max([t for t in done if t <= kill], default=kill)
    times = [before] + [t for t in done if kill < t <= kill + window]
    if len(times) < 2:
        print(f"kill at {kill:.3f}: the writer never completed again")
        continue
    pause = max(b - a for a, b in zip(times, times[1:]))
    pauses.append(pause)
    print(f"kill at {kill:.3f}: pause {pause:.2f} s")
print(f"{len(done)} files written, {len(errors)} errors seen by the writer")
for error in errors[:5]:
    print("  " + error)
if pauses:
    print(f"pause over {len(pauses)} kills: median {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s")
EOF
echo "what freeflow status said of the copies in progress (last 3 lines):"
tail -3 "$DIR/resync-lines.txt" 2>/dev/null || true
grep -h "resync done" "$DIR"/io-*.log | sed 's/^.*resync done/resync done/' | sort | uniq -c | head -20
