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

/// cfmo-train simulate's --thermal P:X:S: in every stretch of S seconds, each
/// worker is throttled to speed X (its steps take 1/X as long) with
/// probability P.
struct Thermal {
  double share = 0;
  double speed = 1;
  double stretch_s = 1;
};
/// P in [0, 1], X in (0, 1], S > 0; errors name --thermal.
Result<Thermal> parse_thermal(const std::string& text);

/// cfmo-train simulate's --speeds SHARE:SPEED,...: that share of the workers
/// (in rank order) runs at that speed (steps take 1/SPEED as long).
struct SpeedShare {
  double share = 1;
  double speed = 1;
};
/// Shares > 0 summing to 1, speeds > 0; errors name --speeds.
Result<std::vector<SpeedShare>> parse_speeds(const std::string& text);

}  // namespace cfmo
