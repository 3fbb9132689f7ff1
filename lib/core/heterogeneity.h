#pragma once
/// The simulated heterogeneity of a rank, as cfmo-train and cfmo-moe both
/// read it from --slowdown RANK=FACTOR (repeatable) and --straggler P:FACTOR:
/// its step takes `slowdown` times its natural time, and with probability
/// `straggler_p` `straggler_factor` times.

#include "core/error.h"

#include <string>
#include <vector>

namespace cfmo {

struct Heterogeneity {
  double slowdown = 1.0;
  double straggler_p = 0.0;
  double straggler_factor = 1.0;
};

/// `rank`'s share of the flags in a run of `ranks` (a RANK=FACTOR naming no
/// rank of the run is kUsage when ranks > 1).
Result<Heterogeneity> parse_heterogeneity(const std::vector<std::string>& slowdown, const std::string& straggler,
                                          int rank, int ranks);

}  // namespace cfmo
