#include "train/trainer.h"

#include "train/channels.h"
#include "train/delta_writer.h"
#include "train/engine.h"

#include "core/atomic_file.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "model/factory.h"
#include "optim/schedule.h"
#include "tensor/ops.h"
#include "train/data_source.h"
#include "train/sample.h"

#include <nlohmann/json.hpp>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

namespace cfmo {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// metrics.jsonl: one JSON object per line, flushed as written so a reader
/// (cfmo-diverge watch, tail -f) sees each line whole.
class MetricsLog {
 public:
  static Result<MetricsLog> open(const fs::path& path, int64_t resume_step) {
    std::error_code ec;
    if (resume_step >= 0 && fs::exists(path, ec)) CFMO_TRY(truncate_after(path, resume_step));
    MetricsLog log;
    errno = 0;
    log.out_ = std::make_unique<std::ofstream>(path, resume_step >= 0 ? std::ios::app : std::ios::trunc);
    if (!*log.out_) {
      return make_error(ErrorKind::kInternal, "Failed to open '{}' for writing: {}", path.string(), reason());
    }
    log.path_ = path;
    return log;
  }

  Status write(const nlohmann::ordered_json& line) {
    if (!out_) return {};
    errno = 0;
    *out_ << line.dump() << '\n';
    out_->flush();
    if (!*out_) return make_error(ErrorKind::kInternal, "Failed to write '{}': {}", path_.string(), reason());
    return {};
  }

 private:
  /// A resumed run rewrites history from its checkpoint on: lines logged
  /// after the checkpoint, by the run that was interrupted, are dropped.
  static Status truncate_after(const fs::path& path, int64_t step) {
    CFMO_ASSIGN_OR_RETURN(std::string text, read_file(path));
    std::string kept;
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) break;  // a torn last line is dropped
      std::string_view line(text.data() + start, end - start);
      auto parsed = nlohmann::json::parse(line, nullptr, false);
      if (!parsed.is_discarded() && parsed.value("step", int64_t{0}) <= step) {
        kept.append(line);
        kept.push_back('\n');
      }
      start = end + 1;
    }
    return write_file_atomic(path, kept);
  }

  /// What the failed stream operation's system call said (the streams keep errno).
  static std::string reason() { return errno != 0 ? std::strerror(errno) : "unknown error"; }

  std::unique_ptr<std::ofstream> out_;
  fs::path path_;
};

}  // namespace

namespace {

/// Every field of a WorkerReport with its JSON key, once: `f(key, member)`
/// for a const or a mutable report, so to_json and from_json stay in step.
template <typename Report, typename F>
void visit_fields(Report& w, F&& f) {
  f("rank", w.rank);
  f("steps", w.steps);
  f("samples", w.samples);
  f("samples_per_s", w.samples_per_s);
  f("solo_samples_per_s", w.solo_samples_per_s);
  f("wait_s", w.wait_s);
  f("finish_wait_s", w.finish_wait_s);
  f("loop_s", w.loop_s);
  f("bytes_sent", w.bytes_sent);
  f("bytes_received", w.bytes_received);
  f("contributions_dropped", w.contributions_dropped);
  f("contributions_sent", w.contributions_sent);
  f("contributions_applied", w.contributions_applied);
  f("contributions_received", w.contributions_received);
  f("rounds", w.rounds);
  f("deferred", w.deferred);
  f("staleness_histogram", w.staleness_histogram);
  f("slowdown", w.slowdown);
  f("deltas_written", w.deltas_written);
  f("deltas_skipped", w.deltas_skipped);
  f("stopped_by", w.stopped_by);
}

nlohmann::ordered_json worker_json(const WorkerReport& w) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  visit_fields(w, [&](const char* key, const auto& value) { j[key] = value; });
  return j;
}

}  // namespace

std::string WorkerReport::to_json() const { return worker_json(*this).dump(); }

Result<WorkerReport> WorkerReport::from_json(std::string_view text) {
  WorkerReport w;
  try {
    const auto j = nlohmann::json::parse(text);
    visit_fields(w, [&](const char* key, auto& value) { j.at(key).get_to(value); });
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kPeer, "a worker report is malformed: {}", e.what());
  }
  return w;
}

