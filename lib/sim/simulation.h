#pragma once
/// `cfmo-train simulate`: what the modes would do on W workers, from the
/// modes' own protocol code (train/modes/*, unchanged) run for W simulated
/// workers in one process on a virtual clock (sim/scheduler.h) over a
/// simulated network (sim/network.h, sim/sim_communicator.h). Each worker
/// is a fiber that takes the trainer's steps: a compute of a drawn time
/// (sim/step_times.h), then the mode's on_gradients and after_step, and at
/// the end its finish, so who waits for whom, staleness, rounds, the
/// owners' replies and the stop are the protocol's. Parameters are not
/// computed: each worker's model is a stand-in of one float, and the
/// network charges every message for the floats a model of `params` would
/// put in it. So memory grows with W by the protocol's state only.

#include "core/error.h"
#include "sim/network.h"
#include "sim/step_times.h"
#include "train/modes.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::sim {

struct SimulateOptions {
  std::vector<int> workers = {8};  ///< one simulation per size (a sweep)
  std::vector<train::ModeKind> modes = {train::ModeKind::kSync};
  int64_t steps = 1000;  ///< per worker: lockstep modes take exactly these; the asynchronous ones share the budget
  int batch = 32;        ///< samples per step and worker
  int64_t params = 124'000'000;  ///< the model's parameters: what the messages carry
  train::ModeSettings settings;  ///< H, beta, max staleness, the outer step, the wire dtype
  StepTimeOptions step_times;
  NetworkOptions network;
  /// --math: every worker trains a real model (its parameters travel and
  /// are charged as they are; --params is ignored), so staleness's effect
  /// on the loss shows; small worlds only (kMaxMathWorkers).
  bool math = false;
  std::string data = "synthetic:4096:1024";
  std::string model = "mlp:32";
  double lr = 0.05;  ///< SGD with momentum 0.9
};

inline constexpr int kMaxMathWorkers = 64;

/// One simulation: a mode on a number of workers.
struct SimulateRow {
  std::string mode;
  int workers = 0;
  int64_t steps = 0;     ///< all workers together
  int64_t samples = 0;   ///< all workers together
  double virtual_s = 0;  ///< the longest worker's loop, in virtual seconds
  double samples_per_s = 0;
  double solo_samples_per_s = 0;  ///< the sum of the workers' rates without waiting
  double efficiency = 0;          ///< samples_per_s / solo_samples_per_s, as a real run's
  double wait_s_mean = 0;
  double wait_s_max = 0;
  double finish_wait_s_mean = 0;
  int64_t rounds = 0;  ///< rank 0's
  uint64_t messages = 0;
  LinkLoad host_uplinks;
  LinkLoad host_downlinks;
  LinkLoad spine_uplinks;
  int owners = 0;                   ///< cfmo, asgd: K, the ranks owning a shard (0: the mode has none)
  uint64_t owner_received_max = 0;  ///< contributions that reached the busiest owner
  double owner_received_mean = 0;
  uint64_t keeper_messages = 0;  ///< messages rank 0 (the budget keeper) received
  uint64_t contributions_dropped = 0;
  std::vector<uint64_t> staleness_histogram;  ///< all workers' replies, [s] = s rounds stale (the last: more)
  double test_loss = -1;      ///< --math: the global parameters' loss on the test set (-1: not computed)
  double test_accuracy = -1;  ///< --math
  double wall_s = 0;          ///< real seconds the simulation took
  uint64_t events = 0;
};

/// The rows, by size then mode; `on_start` is told before each simulation.
Result<std::vector<SimulateRow>> simulate(const SimulateOptions& options,
                                          const std::function<void(std::string_view mode, int workers)>& on_start = {});
Result<SimulateRow> simulate_one(const SimulateOptions& options, train::ModeKind mode, int workers);

/// The rows as a table, as cfmo-train --compare prints.
std::string simulate_table(const std::vector<SimulateRow>& rows);
nlohmann::ordered_json simulate_json(const std::vector<SimulateRow>& rows, const SimulateOptions& options);
/// Efficiency against workers, a line per mode.
std::string simulate_svg(const std::vector<SimulateRow>& rows);

}  // namespace cfmo::sim
