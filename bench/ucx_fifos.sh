#!/usr/bin/env bash
# What leaving UCX's shared-memory FIFOs out costs between ranks of one host
# (issue 16, comm/ucx_communicator.cpp choose_transports): each row runs
# with connect_ucx's own choice ("tcp+cma": TCP loopback for messages, CMA
# for rendezvous, in runs that go on after a loss; a run that ends at its
# first loss, sync here, keeps the FIFOs, so its two columns are alike) and with UCX_TLS=all ("fifos": posix/sysv for messages,
# CMA for rendezvous, with MM_ERROR_HANDLING, connect_ucx's choice before),
# alternately (rep 1 of every row and both choices, then rep 2, ...), the
# same binaries. Prints a Markdown table of medians over REPS; --record
# appends it to bench/RESULTS.md.
#
#   comm-a2a     bench/comm-a2a's all-to-all-v p50 (us) at each of SIZES
#                bytes per peer and its 1-float all-reduce, WORKERS ranks
#   mlp-cfmo     cfmo-train --mode cfmo, the default MLP, MLP_EPOCHS epochs: samples/s
#   mlp-sync     the same in --mode sync (the FIFOs in both columns: a control)
#   gpt-cfmo     the small GPT on fortunes, --mode cfmo, TOKENS tokens: tokens/s
#   moe-ep-cfmo  bench/moe_train.sh's row of that name (expert parallel,
#                --dispatch async, --slowdown 1=1.25), TOKENS tokens: tokens/s
#   moe-ep-sync  bench/moe_train.sh's row of that name: tokens/s (the FIFOs in both columns)
#
#   bench/ucx_fifos.sh [--record]
#   REPS=5 WORKERS=4 TOKENS=200000 MLP_EPOCHS=1 SIZES="4096 16384 65536 262144 1048576" ITERS=1000   (the defaults)
#   ROWS=comm-a2a,mlp-cfmo runs only those rows.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/common.sh
. bench/common.sh
REPS=${REPS:-5}
WORKERS=${WORKERS:-4}
TOKENS=${TOKENS:-200000}
SIZES=${SIZES:-"4096 16384 65536 262144 1048576"}
ITERS=${ITERS:-1000}
MLP_EPOCHS=${MLP_EPOCHS:-1}
ROWS=${ROWS:-comm-a2a,mlp-cfmo,mlp-sync,gpt-cfmo,moe-ep-cfmo,moe-ep-sync}
TRAIN=${TRAIN:-build/tools/cfmo-train}
A2A=${A2A:-build/bench/comm-a2a}
record=false
[ "${1:-}" = "--record" ] && record=true
{ [ -x "$TRAIN" ] && [ -x "$A2A" ]; } || { echo "build first: ninja -C build tools/cfmo-train bench/comm-a2a" >&2; exit 2; }
[ -z "${UCX_TLS:-}" ] || { echo "unset UCX_TLS: this script sets it" >&2; exit 2; }

gpt=gpt:layers=2,heads=4,dim=128,context=64
moe=$gpt,experts=12,top_k=2,expert_dim=256
text=(--data text:/usr/share/games/fortunes --batch-size 16 --epochs 0 --tokens "$TOKENS" --val-tokens 50000 --lr 0.003
  --beta2 0.95)
# name|flags (after --workers W --quiet --json)
all_rows=("mlp-cfmo|--mode cfmo --epochs $MLP_EPOCHS" "mlp-sync|--mode sync --epochs $MLP_EPOCHS"
  "gpt-cfmo|--model $gpt --mode cfmo ${text[*]}"
  "moe-ep-cfmo|--model $moe --mode cfmo --expert-parallel --dispatch async --slowdown 1=1.25 ${text[*]}"
  "moe-ep-sync|--model $moe --mode sync --expert-parallel --slowdown 1=1.25 ${text[*]}")