std::string TrainSummary::to_json() const {
  nlohmann::ordered_json workers_json = nlohmann::ordered_json::array();
  for (const auto& w : per_worker) workers_json.push_back(worker_json(w));
  auto null_or = [](const std::string& v) {
    return v.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v);
  };
  nlohmann::ordered_json slowdowns = nlohmann::ordered_json::object();
  for (const auto& item : slowdown) {
    const auto eq = item.find('=');
    if (eq != std::string::npos) slowdowns[item.substr(0, eq)] = std::stod(item.substr(eq + 1));
  }
  nlohmann::ordered_json j = {
      {"mode", mode},
      {"workers", workers},
      {"model", model},
      {"optimizer", optimizer},
      {"data", data},
      {"blas", blas},
      {"device", device},
      {"parameters", parameters},
      {"steps", steps},
      {"samples", samples},
      {"epochs_completed", epochs_completed},
      {"wall_s", wall_s},
      {"train_s", train_s},
      {"eval_s", eval_s},
      {"samples_per_s", samples_per_s},
      {"efficiency", efficiency},
      {"efficiency_basis",
       "total samples/s over the sum of each worker's solo samples/s, measured during this run "
       "as its samples over its own compute time (simulated slowness included, waits excluded)"},
      {"test_accuracy", test_accuracy},
      {"test_loss", test_loss},
      {"final_train_loss", final_train_loss},
      {"train_loss", train_loss},
      {"val_loss", context > 0 ? nlohmann::ordered_json(val_loss) : nlohmann::ordered_json(nullptr)},
      {"tokens", tokens},
      {"tokens_per_s", tokens_per_s},
      {"gflops_per_s", gflops_per_s},
      {"flops_per_example", flops_per_example},
      {"flops_formula", flops_formula},
      {"bytes_sent", bytes_sent},
      {"stopped_by", stopped_by},
      {"lost_ranks", lost_ranks},
      {"settings",
       {{"sync_interval", mode_settings.sync_interval},
        {"staleness_discount", mode_settings.staleness_discount},
        {"max_staleness", mode_settings.max_staleness},
        {"outer_optimizer", mode_settings.outer_optimizer},
        {"outer_lr", mode_settings.outer_lr},
        {"outer_momentum", mode_settings.outer_momentum},
        {"delta_dtype", std::string(to_string(mode_settings.delta_dtype))}}},
      {"simulation",
       {{"simulated", !slowdown.empty() || !straggler.empty()},
        {"slowdown", slowdowns},
        {"straggler", null_or(straggler)}}},
      {"run_dir", null_or(run_dir)},
      {"resumed_from", null_or(resumed_from)},
      {"per_worker", workers_json}};
  if (!muon_tensors.empty()) j["optimizer_split"] = {{"muon", muon_tensors}, {"adamw", adamw_tensors}};
  return j.dump();
}

namespace {

/// A sample's text on one line of a log: newlines as \\n, other control bytes as spaces.
std::string one_line(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    if (ch == '\n') {
      out += "\\n";
    } else {
      out += static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f ? ' ' : ch;
    }
  }
  return out;
}

/// A checkpoint resumes in a world like the one that wrote it: the position
/// counts global batches of workers x batch size, and cfmo's and asgd's
/// checkpoints hold a position per rank.
Status check_resumable(const fs::path& dir, const CheckpointWorld& saved, const TrainConfig& config, int world) {
  if (saved.workers != world) {
    return make_error(ErrorKind::kUsage, "--resume '{}': written by a run of {} worker(s); this one has {}",
                      dir.string(), saved.workers, world);
  }
  if (world > 1 && !saved.mode.empty() && saved.mode != config.mode) {
    return make_error(ErrorKind::kUsage, "--resume '{}': written in --mode {}; resume it with --mode {}", dir.string(),
                      saved.mode, saved.mode);
  }
  if (saved.batch_size > 0 && saved.batch_size != config.batch_size) {
    return make_error(ErrorKind::kUsage, "--resume '{}': written with --batch-size {}; this run has {}", dir.string(),
                      saved.batch_size, config.batch_size);
  }
  return {};
}

}  // namespace

