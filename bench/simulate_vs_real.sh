#!/usr/bin/env bash
# cfmo-train simulate against the real runs it simulates: 2 and 4 workers,
# homogeneous and with --slowdown 1=2, in sync and cfmo. Each real run logs
# every step's compute time (metrics.jsonl, compute_s); the simulation of the
# same job draws its step times from that run's file, so what is compared is
# the protocol and network model, not a guess of the compute. Prints a
# Markdown table of samples/s and efficiency, real and simulated, and their
# ratio; --record appends it to bench/RESULTS.md.
#
#   bench/simulate_vs_real.sh [--record]
#   WORKERS="2 4" MODES="sync cfmo" STEPS=400 BATCH=64 MODEL=mlp:512,512   (the defaults)
#   LINK="--link-bandwidth 40 --link-latency 5"   the network model of this host (shared memory)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-"2 4"}
MODES=${MODES:-"sync cfmo"}
STEPS=${STEPS:-400}
BATCH=${BATCH:-64}
MODEL=${MODEL:-mlp:512,512}
DATA=${DATA:-synthetic:8192:784}
LINK=${LINK:-"--link-bandwidth 40 --link-latency 5"}
TRAIN=${TRAIN:-build/tools/cfmo-train}
. bench/common.sh
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$1" "$2"; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%+.0f%%", 100 * (a / b - 1)}'; }

table="| workers | scenario | mode | real samples/s | sim samples/s | diff | real efficiency | sim efficiency | diff |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for w in $WORKERS; do
  for scenario in homogeneous slow; do
    slow=()
    [ "$scenario" = slow ] && slow=(--slowdown 1=2)
    for mode in $MODES; do
      run="$tmp/$w-$scenario-$mode"
      "$TRAIN" --workers "$w" --mode "$mode" --data "$DATA" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" \
        --log-every 1 --out "$run" --quiet --json "${slow[@]}" > "$tmp/real.json"
      params=$(field "$tmp/real.json" 'd["parameters"]')
      # shellcheck disable=SC2086
      "$TRAIN" simulate --workers "$w" --mode "$mode" --steps "$STEPS" --batch-size "$BATCH" --params "$params" \
        --step-times "$run/metrics.jsonl" $LINK "${slow[@]}" --json > "$tmp/sim.json"
      real_sps=$(field "$tmp/real.json" 'd["samples_per_s"]')
      real_eff=$(field "$tmp/real.json" 'd["efficiency"]')
      sim_sps=$(field "$tmp/sim.json" 'd["simulate"]["runs"][0]["samples_per_s"]')
      sim_eff=$(field "$tmp/sim.json" 'd["simulate"]["runs"][0]["efficiency"]')
      row=$(printf '| %s | %s | %s | %.0f | %.0f | %s | %.2f | %.2f | %s |' "$w" "$scenario" "$mode" "$real_sps" \
        "$sim_sps" "$(pct "$sim_sps" "$real_sps")" "$real_eff" "$sim_eff" "$(pct "$sim_eff" "$real_eff")")
      echo "$row" >&2
      table+=$'\n'"$row"
    done
  done
done
echo "$table"
if $record; then
  {
    echo
    echo "## cfmo-train simulate against real runs ($(date -u +%Y-%m-%d), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
    echo
    echo "bench/simulate_vs_real.sh: $MODEL on $DATA, $STEPS steps of $BATCH per worker, simulated with $LINK"
    echo "from each real run's own metrics.jsonl."
    echo
    echo "$table"
  } >> bench/RESULTS.md
fi
