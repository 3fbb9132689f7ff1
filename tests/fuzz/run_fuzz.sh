#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/fuzz_*.cpp) with Clang, AddressSanitizer
# and UBSan against the reader sources, seeds them with valid files, and runs
# each briefly. Registered as the meson test 'fuzz' (suite 'slow'); exits 77
# (meson: skipped) with the reason when Clang or its libFuzzer runtime is missing.
#
#   CFD_PACK=build/bench/cfd-pack tests/fuzz/run_fuzz.sh
#   FUZZ_SECONDS=300 FUZZ_RUNS=-1 ... to fuzz longer (-1 runs: only the time limit)
set -euo pipefail
src=${CFMO_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
pack=${CFD_PACK:-$src/build/bench/cfd-pack}
seconds=${FUZZ_SECONDS:-15}
runs=${FUZZ_RUNS:-200000}

cxx=""
for candidate in clang++ clang++-14 clang++-15 clang++-16; do
  if command -v "$candidate" >/dev/null 2>&1; then cxx=$candidate; break; fi
done
[ -n "$cxx" ] || { echo "SKIP: clang++ is not installed (Debian: apt-get install clang)"; exit 77; }
[ -x "$pack" ] || { echo "SKIP: $pack not built (ninja -C build bench/cfd-pack)"; exit 77; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$work/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$work/probe.cpp" -o "$work/probe" 2>/dev/null; then
  echo "SKIP: $cxx cannot link libFuzzer (Debian: apt-get install libclang-rt-dev)"
  exit 77
fi

cflags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I"$src/lib"
        $(pkg-config --cflags fmt nlohmann_json libzstd libxxhash))
sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
libs=($(pkg-config --libs fmt libzstd libxxhash) -pthread)
objects=()
for source in ckpt/cfd.cpp ckpt/delta_stats.cpp ckpt/safetensors.cpp core/atomic_file.cpp core/parallel.cpp; do
  object="$work/$(echo "$source" | tr / _).o"
  "$cxx" "${cflags[@]}" "${sanitize[@]}" -fsanitize=fuzzer-no-link -c "$src/lib/$source" -o "$object" &
  objects+=("$object")
done
wait
for target in fuzz_cfd fuzz_safetensors; do
  "$cxx" "${cflags[@]}" "${sanitize[@]}" -fsanitize=fuzzer "$src/tests/fuzz/$target.cpp" "${objects[@]}" "${libs[@]}" \
    -o "$work/$target"
done

# Seeds: a safetensors pair written byte by byte, and .cfd files packed from it
# with every codec and transform and with several frames per tensor.
seeds_st="$work/seeds_safetensors"
seeds_cfd="$work/seeds_cfd"
mkdir -p "$seeds_st" "$seeds_cfd"
safetensors() {  # FILE, then the eight bytes of two F32 values for w (shape [2])
  local header='{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}'
  { printf "\\x$(printf %02x ${#header})\\x00\\x00\\x00\\x00\\x00\\x00\\x00"; printf '%s' "$header"; printf "$2"; } > "$1"
}
safetensors "$seeds_st/base.safetensors" '\x00\x00\x40\x40\x00\x00\x80\x40\x00\x00\x80\x3f'
safetensors "$seeds_st/local.safetensors" '\x00\x00\x40\x40\x00\x00\x90\x40\x00\x00\x00\x00'
for transform in none byteplanes grouped-planes; do
  for codec in zstd none; do
    "$pack" "$seeds_st/base.safetensors" "$seeds_st/local.safetensors" "$seeds_cfd/$transform-$codec.cfd" \
      --transform "$transform" --codec "$codec" --rank 1 --round 2 --step 30 --base-version 1
  done
done

status=0
for target in fuzz_cfd:"$seeds_cfd" fuzz_safetensors:"$seeds_st"; do
  name=${target%%:*}
  corpus="$work/corpus_$name"
  mkdir -p "$corpus"
  echo "== $name: $runs runs or ${seconds}s"
  if ! "$work/$name" -runs="$runs" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 "$corpus" "${target#*:}" > "$work/$name.log" 2>&1; then
    status=1
    tail -n 60 "$work/$name.log"
    mkdir -p "${FUZZ_ARTIFACTS:-$PWD}"
    cp "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* "${FUZZ_ARTIFACTS:-$PWD}/" 2>/dev/null || true
  else
    grep -E "^(stat::number_of_executed_runs|stat::peak_rss_mb)|Done [0-9]+ runs" "$work/$name.log" || true
  fi
done
exit "$status"
