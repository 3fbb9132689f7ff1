#!/usr/bin/env bash
# cfmo's accuracy gap to sync on one host (issue 16), over many seeds: each
# variant (a line of cfmo-train flags) runs once per seed, and the gap is the
# mean of the per-seed differences to sync's accuracy on the same seed, with
# its standard error. Prints a Markdown table: mean test accuracy, gap,
# standard error, median samples/s, mean rounds per rank.
#
#   bench/cfmo_gap.sh [VARIANT...]        each VARIANT one quoted string of flags
#   SYNC_DIR=DIR: sync's summaries kept in DIR and reused by the next invocation with the same JOB
#   SEEDS="11 12 ... 26" JOB="--workers 3 --data synthetic:8192:512 --model mlp:256,128 --epochs 2"   (the defaults)
#   bench/cfmo_gap.sh "--mode localsgd" "--mode cfmo" "--mode cfmo --reply-hold off"
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
TRAIN=${TRAIN:-build/tools/cfmo-train}
SEEDS=${SEEDS:-$(seq -s ' ' 11 26)}
JOB=${JOB:---workers 3 --data synthetic:8192:512 --model mlp:256,128 --epochs 2}
[ -x "$TRAIN" ] || { echo "build first: ninja -C build tools/cfmo-train" >&2; exit 2; }
[ $# -gt 0 ] || set -- "--mode cfmo"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() {  # run NAME SEED FLAGS...: one run's summary into $tmp/NAME.SEED
  local name=$1 seed=$2
  shift 2
  # shellcheck disable=SC2086
  "$TRAIN" $JOB --quiet --json --seed "$seed" "$@" >"$tmp/$name.$seed"
}

# SYNC_DIR: keep sync's summaries there and reuse them (sync's accuracy is the same every run of a seed).
if [ -n "${SYNC_DIR:-}" ]; then
  mkdir -p "$SYNC_DIR"
  for s in $SEEDS; do [ -s "$SYNC_DIR/sync.$s" ] && cp "$SYNC_DIR/sync.$s" "$tmp/"; done
fi
for s in $SEEDS; do [ -s "$tmp/sync.$s" ] || run sync "$s" --mode sync; done
[ -n "${SYNC_DIR:-}" ] && cp "$tmp"/sync.* "$SYNC_DIR/"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); seeds: $SEEDS; job: $JOB"
echo
echo "| flags | mean acc | against sync | std. error | samples/s (median) | rounds per rank (mean) |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
"$PY" - "$tmp" sync "$SEEDS" "sync" <<'EOF'
import json, sys, statistics as st
tmp, name, seeds, label = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
acc = [json.load(open(f"{tmp}/{name}.{s}"))["test_accuracy"] for s in seeds]
sps = [json.load(open(f"{tmp}/{name}.{s}"))["samples_per_s"] for s in seeds]
print(f"| `{label}` | {st.mean(acc):.4f} | | | {st.median(sps):.0f} | |")
EOF
i=0
for v in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  for s in $SEEDS; do run "v$i" "$s" $v; done
  "$PY" bench/gap_table.py "$tmp" "v$i" "$SEEDS" "$v"
done
