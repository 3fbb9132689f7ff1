#!/usr/bin/env bash
# Packs what bench/gpu.sh needs on a GPU machine that has the CUDA runtime,
# cuBLAS and NCCL but none of cfmo's Debian libraries: the built binaries and
# every shared library they load that is not glibc's, the compiler's or
# CUDA's, with UCX's transport modules, into .gpu/bundle.tar.gz (ignored by
# git; about 15 MB). The device tool carries it with `carry: [".gpu"]`.
#
#   scripts/gpu-bundle.sh [BUILD]     (default BUILD: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
binaries=(tools/cfmo-train tests/test_cuda bench/cuda-bench)
[ -x "$build/tools/cfmo-moe" ] && binaries+=(tools/cfmo-moe)
for b in "${binaries[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu-bundle: $build/$b is not built (configure with -Dcuda=enabled, then ninja)" >&2; exit 2; }
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib/ucx"
for b in "${binaries[@]}"; do cp "$build/$b" "$stage/bin/"; done
# What the device image provides itself: glibc, the compiler's runtime and CUDA.
skip='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so'
for b in "${binaries[@]}"; do
  ldd "$build/$b" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  [[ $name =~ $skip ]] && continue
  cp -L "$lib" "$stage/lib/$name"
done
ucx_modules=$(dirname "$(ldconfig -p | awk '/libucp.so.0 / {print $NF; exit}')")/ucx
[ -d "$ucx_modules" ] && cp -L "$ucx_modules"/*.so.0 "$stage/lib/ucx/" 2>/dev/null || true
mkdir -p .gpu
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
tar -C "$stage" -czf .gpu/bundle.tar.gz .
echo "gpu-bundle: .gpu/bundle.tar.gz ($(du -h .gpu/bundle.tar.gz | cut -f1)): ${binaries[*]}" >&2
