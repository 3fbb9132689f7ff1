#!/usr/bin/env bash
# cfmo-moe against its peers, all in one run on this machine:
#  1. ucx_perftest tag bandwidth between two processes (the transport's ceiling);
#  2. Open MPI's MPI_Alltoallv (bench/mpi-alltoallv) against cfmo's
#     all-to-all-v at the same rank count and sizes, alternated, medians of
#     busbw (nccl-tests' definition), on an equal footing twice: each loop
#     alone (a barrier before each all-to-all, as the MPI peer times it:
#     bench/comm-a2a --barrier), and each loop writing, untimed between its
#     all-to-alls, what a layer writes (--touch TOUCH: TOUCH times the bytes
#     a rank sends, and fresh send buffers; cfmo-moe's sync layer with
#     --ffn 0 writes 5 times them an iteration: send rows, received rows,
#     expert output, combined results, layer output; the loops write their
#     receive buffers, their send buffers and TOUCH = 3 more). Beside them,
#     cfmo-moe's own sync all-to-all-v (--ffn 0, balanced routing, top-1, one
#     expert per rank, so every rank sends exactly SIZE bytes to every rank),
#     which is compared with the MPI loop that writes as much;
#  3. cfmo-moe sync against async tokens/s, 4 ranks and 12 experts, without and
#     with --slowdown 1=1.25 (--mode both: the same inputs back to back),
#     medians; and the machine's compute ceiling for that layer
#     (bench/expert-gemm: the experts' GEMMs alone, one process per core, as
#     many rows a call as one rank sends an expert), the most tokens/s a mode
#     that computes every token can reach here.
# Prints a Markdown table and the targets' ratios; --record appends them to
# bench/RESULTS.md.
#
#   bench/moe_vs_mpi.sh [--record]
#   (RANKS=4 PEER_SIZES="16384 65536 262144 1048576" REPS=3 A2A_ITERS=200 ITERS=30
#    TOKENS=512 HIDDEN=512 FFN=1024 EXPERTS=12 TOUCH=3 to change; A2A_ITERS and
#    TOUCH for part 2)
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-4}
PEER_SIZES=${PEER_SIZES:-"16384 65536 262144 1048576"}
REPS=${REPS:-3}
ITERS=${ITERS:-30}
A2A_ITERS=${A2A_ITERS:-200}
TOKENS=${TOKENS:-512}
HIDDEN=${HIDDEN:-512}
FFN=${FFN:-1024}
EXPERTS=${EXPERTS:-12}
TOUCH=${TOUCH:-3}
MOE=${MOE:-build/tools/cfmo-moe}
MPI_BENCH=${MPI_BENCH:-build/bench/mpi-alltoallv}
COMM_BENCH=${COMM_BENCH:-build/bench/comm-a2a}
GEMM_BENCH=${GEMM_BENCH:-build/bench/expert-gemm}
PY=/usr/bin/python3
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$MOE" ] || { echo "build first: make build" >&2; exit 2; }
have_mpi=true
{ command -v mpirun >/dev/null && [ -x "$MPI_BENCH" ]; } || {
  have_mpi=false; echo "no Open MPI (scripts/install-deps.sh --bench, then rebuild): MPI rows skipped" >&2; }
have_perftest=true
command -v ucx_perftest >/dev/null || { have_perftest=false; echo "no ucx_perftest (ucx-utils): ceiling skipped" >&2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
median() { "$PY" -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:]]; print("%.4f" % statistics.median(v) if v else "")' "$@"; }

# 1. The ceiling: one process sends to another, tag-matched, as cfmo's transport does.
declare -A ceiling
if $have_perftest; then
  for size in $PEER_SIZES; do
    port=$(free_port)
    ucx_perftest -p "$port" > "$tmp/server" 2>&1 &
    server=$!
    sleep 0.5
    mbs=$(timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t tag_bw -s "$size" -n 1000 2>/dev/null |
          awk '/Final:/ {print $6}') || mbs=""
    wait "$server" 2>/dev/null || true
    [ -n "$mbs" ] && ceiling[$size]=$(awk -v m="$mbs" 'BEGIN{printf "%.3f", m*1048576/1e9}')
    echo "ucx_perftest tag_bw $size B: ${ceiling[$size]:-?} GB/s" >&2
  done
fi

