#include "sim/simulation.h"

#include "comm/codec.h"
#include "sim/scheduler.h"
#include "sim/sim_communicator.h"
#include "train/channels.h"

#include <algorithm>
#include <chrono>
#include <memory>

namespace cfmo::sim {
namespace {

/// One simulated worker: the mode and what the trainer keeps around it.
struct Worker {
  std::unique_ptr<Mode> mode;
  std::vector<float> params;
  std::vector<float> grads;
  std::unique_ptr<Optimizer> optimizer;
  double compute_s = 0;
  double loop_s = 0;
  int64_t steps = 0;
  int64_t samples = 0;
  Status status;
};

/// The stand-in model: one float (a mode that is handed no parameters sends
/// nothing), in the last shard (shards are cut on 16-float boundaries).
constexpr size_t kStandIn = 1;

Sizer make_sizer(const SimulateOptions& options, int workers) {
  const auto params = static_cast<size_t>(options.params);
  auto bounds = std::make_shared<std::vector<size_t>>(shard_bounds(params, workers));
  const WireDtype dtype = options.settings.delta_dtype;
  return [bounds, params, dtype](Channel channel, int from, int to, uint64_t payload) -> uint64_t {
    auto shard = [&](int j) { return (*bounds)[static_cast<size_t>(j) + 1] - (*bounds)[static_cast<size_t>(j)]; };
    if (channel == kCollective) return payload + (params - kStandIn) * sizeof(float);
    if (channel == channels::kDeltaShard || channel == channels::kGradShard) {
      return payload + encoded_size(dtype, shard(to));
    }
    // An owner's shard: raw floats.
    if (channel == channels::kFreshShard || channel == channels::kGather) {
      return payload + shard(from) * sizeof(float);
    }
    return payload;
  };
}

/// The trainer's loop (train/step_loop.cpp) on a virtual clock.
void run_worker(Worker& w, int rank, const SimulateOptions& options, bool lockstep, Scheduler& scheduler,
                StepTimes& times) {
  Mode& mode = *w.mode;
  TrainPosition position;
  // Asynchronous workers stop when the budget keeper says; this bound only
  // keeps a broken protocol from running forever.
  const int64_t cap = lockstep ? options.steps : options.steps * static_cast<int64_t>(options.workers.back()) * 4;
  constexpr float kLr = 0.1f;
  while (w.steps < cap && !mode.stop_requested()) {
    const double compute = times.draw(rank, scheduler.time());
    scheduler.sleep(compute);
    w.compute_s += compute;
    if (mode.uses_gradients()) {
      w.status = mode.on_gradients(w.grads, options.batch, kLr);
      if (!w.status) return;
    }
    ++position.step;
    ++position.batch_in_epoch;
    position.samples += options.batch;
    position.train_s = scheduler.time();
    ++w.steps;
    w.samples += options.batch;
    const std::span<float> params = mode.needs_params(position) ? std::span<float>(w.params) : std::span<float>();
    w.status = mode.after_step(position, params, *w.optimizer);
    if (!w.status) return;
  }
  w.loop_s = scheduler.time();
  w.status = mode.finish(w.params, *w.optimizer);
}

}  // namespace

Result<SimulateRow> simulate_one(const SimulateOptions& options, ModeKind kind, int workers) {
  const auto wall_start = std::chrono::steady_clock::now();
  const ModeEntry& entry = mode_entry(kind);
  CFMO_ASSIGN_OR_RETURN(StepTimes times, StepTimes::make(options.step_times, workers));
  Scheduler scheduler;
  Network network(workers, options.network);
  SimWorld world(scheduler, network, workers, make_sizer(options, workers));

  ModeSettings settings = options.settings;
  settings.kind = kind;
  settings.delta_sink = nullptr;
  // The asynchronous modes share the lockstep modes' budget of samples (as a real run's --steps).
  settings.sample_budget = entry.traits.asynchronous ? options.steps * options.batch * workers : 0;
  OptimizerConfig optimizer;
  optimizer.name = "sgd";
  const std::vector<ParamInfo> layout = {{"stand-in", {static_cast<int64_t>(kStandIn)}, 0, kStandIn}};
  const std::vector<float> initial(kStandIn, 0.0f);

  std::vector<Worker> crew(static_cast<size_t>(workers));
  for (int r = 0; r < workers; ++r) {
    Worker& w = crew[static_cast<size_t>(r)];
    w.params = initial;
    w.grads.assign(kStandIn, 0.0f);
    CFMO_ASSIGN_OR_RETURN(w.optimizer, make_optimizer(optimizer, layout, kStandIn));
    CFMO_ASSIGN_OR_RETURN(w.mode, make_mode(settings, &world.rank(r), layout, initial, optimizer));
  }
  SimulateOptions one = options;
  one.workers = {workers};
  for (int r = 0; r < workers; ++r) {
    scheduler.spawn(
        [&, r] { run_worker(crew[static_cast<size_t>(r)], r, one, entry.traits.lockstep, scheduler, times); });
  }
  const Status ran = scheduler.run();
  for (int r = 0; r < workers; ++r) {
    if (!crew[static_cast<size_t>(r)].status) {
      const Error& e = crew[static_cast<size_t>(r)].status.error();
      return make_error(e.kind, "simulated {} worker {}: {}", entry.name, r, e.message);
    }
  }
  CFMO_TRY(ran);

  SimulateRow row;
  row.mode = std::string(entry.name);
  row.workers = workers;
  double wait_sum = 0;
  double finish_sum = 0;
  double received_sum = 0;
  for (int r = 0; r < workers; ++r) {
    const Worker& w = crew[static_cast<size_t>(r)];
    const ModeStats stats = w.mode->stats();
    row.steps += w.steps;
    row.samples += w.samples;
    row.virtual_s = std::max(row.virtual_s, w.loop_s);
    row.solo_samples_per_s += w.compute_s > 0 ? static_cast<double>(w.samples) / w.compute_s : 0;
    wait_sum += stats.wait_s;
    row.wait_s_max = std::max(row.wait_s_max, stats.wait_s);
    finish_sum += stats.finish_wait_s;
    row.owner_received_max = std::max(row.owner_received_max, stats.contributions_received);
    received_sum += static_cast<double>(stats.contributions_received);
    row.contributions_dropped += stats.contributions_dropped;
    if (row.staleness_histogram.size() < stats.staleness_histogram.size()) {
      row.staleness_histogram.resize(stats.staleness_histogram.size(), 0);
    }
    for (size_t s = 0; s < stats.staleness_histogram.size(); ++s)
      row.staleness_histogram[s] += stats.staleness_histogram[s];
    if (r == 0) row.rounds = stats.rounds;
  }
  row.keeper_messages = world.rank(0).stats().messages_received;
  row.wait_s_mean = wait_sum / workers;
  row.finish_wait_s_mean = finish_sum / workers;
  row.owner_received_mean = received_sum / workers;
  row.samples_per_s = row.virtual_s > 0 ? static_cast<double>(row.samples) / row.virtual_s : 0;
  row.efficiency = row.solo_samples_per_s > 0 ? row.samples_per_s / row.solo_samples_per_s : 0;
  row.messages = world.messages();
  row.host_uplinks = network.host_uplinks();
  row.host_downlinks = network.host_downlinks();
  row.spine_uplinks = network.spine_uplinks();
  row.events = scheduler.events_run();
  crew.clear();  // the modes unregister their handlers before the world goes
  row.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return row;
}

Result<std::vector<SimulateRow>> simulate(const SimulateOptions& options,
                                          const std::function<void(std::string_view, int)>& on_start) {
  // Every flag is checked before the first simulation starts.
  if (options.workers.empty()) return make_error(ErrorKind::kUsage, "--workers: no size given");
  CFMO_TRY(StepTimes::make(options.step_times, *std::max_element(options.workers.begin(), options.workers.end())));
  std::vector<SimulateRow> rows;
  for (int workers : options.workers) {
    for (ModeKind kind : options.modes) {
      if (on_start) on_start(mode_entry(kind).name, workers);
      CFMO_ASSIGN_OR_RETURN(auto row, simulate_one(options, kind, workers));
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

}  // namespace cfmo::sim
