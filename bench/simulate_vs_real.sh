#!/usr/bin/env bash
# cfmo-train simulate against the real runs it simulates: 2 and 4 workers,
# homogeneous and with --slowdown 1=2, in sync and cfmo. Each real run logs
# every step's compute time (metrics.jsonl, compute_s); the simulation of the
# same job draws its step times from that run's file, so what is compared is
# the protocol and network model, not a guess of the compute. Prints a
# Markdown table of samples/s and efficiency, real and simulated, and their
# ratio; --record appends it to bench/RESULTS.md.
#
# This host's network is UCX over shared memory, not a switch of known
# links: for each size, the homogeneous sync run's all-reduce time per step
# (its workers' mean wait_s / steps) gives an effective link bandwidth, used
# for every simulation of that size; the other rows are predictions.
#
#   bench/simulate_vs_real.sh [--record]
#   WORKERS="2 4" MODES="sync cfmo" STEPS=400 BATCH=64 MODEL=mlp:512,512   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-"2 4"}
MODES=${MODES:-"sync cfmo"}
STEPS=${STEPS:-400}
BATCH=${BATCH:-64}
MODEL=${MODEL:-mlp:512,512}
DATA=${DATA:-synthetic:8192:784}
TRAIN=${TRAIN:-build/tools/cfmo-train}
. bench/common.sh
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$1" "$2"; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%+.0f%%", 100 * (a / b - 1)}'; }

links=""
table="| workers | scenario | mode | real samples/s | sim samples/s | diff | real efficiency | sim efficiency | diff |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for w in $WORKERS; do
  link=""
  for scenario in homogeneous slow; do
    slow=()
    [ "$scenario" = slow ] && slow=(--slowdown 1=2)
    for mode in $MODES; do
      run="$tmp/$w-$scenario-$mode"
      "$TRAIN" --workers "$w" --mode "$mode" --data "$DATA" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" \
        --log-every 1 --out "$run" --quiet --json "${slow[@]}" > "$tmp/real.json"
      params=$(field "$tmp/real.json" 'd["parameters"]')
      if [ -z "$link" ]; then
        # sync runs first: a ring of W sends 2 (W-1)/W of (params + 3) floats per step in wait_s / steps.
        [ "$mode" = sync ] && [ "$scenario" = homogeneous ] || { echo "MODES must start with sync" >&2; exit 2; }
        gbit=$(field "$tmp/real.json" "8 * 2 * ($w - 1) / $w * (d['parameters'] + 3) * 4 / max(sum(x['wait_s'] for x in d['per_worker']) / $w / $STEPS, 1e-6) / 1e9")
        link="--link-bandwidth $gbit --link-latency 0"
        echo "$w workers: effective link bandwidth $gbit Gb/s" >&2
        links+="$w workers: $gbit Gb/s; "
      fi
      # shellcheck disable=SC2086
      "$TRAIN" simulate --workers "$w" --mode "$mode" --steps "$STEPS" --batch-size "$BATCH" --params "$params" \
        --step-times "$run/metrics.jsonl" $link "${slow[@]}" --json > "$tmp/sim.json"
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
    echo "bench/simulate_vs_real.sh: $MODEL on $DATA, $STEPS steps of $BATCH per worker, simulated from each"
    echo "real run's own metrics.jsonl, with the effective link bandwidth of the homogeneous sync run ($links)."
    echo
    echo "$table"
  } >> bench/RESULTS.md
fi