# 2. The all-to-all-v, alternated: MPI, then cfmo-moe, REPS times.
sweep=""
for size in $PEER_SIZES; do
  rows=$(( size / 4096 * RANKS ))  # tokens per rank: hidden 1024 floats = 4096 bytes a row, RANKS peers
  sweep+="${sweep:+,}$rows"
done
declare -A mpi_runs mpi_touch_runs cfmo_runs comm_runs comm_touch_runs
# Appends "SIZE BUSBW" lines of a JSON-lines file (MPI's or comm-a2a's) to an array.
collect() {
  local -n into=$1
  while read -r size bw; do into[$size]+=" $bw"; done < <("$PY" -c '
import json, sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        r = json.loads(l)
        if r.get("op", "all_to_all_v") == "all_to_all_v": print(r["bytes_per_peer"], r["busbw_gbps"])' "$2")
}
for rep in $(seq 1 "$REPS"); do
  for touch in 0 "$TOUCH"; do
    if $have_mpi; then
      # shellcheck disable=SC2086
      timeout 600 mpirun -np "$RANKS" --oversubscribe "$MPI_BENCH" --iters "$A2A_ITERS" --touch "$touch" $PEER_SIZES \
        > "$tmp/mpi" 2>/dev/null || echo "mpirun failed" >&2
      if [ "$touch" = 0 ]; then collect mpi_runs "$tmp/mpi"; else collect mpi_touch_runs "$tmp/mpi"; fi
    fi
    if [ -x "$COMM_BENCH" ]; then
      # shellcheck disable=SC2086
      timeout 600 "$COMM_BENCH" --ranks "$RANKS" --iters "$A2A_ITERS" --barrier --touch "$touch" $PEER_SIZES \
        > "$tmp/comm" 2>/dev/null || echo "comm-a2a failed" >&2
      if [ "$touch" = 0 ]; then collect comm_runs "$tmp/comm"; else collect comm_touch_runs "$tmp/comm"; fi
    fi
  done
  timeout 600 "$MOE" --ranks "$RANKS" --experts "$RANKS" --top-k 1 --ffn 0 --routing balanced --drop-policy dropless \
    --hidden 1024 --sweep "$sweep" --warmup 5 --iters "$A2A_ITERS" --mode sync --quiet --format json > "$tmp/cfmo" ||
    echo "cfmo-moe failed" >&2
  while read -r size bw; do cfmo_runs[$size]+=" $bw"; done < <("$PY" -c '
import json, sys
for r in json.load(open(sys.argv[1])): print(int(round(r["bytes_per_peer"])), r["busbw_gbps"])' "$tmp/cfmo")
  echo "all-to-all-v rep $rep done" >&2
done

ratio_of() { [ -n "$1" ] && [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2fx", a/b}' || echo "-"; }
a2a_table="| bytes per peer | ucx_perftest tag_bw GB/s (ceiling, 1 pair) | Open MPI, loop alone | cfmo communicator, loop alone | cfmo / MPI | Open MPI, writing as a layer (--touch $TOUCH) | cfmo communicator, writing as a layer | cfmo / MPI | cfmo-moe sync layer's all-to-all-v | cfmo-moe / MPI writing as a layer |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
a2a_notes=""
for size in $PEER_SIZES; do
  # shellcheck disable=SC2086
  m=$(median ${mpi_runs[$size]:-}); a=$(median ${comm_runs[$size]:-})
  # shellcheck disable=SC2086
  mt=$(median ${mpi_touch_runs[$size]:-}); at=$(median ${comm_touch_runs[$size]:-}); c=$(median ${cfmo_runs[$size]:-})
  alone=$(ratio_of "$a" "$m"); written=$(ratio_of "$at" "$mt"); layer=$(ratio_of "$c" "$mt")
  a2a_table+="
| $size | ${ceiling[$size]:--} | ${m:--} | ${a:--} | $alone | ${mt:--} | ${at:--} | $written | ${c:--} | $layer |"
  [ "$size" -ge 65536 ] && a2a_notes+="- $size bytes per peer, cfmo / Open MPI busbw: loops alone $alone, both writing as a layer $written, cfmo-moe's layer against MPI writing as much $layer (target >= 0.9x from 64 KiB)
"
done

# 3. Tokens per second, sync against async on the same inputs, and the
# compute ceiling (bench/expert-gemm). Alternated, rep by rep, as the host's
# speed drifts.
scenarios=("homogeneous|" "slowdown 1=1.25|--slowdown 1=1.25")
ceiling_runs=""
for rep in $(seq 1 "$REPS"); do
  if [ -x "$GEMM_BENCH" ]; then
    ceiling_runs+=" $(timeout 120 "$GEMM_BENCH" --ranks 4 --experts "$EXPERTS" --tokens "$TOKENS" --top-k 2 \
      --hidden "$HIDDEN" --ffn "$FFN" --seconds 3 | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])')"
  fi
  for index in "${!scenarios[@]}"; do
    sc=${scenarios[$index]}; name=${sc%%|*}; flags=${sc#*|}
    # shellcheck disable=SC2086
    timeout 900 "$MOE" --ranks 4 --experts "$EXPERTS" --tokens "$TOKENS" --hidden "$HIDDEN" --ffn "$FFN" \
      --warmup 5 --iters "$ITERS" --mode both --quiet --format json $flags >> "$tmp/both.$index" ||
      echo "cfmo-moe failed" >&2
  done
  echo "layer rep $rep done" >&2
done
# shellcheck disable=SC2086
compute_ceiling=$(median $ceiling_runs | cut -d. -f1)
tok_table="| scenario | sync tokens/s | async tokens/s | async / sync | async late % | async deadline us | sync check | async check | compute ceiling / sync (the most async / sync can be, every token computed) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
tok_notes=""
for index in "${!scenarios[@]}"; do
  name=${scenarios[$index]%%|*}
  row=$("$PY" -c '
import json, sys, statistics as st
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("[")]
sync = [r[0] for r in runs]; asyn = [r[1] for r in runs]
med = lambda rows, k: st.median(r[k] for r in rows)
deadline = st.median((r["deadline_us"] or 0) for r in asyn)
print("%.0f|%.0f|%.2f|%.2f|%.0f|%s|%s" % (med(sync, "tokens_per_s"), med(asyn, "tokens_per_s"),
      med(asyn, "speedup_vs_sync"), 100 * med(asyn, "late_frac"), deadline,
      ",".join(sorted(set(r["check"] for r in sync))), ",".join(sorted(set(r["check"] for r in asyn)))))' "$tmp/both.$index")
  IFS='|' read -r s a ratio late deadline cs ca <<< "$row"
  most=$(ratio_of "$compute_ceiling" "$s")
  tok_table+="
| $name | $s | $a | ${ratio}x | $late | $deadline | $cs | $ca | $most |"
  target=$([ "$name" = homogeneous ] && echo "1.2x (overlap)" || echo "2x")
  tok_notes+="- $name: async / sync tokens/s = ${ratio}x with $late % late tokens (target >= $target; at most $most here without dropping work)
"
done

report="All-to-all-v, $RANKS ranks on this host (median of $REPS runs, $A2A_ITERS iterations each):

$a2a_table

$a2a_notes
MoE layer, 4 ranks, $EXPERTS experts, top-2, $TOKENS tokens per rank, hidden $HIDDEN, ffn $FFN, fp32, capacity factor 1.25 (median of $REPS runs of --mode both, $ITERS iterations each):

$tok_table

Compute ceiling: the experts' GEMMs alone on every core at once (bench/expert-gemm, one process per core, each with one rank's experts, $(( TOKENS * 2 / EXPERTS )) rows a call; nothing routed, communicated or combined), median of $REPS: ${compute_ceiling:-?} tokens/s.

$tok_notes"
echo "$report"
if $record; then
  {
    echo
    echo "### cfmo-moe against ucx_perftest and Open MPI ($(date -u +%Y-%m-%d))"
    echo
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores shared by every rank, load average $(cut -d' ' -f1-3 /proc/loadavg) when it ended${NOTE:+; $NOTE}."
    echo "Command: \`RANKS=$RANKS PEER_SIZES=\"$PEER_SIZES\" REPS=$REPS A2A_ITERS=$A2A_ITERS ITERS=$ITERS TOKENS=$TOKENS HIDDEN=$HIDDEN FFN=$FFN EXPERTS=$EXPERTS bench/moe_vs_mpi.sh --record\`"
    echo
    echo "$report"
  } >> bench/RESULTS.md
fi
