#!/usr/bin/env bash
# How soon a restarted rank serves (issue 16): 3 cfmo ranks on this host
# (Fashion-MNIST, the default MLP, --peer-timeout 3), started by hand as a
# launcher would; once rank 2 trained, it is killed (SIGKILL) and, when rank
# 0 says so, restarted with the same command, so that it rejoins. Per join:
#   taken in -> first step  the run's clock at the joiner's first step (its
#                           own "joined" metrics line) less the run's clock
#                           when rank 0's transport took it in (rank 0's
#                           "joined" line): the time its shards go unserved
#                           (it serves them once its join is done, just
#                           before its first step)
#   first_step_s            the joiner's seconds from its process's start
#                           to the end of its first step
# Each of REPS reps runs every binary of BINS once, in turn (so a pair
# shares the machine's load); prints one row per join and the medians.
#
#   bench/join_setup.sh
#   BINS="/path/to/old/cfmo-train build/tools/cfmo-train" REPS=5 bench/join_setup.sh
#   DURATION=25 EXTRA="--data synthetic:60000:256" bench/join_setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/common.sh
. bench/common.sh
BINS=${BINS:-build/tools/cfmo-train}
REPS=${REPS:-3}
DURATION=${DURATION:-25}
EXTRA=${EXTRA:-}
for b in $BINS; do [ -x "$b" ] || { echo "no binary $b (build first: make build)" >&2; exit 2; }; done

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# one_join BIN DIR: prints "TAKEN_IN_TO_FIRST_STEP FIRST_STEP_S", or "- -".
one_join() {
  local bin=$1 dir=$2 port r
  mkdir -p "$dir"
  port=$(free_port)
  # shellcheck disable=SC2206
  local flags=(--mode cfmo --epochs 0 --time-limit "${DURATION}s" --log-every 10 --json --quiet
               --peer-timeout 3 --out "$dir/run" $EXTRA)
  pids=()
  for r in 0 1 2; do
    RANK=$r WORLD_SIZE=3 CFMO_RENDEZVOUS=127.0.0.1:$port "$bin" "${flags[@]}" >"$dir/out-$r" 2>"$dir/err-$r" &
    pids+=($!)
  done
  until grep -q '"type":"step"' "$dir/run/metrics-rank-2.jsonl" 2>/dev/null; do sleep 0.2; done
  sleep 1
  kill -9 "${pids[2]}"; wait "${pids[2]}" 2>/dev/null || true
  until grep -q "rank 2 lost" "$dir/err-0"; do sleep 0.05; done
  RANK=2 WORLD_SIZE=3 CFMO_RENDEZVOUS=127.0.0.1:$port "$bin" "${flags[@]}" >"$dir/out-2b" 2>"$dir/err-2b" &
  pids+=($!)
  for p in "${pids[0]}" "${pids[1]}" "${pids[3]}"; do wait "$p" || true; done
  "$PY" - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def joined(f, own):
    out = []
    for line in open(f):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("type") == "membership" and m.get("event") == "joined" and ("first_step_s" in m) == own:
            out.append(m)
    return out
taken = joined(f"{d}/run/metrics.jsonl", False)
own = joined(f"{d}/run/metrics-rank-2.jsonl", True)
if taken and own:
    print(f"{own[-1]['wall_s'] - taken[-1]['wall_s']:.2f} {own[-1]['first_step_s']:.2f}")
else:
    print("- -")
PY
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '| binary | rep | taken in -> first step (s) | first_step_s |\n| --- | --- | --- | --- |\n'
declare -A served started
for rep in $(seq 1 "$REPS"); do
  for b in $BINS; do
    read -r s f < <(one_join "$b" "$tmp/$rep-$(echo "$b" | tr '/' '_')")
    printf '| %s | %d | %s | %s |\n' "$b" "$rep" "$s" "$f"
    [ "$s" != - ] && served[$b]="${served[$b]:-} $s" && started[$b]="${started[$b]:-} $f"
  done
done
for b in $BINS; do
  # shellcheck disable=SC2086
  printf '| %s | median | %s | %s |\n' "$b" "$(median ${served[$b]:-0})" "$(median ${started[$b]:-0})"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
