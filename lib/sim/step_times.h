#pragma once
/// The compute time of each simulated step: a natural time, drawn from a
/// measured run's steps (--step-times RUN/metrics.jsonl) or fixed
/// (--step-time), times the worker's factors: --slowdown RANK=FACTOR,
/// --speeds (a share of the workers at a speed), --straggler P:FACTOR (any
/// step, with probability P) and --thermal P:X:S (in each stretch of S
/// seconds a worker is throttled to X with probability P). Deterministic in
/// the seed, each worker its own stream.

#include "core/error.h"
#include "core/heterogeneity.h"
#include "core/rng.h"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::sim {

struct StepTimeOptions {
  double step_time_s = 0.1;      ///< the natural step, when nothing was measured
  std::vector<double> measured;  ///< natural steps to draw from (empty: step_time_s)
  std::vector<std::string> slowdown;
  std::string straggler;
  std::string thermal;
  std::string speeds;
  uint64_t seed = 1;
};

/// The compute times ("compute_s") of a run's step lines in metrics.jsonl:
/// kInput naming the file when it cannot be read or has none.
Result<std::vector<double>> read_step_times(const std::filesystem::path& metrics);

class StepTimes {
 public:
  /// Errors (kUsage) name the flag.
  static Result<StepTimes> make(const StepTimeOptions& options, int workers);

  /// The compute time of `rank`'s step that starts at virtual time `now`.
  double draw(int rank, double now);
  /// The mean natural step (before any factor).
  double natural_mean() const { return natural_mean_; }

 private:
  struct Worker {
    double factor = 1;  ///< slowdown / speed
    Rng rng{0};
  };
  std::vector<double> measured_;
  double step_time_s_ = 0.1;
  double natural_mean_ = 0.1;
  Heterogeneity straggler_;
  std::optional<Thermal> thermal_;
  uint64_t seed_ = 1;
  std::vector<Worker> workers_;
};

}  // namespace cfmo::sim
