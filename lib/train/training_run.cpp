// train()'s first phase: everything a run needs before its first step.
#include "train/training_run.h"

#include "model/factory.h"
#include "model/gpt.h"
#include "tensor/ops.h"

#include <fmt/format.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

namespace cfmo::train::detail {
namespace {

/// A checkpoint resumes in the mode and with the batch size that wrote it
/// (another number of workers is redistributed: regrid).
Status check_resumable(const std::filesystem::path& dir, const CheckpointWorld& saved, const TrainConfig& config,
                       int world) {
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

/// A position of a world of `from_batch` examples a global batch in one of
/// `to_batch`: the same epoch, and of it the global batches that cover the
/// examples already used, rounded down (a part of a batch is seen again
/// rather than skipped).
TrainPosition regrid(TrainPosition p, int64_t from_batch, int64_t to_batch, int64_t examples) {
  const int64_t used = std::min(p.batch_in_epoch * from_batch, examples);
  const int64_t batches = (examples + to_batch - 1) / to_batch;
  p.batch_in_epoch = used / to_batch;
  p.step = p.epoch * batches + p.batch_in_epoch;
  return p;
}

}  // namespace

void set_up_thread(const TrainConfig& config) {
  tensor::ops::set_num_threads(config.threads);
#if defined(__x86_64__)
  // Flush denormals to zero on this thread: Adam's first moment of a weight
  // that stops receiving gradient decays into the denormal range within a
  // few hundred steps, where every multiply costs ~100 cycles. PyTorch's
  // torch.set_flush_denormal(True) does the same.
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
#endif
}

Status build_model(const TrainConfig& config, const TrainPlan& plan, const model::DataShape& shape,
                   const model::MoeOptions& moe, std::unique_ptr<model::Model>& model,
                   std::unique_ptr<optim::Optimizer>& optimizer) {
  CFMO_ASSIGN_OR_RETURN(model, model::make_model(config.model, shape, moe));
  model->init(static_cast<uint64_t>(config.seed));
  CFMO_ASSIGN_OR_RETURN(
      optimizer, optim::make_optimizer(optimizer_config(config, plan.optimizer), model->params(), model->num_params()));
  return {};
}

TrainingRun::TrainingRun(const TrainConfig& config, const TrainPlan& plan, const TrainOptions& options)
    : config(config),
      plan(plan),
      options(options),
      comm(options.comm),
      rank(comm != nullptr ? comm->rank() : 0),
      world(comm != nullptr ? comm->size() : 1),
      traits(plan.traits()),
      async(world > 1 && traits.asynchronous),
      expert_parallel(world > 1 && config.expert_parallel),
      joining(comm != nullptr && comm->joined()),
      planned_world(joining && options.first_world > 0 ? options.first_world : world),
      process_start(options.process_start.value_or(Clock::now())),
      run_clock(comm, run_start),
      announced(static_cast<size_t>(world), false) {
  if (comm != nullptr && world > 1) {
    comm->on_message(channels::kReport, [this](int, std::span<const std::byte> payload) {
      auto report =
          WorkerReport::from_json(std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
      if (!report) return;
      std::lock_guard lock(reports_mutex);
      reports.push_back(std::move(*report));
    });
  }
}

TrainingRun::~TrainingRun() {
  if (comm != nullptr && world > 1) comm->on_message(channels::kReport, nullptr);
}

Status TrainingRun::set_up() {
  set_up_thread(config);
  CFMO_TRY(load_model_and_optimizer());
  CFMO_TRY(resume_from_checkpoint());
  take_runs_plan();
  CFMO_TRY(plan_length());
  CFMO_TRY(make_mode_and_engine());
  // The workspaces now, not in the first step: faulting them in there cost
  // every process about 0.16 s of CPU on this project's VM, twice a core's
  // share with 4 ranks on 2 cores (bench/RESULTS.md).
  if (engine->host_resident()) model().prepare(batch);
  CFMO_TRY(join_run());
  if (came_too_late) return {};  // nothing to train, nothing to write
  return open_outputs();
}

void TrainingRun::take_runs_plan() {
  if (!joining) {
    run_clock.open(planned_world);
    return;
  }
  // The run's clock, so that this process stops with the others at the time
  // limit, and the world the run's schedule is planned for, which the
  // rendezvous does not know (a resumed grown run plans for its first world).
  if (const auto planned = run_clock.adopt(config.peer_timeout, planned_world)) {
    run_start = run_clock.start();
    planned_world = *planned;
  } else if (plan.time_limit_s > 0 && !run_clock.all_left()) {
    observer().on_warning(fmt::format(
        "rank {} joined, but no rank told the run's time within {:.1f}s: its --time-limit counts from its own start",
        rank, config.peer_timeout));
  }
}

Status TrainingRun::join_run() {
  if (!joining) return {};
  CFMO_ASSIGN_OR_RETURN(auto params, engine->host_parameters());
  // The host optimizer, current: sync's joiner takes the group's inner state into it.
  CFMO_ASSIGN_OR_RETURN(optim::Optimizer * inner, engine->host_optimizer());
  CFMO_ASSIGN_OR_RETURN(const Joined joined, mode->join(replicated_part(params), *inner, pos));
  if (joined == Joined::kRunEnded) {
    // Too late, through no fault of its own: the others had ended the run.
    came_too_late = true;
    observer().on_warning(fmt::format(
        "rank {} joined as the run ended: the others had taken their last round; it trained nothing", rank));
    return {};
  }
  if (traits.lockstep && pos.data_world > 0) {
    // The group's cut of this epoch's global batches (it grows at an epoch's
    // start), so that this rank takes its own slice and ends the epoch, and
    // an --epochs budget, at the members' step.
    cut_batches(static_cast<int>(pos.data_world));
    plan_step_limit();
  }
  CFMO_TRY(engine->parameters_changed());
  CFMO_TRY(engine->optimizer_changed());
  // A position at the very end of an epoch continues with the next one,
  // where the members took up the world grown by this rank (at_step_end).
  const bool epoch_ended = pos.batch_in_epoch == batches_per_epoch;
  pos = resume_position(pos, batches_per_epoch);
  if (epoch_ended) take_up_growth();
  return {};
}

void TrainingRun::plan_step_limit() {
  step_limit = config.steps > 0 ? config.steps : INT64_MAX;
  // The epochs left, from this epoch's start (an epoch's batches change when the world grows).
  if (config.epochs > 0) {
    step_limit = std::min(step_limit, pos.step - pos.batch_in_epoch + (config.epochs - pos.epoch) * batches_per_epoch);
  }
  if (token_steps > 0) step_limit = std::min(step_limit, token_steps);
  // Asynchronous workers share a budget of samples instead (plan_length), unless --deterministic.
  if (async && !config.deterministic) step_limit = INT64_MAX;
}

void TrainingRun::cut_batches(int ranks) {
  data_world = ranks;
  pos.data_world = ranks;
  global_batch = static_cast<int64_t>(batch) * data_world;
  batches_per_epoch = (train_examples + global_batch - 1) / global_batch;
}

Status TrainingRun::load_model_and_optimizer() {
  if (Preloaded* ready = options.preloaded.get(); ready != nullptr && ready->source) {
    source = std::move(ready->source);
    model_ptr = std::move(ready->model);
    optimizer = std::move(ready->optimizer);
  } else {
    CFMO_ASSIGN_OR_RETURN(source, load_data_source(config, plan.context));
  }
  CFMO_TRY(source->take_part(rank, world));
  if (!model_ptr) {
    model::MoeOptions moe = moe_options(config);
    if (expert_parallel) {
      moe.expert_rank = rank;
      moe.expert_ranks = world;
      CFMO_ASSIGN_OR_RETURN(const Heterogeneity mine, heterogeneity_for(config, rank));
      moe.serve_slowdown = mine.slowdown;
    }
    CFMO_TRY(build_model(config, plan, source->shape(), moe, model_ptr, optimizer));
  }
  model_spec = model().spec_string();
  if (expert_parallel) {
    static_cast<model::Gpt&>(model()).set_expert_parallel(comm);
  }
  replicated = model().replicated_size();
  for (const model::ParamInfo& p : model().params()) {
    if (p.offset < replicated) replicated_layout.push_back(p);
  }
  train_examples = source->train_examples();
  vocab = source->shape().classes;
  context = model().context();
  sample_every = rank == 0 ? config.sample_every : 0;
  if (sample_every > 0 && context == 0) {
    observer().on_note(fmt::format("--sample-every: {} is not a language model; no samples", model_spec));
    sample_every = 0;
  }
  if (sample_every > 0 && expert_parallel) {
    // A sample's forward passes would dispatch to ranks that are training.
    observer().on_note("--sample-every: no samples with --expert-parallel");
    sample_every = 0;
  }

  optim_config = optimizer_config(config, plan.optimizer);
  return {};
}

Status TrainingRun::resume_from_checkpoint() {
  if (options.resume.empty()) return {};
  CheckpointWorld saved;
  tensor::FloatBuffer outer;
  tensor::FloatBuffer round_sum;
  CFMO_ASSIGN_OR_RETURN(pos, load_checkpoint(options.resume, model(), *optimizer, &saved, &outer, &round_sum));
  CFMO_TRY(check_resumable(options.resume, saved, config, world));
  CFMO_TRY(check_positions(options.resume, pos, saved, optimizer->step_count(), train_examples, config.batch_size));
  if (saved.workers != world) {
    CFMO_TRY(redistribute(saved));
  } else {
    // Every rank starts from the global parameters; in cfmo and asgd each at its own position.
    if (!saved.ranks.empty()) pos = saved.ranks[static_cast<size_t>(rank)];
    // A grown world resumed whole: its plan stays the first world's, and each
    // rank's epoch keeps its cut (plan_length) until the next epoch's start.
    if (saved.first_workers > 0) planned_world = saved.first_workers;
  }
  // localsgd, cfmo: each rank with its own inner optimizer state (rank 0's is
  // the checkpoint's optimizer.safetensors; with --expert-parallel the file
  // holds the whole model's, this rank's experts' too).
  CFMO_TRY(load_rank_optimizer(options.resume, model(), *optimizer, rank));
  resume.outer_momentum.assign(outer.begin(),
                               outer.begin() + static_cast<ptrdiff_t>(std::min(outer.size(), replicated)));
  if (saved.workers == world) {
    resume.ranks = saved.ranks;
    // cfmo: the owners' pending rounds and the shards' versions, and this
    // rank's error feedback, continue where the same shards exist.
    resume.versions = saved.shard_versions;
    resume.outer_in_round = saved.outer_in_round;
    if (round_sum.size() == outer.size()) {
      resume.outer_round_sum.assign(round_sum.begin(),
                                    round_sum.begin() + static_cast<ptrdiff_t>(std::min(round_sum.size(), replicated)));
    }
    CFMO_ASSIGN_OR_RETURN(const tensor::FloatBuffer residual, load_wire_residual(options.resume, model(), rank));
    resume.wire_residual.assign(residual.begin(),
                                residual.begin() + static_cast<ptrdiff_t>(std::min(residual.size(), replicated)));
  }
  if (traits.owners_optimize && world > 1) {
    // An asgd checkpoint's optimizer state is the owners'.
    for (const auto& s : optimizer->state()) resume.owner_state.emplace_back(s.buffer->begin(), s.buffer->end());
    if (saved.workers == world) resume.owner_steps = saved.shard_optimizer_steps;
  }
  if (rank == 0) observer().on_note(fmt::format("resumed from {} at step {}", options.resume.string(), pos.step));
  return {};
}

Status TrainingRun::redistribute(const CheckpointWorld& saved) {
  // The global state is flat in the model's layout (parameters, outer
  // momentum, asgd's owner state), so each owner of the new world simply
  // takes its shard of it; the positions count global batches of the old
  // world and are recounted in the new one's.
  const int batch_size = saved.batch_size > 0 ? saved.batch_size : config.batch_size;
  // A grown world's position counts global batches of its epoch's own cut.
  const TrainPosition& first = saved.ranks.empty() ? pos : saved.ranks[0];
  const int64_t from_batch =
      static_cast<int64_t>(batch_size) * (first.data_world > 0 ? first.data_world : saved.workers);
  const int64_t to_batch = static_cast<int64_t>(config.batch_size) * world;
  TrainPosition base = regrid(first, from_batch, to_batch, train_examples);
  base.data_world = 0;  // this world's cut
  pos = base;
  if (!saved.ranks.empty() && world > 1) {
    // The asynchronous modes' shared budget counts the ranks' samples: the
    // new ranks share the old ones' total, so the run trains the same examples.
    int64_t total = 0;
    for (const auto& r : saved.ranks) total += r.samples;
    resume.ranks.assign(static_cast<size_t>(world), base);
    for (int r = 0; r < world; ++r) {
      resume.ranks[static_cast<size_t>(r)].samples = total / world + (r == 0 ? total % world : 0);
    }
    pos = resume.ranks[static_cast<size_t>(rank)];
  }
  if (!saved.shard_optimizer_steps.empty()) {
    // asgd's owners: each new one continues from the furthest old one's step count.
    resume.owner_steps.assign(static_cast<size_t>(world), *std::max_element(saved.shard_optimizer_steps.begin(),
                                                                            saved.shard_optimizer_steps.end()));
  }
  if (rank == 0) {
    // cfmo and asgd cut the global state into K shards (--owners), the others among the W workers.
    ModeSettings owners;
    owners.owners = config.owners;
    const int shards = traits.asynchronous ? owner_count(owners, world) : world;
    observer().on_note(
        fmt::format("--resume '{}': written by {} worker(s){}, resumed with {}: the global state is "
                    "redistributed over {} shard(s) and every rank continues at epoch {}, batch {}",
                    options.resume.string(), saved.workers,
                    saved.first_workers > 0 && saved.first_workers != saved.workers
                        ? fmt::format(" (a run grown from {} by joins)", saved.first_workers)
                        : "",
                    world, shards, base.epoch, base.batch_in_epoch));
  }
  return {};
}

Status TrainingRun::plan_length() {
  // Sharding: the epoch's shuffled order is cut into global batches of
  // world x batch examples; rank k takes the k-th slice of each. With sync,
  // a step of W workers therefore sees exactly one worker's batch of W x B.
  batch = config.batch_size;
  // A rank of a resumed grown world finishes its epoch with the cut it had
  // (as it would have, uninterrupted); the next epoch's is the whole world's.
  const bool resumed_cut = !options.resume.empty() && pos.data_world > 0 && pos.data_world < world;
  cut_batches(resumed_cut ? static_cast<int>(pos.data_world) : world);
  if (!options.resume.empty()) {
    // A rank's saved position at the very end of an epoch continues with the next one.
    const bool epoch_ended = pos.batch_in_epoch == batches_per_epoch;
    pos = resume_position(pos, batches_per_epoch);
    if (epoch_ended && resumed_cut) cut_batches(world);
  }
  // --tokens: a budget of training tokens, as windows of the model's context (rounded up).
  token_windows = config.tokens > 0 && context > 0 ? (config.tokens + context - 1) / context : 0;
  token_steps = token_windows > 0 ? (token_windows + global_batch - 1) / global_batch : 0;
  plan_step_limit();
  settings.kind = plan.mode;
  settings.sync_interval = config.sync_interval;
  settings.staleness_discount = config.staleness_discount;
  settings.max_staleness = config.max_staleness;
  settings.owners = config.owners;
  settings.outer_optimizer = plan.outer_optimizer;
  settings.outer_lr = plan.outer_lr;
  settings.outer_momentum = config.outer_momentum;
  settings.outer_warmup = config.outer_warmup;
  settings.delta_dtype = plan.delta_dtype;
  settings.peer_timeout_s = config.peer_timeout;
  settings.elastic = config.elastic;
  settings.deterministic = config.deterministic && async;
  settings.hold_replies = config.reply_hold == "round";
  // The run's length as planned for the world it started with: a joiner's
  // and a resumed grown world's schedule (and budget) are the members' own.
  const int64_t planned_batch = static_cast<int64_t>(batch) * planned_world;
  int64_t planned_steps = config.steps > 0 ? config.steps : INT64_MAX;
  if (config.epochs > 0) {
    planned_steps = std::min(planned_steps, config.epochs * ((train_examples + planned_batch - 1) / planned_batch));
  }
  if (token_windows > 0) planned_steps = std::min(planned_steps, (token_windows + planned_batch - 1) / planned_batch);
  int64_t schedule_steps = planned_steps == INT64_MAX ? 0 : planned_steps;
  // --deterministic: the workers stop at the same step, as lockstep workers
  // do, not when a shared budget's message happens to reach them.
  if (async && !settings.deterministic) {
    // Asynchronous workers share a budget of samples, kept by rank 0: a fast
    // worker takes more steps than a slow one. The same budget as sync's.
    int64_t budget = INT64_MAX;
    if (config.steps > 0) budget = config.steps * planned_batch;
    if (config.epochs > 0) budget = std::min(budget, config.epochs * train_examples);
    if (token_windows > 0) budget = std::min(budget, token_windows);
    settings.sample_budget = budget == INT64_MAX ? 0 : budget;
    schedule_steps = settings.sample_budget > 0 ? settings.sample_budget / planned_batch : 0;
    step_limit = INT64_MAX;
  }
  CFMO_ASSIGN_OR_RETURN(simulated, heterogeneity_for(config, rank));
  time_limit_s = plan.time_limit_s;

  schedule.kind = plan.schedule;
  schedule.base_lr = config.lr;
  schedule.min_lr = config.min_lr;
  schedule.warmup_steps = config.warmup_steps;
  schedule.total_steps = schedule_steps;
  return {};
}

Status TrainingRun::make_mode_and_engine() {
  run_dir = config.out;
  // Each reconciliation's delta goes to RUN/deltas/rank-K/, for cfmo-diverge.
  if (!run_dir.empty() && world > 1 && traits.writes_deltas) {
    // A resumed run, or a joiner in a lost rank's place, continues its rounds' numbering.
    const int64_t offset = options.resume.empty() && !joining ? 0 : DeltaWriter::last_round(run_dir, rank);
    delta_writer = std::make_unique<DeltaWriter>(run_dir, rank, replicated_layout, offset);
    settings.delta_sink = [this](int64_t round, int64_t step, int64_t base_version, std::span<const float> base,
                                 std::span<const float> delta) {
      delta_writer->submit(round, step, base_version, base, delta);
    };
  }
  resume.start_samples = pos.samples;
  CFMO_ASSIGN_OR_RETURN(
      mode, make_mode(settings, comm, replicated_layout, replicated_part(model().parameters()), optim_config, resume));
  // Whoever writes the summary lists every join of the run: a restarted or replaced keeper too.
  if (world > 1 && mode->survives_losses()) join_log = std::make_unique<JoinLog>(*comm);

  // Where the arithmetic runs (--device). The host model and optimizer stay the
  // mirror the modes, checkpoints and deltas use; a CUDA engine copies to them
  // only when asked. Every rank makes its engine together (NCCL connects here).
  DeviceEngineOptions engine_options;
  engine_options.device = plan.device;
  engine_options.comm = comm;
  engine_options.device_collectives = world > 1 && traits.device_reduce;
  engine_options.peer_timeout_s = config.peer_timeout;
  engine_options.local_rank = options.local_rank;
  CFMO_ASSIGN_OR_RETURN(engine, make_device_engine(engine_options, model(), *optimizer, optim_config, *source));
  CFMO_TRY(engine->optimizer_changed());  // a resumed optimizer's state, where the engine keeps it
  if (engine->has_device_all_reduce()) {
    mode->use_device_reduce([this](std::span<float> extras) { return engine->device_all_reduce_gradients(extras); });
  }
  return {};
}

Status TrainingRun::open_outputs() {
  if (!run_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(run_dir, ec);
    if (ec) return make_error(ErrorKind::kUsage, "--out '{}': {}", run_dir.string(), ec.message());
    const std::string name = rank == 0 ? "metrics.jsonl" : fmt::format("metrics-rank-{}.jsonl", rank);
    // A joiner keeps the lines of the processes before it in its rank's
    // place: what they trained stays on record even where this one
    // continues from an earlier step (bench/elastic.sh counts from them).
    CFMO_ASSIGN_OR_RETURN(metrics, joining ? MetricsLog::append(run_dir / name)
                                           : MetricsLog::open(run_dir / name, options.resume.empty() ? -1 : pos.step));
  }

  summary.mode = plan.mode_entry().name;
  summary.workers = world;
  summary.rank = rank;
  summary.model = model_spec;
  summary.optimizer = config.optimizer;
  summary.data = source->description();
  summary.blas = tensor::ops::blas_info();
  summary.device = engine->description();
  summary.parameters = model().num_trainable();
  summary.context = context;
  summary.flops_per_example = model().flops_per_example();
  summary.flops_formula = model().flops_formula();
  if (plan.optimizer == optim::OptimizerKind::kMuon) {
    for (const auto& p : model().params())
      (p.is_matrix() ? summary.muon_tensors : summary.adamw_tensors).push_back(p.name);
  }
  summary.run_dir = run_dir.string();
  summary.resumed_from = options.resume.string();
  summary.mode_settings = settings;
  summary.slowdown = config.slowdown;
  summary.straggler = config.straggler;

  // Only the keeper (rank 0, or in cfmo and asgd the lowest live rank)
  // checkpoints, always the global parameters: where its own are
  // the global ones (sync, localsgd right after a round) it writes them at
  // once; in cfmo and asgd it asks the owners for their shards and hands the
  // assembled state to a writer thread, so that no worker waits.
  // localsgd: every rank's inner optimizer state comes to rank 0 by a
  // collective of the whole world, which neither --elastic (a lost rank
  // would fail it) nor --expert-parallel (each rank's layout differs) allows.
  gathers_optimizers = world > 1 && traits.lockstep && !traits.reduces_gradients && !run_dir.empty() &&
                       !expert_parallel && !config.elastic;
  // cfmo --deterministic: every rank meets at each checkpoint's round, so
  // every rank's own state goes in too.
  gathers_optimizers = gathers_optimizers || (async && settings.deterministic && !run_dir.empty());
  // cfmo and asgd: each rank's own state comes to the keeper by message; in
  // localsgd with --elastic too, at each checkpoint's round.
  gives_own_state = world > 1 && traits.lockstep && !traits.reduces_gradients && !run_dir.empty() && !expert_parallel &&
                    config.elastic;
  if ((async && !settings.deterministic && !run_dir.empty()) || gives_own_state) {
    rank_states = std::make_unique<RankStates>(*comm);
  }
  joins_checkpoints = expert_parallel && !run_dir.empty() && !rank_states;
  if (expert_parallel && rank_states) {
    // The keeper's checkpoints hold every expert: the whole model's layout.
    CFMO_ASSIGN_OR_RETURN(const auto whole, model::make_model(config.model, source->shape(), moe_options(config)));
    whole_layout = whole->params();
  }
  last_checkpoint_step = options.resume.empty() ? -1 : pos.step;
  take_up_keeping();
  straggler_rng = Rng(static_cast<uint64_t>(config.seed), 0x57A6000ULL + static_cast<uint64_t>(rank));
  return {};
}

double TrainingRun::epochs_done() const {
  return static_cast<double>(pos.epoch) +
         static_cast<double>(pos.batch_in_epoch) / static_cast<double>(batches_per_epoch);
}

Status TrainingRun::evaluate(bool final) {
  const auto t0 = Clock::now();
  CFMO_ASSIGN_OR_RETURN(const model::EvalResult r, engine->evaluate());
  EvalEvent event{pos.step, epochs_done(), r.loss(), r.accuracy(), seconds_since(run_start), final};
  summary.test_loss = event.test_loss;
  if (context > 0) summary.val_loss = event.test_loss;
  summary.test_accuracy = event.test_accuracy;
  summary.eval_s += seconds_since(t0);
  observer().on_eval(event);
  return metrics.write({{"type", "eval"},
                        {"rank", rank},
                        {"step", pos.step},
                        {"epoch", event.epochs},
                        {"test_loss", event.test_loss},
                        {"test_accuracy", event.test_accuracy},
                        {"wall_s", event.elapsed_s}});
}

CheckpointData TrainingRun::checkpoint_of(std::span<const float> params, const GlobalState* global) {
  CheckpointData data = checkpoint_data(model(), *optimizer, pos);
  data.params.assign(params.begin(), params.end());
  // The world now (grown by joins: every rank's state goes in) and the one it was planned for.
  data.world.workers = comm != nullptr ? comm->size() : 1;
  data.world.first_workers = planned_world;
  data.world.mode = config.mode;
  data.world.batch_size = config.batch_size;
  const auto outer = mode->outer_momentum();
  data.outer_momentum.assign(outer.begin(), outer.end());
  if (global != nullptr) {
    data.world.ranks = global->ranks;
    data.world.shard_versions = global->versions;
    data.outer_momentum.assign(global->outer_momentum.begin(), global->outer_momentum.end());
    if (global->outer_round_sum.size() == global->outer_momentum.size()) {
      data.outer_round_sum.assign(global->outer_round_sum.begin(), global->outer_round_sum.end());
      data.world.outer_in_round = global->outer_in_round;
    }
    if (!global->owner_state.empty() && global->owner_state.size() == data.optimizer_state.size()) {
      // asgd: the owners ran the optimizer; rank 0's own never stepped.
      for (size_t i = 0; i < data.optimizer_state.size(); ++i) {
        data.optimizer_state[i].second.assign(global->owner_state[i].begin(), global->owner_state[i].end());
      }
      data.world.shard_optimizer_steps = global->owner_steps;
    }
  }
  return data;
}

Status TrainingRun::checkpoint() {
  if (expert_parallel) {
    // Every rank's experts gather on the keeper, which writes the whole model.
    if (!joins_checkpoints && !checkpoints) return {};
    CFMO_TRY(sync_host());
    CFMO_TRY(write_global_checkpoint(checkpoint_of(model().parameters(), nullptr)));
    last_checkpoint_step = pos.step;
    return {};
  }
  if (!checkpoints && !gathers_optimizers && !gives_own_state) return {};
  CFMO_TRY(sync_host());
  if (async) return deterministic_checkpoint();
  if (gathers_optimizers && gathered_step != pos.step) CFMO_TRY(gather_optimizers());
  last_checkpoint_step = pos.step;
  if (gives_own_state && !checkpoints) {
    // A member of a localsgd --elastic group: its own inner state to the keeper, which writes this round's.
    if (const int to = mode->keeper(); to != rank && !at_end) {
      CFMO_ASSIGN_OR_RETURN(auto state, own_state());
      rank_states->send(to, RankStates::at_step(pos.step), std::move(state));
    }
    return {};
  }
  if (!checkpoints) return {};
  CheckpointData data = checkpoint_of(model().parameters(), nullptr);
  add_gathered(data);
  if (gives_own_state) {
    // A joiner taken in at this round starts its inner optimizer afresh, as it did uninterrupted.
    std::vector<int> fresh;
    const auto made = mode->round_members();
    for (const int r : mode->members()) {
      if (!at_end && !made.empty() && std::find(made.begin(), made.end(), r) == made.end()) fresh.push_back(r);
    }
    CFMO_TRY(add_rank_states(data, member_states(), fresh));
  }
  CFMO_TRY(write_checkpoint(run_dir, model_spec, model().params(), data, options.config_toml, config.keep_checkpoints));
  return {};
}

void TrainingRun::add_gathered(CheckpointData& data) const {
  if (gathered_step != pos.step) return;
  data.rank_optimizer_state = gathered;
  data.world.rank_optimizer_steps = gathered_steps;
  data.wire_residuals = gathered_residuals;
  if (async) data.world.ranks = gathered_positions;  // where every rank is, not where its last report said
}

Status TrainingRun::deterministic_checkpoint() {
  // Every rank is at this round's end (every reply in), so the owners hold
  // the round's whole result and no contribution of the next: the
  // next round's cannot be applied before the keeper's, which it sends after
  // its request below on the same links.
  if (gathered_step != pos.step) CFMO_TRY(gather_optimizers());
  last_checkpoint_step = pos.step;
  if (!checkpoints || !mode->request_snapshot()) return {};
  const auto deadline = Clock::now() + std::chrono::duration<double>(2 * config.peer_timeout);
  std::optional<GlobalState> global;
  while (!(global = mode->take_snapshot()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!global) {
    return make_error(ErrorKind::kPeer,
                      "--deterministic: the owners did not answer the checkpoint at step {} within {:.1f}s", pos.step,
                      2 * config.peer_timeout);
  }
  CheckpointData data = checkpoint_of(global->params, &*global);
  add_gathered(data);
  CFMO_TRY(write_checkpoint(run_dir, model_spec, model().params(), data, options.config_toml, config.keep_checkpoints));
  return {};
}

Status TrainingRun::gather_optimizers() {
  CFMO_TRY(engine->host_optimizer());
  const auto state = optimizer->state();
  const auto residual = mode->wire_residual();
  size_t floats = 0;
  for (const auto& s : state) floats += s.buffer->size();
  // What each rank has and rank 0 keeps: its optimizer's buffers one after
  // the other, its error feedback, then its optimizer's steps and position
  // (the same sizes on every rank).
  struct Tail {
    int64_t optimizer_steps;
    TrainPosition position;
  };
  const size_t bytes = (floats + residual.size()) * sizeof(float) + sizeof(Tail);
  std::vector<std::byte> own(bytes);
  {
    auto* at = reinterpret_cast<float*>(own.data());
    for (const auto& s : state) at = std::copy(s.buffer->begin(), s.buffer->end(), at);
    at = std::copy(residual.begin(), residual.end(), at);
    const Tail tail{optimizer->step_count(), pos};
    std::memcpy(at, &tail, sizeof(Tail));
  }
  // Each rank above 0 sends its own to rank 0, which receives them all.
  std::vector<std::vector<std::byte>> theirs(rank == 0 ? static_cast<size_t>(world) : 0);
  std::vector<std::span<const std::byte>> send(static_cast<size_t>(world));
  std::vector<std::span<std::byte>> recv(static_cast<size_t>(world));
  if (rank != 0) send[0] = own;
  for (size_t p = 1; p < theirs.size(); ++p) {
    theirs[p].resize(bytes);
    recv[p] = theirs[p];
  }
  CFMO_TRY(comm->all_to_all_v(send, recv));
  gathered.clear();
  gathered_steps.clear();
  gathered_residuals.clear();
  gathered_positions.clear();
  if (rank == 0) theirs[0] = std::move(own);
  for (size_t p = 0; p < theirs.size(); ++p) {
    const float* at = reinterpret_cast<const float*>(theirs[p].data());
    if (p > 0) {
      auto& per_rank = gathered.emplace_back();
      for (const auto& s : state) {
        per_rank.emplace_back(s.name, tensor::FloatBuffer(at, at + s.buffer->size()));
        at += s.buffer->size();
      }
    } else {
      at += floats;
    }
    if (!residual.empty()) gathered_residuals.emplace_back(at, at + residual.size());
    at += residual.size();
    Tail tail{};
    std::memcpy(static_cast<void*>(&tail), at, sizeof(Tail));
    gathered_steps.push_back(tail.optimizer_steps);
    gathered_positions.push_back(tail.position);
  }
  gathered_step = pos.step;
  return {};
}

Status TrainingRun::write_global_checkpoint(CheckpointData data) {
  if (expert_parallel) {
    CFMO_ASSIGN_OR_RETURN(whole_model, gather_whole_model(data));
  }
  if (!checkpoints) return {};
  const model::Model& layout_of = whole_model ? *whole_model : model();
  CFMO_TRY(
      write_checkpoint(run_dir, model_spec, layout_of.params(), data, options.config_toml, config.keep_checkpoints));
  return {};
}

Status TrainingRun::sync_host() {
  CFMO_TRY(engine->host_parameters());
  CFMO_TRY(engine->host_optimizer());
  return {};
}

void TrainingRun::take_up_keeping() {
  if (checkpoints || run_dir.empty() || mode->keeper() != rank) return;
  checkpoints = true;
  if (async && (!expert_parallel || rank_states)) {
    checkpoint_writer =
        std::make_unique<CheckpointWriter>(run_dir, model_spec, expert_parallel ? whole_layout : model().params(),
                                           options.config_toml, config.keep_checkpoints);
  }
}

std::vector<int> TrainingRun::lost_experts() const {
  std::vector<int> out;
  for (const int r : comm->lost_ranks()) {
    const auto held = model_ptr->experts_held_by(r);
    out.insert(out.end(), held.begin(), held.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

Status TrainingRun::announce_own_join() {
  first_step_s = seconds_since(process_start);
  observer().on_note(fmt::format("joined the run as rank {} at step {}: first step {:.2f}s after this process started",
                                 rank, pos.step, first_step_s));
  return metrics.write({{"type", "membership"},
                        {"event", "joined"},
                        {"rank", rank},
                        {"joined_rank", rank},
                        {"step", pos.step},
                        {"wall_s", seconds_since(run_start)},
                        {"first_step_s", first_step_s}});
}

void TrainingRun::take_up_growth() {
  // Losses keep the cut (a lost rank's share goes untrained, or to the
  // members with --keep-global-batch).
  if (comm == nullptr) return;
  int grown = comm->size();
  if (const auto members = mode->members(); traits.lockstep && !members.empty()) {
    // A lockstep group's members, the same on every member at a step's end
    // (they took the same sums), where the transport may count a joiner the
    // group has not taken in yet.
    grown = *std::max_element(members.begin(), members.end()) + 1;
  }
  if (grown <= data_world) return;
  cut_batches(grown);
  plan_step_limit();  // the epochs left are of the grown world's batches
}

Status TrainingRun::announce_lost() {
  if (world <= 1 || !mode->survives_losses()) return {};
  if (const std::string at = comm->join_address(); rank != 0 && at != join_address_announced) {
    // Rank 0 was lost and this rank leads now: where a joiner (--join, a restarted rank) comes.
    join_address_announced = at;
    if (!at.empty()) observer().on_warning(fmt::format("rank {} serves joins at {}", rank, at));
  }
  const auto joins = comm->joined_ranks();
  for (; joins_announced < joins.size(); ++joins_announced) {
    const int r = joins[joins_announced];
    const bool grown = static_cast<size_t>(r) >= announced.size();  // a new rank: the world grew
    if (grown) announced.resize(static_cast<size_t>(r) + 1, false);
    // Lost and taken back between two steps of this rank (under load a step
    // can outlast the joiner's wait): the loss happened all the same, and is
    // told before the join. Not for a rank of the grown world's first join.
    if (!grown && r != rank && !announced[static_cast<size_t>(r)]) {
      std::string why = comm->replaced_loss(joins_announced);
      if (why.empty()) why = "a new process took its place before this rank found it lost";
      CFMO_TRY(announce_loss(r, std::move(why), -1));
    }
    announced[static_cast<size_t>(r)] = false;  // a loss of the new process is news again
    // On the run's clock when the transport took it in, not when this rank
    // looked: the ranks' notices of one join then agree (merge_joins).
    JoinedRank joined{r, pos.step, std::chrono::duration<double>(comm->joined_at(joins_announced) - run_start).count(),
                      -1};
    if (options.observer != nullptr) {
      options.observer->on_warning(
          grown ? fmt::format("rank {} joined (a new rank: the world has {} ranks now)", r, r + 1)
                : fmt::format("rank {} joined (a new process in its place){}", r,
                              mode->shard_served_by(r) == r ? "; it serves its shard again" : ""));
    }
    CFMO_TRY(metrics.write({{"type", "membership"},
                            {"event", "joined"},
                            {"rank", rank},
                            {"joined_rank", r},
                            {"step", pos.step},
                            {"wall_s", joined.wall_s}}));
    // (Merged: the keeper's list may have come with it already.)
    summary.joined = merge_joins(summary.joined, {joined});
  }
  const auto lost = comm->lost_ranks();
  for (const int r : lost) {
    // (A new rank lost before this rank read its join: its join is announced next time.)
    if (static_cast<size_t>(r) >= announced.size() || announced[static_cast<size_t>(r)]) continue;
    CFMO_TRY(announce_loss(r, comm->lost_reason(r), mode->shard_served_by(r)));
  }
  if (join_log) {
    // The others' lists in, and this one to the keeper and its standby (the next live rank).
    join_log->merge_received(summary.joined);
    const int keeping = mode->keeper();
    int standby = -1;
    for (int r = keeping + 1; r < comm->size() && standby < 0; ++r) {
      if (std::find(lost.begin(), lost.end(), r) == lost.end()) standby = r;
    }
    join_log->share(summary.joined, keeping, standby);
  }
  return {};
}

Status TrainingRun::announce_loss(int r, std::string why, int served_by) {
  announced[static_cast<size_t>(r)] = true;
  LostRank lost{r,
                pos.step,
                seconds_since(run_start),
                std::move(why),
                served_by,
                expert_parallel ? model().experts_held_by(r) : std::vector<int>{},
                {}};
  if (options.observer != nullptr) {
    options.observer->on_warning(
        fmt::format("rank {} lost ({}){}", r, lost.why,
                    lost.served_by >= 0 ? fmt::format("; its shard is now served by rank {}", lost.served_by) : ""));
  }
  CFMO_TRY(metrics.write(
      {{"type", "membership"},
       {"event", "lost"},
       {"rank", rank},
       {"lost_rank", r},
       {"step", pos.step},
       {"wall_s", lost.wall_s},
       {"why", lost.why},
       {"served_by", lost.served_by < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(lost.served_by)}}));
  summary.lost.push_back(std::move(lost));
  return {};
}

}  // namespace cfmo::train::detail
