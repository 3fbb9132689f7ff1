#!/usr/bin/env bash
# PyTorch DDP (gloo) against cfmo.Reconciler in mode cfmo, the same PyTorch
# MLP on Fashion-MNIST (784-256-128-10, AdamW, batch 64 per worker, one
# thread per worker), 2 workers, homogeneous and with rank 1 2x slow, at
# equal total samples: samples/s, efficiency, test accuracy, bytes sent, and
# what rec.step costs on a step (the median step does not reconcile).
# DDP is bench/pytorch_ddp.py; cfmo is examples/torch_mlp.py under
# python3 -m cfmo.launch. Prints a Markdown table; --record appends it to
# bench/RESULTS.md with the command.
#
#   bench/torch_cfmo.sh [--record]
#   SAMPLES=40000 WORKERS=2 SCENARIOS="homogeneous slow" (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
SAMPLES=${SAMPLES:-40000}
WORKERS=${WORKERS:-2}
SCENARIOS=${SCENARIOS:-"homogeneous slow"}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
BUILD=${BUILD:-build}
PY=/usr/bin/python3
record=false
[ "${1:-}" = "--record" ] && record=true
[ -f "$BUILD/python/cfmo/__init__.py" ] || { echo "build the Python module first: make build" >&2; exit 2; }
"$PY" -c 'import torch' 2>/dev/null || { echo "no python3-torch: nothing to compare" >&2; exit 2; }
export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
steps=$(( SAMPLES / (WORKERS * 64) ))
for sc in $SCENARIOS; do
  flags=()
  [ "$sc" = slow ] && flags=(--slowdown 1=2)
  timeout 600 "$PY" bench/pytorch_ddp.py --data "$DATA" --workers "$WORKERS" --steps "$steps" "${flags[@]}" \
    2>"$tmp/err" | tail -1 > "$tmp/ddp-$sc" || { echo "ddp $sc failed" >&2; cat "$tmp/err" >&2; exit 1; }
  echo "$sc ddp: done" >&2
  timeout 600 "$PY" -m cfmo.launch -n "$WORKERS" examples/torch_mlp.py --data "$DATA" --mode cfmo \
    --samples "$(( steps * WORKERS * 64 ))" --json "${flags[@]}" 2>"$tmp/err" | tail -1 > "$tmp/cfmo-$sc" ||
    { echo "cfmo $sc failed" >&2; cat "$tmp/err" >&2; exit 1; }
  echo "$sc cfmo: done" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

table=$("$PY" - "$tmp" "$WORKERS" $SCENARIOS <<'PYEOF'
import json, os, sys
root, workers, scenarios = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
params = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
print("| scenario | peer | samples | samples/s | efficiency | test accuracy | bytes sent | rec.step / step (median) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for sc in scenarios:
    ddp = json.load(open(os.path.join(root, f"ddp-{sc}")))
    cf = json.load(open(os.path.join(root, f"cfmo-{sc}")))
    # gloo's ring all-reduce: each rank sends 2 (W-1)/W of the fp32 gradient every step (computed, not measured).
    steps = ddp["samples"] // (workers * 64)
    ddp_bytes = int(steps * workers * 2 * (workers - 1) / workers * 4 * params)
    solo_sum = cf["samples_per_s"] / cf["efficiency"]
    name = "homogeneous" if sc == "homogeneous" else "rank 1 2x slow"
    print(f"| {name} | DDP gloo | {ddp['samples']} | {ddp['samples_per_s']:.0f} | {ddp['samples_per_s'] / solo_sum:.2f}* "
          f"| {ddp['test_accuracy']:.4f} | {ddp_bytes / 1e6:.1f} MB* | - |")
    print(f"| {name} | cfmo | {cf['samples']} | {cf['samples_per_s']:.0f} | {cf['efficiency']:.2f} "
          f"| {cf['test_accuracy']:.4f} | {cf['bytes_sent'] / 1e6:.1f} MB | {cf['rec_step_us']:.1f} us / "
          f"{cf['step_us']:.0f} us = {100 * cf['rec_step_us'] / cf['step_us']:.2f}% |")
    print(f"| {name} | cfmo / DDP | | **{cf['samples_per_s'] / ddp['samples_per_s']:.2f}x** | | "
          f"{100 * (cf['test_accuracy'] - ddp['test_accuracy']):+.2f} points | | |")
PYEOF
)
echo "$table"
if $record; then
  {
    echo
    echo "### PyTorch DDP vs cfmo.Reconciler (mode cfmo), the Python module ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(getconf _NPROCESSORS_ONLN) cores, load average $load_before before and $load_after after (other builds ran)."
    echo "Command: \`SAMPLES=$SAMPLES WORKERS=$WORKERS bench/torch_cfmo.sh --record\`"
    echo
    echo "$table"
    echo
    echo "\\* DDP's efficiency is its samples/s over the sum of the workers' solo rates measured in"
    echo "the cfmo run of the same row; its bytes are computed (gloo's ring: 2 (W-1)/W of the fp32"
    echo "gradient per rank and step), not measured. cfmo's bytes are the communicator's count."
  } >> bench/RESULTS.md
fi
