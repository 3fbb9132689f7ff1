#pragma once
/// The compute time of each simulated step: a natural time, taken from a
/// measured run's steps (--step-times RUN/metrics.jsonl: a rank the run had
/// replays that rank's steps in order, the others draw from rank 0's) or fixed
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

/// A rank's recorded steps in order: each one's compute, and the trainer's
/// own time after it, neither compute nor waiting (its metrics line, the
/// step's bookkeeping): the next line's wall_s less that step's compute_s
/// and wait_s (0 where the lines have no wait_s).
struct RecordedSteps {
  std::vector<double> compute;
  std::vector<double> between;
};

struct StepTimeOptions {
  double step_time_s = 0.1;      ///< the natural step, when nothing was measured
  std::vector<double> measured;  ///< natural steps to draw from (empty: step_time_s)
  /// Each recorded rank's steps in order: simulated rank r < size() replays
  /// by_rank[r] (round and round) instead of drawing from `measured`.
  std::vector<RecordedSteps> by_rank;
  std::vector<std::string> slowdown;
  std::string straggler;
  std::string thermal;
  std::string speeds;
  uint64_t seed = 1;
};

/// The compute times ("compute_s") of a run's step lines in metrics.jsonl:
/// kInput naming the file when it cannot be read or has none.
Result<std::vector<double>> read_step_times(const std::filesystem::path& metrics);

Result<RecordedSteps> read_recorded_steps(const std::filesystem::path& metrics);
/// Every rank's: `metrics` is rank 0's, metrics-rank-R.jsonl beside it rank
/// R's (R = 1, 2, ... while there is one).
Result<std::vector<RecordedSteps>> read_ranks_step_times(const std::filesystem::path& metrics);

class StepTimes {
 public:
  /// Errors (kUsage) name the flag.
  static Result<StepTimes> make(const StepTimeOptions& options, int workers);

  /// The compute time of `rank`'s step that starts at virtual time `now`.
  double draw(int rank, double now);
  /// After the step drawn last: the trainer's own time before the next
  /// (recorded steps replayed; else 0).
  double between(int rank) const;
  /// The mean natural step (before any factor).
  double natural_mean() const { return natural_mean_; }

 private:
  struct Worker {
    double factor = 1;  ///< slowdown / speed
    Rng rng{0};
    bool replay = false;  ///< its rank's recorded steps in order (by_rank_), the run had it
    size_t next = 0;      ///< the next of them
  };
  std::vector<RecordedSteps> by_rank_;
  std::vector<double> measured_;
  double step_time_s_ = 0.1;
  double natural_mean_ = 0.1;
  Heterogeneity straggler_;
  std::optional<Thermal> thermal_;
  uint64_t seed_ = 1;
  std::vector<Worker> workers_;
};

}  // namespace cfmo::sim
