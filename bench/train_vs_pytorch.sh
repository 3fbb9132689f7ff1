#!/usr/bin/env bash
# cfmo-train (one worker) against PyTorch on the same MLP, data and optimizer,
# in the same run: MLP 784-256-128-10, batch 64, AdamW lr 1e-3, one thread each.
# Runs alternate A/B; medians are reported; peak RSS from /usr/bin/time -v.
# Then cfmo-train's accuracy per epoch over 10 epochs.
#
#   bench/train_vs_pytorch.sh [--record]      (REPS=5 STEPS=3000 EPOCHS=10 to change)
#
# Both peers get the same OpenBLAS kernel: the one cfmo-train selects (see
# OPENBLAS_CORETYPE in cfmo-train(1)); PyTorch (Debian python3-torch) uses
# the same libopenblas for its GEMMs. Both flush denormals (cfmo-train always
# does; the peer script calls torch.set_flush_denormal(True)).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
REPS=${REPS:-5}
STEPS=${STEPS:-3000}
EPOCHS=${EPOCHS:-10}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
TRAIN=${TRAIN:-build/tools/cfmo-train}
record=false
[ "${1:-}" = "--record" ] && record=true

[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }
[ -d "$DATA" ] || { echo "no data set at $DATA: scripts/install-deps.sh installs dataset-fashion-mnist" >&2; exit 2; }
have_torch=true
torch_available || have_torch=false
[ -x /usr/bin/time ] || { echo "/usr/bin/time missing (Debian package time)" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$TRAIN" --data synthetic:64:64 --steps 1 --quiet --json > "$tmp/probe.json"
pin_blas_coretype "$tmp/probe.json"

cfmo_cmd=("$TRAIN" --data "$DATA" --model mlp:256,128 --optimizer adamw --lr 1e-3 --weight-decay 0.01
          --batch-size 64 --threads 1 --steps "$STEPS" --epochs 0 --quiet --json)
torch_cmd=("$PY" bench/pytorch_mlp.py --data "$DATA" --hidden 256,128 --lr 1e-3 --weight-decay 0.01
           --batch-size 64 --threads 1 --steps "$STEPS" --epochs 100)

cfmo_rates=(); torch_rates=(); cfmo_rss=(); torch_rss=()
for i in $(seq 1 "$REPS"); do
  /usr/bin/time -v "${cfmo_cmd[@]}" > "$tmp/cfmo.json" 2> "$tmp/cfmo.time"
  cfmo_rates+=("$(json_field "$tmp/cfmo.json" samples_per_s)"); cfmo_rss+=("$(peak_mb "$tmp/cfmo.time")")
  if $have_torch; then
    OMP_NUM_THREADS=1 /usr/bin/time -v "${torch_cmd[@]}" > "$tmp/torch.json" 2> "$tmp/torch.time"
    torch_rates+=("$(json_field "$tmp/torch.json" samples_per_s)"); torch_rss+=("$(peak_mb "$tmp/torch.time")")
  fi
  echo "rep $i: cfmo ${cfmo_rates[-1]} samples/s${torch_rates:+, pytorch ${torch_rates[-1]} samples/s}" >&2
done
cfmo_med=$(median "${cfmo_rates[@]}")
table="| peer | samples/s (median of $REPS, $STEPS steps) | peak RSS MB |
| --- | --- | --- |
| cfmo-train | $(printf '%.0f' "$cfmo_med") | $(median "${cfmo_rss[@]}") |"
if $have_torch; then
  torch_med=$(median "${torch_rates[@]}")
  ratio=$(ratio "$cfmo_med" "$torch_med")
  table+="
| PyTorch $("$PY" -c 'import torch; print(torch.__version__)') | $(printf '%.0f' "$torch_med") | $(median "${torch_rss[@]}") |
| **ratio cfmo / PyTorch** | **${ratio}x** (target 1.8x) | |"
fi

echo "accuracy: cfmo-train, $EPOCHS epochs of AdamW, cosine schedule after 500 warmup steps..." >&2
"$TRAIN" --data "$DATA" --model mlp:256,128 --optimizer adamw --lr 1e-3 --weight-decay 0.01 --batch-size 64 \
  --schedule cosine --warmup-steps 500 --threads 1 --epochs "$EPOCHS" --quiet --json --out "$tmp/run" > "$tmp/acc.json"
accuracy=$("$PY" - "$tmp/run/metrics.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"eval"' in l]
print(" ".join(f"{r['test_accuracy']:.4f}" for r in rows))
PYEOF
)
final=$(json_field "$tmp/acc.json" test_accuracy)

report="$table

Test accuracy per epoch (cfmo-train, AdamW, cosine after 500 warmup steps): $accuracy; final $final (target 0.88 within 10 epochs)."
echo "$report"

if $record; then
  {
    echo
    echo "### cfmo-train vs PyTorch, one worker ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $blas; OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE for both."
    echo "Command: \`REPS=$REPS STEPS=$STEPS EPOCHS=$EPOCHS bench/train_vs_pytorch.sh --record\`"
    echo
    echo "$report"
  } >> bench/RESULTS.md
  echo "appended to bench/RESULTS.md" >&2
fi
