#!/usr/bin/env bash
# Goodput under failures (issue 16): 4 rank processes on this host for
# DURATION seconds of --time-limit, in sync --elastic, localsgd --elastic and
# cfmo, once without faults and once with a rank killed (SIGKILL) every
# KILL_EVERY seconds (ranks 3, 2, ... in turn; rank 0, the keeper, lives).
# Where cfmo-train has --join, each killed rank is restarted RESTART_AFTER
# seconds later with --join to the job (and the first steps' times of the
# joins are printed); without it the world shrinks by one at each kill.
# Goodput: samples trained per second of wall time (the keeper's summary,
# a lost rank counted up to its last reconciliation) over the fault-free
# run's; accuracy: the final test accuracy against the fault-free run's.
# Prints a Markdown table; --record appends it to bench/RESULTS.md.
#
#   bench/elastic.sh [--record]
#   DURATION=120 KILL_EVERY=15 RESTART_AFTER=5 MODES="sync localsgd cfmo" KILLS=3   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-120}
KILL_EVERY=${KILL_EVERY:-15}
RESTART_AFTER=${RESTART_AFTER:-5}
KILLS=${KILLS:-3}
MODES=${MODES:-"sync localsgd cfmo"}
TRAIN=${TRAIN:-build/tools/cfmo-train}
PY=/usr/bin/python3
W=4
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }
can_join=false
"$TRAIN" --help | grep -q -- '--join' && can_join=true

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run MODE FAULTS: prints "samples wall_s accuracy lost" of the keeper's summary.
run() {
  local mode=$1 faults=$2 dir="$tmp/$1-$2" port
  mkdir -p "$dir"
  port=$(free_port)
  local flags=(--mode "$mode" --epochs 0 --time-limit "${DURATION}s" --json --quiet)
  [ "$mode" != cfmo ] && flags+=(--elastic)
  pids=()
  for r in $(seq 0 $((W - 1))); do
    RANK=$r WORLD_SIZE=$W CFMO_RENDEZVOUS=127.0.0.1:$port "$TRAIN" "${flags[@]}" >"$dir/out-$r" 2>"$dir/err-$r" &
    pids+=($!)
  done
  if [ "$faults" = faults ]; then
    local victim=$((W - 1))
    for k in $(seq 1 "$KILLS"); do
      sleep "$KILL_EVERY"
      kill -9 "${pids[$victim]}" 2>/dev/null || true
      wait "${pids[$victim]}" 2>/dev/null || true  # reaped at once, as a launcher does
      if $can_join; then
        sleep "$RESTART_AFTER"
        RANK=$victim WORLD_SIZE=$W "$TRAIN" "${flags[@]}" --join 127.0.0.1:$port >"$dir/out-$victim-$k" \
          2>"$dir/err-$victim-$k" &
        pids[$victim]=$!
      else
        victim=$((victim - 1))
      fi
    done
  fi
  wait "${pids[0]}" || { echo "$mode $faults: rank 0 failed:" >&2; tail -3 "$dir/err-0" >&2; }
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  "$PY" - "$dir/out-0" <<'PYEOF'
import json, sys
s = None
for line in open(sys.argv[1]):
    if line.startswith('{'): s = json.loads(line)
print(s["samples"], s["wall_s"], s["test_accuracy"], len(s.get("lost_ranks", [])))
PYEOF
}

what="kill one of $W ranks every ${KILL_EVERY}s, $KILLS times"
$can_join && what+=", each restarted with --join ${RESTART_AFTER}s later" || what+=" (no --join: not restarted)"
table="| mode | fault-free samples/s | with faults samples/s | goodput | accuracy (fault-free / faults) | lost |
|---|---|---|---|---|---|"
for mode in $MODES; do
  read -r s0 w0 a0 _ < <(run "$mode" none)
  read -r s1 w1 a1 l1 < <(run "$mode" faults)
  row=$("$PY" -c "
s0,w0,a0,s1,w1,a1=$s0,$w0,$a0,$s1,$w1,$a1
r0=s0/w0; r1=s1/w1
print(f'| {\"sync --elastic\" if \"$mode\"==\"sync\" else \"$mode\" + (\" --elastic\" if \"$mode\"==\"localsgd\" else \"\")} | {r0:.0f} | {r1:.0f} | {r1/r0:.2f} | {a0:.4f} / {a1:.4f} | $l1 |')")
  table+=$'\n'"$row"
  echo "$row" >&2
done
echo "$what, ${DURATION}s each run:"
echo "$table"
if $record; then
  {
    echo
    echo "### Goodput under failures (bench/elastic.sh, $(date -u +%Y-%m-%d))"
    echo
    echo "$what, ${DURATION}s of --time-limit each run, default model and data, loaded machine: ${LOAD_NOTE:-other jobs running}."
    echo
    echo "$table"
  } >>bench/RESULTS.md
fi