rows=()
for row in "${all_rows[@]}"; do [[ ",$ROWS," == *",${row%%|*},"* ]] && rows+=("$row"); done
choices=("tcp+cma|" "fifos|all")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
for rep in $(seq 1 "$REPS"); do
  for choice in "${choices[@]}"; do
    IFS='|' read -r label tls <<< "$choice"
    if [[ ",$ROWS," == *,comm-a2a,* ]]; then
      # shellcheck disable=SC2086
      env ${tls:+UCX_TLS=$tls} "$A2A" --ranks "$WORKERS" --iters "$ITERS" $SIZES > "$tmp/comm-a2a.$label.$rep" 2>&1 ||
        echo "comm-a2a failed: $label rep $rep" >&2
    fi
    for row in "${rows[@]}"; do
      IFS='|' read -r name flags <<< "$row"
      # shellcheck disable=SC2086
      env ${tls:+UCX_TLS=$tls} "$TRAIN" $flags --workers "$WORKERS" --seed "$rep" --quiet --json \
        > "$tmp/$name.$label.$rep" 2> "$tmp/$name.$label.$rep.err" ||
        { echo "run failed: $name $label rep $rep" >&2; tail -3 "$tmp/$name.$label.$rep.err" >&2; }
    done
    echo "rep $rep $label: done" >&2
  done
done
elapsed=$(($(date +%s) - start))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

report=$("$PY" - "$tmp" "$REPS" "$SIZES" "$ROWS" <<'EOF'
import json, os, statistics, sys
root, reps, sizes, wanted = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split(",")
labels = ["tcp+cma", "fifos"]
def median(v):
    return statistics.median(v) if v else float("nan")
def lines(path):
    try:
        return [json.loads(l) for l in open(path).read().splitlines() if l.startswith("{")]
    except (OSError, ValueError):
        return []
print("| row | measure | tcp+cma (median) | fifos (median) | tcp+cma / fifos | runs | tcp+cma runs | fifos runs |")
print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
keys = [("all_reduce_1", "4")] + [("all_to_all_v", s) for s in sizes] if "comm-a2a" in wanted else []
for op, size in keys:
    got = {l: [] for l in labels}
    for l in labels:
        for rep in range(1, reps + 1):
            for j in lines(os.path.join(root, f"comm-a2a.{l}.{rep}")):
                if j["op"] == op and str(j["bytes_per_peer"]) == size:
                    got[l].append(j["p50_us"])
    a, b = median(got["tcp+cma"]), median(got["fifos"])
    what = "1-float all-reduce" if op == "all_reduce_1" else f"all-to-all-v {size} B/peer"
    runs = [" ".join(f"{v:.0f}" for v in got[l]) for l in labels]
    print(f"| comm-a2a | {what}, p50 us | {a:.1f} | {b:.1f} | {a / b:.2f} | {len(got['fifos'])} | {runs[0]} | {runs[1]} |")
for name, key in [("mlp-cfmo", "samples_per_s"), ("mlp-sync", "samples_per_s"), ("gpt-cfmo", "tokens_per_s"),
                  ("moe-ep-cfmo", "tokens_per_s"), ("moe-ep-sync", "tokens_per_s")]:
    if name not in wanted:
        continue
    got = {l: [] for l in labels}
    for l in labels:
        for rep in range(1, reps + 1):
            j = lines(os.path.join(root, f"{name}.{l}.{rep}"))
            if j:
                got[l].append(j[-1][key])
    a, b = median(got["tcp+cma"]), median(got["fifos"])
    unit = key.replace("_per_s", "/s")
    runs = [" ".join(f"{v:.0f}" for v in got[l]) for l in labels]
    print(f"| {name} | {unit} | {a:.0f} | {b:.0f} | {a / b:.2f} | {min(len(got['tcp+cma']), len(got['fifos']))} | {runs[0]} | {runs[1]} |")
EOF
)
command="REPS=$REPS WORKERS=$WORKERS TOKENS=$TOKENS MLP_EPOCHS=$MLP_EPOCHS SIZES=\"$SIZES\" ITERS=$ITERS ROWS=$ROWS bench/ucx_fifos.sh"
echo "$report"
echo "load average before $load_before, after $load_after; $elapsed s"
if $record; then
  {
    echo
    echo "### UCX between ranks of one host: TCP + CMA against the shared-memory FIFOs ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(nproc) cores, load average $load_before before and $load_after after (other builds ran)."
    echo "Command: \`$command\` ($elapsed s)"
    echo
    echo "$report"
  } >> bench/RESULTS.md
fi
