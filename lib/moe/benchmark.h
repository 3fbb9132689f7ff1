#pragma once
/// A whole cfmo-moe run on one rank: for each size, each mode on the same
/// inputs (warmup, then the measured iterations), the reference check, and
/// the summary every rank agrees on. Every rank calls it with the same
/// configuration; it is collective throughout.

#include "comm/communicator.h"
#include "moe/moe_config.h"
#include "moe/stats.h"

#include <functional>
#include <string>
#include <vector>

namespace cfmo::moe {

/// The simulated heterogeneity of this rank (see --slowdown, --straggler).
struct Simulation {
  double slowdown = 1;
  double straggler_p = 0;
  double straggler_factor = 1;
};

/// Parses --slowdown and --straggler for `rank` of a world of `ranks`, the way cfmo-train does.
Result<Simulation> simulation_for(const MoeConfig& config, int rank, int ranks);

/// Moves this rank's experts to a device (a CUDA one: the GPU of the rank
/// `local_rank` on its host) and returns the device's description. The tool
/// passes cuda/moe_experts.h's place_experts: moe does not link the CUDA backend.
using PlaceExperts = std::function<Result<std::string>(std::vector<ExpertFfn>&, const tensor::Device&, int local_rank)>;

struct BenchmarkOptions {
  comm::Communicator* comm = nullptr;
  int local_rank = -1;         ///< the rank's index on its host, for "cuda" (device_for_rank); -1: its rank
  PlaceExperts place_experts;  ///< needed for a --device other than cpu
  Simulation simulation;
  std::function<void(const std::string&)> note;  ///< progress lines (rank 0 passes one); may be empty
};

Result<std::vector<ModeSummary>> run_benchmark(const MoeConfig& config, const MoePlan& plan,
                                               const BenchmarkOptions& options);

/// Recomputes this rank's output of `iteration` in one process (every
/// expert's weights drawn here, no communication) and compares `record`'s
/// last output with it; tokens with a late result count only in max_abs_err.
CheckValues reference_check(const EngineSetup& setup, uint64_t seed, int ffn, int64_t iteration,
                            const RankRecord& record);

}  // namespace cfmo::moe
