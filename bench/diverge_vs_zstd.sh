#!/usr/bin/env bash
# The .cfd delta container against plain zstd on deltas of a real training
# run: size against `zstd -3` of the same raw float32 deltas, and read-and-
# reduce throughput of `cfmo-diverge report` against `zstd -d` of those bytes.
#
#   bench/diverge_vs_zstd.sh [--record]    (ROUNDS=25 RANKS=4 H=20 START=200 REPS=5 to change)
#
# The deltas: cfmo-train runs one worker so far, so a run of RANKS workers is
# emulated the way local-update training works: a global run checkpoints every
# H steps (Fashion-MNIST, MLP 784-256-128-10, AdamW lr 1e-3, batch 64); for
# each of ROUNDS rounds every rank resumes from that checkpoint with its own
# data order (--seed) for H steps; the rank's delta is its parameters minus
# the checkpoint's, in float32, as the trainer computes it. bench/cfd-pack
# writes each delta as RUN/deltas/rank-K/round-RRRRRR.cfd (the default
# transform) and the raw float32 bytes for the peer. DELTAS=dir keeps and
# reuses them.
#
# Throughput: MB of float32 delta data per second (raw size / wall time), for
# the whole run directory in one process each: cfmo-diverge report (reads,
# decompresses, checks every frame's checksum and reduces: |delta|^2,
# max|delta|, non-finite count) with --threads 1 and with --threads 2, and
# `zstd -d -c FILES > /dev/null` (one thread; zstd decompresses on one thread).
# Runs alternate; medians of REPS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-25}
RANKS=${RANKS:-4}
H=${H:-20}
START=${START:-200}
REPS=${REPS:-5}
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
BUILD=${BUILD:-build}
TRAIN=$BUILD/tools/cfmo-train
DIVERGE=$BUILD/tools/cfmo-diverge
PACK=$BUILD/bench/cfd-pack
record=false
[ "${1:-}" = "--record" ] && record=true

for tool in "$TRAIN" "$DIVERGE" "$PACK"; do
  [ -x "$tool" ] || { echo "build first: ninja -C $BUILD ($tool missing)" >&2; exit 2; }
