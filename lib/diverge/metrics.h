#pragma once
/// Divergence of a worker's local parameters from the global parameters its
/// round started from (the base, theta-bar), computed from DeltaStats alone:
///
///   rel_l2 = |delta| / |base|
///   cosine = cos(base + delta, base)
///
/// The article's rule of thumb: a relative L2 above about 5% between
/// reconciliations means the staleness discount is too high or the sync
/// interval too long.

#include "ckpt/delta_stats.h"

#include <cstdint>

namespace cfmo::diverge {

struct Divergence {
  double rel_l2 = 0;           ///< NaN (undefined) when the base is zero and the delta is not
  double cosine = 1;           ///< NaN (undefined) when the base or the local parameters are zero
  double max_abs = 0;          ///< largest |delta|
  int64_t nonfinite = 0;       ///< non-finite delta values
  int64_t base_nonfinite = 0;  ///< non-finite base values
  double delta_l2 = 0;         ///< |delta|
  double base_l2 = 0;          ///< |base|
};

/// Over the finite values (DeltaStats leaves non-finite ones out of its sums).
Divergence divergence(const ckpt::DeltaStats& stats);

}  // namespace cfmo::diverge
