#include "ckpt/delta_stats.h"

#include "core/simd.h"

#include <algorithm>
#include <bit>
#include <cstring>

// The vector helpers below are internal and inlined into each SIMD clone; no
// vector crosses an ABI boundary, so GCC's note about the vector ABI does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace cfmo::ckpt {
namespace {

// Everything a kernel calls is forced inline, so it is compiled for the
// clone's ISA instead of the baseline one.
#define CFMO_INLINE __attribute__((always_inline)) inline

// Eight lanes, written with GCC/Clang vector types because the compilers do
// not vectorise the branchy scalar form: lane j accumulates the elements i
// with i % 8 == j, in order, on every ISA, so the sums are bit-identical
// across the SIMD clones and machines.
constexpr size_t kLanes = 8;
using U8 = uint32_t __attribute__((vector_size(32)));
using F8 = float __attribute__((vector_size(32)));
using D8 = double __attribute__((vector_size(64)));

// Counters are 32-bit per lane; blocks of this many elements keep them from wrapping.
constexpr size_t kBlock = size_t{1} << 30;

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

CFMO_INLINE U8 load(const float* p) {
  U8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

CFMO_INLINE U8 max_u(U8 a, U8 b) {
  const U8 take_b = static_cast<U8>(b > a);
  return (b & take_b) | (a & ~take_b);
}

CFMO_INLINE D8 widen(U8 bits) { return __builtin_convertvector(std::bit_cast<F8>(bits), D8); }

double lane_sum(const double (&acc)[kLanes]) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Per-lane state, spilled to arrays for the scalar tail, which continues the lanes.
struct Lanes {
  double base_sq[kLanes] = {};
  double delta_sq[kLanes] = {};
  double dot[kLanes] = {};
  uint32_t max_bits[kLanes] = {};  // |delta| as bits: for finite values, integer order is float order
  int64_t bad[kLanes] = {};
  int64_t base_bad[kLanes] = {};

  DeltaStats finish(size_t n) const {
    DeltaStats stats;
    stats.elements = static_cast<int64_t>(n);
    stats.base_sq = lane_sum(base_sq);
    stats.delta_sq = lane_sum(delta_sq);
    stats.base_dot_delta = lane_sum(dot);
    stats.max_abs = std::bit_cast<float>(*std::max_element(max_bits, max_bits + kLanes));
    for (size_t j = 0; j < kLanes; ++j) {
      stats.nonfinite += bad[j];
      stats.base_nonfinite += base_bad[j];
    }
    return stats;
  }

  // One element into lane j, exactly as the vector loop treats it.
  CFMO_INLINE void scalar(uint32_t delta_bits, uint32_t base_bits, size_t j, bool with_base) {
    const uint32_t d_abs = delta_bits & kAbsMask;
    const uint32_t b_abs = base_bits & kAbsMask;
    const bool d_ok = d_abs < kInfBits;
    const bool b_ok = b_abs < kInfBits;
    const double d = std::bit_cast<float>(d_ok ? delta_bits : 0u);
    delta_sq[j] += d * d;
    max_bits[j] = std::max(max_bits[j], d_ok ? d_abs : 0u);
    bad[j] += d_ok ? 0 : 1;
    if (with_base) {
      const double b = std::bit_cast<float>(b_ok ? base_bits : 0u);
      base_sq[j] += b * b;
      dot[j] += (b_ok ? d : 0.0) * (d_ok ? b : 0.0);
      base_bad[j] += b_ok ? 0 : 1;
    }
  }
};

// delta_at(i) loads 8 delta values' bits; scalar_delta(i) one. Shared by the
// three kernels so their delta fields agree bit for bit.
template <bool kWithBase, typename DeltaAt, typename ScalarDelta>
CFMO_INLINE DeltaStats reduce(const float* base, size_t n, DeltaAt delta_at, ScalarDelta scalar_delta) {
  Lanes lanes;
  size_t i = 0;
  while (i + kLanes <= n) {
    const size_t block_end = i + std::min(kBlock, (n - i) / kLanes * kLanes);
    D8 bsq = {}, dsq = {}, dot = {};
    U8 max_bits = {}, bad = {}, base_bad = {};
    std::memcpy(&bsq, lanes.base_sq, sizeof bsq);
    std::memcpy(&dsq, lanes.delta_sq, sizeof dsq);
    std::memcpy(&dot, lanes.dot, sizeof dot);
    std::memcpy(&max_bits, lanes.max_bits, sizeof max_bits);
    for (; i < block_end; i += kLanes) {
      const U8 w = delta_at(i);
      const U8 d_abs = w & kAbsMask;
      const U8 d_ok = static_cast<U8>(d_abs < kInfBits);  // all ones or zero
      const D8 d = widen(w & d_ok);
      dsq += d * d;
      max_bits = max_u(max_bits, d_abs & d_ok);
      bad += d_ok + 1u;  // 0 for a finite value, 1 otherwise
      if constexpr (kWithBase) {
        const U8 bw = load(base + i);
        const U8 b_ok = static_cast<U8>((bw & kAbsMask) < kInfBits);
        const D8 b = widen(bw & b_ok);
        bsq += b * b;
        dot += widen(w & d_ok & b_ok) * widen(bw & b_ok & d_ok);
        base_bad += b_ok + 1u;
      }
    }
    std::memcpy(lanes.base_sq, &bsq, sizeof bsq);
    std::memcpy(lanes.delta_sq, &dsq, sizeof dsq);
    std::memcpy(lanes.dot, &dot, sizeof dot);
    std::memcpy(lanes.max_bits, &max_bits, sizeof max_bits);
    for (size_t j = 0; j < kLanes; ++j) {
      lanes.bad[j] += bad[j];
      lanes.base_bad[j] += base_bad[j];
    }
  }
  for (size_t j = 0; i < n; ++i, ++j) {
    lanes.scalar(scalar_delta(i), kWithBase ? std::bit_cast<uint32_t>(base[i]) : 0u, j, kWithBase);
  }
  return lanes.finish(n);
}

}  // namespace

void DeltaStats::merge(const DeltaStats& other) {
  elements += other.elements;
  base_sq += other.base_sq;
  delta_sq += other.delta_sq;
  base_dot_delta += other.base_dot_delta;
  max_abs = std::max(max_abs, other.max_abs);
  nonfinite += other.nonfinite;
  base_nonfinite += other.base_nonfinite;
}

CFMO_SIMD_CLONES
DeltaStats delta_only_stats(std::span<const float> delta) {
  const float* d = delta.data();
  return reduce<false>(
      nullptr, delta.size(), [d](size_t i) __attribute__((always_inline)) { return load(d + i); },
      [d](size_t i) __attribute__((always_inline)) { return std::bit_cast<uint32_t>(d[i]); });
}

CFMO_SIMD_CLONES
DeltaStats delta_stats(std::span<const float> base, std::span<const float> delta) {
  const float* d = delta.data();
  return reduce<true>(
      base.data(),
      std::min(base.size(), delta.size()), [d](size_t i) __attribute__((always_inline)) { return load(d + i); },
      [d](size_t i) __attribute__((always_inline)) { return std::bit_cast<uint32_t>(d[i]); });
}

CFMO_SIMD_CLONES
DeltaStats pair_stats(std::span<const float> base, std::span<const float> local) {
  const float* b = base.data();
  const float* l = local.data();
  return reduce<true>(
      b, std::min(base.size(), local.size()), [ b, l ](size_t i) __attribute__((always_inline)) {
        F8 bv;
        F8 lv;
        std::memcpy(&bv, b + i, sizeof bv);
        std::memcpy(&lv, l + i, sizeof lv);
        return std::bit_cast<U8>(lv - bv);
      },
      [ b, l ](size_t i) __attribute__((always_inline)) { return std::bit_cast<uint32_t>(l[i] - b[i]); });
}

}  // namespace cfmo::ckpt
