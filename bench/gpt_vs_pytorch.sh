#!/usr/bin/env bash
# cfmo-train's GPT against PyTorch's (bench/pytorch_gpt.py) in the same run:
# the same GPT-2 architecture, initialisation distribution, AdamW (betas 0.9,
# 0.95, weight decay on matrices only), data windows (context+1 tokens from a
# random start) and one thread each (issue 14, section 5). Two configs:
#   small  gpt:layers=2,heads=4,dim=128,context=64    batch 16
#   large  gpt:layers=6,heads=6,dim=384,context=256   batch 8 (10.8M parameters with the byte vocabulary)
# Runs alternate cfmo / PyTorch; medians of tokens/s are reported, with the
# ratio. One thread's sgemm peak (build/bench/sgemm-peak, through the same
# BLAS seam and kernel) is measured in the same run, before and after the
# timed runs, and each peer's GFLOP/s is shown as a share of it.
#
# GFLOP/s: "common" is tokens/s x the one formula bench/pytorch_gpt.py prints,
#   flops_per_token = 6 (N - T C) + 12 L T C
# (N parameters, wpe a lookup; attention's full T x T square, the masked half
# included), so both peers are counted alike; cfmo-train's own gflops_per_s
# (its formula, in cfmo-train(1)) is shown beside it.
# The timed runs validate on the first SPEED_VAL_TOKENS validation tokens only
# (the full split would cost the large config minutes of evaluation a run,
# outside the timed steps); then val_loss at equal tokens on the whole
# validation split: the small config for QUALITY_STEPS steps, each peer once.
#
#   bench/gpt_vs_pytorch.sh [--record]
#     REPS=3 SMALL_STEPS=300 LARGE_STEPS=20 QUALITY_STEPS=2000 SPEED_VAL_TOKENS=8192 CONFIGS="small large"
#     DATA=text:/usr/share/games/fortunes VOCAB=256 LR=1e-3 WD=0.1 to change
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
REPS=${REPS:-3}
SMALL_STEPS=${SMALL_STEPS:-300}
LARGE_STEPS=${LARGE_STEPS:-20}
QUALITY_STEPS=${QUALITY_STEPS:-2000}
SPEED_VAL_TOKENS=${SPEED_VAL_TOKENS:-8192}
CONFIGS=${CONFIGS:-small large}
DATA=${DATA:-text:/usr/share/games/fortunes}
VOCAB=${VOCAB:-$([[ $DATA == tokens:* ]] && echo 50257 || echo 256)}
LR=${LR:-1e-3}
WD=${WD:-0.1}
TRAIN=${TRAIN:-build/tools/cfmo-train}
PEAK=${PEAK:-build/bench/sgemm-peak}
record=false
[ "${1:-}" = "--record" ] && record=true

if [ ! -x "$TRAIN" ] || [ ! -x "$PEAK" ]; then
  echo "build first: make build ($TRAIN, $PEAK)" >&2
  exit 2
fi
if [[ $DATA == text:/usr/share/games/fortunes* ]] && [ ! -d /usr/share/games/fortunes ]; then
  echo "no text at /usr/share/games/fortunes: scripts/install-deps.sh installs Debian's fortunes" >&2
  exit 2
fi
have_torch=true
torch_available || have_torch=false

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The smallest GPT for one step: says clearly when this cfmo-train has no GPT yet.
head -c 4096 /dev/urandom > "$tmp/probe.txt"
if ! "$TRAIN" --model gpt:layers=1,heads=1,dim=8,context=8 --data "text:$tmp/probe.txt" --steps 1 --epochs 0 \
  --quiet --json > "$tmp/probe.json" 2> "$tmp/probe.err"; then
  echo "gpt_vs_pytorch: $TRAIN does not train --model gpt (issue 14's GPT is not in this build): $(head -n 1 "$tmp/probe.err")" >&2
  exit 2
fi
pin_blas_coretype "$tmp/probe.json"

sgemm_peak() { "$PEAK" --threads 1 --seconds 2 > "$tmp/peak.json" && json_field "$tmp/peak.json" gflops; }

# config NAME: sets model, batch, steps and the architecture's numbers.
config() {
  case "$1" in
    small) layers=2 heads=4 dim=128 context=64 batch=16 steps=$SMALL_STEPS ;;
    large) layers=6 heads=6 dim=384 context=256 batch=8 steps=$LARGE_STEPS ;;
    *) echo "gpt_vs_pytorch: unknown config '$1' (small, large)" >&2; exit 2 ;;
  esac
  model="gpt:layers=$layers,heads=$heads,dim=$dim,context=$context"
  # 6 (N - T C) + 12 L T C with N = V C + T C + L (12 C^2 + 13 C) + 2 C (bench/pytorch_gpt.py).
  flops_per_token=$(awk -v v="$VOCAB" -v t="$context" -v l="$layers" -v c="$dim" \
    'BEGIN {printf "%.0f", 6 * (v * c + l * (12 * c * c + 13 * c) + 2 * c) + 12 * l * t * c}')
}

