#pragma once
/// The statistics a parameter delta is judged by, computed in one pass:
/// squared norms of the base (the global parameters) and of the delta, their
/// dot product, the largest |delta| and how many values are not finite.
/// Sums skip non-finite values (they are counted instead), so every field is
/// a finite number that JSON can hold. Each kernel keeps a fixed accumulation
/// order, so the same values give bit-identical sums on every machine and
/// SIMD width; a long tensor is reduced in chunks merged in order.

#include <cstdint>
#include <span>

namespace cfmo::ckpt {

struct DeltaStats {
  int64_t elements = 0;
  double base_sq = 0;          ///< sum of base^2 over finite base values
  double delta_sq = 0;         ///< sum of delta^2 over finite delta values
  double base_dot_delta = 0;   ///< sum of base*delta where both are finite
  double max_abs = 0;          ///< largest |delta| over finite delta values
  int64_t nonfinite = 0;       ///< delta values that are NaN or infinite
  int64_t base_nonfinite = 0;  ///< base values that are NaN or infinite

  /// Adds `other` (the next chunk): sums add, maxima and counts combine.
  void merge(const DeltaStats& other);
};

/// Statistics of `delta` against `base` (same length).
DeltaStats delta_stats(std::span<const float> base, std::span<const float> delta);

/// The fields that need only the delta (elements, delta_sq, max_abs,
/// nonfinite), bit-identical to delta_stats's; the base fields stay 0.
DeltaStats delta_only_stats(std::span<const float> delta);

/// Statistics of local - base (computed in float, as the trainer computes a
/// delta) against `base`, without materialising the delta.
DeltaStats pair_stats(std::span<const float> base, std::span<const float> local);

}  // namespace cfmo::ckpt
