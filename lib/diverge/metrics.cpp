#include "diverge/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace cfmo::diverge {

Divergence divergence(const ckpt::DeltaStats& stats) {
  constexpr double kUndefined = std::numeric_limits<double>::quiet_NaN();
  Divergence d;
  d.delta_l2 = std::sqrt(stats.delta_sq);
  d.base_l2 = std::sqrt(stats.base_sq);
  d.max_abs = stats.max_abs;
  d.nonfinite = stats.nonfinite;
  d.base_nonfinite = stats.base_nonfinite;
  if (stats.base_sq > 0) {
    d.rel_l2 = d.delta_l2 / d.base_l2;
  } else {
    d.rel_l2 = stats.delta_sq > 0 ? kUndefined : 0.0;
  }
  // |base + delta|^2 expanded; rounding can take it a hair below zero when
  // the local parameters are (almost) exactly zero.
  const double local_sq = std::max(0.0, stats.base_sq + 2 * stats.base_dot_delta + stats.delta_sq);
  if (stats.base_sq > 0 && local_sq > 0) {
    const double c = (stats.base_sq + stats.base_dot_delta) / (d.base_l2 * std::sqrt(local_sq));
    d.cosine = std::clamp(c, -1.0, 1.0);
  } else {
    d.cosine = kUndefined;
  }
  return d;
}

}  // namespace cfmo::diverge
