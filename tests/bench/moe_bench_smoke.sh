#!/usr/bin/env bash
# Runs bench/moe_vs_mpi.sh at its smallest (one rep, a few iterations, two
# sizes), so the script and its helpers (comm-a2a, expert-gemm, mpi-alltoallv
# where Open MPI is) keep working between the runs that record figures; checks
# that every table came out with numbers and that both modes passed their
# check. No figure is judged. Registered as the meson test 'bench-moe' (suite
# 'slow').
set -euo pipefail
src=${CFMO_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
REPS=1 A2A_ITERS=5 ITERS=3 PEER_SIZES="16384 65536" "$src/bench/moe_vs_mpi.sh" > "$out" 2>&1 || {
  cat "$out"; echo "FAIL: bench/moe_vs_mpi.sh exited $?"; exit 1; }
fail() { cat "$out"; echo "FAIL: $1"; exit 1; }
# The all-to-all rows: the cfmo columns hold numbers (MPI's may be "-" without Open MPI).
for size in 16384 65536; do
  row=$(grep "^| $size |" "$out") || fail "no all-to-all-v row for $size bytes per peer"
  comm=$(cut -d'|' -f5 <<< "$row" | tr -d ' ')
  layer=$(cut -d'|' -f10 <<< "$row" | tr -d ' ')
  [[ $comm =~ ^[0-9.]+$ && $layer =~ ^[0-9.]+$ ]] || fail "all-to-all-v row for $size: $row"
done
for scenario in "homogeneous" "slowdown 1=1.25"; do
  row=$(grep "^| $scenario |" "$out") || fail "no layer row for $scenario"
  [[ $row =~ \|\ [0-9]+\ \|\ [0-9]+\ \|\ [0-9.]+x\ \| ]] || fail "layer row for $scenario: $row"
  [[ $row =~ \|\ pass\ \|\ pass\ \| ]] || fail "a mode failed its check: $row"
done
grep -Eq "^Compute ceiling: .* [0-9]+ tokens/s\.$" "$out" || fail "no compute ceiling"
echo "bench/moe_vs_mpi.sh: every table filled"
