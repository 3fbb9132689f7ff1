# shellcheck shell=bash
# Helpers the cfmo-train benchmarks share; source it from a bench/*.sh script:
#   . "$(dirname "$0")/common.sh"
# Defines PY (Debian's python3, the one with python3-torch), json_field,
# peak_mb, median, ratio, torch_available and pin_blas_coretype.

PY=${PY:-/usr/bin/python3}

# json_field FILE KEY: KEY of the JSON object on FILE's last line.
json_field() { "$PY" -c "import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])[sys.argv[2]])" "$1" "$2"; }
# peak_mb FILE: the peak RSS in MB from a /usr/bin/time -v report.
peak_mb() { awk '/Maximum resident set size/ {printf "%.0f", $NF/1024}' "$1"; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# ratio A B: A / B to two decimals.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }

# torch_available: true where PY imports torch and numpy; says so on stderr otherwise.
torch_available() {
  "$PY" -c 'import torch, numpy' 2>/dev/null && return 0
  echo "PyTorch is not installed (Debian python3-torch: scripts/install-deps.sh --bench); measuring cfmo-train alone" >&2
  return 1
}

# pin_blas_coretype PROBE_JSON: both peers get the OpenBLAS kernel cfmo-train
# selects (see OPENBLAS_CORETYPE in cfmo-train(1)); PyTorch (Debian
# python3-torch) uses the same libopenblas for its GEMMs. PROBE_JSON is a
# `cfmo-train --json` summary; its `blas` field ends with the core type.
pin_blas_coretype() {
  blas=$(json_field "$1" blas)
  export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-${blas##* }}
  echo "BLAS: $blas; both peers run with OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE" >&2
}
