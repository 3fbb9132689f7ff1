#!/usr/bin/env bash
# The article's comparison on this machine: 2 and 4 workers x {sync, localsgd,
# asgd, cfmo} x {homogeneous, one worker 1.25x slower, one 2x slower,
# stragglers 5% of steps 5x} at equal total samples, with PyTorch DDP (gloo)
# on the same rows where python3-torch is installed. Prints a Markdown table
# and the targets' ratios; --record appends them to bench/RESULTS.md.
#
#   bench/train_modes.sh [--record]       (EPOCHS=2 WORKERS="2 4" REPS=1 to change)
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${EPOCHS:-2}
WORKERS=${WORKERS:-"2 4"}
REPS=${REPS:-1}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
TRAIN=${TRAIN:-build/tools/cfmo-train}
PY=/usr/bin/python3
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }
have_torch=true
"$PY" -c 'import torch' 2>/dev/null || { have_torch=false; echo "no python3-torch: DDP rows skipped" >&2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
blas=$("$TRAIN" --data synthetic:64:64 --steps 1 --quiet --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["blas"])')
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-${blas##* }}

scenarios=("homogeneous|" "slowdown 1=1.25|--slowdown 1=1.25" "slowdown 1=2|--slowdown 1=2" "straggler 0.05:5|--straggler 0.05:5")
table="| workers | scenario | run | samples/s | efficiency | max wait s | bytes sent | test acc |
| --- | --- | --- | --- | --- | --- | --- | --- |"
summary_py='
import json, sys, statistics
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(k): return statistics.median(r[k] for r in runs)
wait = statistics.median(max(w["wait_s"] for w in r["per_worker"]) for r in runs)
print("%.0f|%.2f|%.2f|%.0f|%.4f" % (med("samples_per_s"), med("efficiency"), wait, med("bytes_sent"), med("test_accuracy")))
'
declare -A result
for w in $WORKERS; do
  for sc in "${scenarios[@]}"; do
    name=${sc%%|*}; flags=${sc#*|}
    for mode in sync localsgd asgd cfmo; do
      : > "$tmp/runs"
      for rep in $(seq 1 "$REPS"); do
        # shellcheck disable=SC2086
        "$TRAIN" --data "$DATA" --workers "$w" --mode "$mode" --epochs "$EPOCHS" --quiet --json $flags \
          >> "$tmp/runs" 2> "$tmp/err" || { echo "run failed: $mode $w $name" >&2; cat "$tmp/err" >&2; }
      done
      row=$("$PY" -c "$summary_py" "$tmp/runs")
      result["$w|$name|$mode"]=$row
      IFS='|' read -r sps eff wait bytes acc <<< "$row"
      table+="
| $w | $name | cfmo-train $mode | $sps | $eff | $wait | $bytes | $acc |"
      echo "$w $name $mode: $row" >&2
    done
    if $have_torch && [ "$name" != "straggler 0.05:5" ]; then
      steps=$(( EPOCHS * 60000 / (w * 64) ))
      # shellcheck disable=SC2086
      ddp=$(OMP_NUM_THREADS=1 timeout 900 "$PY" bench/pytorch_ddp.py --data "$DATA" --workers "$w" --steps "$steps" \
              $flags 2>/dev/null | tail -1) || ddp=""
      if [ -n "$ddp" ]; then
        row=$(echo "$ddp" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print("%.0f|-|-|-|%.4f" % (d["samples_per_s"], d["test_accuracy"]))')
        result["$w|$name|ddp"]=$row
        IFS='|' read -r sps eff wait bytes acc <<< "$row"
        table+="
| $w | $name | PyTorch DDP (gloo) | $sps | - | - | - | $acc |"
        echo "$w $name ddp: $row" >&2
      fi
    fi
  done
done

field() { echo "${result[$1]:-}" | cut -d'|' -f"$2"; }
notes=""
for w in $WORKERS; do
  cf=$(field "$w|homogeneous|cfmo" 1); ddp=$(field "$w|homogeneous|ddp" 1)
  [ -n "$ddp" ] && notes+="- $w workers, homogeneous: cfmo / DDP samples/s = $(awk -v a="$cf" -v b="$ddp" 'BEGIN{printf "%.2f", a/b}')x (target >= 3x with 2 workers)
"
  min_eff=1
  for sc in "${scenarios[@]}"; do
    e=$(field "$w|${sc%%|*}|cfmo" 2); min_eff=$(awk -v a="$min_eff" -v b="$e" 'BEGIN{print (b<a)?b:a}')
  done
  notes+="- $w workers: lowest cfmo efficiency over the scenarios = $min_eff (target >= 0.9)
"
  acc_s=$(field "$w|homogeneous|sync" 5); acc_c=$(field "$w|homogeneous|cfmo" 5)
  notes+="- $w workers, homogeneous: test accuracy cfmo - sync = $(awk -v a="$acc_c" -v b="$acc_s" 'BEGIN{printf "%+.2f", (a-b)*100}') points (target within 0.5)
"
  by_s=$(field "$w|homogeneous|sync" 4); by_c=$(field "$w|homogeneous|cfmo" 4)
  notes+="- $w workers, homogeneous: bytes sent sync / cfmo = $(awk -v a="$by_s" -v b="$by_c" 'BEGIN{printf "%.1f", a/b}')x (target >= H = 10)
"
done

report="$table

$notes"
echo "$report"
if $record; then
  {
    echo
    echo "### cfmo-train modes, $EPOCHS epochs of Fashion-MNIST per row ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores (workers share them); $blas."
    echo "Command: \`EPOCHS=$EPOCHS WORKERS=\"$WORKERS\" REPS=$REPS bench/train_modes.sh --record\`"
    echo
    echo "$report"
  } >> bench/RESULTS.md
fi
