#!/usr/bin/env bash
# The article's comparison on this machine: 2 and 4 workers x {sync, localsgd,
# asgd, cfmo} x {homogeneous, one worker 1.25x slower, one 2x slower,
# stragglers 5% of steps 5x} at equal total samples, with PyTorch DDP (gloo)
# on the same rows where python3-torch is installed. Run r of a row uses
# --seed r, so REPS runs are REPS seeds: throughput, waits and bytes are their
# medians, accuracy their mean, and the accuracy gap to sync is the mean of
# the per-seed differences with its standard error. Prints a Markdown table
# and the targets' ratios; --record appends them to bench/RESULTS.md.
#
#   bench/train_modes.sh [--record]
#   EPOCHS=2 WORKERS="2 4" REPS=1 SCENARIOS=all MODES="sync localsgd asgd cfmo" DDP=1   (the defaults)
#   SCENARIOS=homogeneous MODES="sync localsgd cfmo" REPS=10 DDP=0 bench/train_modes.sh   (the accuracy gap alone)
#   EXTRA="--delta-dtype fp32" bench/train_modes.sh                                      (flags for every cfmo-train run)
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${EPOCHS:-2}
WORKERS=${WORKERS:-"2 4"}
REPS=${REPS:-1}
SCENARIOS=${SCENARIOS:-all}
MODES=${MODES:-"sync localsgd asgd cfmo"}
DDP=${DDP:-1}
EXTRA=${EXTRA:-}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
TRAIN=${TRAIN:-build/tools/cfmo-train}
PY=/usr/bin/python3
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }
have_torch=false
if [ "$DDP" = 1 ]; then
  have_torch=true
  "$PY" -c 'import torch' 2>/dev/null || { have_torch=false; echo "no python3-torch: DDP rows skipped" >&2; }
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
blas=$("$TRAIN" --data synthetic:64:64 --steps 1 --quiet --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["blas"])')
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-${blas##* }}
H=$("$TRAIN" $EXTRA --print-config | sed -n 's/^sync_interval = //p')

all=("homogeneous|" "slowdown 1=1.25|--slowdown 1=1.25" "slowdown 1=2|--slowdown 1=2" "straggler 0.05:5|--straggler 0.05:5")
scenarios=()
for sc in "${all[@]}"; do
  if [ "$SCENARIOS" = all ] || [ "$SCENARIOS" = "${sc%%|*}" ]; then scenarios+=("$sc"); fi
done
start=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# Each run's summary goes to $tmp/<workers>/<scenario>/<mode>, one JSON line per seed.
for w in $WORKERS; do
  for sc in "${scenarios[@]}"; do
    name=${sc%%|*}; flags=${sc#*|}
    dir="$tmp/$w/$name"; mkdir -p "$dir"
    for mode in $MODES; do
      : > "$dir/$mode"
      for rep in $(seq 1 "$REPS"); do
        # shellcheck disable=SC2086
        "$TRAIN" --data "$DATA" --workers "$w" --mode "$mode" --epochs "$EPOCHS" --seed "$rep" --quiet --json \
          $flags $EXTRA >> "$dir/$mode" 2> "$tmp/err" || { echo "run failed: $mode $w $name" >&2; cat "$tmp/err" >&2; }
      done
      echo "$w $name $mode: done" >&2
    done
    if $have_torch && [ "$name" != "straggler 0.05:5" ]; then
      steps=$(( EPOCHS * 60000 / (w * 64) ))
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 timeout 900 "$PY" bench/pytorch_ddp.py --data "$DATA" --workers "$w" --steps "$steps" \
        $flags 2>/dev/null | tail -1 > "$dir/ddp" || : > "$dir/ddp"
      echo "$w $name ddp: done" >&2
    fi
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

report=$("$PY" - "$tmp" "$H" "$WORKERS" "$MODES" "${scenarios[@]}" <<'EOF'
import json, math, os, statistics, sys
root, H, workers, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
scenarios = [s.split("|")[0] for s in sys.argv[5:]]
def runs(w, sc, mode):
    path = os.path.join(root, w, sc, mode)
    if not os.path.exists(path): return []
    return [json.loads(l) for l in open(path) if l.startswith("{")]
def med(rs, f): return statistics.median(f(r) for r in rs)
rows = ["| workers | scenario | run | samples/s | efficiency | max wait s | bytes sent | test acc (mean of seeds) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
for w in workers:
    for sc in scenarios:
        for mode in modes:
            rs = runs(w, sc, mode)
            if not rs: continue
            acc = statistics.mean(r["test_accuracy"] for r in rs)
            rows.append("| %s | %s | cfmo-train %s | %.0f | %.2f | %.2f | %.0f | %.4f |" % (
                w, sc, mode, med(rs, lambda r: r["samples_per_s"]), med(rs, lambda r: r["efficiency"]),
                med(rs, lambda r: max(p["wait_s"] for p in r["per_worker"])), med(rs, lambda r: r["bytes_sent"]), acc))
        ddp = runs(w, sc, "ddp")
        if ddp:
            rows.append("| %s | %s | PyTorch DDP (gloo) | %.0f | - | - | - | %.4f |" % (
                w, sc, ddp[0]["samples_per_s"], ddp[0]["test_accuracy"]))
notes = []
def gap(w, mode):
    a = {i: r["test_accuracy"] for i, r in enumerate(runs(w, "homogeneous", mode))}
    b = {i: r["test_accuracy"] for i, r in enumerate(runs(w, "homogeneous", "sync"))}
    d = [100 * (a[i] - b[i]) for i in a if i in b]
    if not d: return None
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return statistics.mean(d), se, len(d)
for w in workers:
    cf, ddp = runs(w, "homogeneous", "cfmo"), runs(w, "homogeneous", "ddp")
    if cf and ddp:
        notes.append("- %s workers, homogeneous: cfmo / DDP samples/s = %.2fx (target >= 3x with 2 workers)" % (
            w, med(cf, lambda r: r["samples_per_s"]) / ddp[0]["samples_per_s"]))
    effs = [med(runs(w, sc, "cfmo"), lambda r: r["efficiency"]) for sc in scenarios if runs(w, sc, "cfmo")]
    if effs:
        notes.append("- %s workers: lowest cfmo efficiency over the scenarios = %.2f (target >= 0.9)" % (w, min(effs)))
    for mode in ("cfmo", "localsgd"):
        g = gap(w, mode) if mode in modes and "sync" in modes else None
        if g:
            notes.append("- %s workers, homogeneous: test accuracy %s - sync = %+.2f points, +- %.2f (standard error over %d seeds; target for cfmo: within 0.5)" % (w, mode, g[0], g[1], g[2]))
    sy = runs(w, "homogeneous", "sync")
    if cf and sy:
        notes.append("- %s workers, homogeneous: bytes sent sync / cfmo = %.1fx (target >= H = %d)" % (
            w, med(sy, lambda r: r["bytes_sent"]) / med(cf, lambda r: r["bytes_sent"]), H))
print("\n".join(rows))
print()
print("\n".join(notes))
EOF
)
elapsed=$(( $(date +%s) - start ))
echo "$report"
echo "load average before/after (1, 5, 15 min): $load_before / $load_after; $((elapsed / 60)) min $((elapsed % 60)) s"
if $record; then
  {
    echo
    echo "### cfmo-train modes, $EPOCHS epochs of Fashion-MNIST per row ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores (workers share them); $blas."
    echo "Load average before/after (1, 5, 15 min): $load_before / $load_after. Took $((elapsed / 60)) min $((elapsed % 60)) s."
    echo "Command: \`EPOCHS=$EPOCHS WORKERS=\"$WORKERS\" REPS=$REPS SCENARIOS=$SCENARIOS MODES=\"$MODES\" DDP=$DDP${EXTRA:+ EXTRA=\"$EXTRA\"} bench/train_modes.sh --record\`"
    echo
    echo "$report"
  } >> bench/RESULTS.md
fi
