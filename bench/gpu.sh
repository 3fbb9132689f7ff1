#!/usr/bin/env bash
# The GPU checks of issue 7 in one run, for a lent GPU machine (under 8
# minutes on one H200): the GPU test suite, the backend's targets
# (cuda-bench: a GEMM-bound training step against cuBLAS alone for the same
# GEMMs, the fused AdamW update against copy bandwidth), and the trainer's
# samples/s on the CPU and on the GPU. Everything goes to OUTDIR.
#
# Here:   scripts/gpu-bundle.sh            (binaries and their libraries -> .gpu/)
# There:  bench/gpu.sh "$OUT"              (the device tool, carry [".gpu"])
# Or on any machine with a CUDA build:     bench/gpu.sh OUTDIR build
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
build=${2:-}
mkdir -p "$out"
log() { echo "gpu.sh: $*" | tee -a "$out/summary.txt" >&2; }

if [ -z "$build" ] && [ -f .gpu/bundle.tar.gz ]; then
  root=/tmp/cfmo-gpu
  rm -rf "$root" && mkdir -p "$root" && tar -C "$root" -xzf .gpu/bundle.tar.gz
  bin_train=$root/bin/cfmo-train bin_test=$root/bin/test_cuda bin_bench=$root/bin/cuda-bench bin_moe=$root/bin/cfmo-moe
  # cuBLAS and NCCL from the machine: the CUDA toolkit, or the nvidia-* Python wheels beside PyTorch.
  extra=$(python3 - <<'PY' 2>/dev/null
import importlib, os
dirs = []
for m in ("nvidia.cublas", "nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13"):
    try:
        mod = importlib.import_module(m)
        for p in getattr(mod, "__path__", []):
            for sub in ("lib", "lib64"):
                d = os.path.join(p, sub)
                if os.path.isdir(d): dirs.append(d)
    except Exception:
        pass
print(":".join(dirs))
PY
)
  export LD_LIBRARY_PATH="$root/lib:/usr/local/cuda/lib64:${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export UCX_MODULE_DIR=$root/lib/ucx
else
  build=${build:-build}
  bin_train=$build/tools/cfmo-train bin_test=$build/tests/test_cuda bin_bench=$build/bench/cuda-bench
  bin_moe=$build/tools/cfmo-moe
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true; } > "$out/gpu.txt" 2>&1
log "GPU: $(tail -n +2 "$out/gpu.txt" | head -1)"
for b in "$bin_train" "$bin_test" "$bin_bench"; do
  ldd "$b" | grep -q "not found" && { log "missing libraries for $b:"; ldd "$b" | grep "not found" | tee -a "$out/summary.txt"; }
done

log "GPU tests"
timeout 240 "$bin_test" --gtest_output=json:"$out/test_cuda.json" > "$out/test_cuda.txt" 2>&1
log "test_cuda exit $? ($(grep -cE '^\[       OK' "$out/test_cuda.txt") ok, $(grep -cE '^\[  FAILED' "$out/test_cuda.txt") failed lines)"

log "backend targets"
timeout 180 "$bin_bench" > "$out/cuda_bench.jsonl" 2> "$out/cuda_bench.err"
log "cuda-bench exit $?"
cat "$out/cuda_bench.jsonl" | tee -a "$out/summary.txt"

log "trainer samples/s, CPU and GPU (synthetic data of Fashion-MNIST's shape)"
for device in cpu cuda; do
  for model in mlp:256,128 mlp:4096,4096,4096; do
    batch=64; [ "$model" != mlp:256,128 ] && batch=4096
    [ "$device" = cpu ] && [ "$batch" = 4096 ] && steps=20 || steps=2000
    [ "$device" = cuda ] && [ "$batch" = 4096 ] && steps=300
    timeout 120 "$bin_train" --data synthetic:60000:10000 --model "$model" --batch-size "$batch" --steps "$steps" \
      --device "$device" --threads 16 --json --quiet > "$out/train-$device-${model//[:,]/_}.json" 2> "$out/train-$device.err"
    log "train $device $model batch $batch: exit $? $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(round(d["samples_per_s"]), "samples/s, acc", round(d["test_accuracy"],4))' "$out/train-$device-${model//[:,]/_}.json" 2>/dev/null)"
  done
done
log "cfmo-moe on the GPU: 4 ranks sharing it, 12 experts, sync and async (tokens over UCX, host-staged)"
if [ -x "$bin_moe" ]; then
  for slow in "" "--slowdown 1=1.25"; do
    timeout 150 "$bin_moe" --ranks 4 --experts 12 --tokens 4096 --hidden 1024 --ffn 4096 --mode both --device cuda:0 \
      --warmup 5 --iters 30 $slow --format json > "$out/moe-gpu${slow:+-slow}.json" 2> "$out/moe-gpu.err"
    log "moe gpu ${slow:-homogeneous}: exit $? $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(" | ".join(f"{x[\"mode\"]} {x[\"tokens_per_s\"]:.0f} tok/s check {x[\"check\"]}" for x in r))' "$out/moe-gpu${slow:+-slow}.json" 2>/dev/null)"
  done
fi
log "done"
