#!/usr/bin/env bash
# Failover pause of replicated metadata (docs/replication.md, "Replicated metadata"),
# measured with real processes on loopback: three metadata servers under Raft, three I/O
# servers with two copies of each stripe, each its own process with default timeouts, a
# mount, and a writer that creates 64 KiB files with fsync in a loop. KILLS times the
# metadata server that leads is killed with SIGKILL and started again RESTART_AFTER
# seconds later (default 5: the others elect a new leader before it is back). The pause of a kill is the longest gap between the writer's
# completed files from the last one before it until the next kill.
#
#   bench/meta_failover.sh            # 10 kills; KILLS=N, RESTART_AFTER=s, FREEFLOW=path, DIR=scratch dir
#
# Prints each pause, their median and maximum, and whether the writer saw an error.
set -euo pipefail
cd "$(dirname "$0")/.."
FF=${FREEFLOW:-$PWD/target/release/freeflow}
DIR=${DIR:-/var/tmp/freeflow-meta-failover}
KILLS=${KILLS:-10}
RESTART_AFTER=${RESTART_AFTER:-5}
MNT=$DIR/mnt

cleanup() {
  [ -n "${WRITER:-}" ] && kill "$WRITER" 2>/dev/null || true
  fusermount3 -u "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null || true
  for pid in "${PIDS[@]:-}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

rm -rf "$DIR"
mkdir -p "$DIR"
"$FF" init --out "$DIR" --meta-hosts 127.0.0.1,127.0.0.1,127.0.0.1 \
  --io-hosts 127.0.0.1,127.0.0.1,127.0.0.1 --key-path "$DIR/cluster.key" --data-root "$DIR/data" \
  --replicas 2 >/dev/null
declare -a PIDS
start_meta() { "$FF" meta --config "$DIR/meta-$1.toml" >>"$DIR/meta-$1.log" 2>&1 & PIDS[$1]=$!; }
for id in 1 2 3; do start_meta "$id"; done
for i in 0 1 2; do "$FF" io --config "$DIR/io-$i.toml" >"$DIR/io-$i.log" 2>&1 & PIDS[$((10 + i))]=$!; done
in_service() { "$FF" --cluster "$DIR/client.toml" status 2>/dev/null | grep -cE '^[0-9]+ .* in service ' || true; }
for _ in $(seq 200); do [ "$(in_service)" = 3 ] && break; sleep 0.1; done
mkdir -p "$MNT"
"$FF" mount "$DIR/client.toml" "$MNT" >"$DIR/mount.log" 2>&1 &
PIDS[20]=$!
for _ in $(seq 100); do mountpoint -q "$MNT" && break; sleep 0.1; done

python3 bench/fsync_writer.py "$MNT" "$DIR/done.txt" &
WRITER=$!
sleep 2
# The member that leads now: the last "leading" line of all the logs.
leader() { grep -h "leading the metadata cluster" "$DIR"/meta-*.log | sort | tail -n 1 | sed -E 's/.*node=([0-9]+).*/\1/'; }
: >"$DIR/kills.txt"
for k in $(seq "$KILLS"); do
  victim=$(leader)
  date +%s.%N >>"$DIR/kills.txt"
  kill -9 "${PIDS[$victim]}" || echo "member $victim was not running" >&2
  sleep "$RESTART_AFTER"
  start_meta "$victim"
  sleep 3
done
date +%s.%N >>"$DIR/kills.txt"
sleep 1
kill "$WRITER"
WRITER=

python3 - "$DIR/done.txt" "$DIR/kills.txt" <<'PY'
import statistics, sys
done = [l.split() for l in open(sys.argv[1])]
errors = [l for l in done if l[0] == "ERROR"]
times = [float(l[0]) for l in done if l[0] != "ERROR"]
kills = [float(l) for l in open(sys.argv[2])]
pauses = []
for start, end in zip(kills, kills[1:]):
    before = [t for t in times if t <= start]
    window = [t for t in times if start < t <= end]
    points = ([before[-1]] if before else [start]) + window
    pauses.append(max(b - a for a, b in zip(points, points[1:])) if len(points) > 1 else end - start)
print("pauses (s):", " ".join(f"{p:.2f}" for p in pauses))
print(f"median {statistics.median(pauses):.2f} s, max {max(pauses):.2f} s; {len(times)} files, {len(errors)} errors")
for line in errors[:5]:
    print(" ".join(line))
PY