Result<TrainSummary> train(const TrainConfig& config, const TrainOptions& options) {
  const auto run_start = Clock::now();
  CFMO_TRY(validate(config));
  TrainObserver null_observer;
  TrainObserver& observer = options.observer != nullptr ? *options.observer : null_observer;
  Communicator* comm = options.comm;
  const int rank = comm != nullptr ? comm->rank() : 0;
  const int world = comm != nullptr ? comm->size() : 1;
  const bool async = world > 1 && (config.mode == "cfmo" || config.mode == "asgd");
  ops::set_num_threads(config.threads);
#if defined(__x86_64__)
  // Flush denormals to zero on this thread: Adam's first moment of a weight
  // that stops receiving gradient decays into the denormal range within a
  // few hundred steps, where every multiply costs ~100 cycles. PyTorch's
  // torch.set_flush_denormal(True) does the same.
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
#endif
  CFMO_ASSIGN_OR_RETURN(auto source, load_data_source(config, rank, world, model_context(config.model)));
  CFMO_ASSIGN_OR_RETURN(auto model_ptr, make_model(config.model, source->shape()));
  Model& model = *model_ptr;
  model.init(static_cast<uint64_t>(config.seed));  // the same on every rank
  const std::string model_spec = model.spec_string();
  const int64_t train_examples = source->train_examples();
  const int vocab = source->shape().classes;
  int64_t sample_every = rank == 0 ? config.sample_every : 0;
  if (sample_every > 0 && model.context() == 0) {
    observer.on_note(fmt::format("--sample-every: {} is not a language model; no samples", model_spec));
    sample_every = 0;
  }

  OptimizerConfig optim_config;
  optim_config.name = config.optimizer;
  optim_config.momentum = config.momentum;
  optim_config.nesterov = config.nesterov;
  optim_config.beta1 = config.beta1;
  optim_config.beta2 = config.beta2;
  optim_config.eps = config.eps;
  optim_config.weight_decay = config.weight_decay;
  optim_config.ns_steps = config.ns_steps;
  CFMO_ASSIGN_OR_RETURN(auto optimizer, make_optimizer(optim_config, model.params(), model.num_params()));

  TrainPosition pos;
  ModeResume resume;
  if (!options.resume.empty()) {
    CheckpointWorld saved;
    FloatBuffer outer;
    CFMO_ASSIGN_OR_RETURN(pos, load_checkpoint(options.resume, model, *optimizer, &saved, &outer));
    CFMO_TRY(check_resumable(options.resume, saved, config, world));
    CFMO_TRY(check_positions(options.resume, pos, saved, optimizer->step_count(), train_examples, config.batch_size));
    // Every rank starts from the global parameters; in cfmo and asgd each at its own position.
    if (!saved.ranks.empty()) pos = saved.ranks[static_cast<size_t>(rank)];
    resume.outer_momentum.assign(outer.begin(), outer.end());
    resume.ranks = saved.ranks;
    if (config.mode == "asgd" && world > 1) {
      // An asgd checkpoint's optimizer state is the owners'.
      for (const auto& s : optimizer->state()) resume.owner_state.emplace_back(s.buffer->begin(), s.buffer->end());
      resume.owner_steps = saved.shard_optimizer_steps;
    }
    if (rank == 0) observer.on_note(fmt::format("resumed from {} at step {}", options.resume.string(), pos.step));
  }

  // Sharding: the epoch's shuffled order is cut into global batches of
  // world x batch examples; rank k takes the k-th slice of each. With sync,
  // a step of W workers therefore sees exactly one worker's batch of W x B.
  const int batch = config.batch_size;
  const int64_t global_batch = static_cast<int64_t>(batch) * world;
  const int64_t batches_per_epoch = (train_examples + global_batch - 1) / global_batch;
  // A rank's saved position at the very end of an epoch continues with the next one.
  if (!options.resume.empty()) pos = resume_position(pos, batches_per_epoch);
  int64_t step_limit = config.steps > 0 ? config.steps : INT64_MAX;
  if (config.epochs > 0) step_limit = std::min(step_limit, config.epochs * batches_per_epoch);
  // --tokens: a budget of training tokens, as windows of the model's context (rounded up).
  const int context = model.context();
  const int64_t token_windows = config.tokens > 0 && context > 0 ? (config.tokens + context - 1) / context : 0;
  const int64_t token_steps = token_windows > 0 ? (token_windows + global_batch - 1) / global_batch : 0;
  if (token_steps > 0) step_limit = std::min(step_limit, token_steps);
  ModeSettings settings;
  settings.name = config.mode;
  settings.sync_interval = config.sync_interval;
  settings.staleness_discount = config.staleness_discount;
  settings.max_staleness = config.max_staleness;
  settings.outer_optimizer = config.outer_optimizer;
  settings.outer_lr = config.outer_lr;
  settings.outer_momentum = config.outer_momentum;
  CFMO_ASSIGN_OR_RETURN(settings.delta_dtype, parse_wire_dtype(config.delta_dtype));
  settings.peer_timeout_s = config.peer_timeout;
  int64_t schedule_steps = step_limit == INT64_MAX ? 0 : step_limit;
  if (async) {
    // Asynchronous workers share a budget of samples, kept by rank 0: a fast
    // worker takes more steps than a slow one. The same budget as sync's.
    int64_t budget = INT64_MAX;
    if (config.steps > 0) budget = config.steps * global_batch;
    if (config.epochs > 0) budget = std::min(budget, config.epochs * train_examples);
    if (token_windows > 0) budget = std::min(budget, token_windows);
    settings.sample_budget = budget == INT64_MAX ? 0 : budget;
    schedule_steps = settings.sample_budget > 0 ? settings.sample_budget / global_batch : 0;
    step_limit = INT64_MAX;
  }
  CFMO_ASSIGN_OR_RETURN(const Heterogeneity simulated, heterogeneity_for(config, rank));
  double time_limit_s = 0;
  if (!config.time_limit.empty()) {
    CFMO_ASSIGN_OR_RETURN(time_limit_s, parse_duration(config.time_limit));
  }

  Schedule schedule;
  CFMO_ASSIGN_OR_RETURN(schedule.kind, Schedule::parse_kind(config.schedule));
  schedule.base_lr = config.lr;
  schedule.min_lr = config.min_lr;
  schedule.warmup_steps = config.warmup_steps;
  schedule.total_steps = schedule_steps;

  const fs::path run_dir = config.out;
  // Each reconciliation's delta goes to RUN/deltas/rank-K/, for cfmo-diverge.
  std::unique_ptr<DeltaWriter> delta_writer;
  if (!run_dir.empty() && world > 1 && (config.mode == "localsgd" || config.mode == "cfmo")) {
    const int64_t offset = options.resume.empty() ? 0 : DeltaWriter::last_round(run_dir, rank);
    delta_writer = std::make_unique<DeltaWriter>(run_dir, rank, model.params(), offset);
    settings.delta_sink = [&delta_writer](int64_t round, int64_t step, int64_t base_version,
                                          std::span<const float> base, std::span<const float> delta) {
      delta_writer->submit(round, step, base_version, base, delta);
    };
  }
  CFMO_ASSIGN_OR_RETURN(auto mode, make_mode(settings, comm, model.params(), model.parameters(), optim_config, resume));

  // Where the arithmetic runs (--device). The host model and optimizer stay the
  // mirror the modes, checkpoints and deltas use; a CUDA engine copies to them
  // only when asked. Every rank makes its engine together (NCCL connects here).
  EngineOptions engine_options;
  CFMO_ASSIGN_OR_RETURN(engine_options.device, parse_device(config.device));
  engine_options.comm = comm;
  engine_options.device_collectives = world > 1 && config.mode == "sync";
  engine_options.peer_timeout_s = config.peer_timeout;
  engine_options.local_rank = options.local_rank;
  CFMO_ASSIGN_OR_RETURN(auto engine, make_engine(engine_options, model, *optimizer, optim_config, *source));
  CFMO_TRY(engine->optimizer_changed());  // a resumed optimizer's state, where the engine keeps it
  if (engine->has_device_all_reduce()) {
    mode->use_device_reduce([&engine](std::span<float> extras) { return engine->device_all_reduce_gradients(extras); });
  }
  // Brings the host model and optimizer up to date with the engine (a checkpoint, the end).
  auto sync_host = [&]() -> Status {
    CFMO_TRY(engine->host_parameters());
    CFMO_TRY(engine->host_optimizer());
    return {};
  };

  MetricsLog metrics;
  if (!run_dir.empty()) {
    std::error_code ec;
    fs::create_directories(run_dir, ec);
    if (ec) return make_error(ErrorKind::kUsage, "--out '{}': {}", run_dir.string(), ec.message());
    const std::string name = rank == 0 ? "metrics.jsonl" : fmt::format("metrics-rank-{}.jsonl", rank);
    CFMO_ASSIGN_OR_RETURN(metrics, MetricsLog::open(run_dir / name, options.resume.empty() ? -1 : pos.step));
  }

  TrainSummary summary;
  summary.mode = config.mode;
  summary.workers = world;
  summary.rank = rank;
  summary.model = model_spec;
  summary.optimizer = config.optimizer;
  summary.data = source->description();
  summary.blas = ops::blas_info();
  summary.device = engine->description();
  summary.parameters = model.num_trainable();
  summary.context = context;
  summary.flops_per_example = model.flops_per_example();
  summary.flops_formula = model.flops_formula();
  if (config.optimizer == "muon") {
    for (const auto& p : model.params())
      (p.is_matrix() ? summary.muon_tensors : summary.adamw_tensors).push_back(p.name);
  }
  summary.run_dir = run_dir.string();
  summary.resumed_from = options.resume.string();
  summary.mode_settings = settings;
  summary.slowdown = config.slowdown;
  summary.straggler = config.straggler;

  // metrics.jsonl's "epoch": epochs completed, fractional within an epoch (as step/steps-per-epoch).
  auto epochs_done = [&] {
    return static_cast<double>(pos.epoch) +
           static_cast<double>(pos.batch_in_epoch) / static_cast<double>(batches_per_epoch);
  };
  auto evaluate = [&](bool final) -> Status {
    const auto t0 = Clock::now();
    CFMO_ASSIGN_OR_RETURN(const EvalResult r, engine->evaluate());
    EvalEvent event{pos.step, epochs_done(), r.loss(), r.accuracy(), seconds_since(run_start), final};
    summary.test_loss = event.test_loss;
    if (context > 0) summary.val_loss = event.test_loss;
    summary.test_accuracy = event.test_accuracy;
    summary.eval_s += seconds_since(t0);
    observer.on_eval(event);
    return metrics.write({{"type", "eval"},
                          {"rank", rank},
                          {"step", pos.step},
                          {"epoch", event.epochs},
                          {"test_loss", event.test_loss},
                          {"test_accuracy", event.test_accuracy},
                          {"wall_s", event.elapsed_s}});
  };
  // Only rank 0 checkpoints, always the global parameters: where its own are
  // the global ones (sync, localsgd right after a round) it writes them at
  // once; in cfmo and asgd it asks the owners for their shards and hands the
  // assembled state to a writer thread, so that no worker waits.
  const bool checkpoints = rank == 0 && !run_dir.empty();
  int64_t last_checkpoint_step = options.resume.empty() ? -1 : pos.step;
  std::unique_ptr<CheckpointWriter> checkpoint_writer;
  if (checkpoints && async) {
    checkpoint_writer = std::make_unique<CheckpointWriter>(run_dir, model_spec, model.params(), options.config_toml,
                                                           config.keep_checkpoints);
  }
  // What a checkpoint of this run holds; `global` is the owners' state (cfmo, asgd).
  auto checkpoint_of = [&](std::span<const float> params, const GlobalState* global) {
    CheckpointData data = checkpoint_data(model, *optimizer, pos);
    data.params.assign(params.begin(), params.end());
    data.world.workers = world;
    data.world.mode = config.mode;
    data.world.batch_size = config.batch_size;
    const auto outer = mode->outer_momentum();
    data.outer_momentum.assign(outer.begin(), outer.end());
    if (global != nullptr) {
      data.world.ranks = global->ranks;
      data.outer_momentum.assign(global->outer_momentum.begin(), global->outer_momentum.end());
      if (!global->owner_state.empty() && global->owner_state.size() == data.optimizer_state.size()) {
        // asgd: the owners ran the optimizer; rank 0's own never stepped.
        for (size_t i = 0; i < data.optimizer_state.size(); ++i) {
          data.optimizer_state[i].second.assign(global->owner_state[i].begin(), global->owner_state[i].end());
        }
        data.world.shard_optimizer_steps = global->owner_steps;
      }
    }
    return data;
  };
  auto checkpoint = [&]() -> Status {
    if (!checkpoints) return {};
    CFMO_TRY(sync_host());
    CFMO_TRY(write_checkpoint(run_dir, model_spec, model.params(), checkpoint_of(model.parameters(), nullptr),
                              options.config_toml, config.keep_checkpoints));
    last_checkpoint_step = pos.step;
    return {};
  };
  bool checkpoint_due = false;  // an epoch end or --checkpoint-every asked for one

  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  Rng straggler_rng(static_cast<uint64_t>(config.seed), 0x57A6000ULL + static_cast<uint64_t>(rank));

  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t window_samples = 0;
  double window_s = 0;
  double progress_loss = 0;
  int64_t progress_steps = 0;
  double train_s = 0;
  double compute_s = 0;  // computing and simulated slowness, not waiting
  int64_t samples_this_run = 0;
  int64_t steps_this_run = 0;
  int64_t last_eval_step = -1;
  // Every worker starts its loop together: ranks finish loading data and
  // connecting at different times, and a loop started alone would count
  // time in which the others cannot yet run against the run's throughput.
  if (world > 1) CFMO_TRY(comm->barrier());
  const auto loop_start = Clock::now();

  // Asynchronous workers train on without a lost peer: each says so, once a peer.
  std::vector<bool> announced(static_cast<size_t>(world), false);
  auto announce_lost = [&] {
    if (!async || options.observer == nullptr) return;
    for (const int r : comm->lost_ranks()) {
      if (announced[static_cast<size_t>(r)]) continue;
      announced[static_cast<size_t>(r)] = true;
      options.observer->on_warning(fmt::format("rank {} lost ({})", r, comm->lost_reason(r)));
    }
  };

  std::string stopped_by;
  for (;;) {
    announce_lost();
    if (pos.step >= step_limit) {
      stopped_by = config.steps > 0 && pos.step >= config.steps ? "steps"
                   : token_steps > 0 && pos.step >= token_steps ? "tokens"
                                                                : "epochs";
      break;
    }
    std::string wish;
    if (time_limit_s > 0 && seconds_since(run_start) >= time_limit_s) wish = "time-limit";
    if (options.stop != nullptr && options.stop->load(std::memory_order_relaxed)) wish = "interrupt";
    if (!wish.empty()) {
      if (stopped_by.empty()) stopped_by = wish;
      // Lockstep workers stop together: the wish travels with the next collective.
      if (!mode->lockstep()) break;
      mode->want_stop(wish);
    }
    if (mode->stop_requested()) {
      if (mode->lockstep()) stopped_by = mode->agreed_reason();  // the same on every rank
      if (stopped_by.empty()) {
        // The budget that was spent: the smallest of those given, in examples of all workers.
        const int64_t by_steps = config.steps > 0 ? config.steps * global_batch : INT64_MAX;
        const int64_t by_epochs = config.epochs > 0 ? config.epochs * train_examples : INT64_MAX;
        const int64_t by_tokens = token_windows > 0 ? token_windows : INT64_MAX;
        stopped_by = !async                                                              ? "peer"
                     : by_tokens < std::min(by_steps, by_epochs)                         ? "tokens"
                     : config.epochs > 0 && (config.steps == 0 || by_epochs <= by_steps) ? "epochs"
                                                                                         : "steps";
      }
      break;
    }
    if (async && rank != 0 && comm->health().has_value() == false) {
      const auto lost = comm->lost_ranks();
      if (std::find(lost.begin(), lost.end(), 0) != lost.end()) {
        // With the root cause's kind: a rank 0 that failed on its own passed it on as it left.
        const Error cause = comm->health().error();
        return make_error(cause.kind, "rank 0, which keeps the run's budget, is lost: {}", cause.message);
      }
    }
    // An indexed set is walked in each epoch's shuffled order; sampled windows come from the step.
    BatchRequest request;
    request.step = pos.step;
    request.count = batch;
    if (source->indexed()) {
      if (order_epoch != pos.epoch) {
        order = epoch_order(static_cast<uint64_t>(config.seed), pos.epoch, train_examples);
        order_epoch = pos.epoch;
      }
      const int64_t first = pos.batch_in_epoch * global_batch + static_cast<int64_t>(rank) * batch;
      request.count = static_cast<int>(std::clamp<int64_t>(train_examples - first, 0, batch));
      if (request.count > 0) {
        request.indices =
            std::span<const int64_t>(order).subspan(static_cast<size_t>(first), static_cast<size_t>(request.count));
      }
    }

    const auto step_start = Clock::now();
    const int n = request.count;
    float loss = 0;
    if (n > 0) {
      CFMO_ASSIGN_OR_RETURN(loss, engine->forward_backward(request));
      if (!std::isfinite(loss)) {
        return make_error(ErrorKind::kCheckFailed,
                          "training diverged: loss is {} at step {} (lower --lr or set --clip-grad-norm)", loss,
                          pos.step + 1);
      }
    } else {
      CFMO_TRY(engine->zero_gradients());
    }
    const double lr = schedule.at(pos.step);
    const auto wait_before = mode->stats().wait_s;
    // Clip the gradient that is applied: the all-reduced one in sync, the pushed one in asgd.
    if (mode->owns_update() && config.clip_grad_norm > 0) CFMO_TRY(engine->clip_gradients(config.clip_grad_norm));
    if ((n > 0 || !async) && mode->uses_gradients()) {
      // The gradients come to the host only for a mode that reduces them there.
      std::span<float> grads;
      const bool on_host = !engine->has_device_all_reduce();
      if (on_host) {
        CFMO_ASSIGN_OR_RETURN(grads, engine->host_gradients());
      }
      CFMO_TRY(mode->on_gradients(grads, n, static_cast<float>(lr)));
      if (on_host && !mode->owns_update()) CFMO_TRY(engine->gradients_changed());
    }
    if (!mode->owns_update() && config.clip_grad_norm > 0) CFMO_TRY(engine->clip_gradients(config.clip_grad_norm));
    if (!mode->owns_update() && (n > 0 || config.mode == "sync")) CFMO_TRY(engine->step(static_cast<float>(lr)));
    ++pos.step;
    ++steps_this_run;
    pos.samples += n;
    samples_this_run += n;
    ++pos.batch_in_epoch;
    {
      // The host copy of the parameters only at the steps where the mode works on them.
      std::span<float> params;
      const bool host_params = engine->host_resident() || mode->needs_params(pos);
      if (host_params) {
        CFMO_ASSIGN_OR_RETURN(params, engine->host_parameters());
      }
      CFMO_TRY(mode->after_step(pos, params, engine->mode_optimizer()));
      if (host_params) CFMO_TRY(engine->parameters_changed());
    }
    // Simulated heterogeneity: sleep so the step takes FACTOR times its natural time.
    const double natural_s = seconds_since(step_start) - (mode->stats().wait_s - wait_before);
    double factor = simulated.slowdown;
    if (simulated.straggler_p > 0 && straggler_rng.uniform() < simulated.straggler_p) {
      factor *= simulated.straggler_factor;
    }
    if (factor > 1) std::this_thread::sleep_for(std::chrono::duration<double>((factor - 1) * natural_s));
    const double step_s = seconds_since(step_start);
    // The solo rate: everything this step took except waiting on other workers.
    compute_s += step_s - (mode->stats().wait_s - wait_before);
    train_s += step_s;
    pos.train_s += step_s;

    window_loss += loss;
    progress_loss += loss;
    ++window_steps;
    ++progress_steps;
    window_samples += n;
    window_s += step_s;
    summary.final_train_loss = loss;
    summary.train_loss = window_steps > 0 ? window_loss / static_cast<double>(window_steps) : loss;

    StepEvent event;
    event.step = pos.step;
    event.epoch = pos.epoch;
    event.lr = lr;
    event.elapsed_s = seconds_since(run_start);
    double fraction = -1;
    if (step_limit != INT64_MAX) fraction = static_cast<double>(pos.step) / static_cast<double>(step_limit);
    if (async && settings.sample_budget > 0) {
      fraction = static_cast<double>(pos.samples * world) / static_cast<double>(settings.sample_budget);
    }
    if (time_limit_s > 0) fraction = std::max(fraction, event.elapsed_s / time_limit_s);
    event.fraction = std::min(fraction, 1.0);
    if (fraction > 0 && fraction < 1) event.eta_s = train_s * (1 - fraction) / fraction;
    if (time_limit_s > 0) {
      const double left = std::max(0.0, time_limit_s - event.elapsed_s);
      event.eta_s = event.eta_s < 0 ? left : std::min(event.eta_s, left);
    }
    event.loss = progress_loss / static_cast<double>(progress_steps);
    event.samples_per_s = static_cast<double>(samples_this_run) / std::max(train_s, 1e-9);
    event.logged = pos.step % config.log_every == 0;
    if (event.logged) {
      event.loss = window_loss / static_cast<double>(window_steps);
      event.samples_per_s = static_cast<double>(window_samples) / std::max(window_s, 1e-9);
      CFMO_TRY(metrics.write({{"type", "step"},
                              {"rank", rank},
                              {"step", pos.step},
                              {"epoch", epochs_done()},
                              {"loss", event.loss},
                              {"lr", lr},
                              {"samples", pos.samples},
                              {"samples_per_s", event.samples_per_s},
                              {"wall_s", event.elapsed_s}}));
      window_loss = 0;
      window_steps = 0;
      window_samples = 0;
      window_s = 0;
      progress_loss = 0;
      progress_steps = 0;
    }
    observer.on_step(event);
    if (sample_every > 0 && pos.step % sample_every == 0) {
      // Rank 0's own parameters, sampled between steps: the workspaces are free then.
      SampleOptions sample;
      sample.tokens = 64;
      sample.seed = static_cast<uint64_t>(pos.step);
      CFMO_ASSIGN_OR_RETURN(const auto text, sample_tokens(model, {}, sample));
      observer.on_note(fmt::format("step {} sample: {}", pos.step, one_line(tokens_to_text(text, vocab))));
    }

    if (pos.batch_in_epoch == batches_per_epoch) {
      ++pos.epoch;
      pos.batch_in_epoch = 0;
      if (rank == 0 && (world == 1 || config.mode == "sync")) {
        CFMO_TRY(evaluate(false));
        last_eval_step = pos.step;
      }
      checkpoint_due = checkpoints;
    } else if (checkpoints && config.checkpoint_every > 0 && pos.step % config.checkpoint_every == 0) {
      checkpoint_due = true;
    }
    if (checkpoint_due && mode->params_are_global()) {
      CFMO_TRY(checkpoint());
      checkpoint_due = false;
    } else if (checkpoint_due && mode->request_snapshot()) {
      checkpoint_due = false;
    }
    if (checkpoint_writer) {
      if (auto global = mode->take_snapshot()) {
        CFMO_TRY(engine->host_optimizer());  // rank 0's optimizer state goes with the owners' shards
        checkpoint_writer->submit(checkpoint_of(global->params, &*global));
      }
    }
  }
  const double loop_s = seconds_since(loop_start);

  // The last reconciliation; afterwards rank 0 holds the global parameters.
  {
    CFMO_ASSIGN_OR_RETURN(auto params, engine->host_parameters());
    const Status finished = mode->finish(params, engine->mode_optimizer());
    announce_lost();
    CFMO_TRY(finished);
    CFMO_TRY(engine->parameters_changed());  // the evaluation below runs where the engine is
    CFMO_TRY(sync_host());
  }
  const ModeStats mode_stats = mode->stats();
  int64_t deltas_written = 0;
  int64_t deltas_skipped = 0;
  if (delta_writer) {
    // finish() sent the last round: the sink is not called again.
    delta_writer->close();  // writes what is queued
    deltas_written = delta_writer->written();
    deltas_skipped = delta_writer->skipped();
    CFMO_TRY(delta_writer->status());
  }

  WorkerReport own;
  own.rank = rank;
  own.steps = steps_this_run;
  own.samples = samples_this_run;
  own.samples_per_s = loop_s > 0 ? static_cast<double>(samples_this_run) / loop_s : 0;
  own.solo_samples_per_s = compute_s > 0 ? static_cast<double>(samples_this_run) / compute_s : 0;
  own.wait_s = mode_stats.wait_s;
  own.finish_wait_s = mode_stats.finish_wait_s;
  own.loop_s = loop_s;
  own.contributions_dropped = mode_stats.contributions_dropped;
  own.contributions_sent = mode_stats.contributions_sent;
  own.contributions_applied = mode_stats.contributions_applied;
  own.contributions_received = mode_stats.contributions_received;
  own.rounds = mode_stats.rounds;
  own.deferred = mode_stats.deferred;
  own.staleness_histogram = mode_stats.staleness_histogram;
  own.slowdown = simulated.slowdown;
  own.stopped_by = stopped_by;
  own.deltas_written = deltas_written;
  own.deltas_skipped = deltas_skipped;
  if (comm != nullptr) {
    const CommStats cs = comm->stats();
    own.bytes_sent = cs.bytes_sent;
    own.bytes_received = cs.bytes_received;
  }
  summary.per_worker.push_back(own);

  if (comm != nullptr && world > 1) {
    // Every worker's report goes to rank 0, which waits for the live ones.
    std::mutex reports_mutex;
    std::vector<WorkerReport> reports;
    if (rank == 0) {
      comm->on_message(channels::kReport, [&](int, std::span<const std::byte> payload) {
        auto report =
            WorkerReport::from_json(std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
        if (!report) return;
        std::lock_guard lock(reports_mutex);
        reports.push_back(std::move(*report));
      });
      const auto deadline = Clock::now() + std::chrono::duration<double>(config.peer_timeout * 2);
      for (;;) {
        const auto lost = comm->lost_ranks();
        {
          std::lock_guard lock(reports_mutex);
          if (static_cast<int>(reports.size() + lost.size()) >= world - 1 || Clock::now() > deadline) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      comm->on_message(channels::kReport, nullptr);
      std::lock_guard lock(reports_mutex);
      for (auto& r : reports) summary.per_worker.push_back(std::move(r));
      std::sort(summary.per_worker.begin(), summary.per_worker.end(),
                [](const WorkerReport& a, const WorkerReport& b) { return a.rank < b.rank; });
    } else {
      const std::string text = own.to_json();
      comm->post(0, channels::kReport,
                 std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                        reinterpret_cast<const std::byte*>(text.data()) + text.size()));
    }
    summary.lost_ranks = comm->lost_ranks();
    announce_lost();
    if (!async) CFMO_TRY(comm->health());
  }

  if (rank == 0) {
    // The final parameters are those of the last evaluation when the run ended on an epoch boundary.
    if (last_eval_step != pos.step || (world > 1 && config.mode != "sync")) CFMO_TRY(evaluate(true));
    if (checkpoint_writer) {
      // Mid-run checkpoints first, then the end's, which holds the final global state.
      checkpoint_writer->close();
      CFMO_TRY(checkpoint_writer->status());
      if (checkpoints) {
        const auto global = mode->final_state();
        CFMO_TRY(write_checkpoint(run_dir, model_spec, model.params(),
                                  checkpoint_of(model.parameters(), global ? &*global : nullptr), options.config_toml,
                                  config.keep_checkpoints));
      }
    } else if (last_checkpoint_step != pos.step) {
      CFMO_TRY(checkpoint());
    }
    if (!run_dir.empty()) {
      CFMO_TRY(save_model(run_dir / "model.safetensors", model,
                          {{"format", "pt"}, {"cfmo.model", model_spec}, {"cfmo.step", std::to_string(pos.step)}}));
      // Beside it, the Hugging Face config that makes RUN a model directory (the GPT's).
      if (const std::string hf = model.hf_config_json(); !hf.empty()) {
        CFMO_TRY(write_file_atomic(run_dir / "config.json", hf));
      }
    }
  }

  int64_t total_samples = 0;
  int64_t total_steps = 0;
  double solo_sum = 0;
  double longest_loop = 0;
  uint64_t bytes = 0;
  // A lost rank sent no report: its samples count up to its last contribution.
  for (const int r : summary.lost_ranks) {
    const auto& reported = summary.per_worker;
    if (std::none_of(reported.begin(), reported.end(), [r](const WorkerReport& w) { return w.rank == r; })) {
      total_samples += mode->reconciled_samples(r);
    }
  }
  for (const auto& w : summary.per_worker) {
    total_samples += w.samples;
    total_steps += w.steps;
    solo_sum += w.solo_samples_per_s;
    longest_loop = std::max(longest_loop, w.loop_s);
    bytes += w.bytes_sent;
  }
  summary.steps = world == 1 ? pos.step : total_steps;
  summary.samples = world == 1 ? pos.samples : total_samples;
  summary.epochs_completed = world == 1 || !async ? pos.epoch : total_samples / train_examples;
  summary.wall_s = seconds_since(run_start);
  summary.train_s = world == 1 ? train_s : longest_loop;
  summary.samples_per_s = world == 1 ? (train_s > 0 ? static_cast<double>(samples_this_run) / train_s : 0)
                                     : (longest_loop > 0 ? static_cast<double>(total_samples) / longest_loop : 0);
  summary.efficiency = solo_sum > 0 ? summary.samples_per_s / solo_sum : 0;
  summary.tokens = summary.samples * context;
  summary.tokens_per_s = summary.samples_per_s * context;
  summary.gflops_per_s = summary.samples_per_s * summary.flops_per_example / 1e9;
  summary.stopped_by = stopped_by;
  summary.bytes_sent = bytes;
  return summary;
}

}  // namespace cfmo