# cfmo_run STEPS VAL_TOKENS OUT and torch_run STEPS VAL_TOKENS OUT: one run of
# the current config (VAL_TOKENS 0: the whole validation split).
cfmo_run() {
  "$TRAIN" --model "$model" --data "$DATA" --vocab-size "$VOCAB" --optimizer adamw --lr "$LR" --weight-decay "$WD" \
    --beta1 0.9 --beta2 0.95 --batch-size "$batch" --threads 1 --steps "$1" --epochs 0 --val-tokens "$2" \
    --quiet --json > "$3"
}
torch_run() {
  OMP_NUM_THREADS=1 "$PY" bench/pytorch_gpt.py --data "$DATA" --vocab-size "$VOCAB" --layers "$layers" \
    --heads "$heads" --dim "$dim" --context "$context" --batch-size "$batch" --lr "$LR" --weight-decay "$WD" \
    --threads 1 --steps "$1" --val-tokens "$2" > "$3"
}
gflops() { awk -v r="$1" -v f="$flops_per_token" 'BEGIN {printf "%.1f", r * f / 1e9}'; }
share() { awk -v g="$1" -v p="$2" 'BEGIN {printf "%.0f%%", 100 * g / p}'; }

peak_before=$(sgemm_peak)
echo "sgemm peak, one thread: $peak_before GFLOP/s" >&2
rows=(); shares=()
for name in $CONFIGS; do
  config "$name"
  cfmo_rates=(); cfmo_own=(); torch_rates=()
  for i in $(seq 1 "$REPS"); do
    cfmo_run "$steps" "$SPEED_VAL_TOKENS" "$tmp/cfmo.json"
    cfmo_rates+=("$(json_field "$tmp/cfmo.json" tokens_per_s)"); cfmo_own+=("$(json_field "$tmp/cfmo.json" gflops_per_s)")
    if $have_torch; then
      torch_run "$steps" "$SPEED_VAL_TOKENS" "$tmp/torch.json"
      torch_rates+=("$(json_field "$tmp/torch.json" tokens_per_s)")
    fi
    echo "$name rep $i: cfmo ${cfmo_rates[-1]} tokens/s${torch_rates:+, pytorch ${torch_rates[-1]} tokens/s}" >&2
  done
  cfmo_med=$(median "${cfmo_rates[@]}")
  row="| $name: $model, batch $batch, $steps steps | $(printf '%.0f' "$cfmo_med") | $(gflops "$cfmo_med") ($(printf '%.1f' "$(median "${cfmo_own[@]}")") own)"
  if $have_torch; then
    torch_med=$(median "${torch_rates[@]}")
    row+=" | $(printf '%.0f' "$torch_med") | $(gflops "$torch_med") | **$(ratio "$cfmo_med" "$torch_med")x** |"
  else
    row+=" | | | |"
  fi
  rows+=("$row")
  shares+=("$name: cfmo $(share "$(gflops "$cfmo_med")" "$peak_before")${torch_med:+, PyTorch $(share "$(gflops "$torch_med")" "$peak_before")}")
done
peak_after=$(sgemm_peak)

torch_version=$($have_torch && "$PY" -c 'import torch; print(torch.__version__)' || echo "not installed")
table="| config | cfmo tokens/s (median of $REPS) | cfmo GFLOP/s common (own) | PyTorch $torch_version tokens/s | PyTorch GFLOP/s | ratio cfmo / PyTorch |
| --- | --- | --- | --- | --- | --- |
$(printf '%s\n' "${rows[@]}")

One thread's sgemm peak (sgemm-peak, 1024^3): $peak_before GFLOP/s before the runs, $peak_after after.
Shares of the peak (common count): $(printf '%s\n' "${shares[@]}" | paste -sd ';' | sed 's/;/; /g')."

quality=""
if [ "$QUALITY_STEPS" -gt 0 ]; then
  config small
  echo "val_loss at equal tokens: the small config, $QUALITY_STEPS steps each..." >&2
  cfmo_run "$QUALITY_STEPS" 0 "$tmp/cfmo_q.json"
  cfmo_val=$(printf '%.4f' "$(json_field "$tmp/cfmo_q.json" val_loss)")
  quality="val_loss after $QUALITY_STEPS steps of the small config ($((QUALITY_STEPS * batch * context)) tokens): cfmo-train $cfmo_val"
  if $have_torch; then
    torch_run "$QUALITY_STEPS" 0 "$tmp/torch_q.json"
    torch_val=$(printf '%.4f' "$(json_field "$tmp/torch_q.json" val_loss)")
    quality+=", PyTorch $torch_val, cfmo / PyTorch $(awk -v a="$cfmo_val" -v b="$torch_val" 'BEGIN {printf "%.4f", a / b}') (target within 2%)"
  fi
  quality+="."
fi

report="$table
${quality:+
$quality}"
echo "$report"

if $record; then
  {
    echo
    echo "### cfmo-train's GPT vs PyTorch, one thread ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $blas; OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE for both; data $DATA (vocabulary $VOCAB); AdamW lr $LR, weight decay $WD, betas (0.9, 0.95)."
    echo "Command: \`REPS=$REPS SMALL_STEPS=$SMALL_STEPS LARGE_STEPS=$LARGE_STEPS QUALITY_STEPS=$QUALITY_STEPS SPEED_VAL_TOKENS=$SPEED_VAL_TOKENS CONFIGS=\"$CONFIGS\" bench/gpt_vs_pytorch.sh --record\`"
    echo
    echo "$report"
  } >> bench/RESULTS.md
  echo "appended to bench/RESULTS.md" >&2
fi
