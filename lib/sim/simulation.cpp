#include "sim/simulation.h"

#include "comm/codec.h"
#include "data/dataset.h"
#include "model/factory.h"
#include "sim/scheduler.h"
#include "sim/sim_communicator.h"
#include "train/channels.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

namespace cfmo::sim {
namespace {

/// One simulated worker: the mode and what the trainer keeps around it.
struct Worker {
  std::unique_ptr<model::Model> model;  ///< --math only
  std::vector<float> batch;             ///< --math: this step's rows
  std::unique_ptr<train::Mode> mode;
  std::vector<float> params;
  std::vector<float> grads;
  std::unique_ptr<optim::Optimizer> optimizer;
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
  if (options.math) return nullptr;  // the messages carry the model's own floats
  const auto params = static_cast<size_t>(options.params);
  const int shards = train::owner_count(options.settings, workers);
  auto bounds = std::make_shared<std::vector<size_t>>(train::shard_bounds(params, shards));
  const comm::WireDtype dtype = options.settings.delta_dtype;
  return [bounds, params, dtype, shards](comm::Channel channel, int from, int to, uint64_t payload) -> uint64_t {
    // Shard j is served by rank j (no rank is lost here); ranks K and up serve none.
    auto shard = [&](int j) -> size_t {
      return j < shards ? (*bounds)[static_cast<size_t>(j) + 1] - (*bounds)[static_cast<size_t>(j)] : 0;
    };
    if (channel == kCollective) return payload + (params - kStandIn) * sizeof(float);
    if (channel == train::channels::kDeltaShard || channel == train::channels::kGradShard) {
      return payload + comm::encoded_size(dtype, shard(to));
    }
    // An owner's shard: raw floats.
    if (channel == train::channels::kFreshShard || channel == train::channels::kGather) {
      return payload + shard(from) * sizeof(float);
    }
    return payload;
  };
}

/// The trainer's loop (train/step_loop.cpp) on a virtual clock.
void run_worker(Worker& w, int rank, int workers, const SimulateOptions& options, bool lockstep, Scheduler& scheduler,
                StepTimes& times, const data::Dataset* train) {
  train::Mode& mode = *w.mode;
  const std::span<float> params = w.model ? w.model->parameters() : std::span<float>(w.params);
  const std::span<float> grads = w.model ? w.model->gradients() : std::span<float>(w.grads);
  train::TrainPosition position;
  // Asynchronous workers stop when the budget keeper says; this bound only
  // keeps a broken protocol from running forever.
  const int64_t cap = lockstep ? options.steps : options.steps * static_cast<int64_t>(workers) * 4;
  const auto lr = static_cast<float>(options.lr);
  while (w.steps < cap && !mode.stop_requested()) {
    const double compute = times.draw(rank, scheduler.time());
    scheduler.sleep(compute);
    w.compute_s += compute;
    if (w.model) {
      // The rows of this worker's share of the global batch, round and round the data.
      const int64_t room = std::max<int64_t>(1, train->count - options.batch + 1);
      const int64_t first = ((w.steps * workers + rank) * options.batch) % room;
      const int n = static_cast<int>(std::min<int64_t>(options.batch, train->count - first));
      train->rows_to_float(first, n, w.batch.data());
      w.model->forward_backward({n, w.batch.data(), train->labels.data() + first, nullptr});
    }
    if (mode.uses_gradients()) {
      w.status = mode.on_gradients(grads, options.batch, lr);
      if (!w.status) return;
    }
    if (w.model && !mode.owns_update()) w.optimizer->step(params, grads, lr);
    ++position.step;
    ++position.batch_in_epoch;
    position.samples += options.batch;
    position.train_s = scheduler.time();
    ++w.steps;
    w.samples += options.batch;
    w.status = mode.after_step(position, mode.needs_params(position) ? params : std::span<float>(), *w.optimizer);
    if (!w.status) return;
    // A replayed run's own time between steps (its metrics line, ...): neither compute nor waiting.
    if (const double between = times.between(rank); between > 0) scheduler.sleep(between);
  }
  w.loop_s = scheduler.time();
  w.status = mode.finish(params, *w.optimizer);
}

}  // namespace

Result<SimulateRow> simulate_one(const SimulateOptions& options, train::ModeKind kind, int workers) {
  const auto wall_start = std::chrono::steady_clock::now();
  const train::ModeEntry& entry = train::mode_entry(kind);
  CFMO_ASSIGN_OR_RETURN(StepTimes times, StepTimes::make(options.step_times, workers));
  Scheduler scheduler;
  Network network(workers, options.network);
  SimWorld world(scheduler, network, workers, make_sizer(options, workers));

  train::ModeSettings settings = options.settings;
  settings.kind = kind;
  settings.delta_sink = nullptr;
  // No rank is lost here, so the peer timeout only bounds the modes' waits;
  // and a link here serves its messages one after another, so at the end a
  // few bytes to a busy owner wait behind all the shards sent to it before
  // (a real network interleaves them): with many workers to few owners that
  // is more than the default's 3 x 10 s. An hour of virtual time.
  settings.peer_timeout_s = std::max(settings.peer_timeout_s, 3600.0);
  // The asynchronous modes share the lockstep modes' budget of samples (as a real run's --steps).
  settings.sample_budget = entry.traits.asynchronous ? options.steps * options.batch * workers : 0;
  optim::OptimizerConfig optimizer;
  optimizer.kind = optim::OptimizerKind::kSgd;
  optimizer.momentum = 0.9;
  std::vector<model::ParamInfo> layout = {{"stand-in", {static_cast<int64_t>(kStandIn)}, 0, kStandIn}};
  std::vector<float> initial(kStandIn, 0.0f);
  std::optional<data::DataSplit> data;
  model::DataShape shape;
  if (options.math) {
    if (workers > kMaxMathWorkers) {
      return make_error(ErrorKind::kUsage, "--math: at most {} workers ({} asked): every worker trains its model",
                        kMaxMathWorkers, workers);
    }
    CFMO_ASSIGN_OR_RETURN(data, data::load_data(options.data, options.step_times.seed));
    shape = {model::InputKind::kFeatures, data->train.features, data->train.classes};
    CFMO_ASSIGN_OR_RETURN(auto first, model::make_model(options.model, shape));
    first->init(options.step_times.seed);
    layout = first->params();
    initial.assign(first->parameters().begin(), first->parameters().end());
  }

  std::vector<Worker> crew(static_cast<size_t>(workers));
  for (int r = 0; r < workers; ++r) {
    Worker& w = crew[static_cast<size_t>(r)];
    if (options.math) {
      CFMO_ASSIGN_OR_RETURN(w.model, model::make_model(options.model, shape));
      w.model->init(options.step_times.seed);  // the same start everywhere
      w.batch.resize(static_cast<size_t>(options.batch) * static_cast<size_t>(shape.features));
    } else {
      w.params = initial;
      w.grads.assign(kStandIn, 0.0f);
    }
    CFMO_ASSIGN_OR_RETURN(w.optimizer, optim::make_optimizer(optimizer, layout, initial.size()));
    CFMO_ASSIGN_OR_RETURN(w.mode, train::make_mode(settings, &world.rank(r), layout, initial, optimizer));
  }
  const data::Dataset* train = data ? &data->train : nullptr;
  for (int r = 0; r < workers; ++r) {
    world.bind_fiber(r, scheduler.spawn([&, r] {
      run_worker(crew[static_cast<size_t>(r)], r, workers, options, entry.traits.lockstep, scheduler, times, train);
    }));
  }
  // The modes' seam waits poll for replies, done, stop and the gather, which
  // only a message changes, or for a deadline (seconds): a waiting worker
  // wakes at each message to it, and with none after a tenth of the peer
  // timeout (a deadline then passes at most that late).
  scheduler.set_poll_cap(std::max(settings.peer_timeout_s / 10, Scheduler::kQuantum));
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
  row.owners = entry.traits.asynchronous ? train::owner_count(settings, workers) : 0;
  double wait_sum = 0;
  double finish_sum = 0;
  double received_sum = 0;
  for (int r = 0; r < workers; ++r) {
    const Worker& w = crew[static_cast<size_t>(r)];
    const train::ModeStats stats = w.mode->stats();
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
  if (data) {
    // finish left the global parameters on rank 0 (on every rank in the lockstep modes).
    const data::Dataset& test = data->test;
    std::vector<float> rows(static_cast<size_t>(test.count) * static_cast<size_t>(test.features));
    test.rows_to_float(0, test.count, rows.data());
    const model::EvalResult eval =
        crew[0].model->evaluate({static_cast<int>(test.count), rows.data(), test.labels.data(), nullptr});
    row.test_loss = eval.loss();
    row.test_accuracy = eval.accuracy();
  }
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
    for (train::ModeKind kind : options.modes) {
      if (on_start) on_start(train::mode_entry(kind).name, workers);
      CFMO_ASSIGN_OR_RETURN(auto row, simulate_one(options, kind, workers));
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

}  // namespace cfmo::sim