done
command -v zstd >/dev/null || { echo "the zstd command is missing (Debian package zstd)" >&2; exit 2; }
[ -d "$DATA" ] || { echo "no data set at $DATA: scripts/install-deps.sh installs dataset-fashion-mnist" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
deltas=${DELTAS:-$tmp/deltas}
run=$deltas/run
raw=$deltas/raw

if [ ! -f "$deltas/done" ]; then
  mkdir -p "$deltas" "$raw"
  echo "training the global run and $RANKS ranks x $ROUNDS rounds of $H steps ..." >&2
  "$TRAIN" --data "$DATA" --model mlp:256,128 --optimizer adamw --lr 1e-3 --steps $((START + H * ROUNDS)) --epochs 0 \
    --checkpoint-every "$H" --keep-checkpoints 100000 --quiet --out "$deltas/global" > /dev/null
  for round in $(seq 1 "$ROUNDS"); do
    step=$((START + H * (round - 1)))
    ckpt=$deltas/global/checkpoints/$(printf 'step-%08d' "$step")
    for rank in $(seq 0 $((RANKS - 1))); do
      "$TRAIN" --resume "$ckpt" --seed $((1000 * round + rank)) --steps $((step + H)) --quiet \
        --out "$tmp/local" > /dev/null
      name=$(printf 'round-%06d' "$round")
      mkdir -p "$run/deltas/rank-$rank"
      "$PACK" "$ckpt/model.safetensors" "$tmp/local/model.safetensors" "$run/deltas/rank-$rank/$name.cfd" \
        --rank "$rank" --round "$round" --step $((step + H)) --base-version $((round - 1)) \
        --raw "$raw/rank-$rank-$name.f32"
      for transform in none byteplanes; do
        mkdir -p "$deltas/$transform"
        "$PACK" "$ckpt/model.safetensors" "$tmp/local/model.safetensors" "$deltas/$transform/$rank-$name.cfd" \
          --transform "$transform"
      done
      mkdir -p "$deltas/xor-base"
      "$PACK" "$ckpt/model.safetensors" "$tmp/local/model.safetensors" "$deltas/xor-base/$rank-$name.cfd" --xor-base
      rm -rf "$tmp/local"
    done
  done
  zstd -q -3 -f "$raw"/*.f32
  touch "$deltas/done"
fi

sum_size() { find "$@" -type f -printf '%s\n' | awk '{s += $1} END {print s}'; }
raw_bytes=$(sum_size "$raw" -name '*.f32')
zstd_bytes=$(sum_size "$raw" -name '*.zst')
cfd_bytes=$(sum_size "$run/deltas" -name '*.cfd')
none_bytes=$(sum_size "$deltas/none")
planes_bytes=$(sum_size "$deltas/byteplanes")
xor_bytes=$(sum_size "$deltas/xor-base")
files=$(find "$run/deltas" -name '*.cfd' | wc -l)
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }

now() { date +%s.%N; }
mbps() { awk -v bytes="$raw_bytes" -v s="$1" -v e="$2" 'BEGIN {printf "%.0f", bytes / (e - s) / 1e6}'; }
cfd1=(); cfd2=(); zst=()
for i in $(seq 1 "$REPS"); do
  s=$(now); "$DIVERGE" report "$run" --format json --threads 1 > /dev/null; e=$(now); cfd1+=("$(mbps "$s" "$e")")
  s=$(now); zstd -q -d -c "$raw"/*.zst > /dev/null; e=$(now); zst+=("$(mbps "$s" "$e")")
  s=$(now); "$DIVERGE" report "$run" --format json --threads 2 > /dev/null; e=$(now); cfd2+=("$(mbps "$s" "$e")")
  echo "rep $i: cfmo-diverge 1 thread ${cfd1[-1]} MB/s, 2 threads ${cfd2[-1]} MB/s; zstd -d ${zst[-1]} MB/s" >&2
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
m1=$(median "${cfd1[@]}"); m2=$(median "${cfd2[@]}"); mz=$(median "${zst[@]}")

table="| | bytes | ratio to raw | against plain zstd -3 |
| --- | --- | --- | --- |
| raw float32 deltas | $raw_bytes | 1.000 | |
| plain \`zstd -3\` of the raw deltas | $zstd_bytes | $(ratio "$raw_bytes" "$zstd_bytes") | 1.000 |
| .cfd, transform none | $none_bytes | $(ratio "$raw_bytes" "$none_bytes") | $(ratio "$zstd_bytes" "$none_bytes")x |
| .cfd, byteplanes | $planes_bytes | $(ratio "$raw_bytes" "$planes_bytes") | $(ratio "$zstd_bytes" "$planes_bytes")x |
| **.cfd, grouped-planes (the default)** | $cfd_bytes | $(ratio "$raw_bytes" "$cfd_bytes") | **$(ratio "$zstd_bytes" "$cfd_bytes")x** (target 1.15x) |
| (for comparison: local XOR base, grouped-planes; needs the base to decode) | $xor_bytes | $(ratio "$raw_bytes" "$xor_bytes") | $(ratio "$zstd_bytes" "$xor_bytes")x |

| read and reduce (median of $REPS) | MB/s of float32 deltas | against \`zstd -d\` |
| --- | --- | --- |
| \`zstd -d -c *.zst > /dev/null\` (one thread) | $mz | 1.00 |
| \`cfmo-diverge report RUN --threads 1\` | $m1 | **$(ratio "$m1" "$mz")x** (target 0.8x) |
| \`cfmo-diverge report RUN --threads 2\` | $m2 | **$(ratio "$m2" "$mz")x** |"
echo
echo "$files deltas of $RANKS ranks x $ROUNDS rounds, $H AdamW steps each, from step $START"
echo "$table"

if $record; then
  cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)
  {
    echo
    echo "### cfmo-diverge: .cfd against zstd ($(date +%Y-%m-%d))"
    echo
    echo "Machine: $cpu, $(nproc) cores; zstd $(zstd -V | grep -o 'v[0-9.]*')."
    echo "Command: \`ROUNDS=$ROUNDS RANKS=$RANKS H=$H START=$START REPS=$REPS bench/diverge_vs_zstd.sh --record\`"
    echo "Deltas: $files, $RANKS ranks x $ROUNDS rounds of $H AdamW steps (lr 1e-3, batch 64) of the MLP"
    echo "784-256-128-10 on Fashion-MNIST from step $START on, each 940,584 bytes of float32."
    echo
    echo "$table"
  } >> bench/RESULTS.md
  echo "appended to bench/RESULTS.md" >&2
fi
