#pragma once
/// One worker's training run, the state train() carries from phase to
/// phase, and the phases as they happen (train() in trainer.cpp calls them
/// in this order):
///
///   set_up        (training_run.cpp) data, model, optimizer (preload's,
///                 read before the process connected, if given), a resumed
///                 position, the run's length, the mode, the engine, the
///                 metrics log and the summary's fixed part
///   run_loop      (step_loop.cpp) the steps, until a limit, the shared
///                 budget or a stop; each step: the batch, forward and
///                 backward, the mode, the update, simulated slowness, the
///                 events, evaluation at epoch ends and the checkpoint policy
///   finish        (run_end.cpp) the last reconciliation, the workers'
///                 reports to the keeper, the final evaluation, checkpoint and
///                 model, and the summary's totals
///
/// Internal to train/: tools call train().

#include "core/clock.h"
#include "core/rng.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/data_source.h"
#include "train/delta_writer.h"
#include "train/device_engine.h"
#include "train/join_log.h"
#include "train/metrics_log.h"
#include "train/rank_states.h"
#include "train/run_clock.h"
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::train {

struct Preloaded {
  std::unique_ptr<DataSource> source;  ///< read whole, its part not taken yet
  /// Built and initialized (the same on every rank); null with
  /// --expert-parallel, whose model holds its rank's experts only.
  std::unique_ptr<model::Model> model;
  std::unique_ptr<optim::Optimizer> optimizer;  ///< of `model`
};

}  // namespace cfmo::train

namespace cfmo::train::detail {

using Clock = std::chrono::steady_clock;

using cfmo::seconds_since;

/// The training thread's settings (--threads, denormals flushed), before anything is built on it.
void set_up_thread(const TrainConfig& config);
/// The model `config` names for data of `shape` (with `moe`), initialized
/// the same on every rank, and its optimizer.
Status build_model(const TrainConfig& config, const TrainPlan& plan, const model::DataShape& shape,
                   const model::MoeOptions& moe, std::unique_ptr<model::Model>& model,
                   std::unique_ptr<optim::Optimizer>& optimizer);

struct TrainingRun {
  TrainingRun(const TrainConfig& config, const TrainPlan& plan, const TrainOptions& options);
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;
  ~TrainingRun();

  Status set_up();
  Status run_loop();
  Result<TrainSummary> finish();

  // set_up's parts
  Status load_model_and_optimizer();
  Status resume_from_checkpoint();
  /// A checkpoint of another number of workers: positions recounted, the
  /// global state spread over this world's shards; rank 0 says so in one line.
  Status redistribute(const CheckpointWorld& saved);
  /// The run's clock and planned world: a rank of the start tells joiners
  /// its own from now on, a joiner takes the run's (run_clock.h).
  void take_runs_plan();
  Status plan_length();
  Status make_mode_and_engine();
  /// A joiner (comm->joined()): the global state and its place's position from the run.
  Status join_run();
  /// A joiner that the run ended before it was taken in (join_run says so
  /// in one line): train() ends at once, with this summary (status 0).
  bool came_too_late = false;
  TrainSummary too_late_summary() const;
  Status open_outputs();

  // run_loop's parts
  /// Whether the loop ends before the next step (and stopped_by says why).
  Result<bool> should_stop();
  Status train_step();
  Status report_step(float loss, double lr, int n, double step_s, double step_compute_s);
  Status at_step_end();
  /// --clip-grad-norm on the applied gradient (with --expert-parallel its norm
  /// over every rank's experts).
  Status clip_gradients();

  // finish's parts
  Status last_reconciliation();
  WorkerReport own_report(const ModeStats& mode_stats, int64_t deltas_written, int64_t deltas_skipped) const;
  /// Every worker's report goes to the keeper, which waits for the live ones.
  Status gather_reports(const WorkerReport& own);
  /// The reports received (channels::kReport): taken from the start, on every
  /// rank (any may come to keep the run), since a worker that finishes first
  /// sends its report before the keeper is done with its own last round.
  std::mutex reports_mutex;
  std::vector<WorkerReport> reports;
  /// The keeper: the final evaluation, checkpoint, model and its config.json.
  Status write_final_outputs();
  /// The summary's figures over all workers.
  void add_totals();

  // shared by the phases
  TrainObserver& observer() { return options.observer != nullptr ? *options.observer : null_observer; }
  model::Model& model() { return *model_ptr; }
  /// metrics.jsonl's "epoch": epochs completed, fractional within an epoch (as step/steps-per-epoch).
  double epochs_done() const;
  Status evaluate(bool final);
  /// What a checkpoint of this run holds; `global` is the owners' state (cfmo, asgd).
  CheckpointData checkpoint_of(std::span<const float> params, const GlobalState* global);
  Status checkpoint();
  /// Every rank's inner optimizer state for a checkpoint at this step, the
  /// others' to rank 0 (a collective: every rank calls it at the same step).
  Status gather_optimizers();
  /// --expert-parallel, every rank together: rank 0 receives every rank's
  /// experts (parameters and optimizer state) and returns the whole model
  /// with `part` (its own checkpoint data) completed in that model's layout;
  /// the others send theirs and get null.
  Result<std::unique_ptr<model::Model>> gather_whole_model(CheckpointData& part);
  /// rank 0 (or the keeper) with every rank's packed experts (`received`,
  /// by rank; an empty one's rank was lost: its experts come from the newest
  /// checkpoint, else keep their initial values, and lost_experts_from says
  /// which): the whole model, with `part` completed in its layout.
  Result<std::unique_ptr<model::Model>> assemble_whole_model(CheckpointData& part,
                                                             const std::vector<std::vector<std::byte>>& received);
  Status restore_missing_experts(const model::Model& whole, const std::vector<int>& missing,
                                 tensor::FloatBuffer& params, const CheckpointData& part,
                                 std::vector<tensor::FloatBuffer>& state);
  /// This rank's experts and their optimizer state from `part` (its own checkpoint data), packed.
  std::vector<std::byte> own_experts(const CheckpointData& part) const;
  /// Where the last whole model took a lost rank's experts from: a
  /// checkpoint's directory, "initial values", or empty (none was lost).
  std::string lost_experts_from;

  // cfmo and asgd without --deterministic (own_state.cpp): each rank's own
  // state comes to the keeper by message (rank_states.h) for its checkpoints.
  /// This rank's own state: its inner optimizer's steps and state (over the
  /// replicated part; none in asgd, whose owners optimize), its position, its
  /// error feedback and, with --expert-parallel, its experts.
  Result<std::vector<std::byte>> own_state();
  /// Every rank, at a step's end: answers the keeper's request, if one came.
  Status answer_state_request();
  /// The keeper: adds the ranks' states (`states`, by rank; empty where none
  /// came: that rank keeps the keeper's inner state and its last reported
  /// position) and its own to `data`; with --expert-parallel the experts
  /// make `whole_model`, and `data` is in its layout. `fresh`: ranks taken
  /// in at this checkpoint's round (localsgd --elastic), whose inner state is a new one.
  Status add_rank_states(CheckpointData& data, std::vector<std::vector<std::byte>> states,
                         const std::vector<int>& fresh = {});
  /// The keeper: submits the owners' snapshot once every live rank's state is in.
  Status submit_async_checkpoint();
  /// The keeper at the end: every live rank's last state (sent in finish), of the group's members where there is one.
  std::vector<std::vector<std::byte>> final_rank_states();
  /// localsgd --elastic, the keeper at a checkpoint's round: the states the
  /// members that made it sent at this step (at the end: their last ones).
  std::vector<std::vector<std::byte>> member_states();
  /// The answers to `id` once every live rank of `from` (empty: of the world,
  /// as it is while waiting) gave one, or 2x --peer-timeout passed (a rank
  /// that did not keeps the keeper's).
  std::vector<std::vector<std::byte>> await_states(uint64_t id, const std::vector<int>& from);
  /// null: not asynchronous (or localsgd --elastic), --deterministic or no run directory
  std::unique_ptr<RankStates> rank_states;
  /// localsgd --elastic with a run directory: every member's inner state
  /// goes to the keeper by message at each checkpoint's round (no collective
  /// of the whole world may run: a lost rank would fail it, a joiner is not in it).
  bool gives_own_state = false;
  bool at_end = false;        ///< finish: the end's checkpoint
  uint64_t states_asked = 0;  ///< the keeper: its open request (0: none)
  Clock::time_point states_asked_at;
  std::optional<GlobalState> pending_global;   ///< the keeper: a snapshot waiting for the ranks' states
  std::vector<model::ParamInfo> whole_layout;  ///< --expert-parallel: the layout of the model holding every expert

  /// Writes a checkpoint (rank 0) of the global state; with
  /// --expert-parallel every rank calls it and the experts gather first.
  Status write_global_checkpoint(CheckpointData data);
  /// Brings the host model and optimizer up to date with the engine (a checkpoint, the end).
  Status sync_host();
  /// Asynchronous workers train on without a lost peer: each says so, once a peer.
  /// Announces the ranks found lost since the last call (async modes), with
  /// where their shards went, and those a new process joined, and writes each
  /// as a membership line of metrics.jsonl.
  Status announce_lost();
  /// One loss of `r` for announce_lost: the warning, the metrics line, the summary's entry.
  Status announce_loss(int r, std::string why, int served_by);
  /// At an epoch's start: the world grew (a join took no lost rank's place),
  /// so its global batches are cut among the grown world's ranks from now on.
  void take_up_growth();
  /// This epoch's global batches cut among `ranks`: data_world, global_batch, batches_per_epoch.
  void cut_batches(int ranks);
  /// step_limit from --steps, the --epochs left (of this epoch's batches) and --tokens, at `pos`.
  void plan_step_limit();
  /// cfmo --expert-parallel, the keeper after the whole model was assembled
  /// with a lost rank's experts: one line saying where they came from, and
  /// the summary's lost entries the same.
  void name_lost_experts();
  /// --expert-parallel: the experts of the ranks found lost, in order.
  std::vector<int> lost_experts() const;
  /// A joiner, after its first step: says when it joined, and how long it took.
  Status announce_own_join();
  /// This rank keeps the run now (the lowest live rank in cfmo and asgd):
  /// it takes up the checkpoints.
  void take_up_keeping();

  const TrainConfig& config;
  const TrainPlan plan;
  const TrainOptions& options;
  /// When the run started: this process's start, or for a joiner the run's
  /// as the others told it (run_clock), which the time limit counts from.
  Clock::time_point run_start = Clock::now();
  TrainObserver null_observer;
  comm::Communicator* comm;
  const int rank;
  const int world;
  const ModeTraits traits;
  const bool async;  ///< several workers in an asynchronous mode
  /// --expert-parallel with several workers: each rank holds its experts
  /// only; the modes see the replicated prefix, every rank evaluates and
  /// joins each checkpoint (the experts gather on rank 0).
  const bool expert_parallel;
  /// This process joined the run under way (--join, a restarted rank): it
  /// takes the global state from the others and passes no start barrier.
  const bool joining;
  /// The ranks the run's length, budget and schedule are planned for: the
  /// world it started with (a joiner's from the ranks there, run_clock.h; a
  /// resumed grown world's from its checkpoint), the same on every rank,
  /// however the world grew.
  int planned_world;
  const Clock::time_point process_start;
  RunClock run_clock;          ///< tells joiners the run's seconds and plan; a joiner's own come from it
  double first_step_s = -1;    ///< a joiner: from process_start to the end of its first step
  size_t joins_announced = 0;  ///< of comm->joined_ranks()
  /// The run's joins, shared with the keeper and its standby (null: a mode that survives no loss).
  std::unique_ptr<JoinLog> join_log;
  std::string join_address_announced;  ///< comm->join_address() as last said

  // What the run trains, in the order they must be destroyed backwards (the
  // engine refers to the model, the optimizer and the data).
  std::unique_ptr<DataSource> source;
  std::unique_ptr<model::Model> model_ptr;
  std::string model_spec;
  size_t replicated = 0;                            ///< model().replicated_size(): what the mode reconciles
  std::vector<model::ParamInfo> replicated_layout;  ///< its tensors
  /// The part of a flat buffer in the model's layout that the mode sees.
  std::span<float> replicated_part(std::span<float> flat) const {
    return flat.first(std::min(flat.size(), replicated));
  }
  int64_t train_examples = 0;
  int vocab = 0;
  int context = 0;
  int64_t sample_every = 0;
  optim::OptimizerConfig optim_config;
  std::unique_ptr<optim::Optimizer> optimizer;
  TrainPosition pos;
  ModeResume resume;

  // The run's length.
  int batch = 0;
  int64_t global_batch = 0;
  int64_t batches_per_epoch = 0;
  int data_world = 1;  ///< the ranks each global batch is cut among: the world, grown at an epoch's start
  int64_t step_limit = INT64_MAX;
  int64_t token_windows = 0;
  int64_t token_steps = 0;
  ModeSettings settings;
  Heterogeneity simulated;
  double time_limit_s = 0;
  optim::Schedule schedule;

  std::filesystem::path run_dir;
  std::unique_ptr<DeltaWriter> delta_writer;
  std::unique_ptr<Mode> mode;
  std::unique_ptr<DeviceEngine> engine;
  MetricsLog metrics;
  TrainSummary summary;

  // The checkpoint policy.
  bool checkpoints = false;        ///< this rank writes them (the keeper with a run directory)
  bool joins_checkpoints = false;  ///< this rank takes part in them (it writes them, or sends its experts)
  int keeper = 0;                  ///< finish: the rank that keeps the run
  /// --expert-parallel, rank 0: the whole model of the last checkpoint, for
  /// the final model.safetensors (dropped after a mid-run checkpoint).
  std::unique_ptr<model::Model> whole_model;
  int64_t last_checkpoint_step = -1;
  std::unique_ptr<CheckpointWriter> checkpoint_writer;
  bool checkpoint_due = false;  ///< an epoch end or --checkpoint-every asked for one
  /// Every rank takes part in each checkpoint with its own inner optimizer
  /// state: the ranks' optimizers drift apart between rounds (localsgd).
  bool gathers_optimizers = false;
  int64_t gathered_step = -1;                                                      ///< the step `gathered` is of
  std::vector<std::vector<std::pair<std::string, tensor::FloatBuffer>>> gathered;  ///< rank 0: ranks 1..W-1's
  std::vector<int64_t> gathered_steps;                  ///< rank 0: every rank's optimizer steps then
  std::vector<tensor::FloatBuffer> gathered_residuals;  ///< rank 0: every rank's error feedback (cfmo), or none
  std::vector<TrainPosition> gathered_positions;        ///< rank 0: every rank's position then
  /// Adds what gather_optimizers gathered at this step to `data`.
  void add_gathered(CheckpointData& data) const;
  /// cfmo --deterministic, every rank at a round's end: the owners' state
  /// and every rank's own into one checkpoint (the keeper writes it).
  Status deterministic_checkpoint();

  // The loop's state.
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  Rng straggler_rng{0};
  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t window_samples = 0;
  double window_s = 0;
  double progress_loss = 0;
  int64_t progress_steps = 0;
  double train_s = 0;
  double compute_s = 0;  ///< computing and simulated slowness, not waiting
  int64_t samples_this_run = 0;
  int64_t steps_this_run = 0;
  int64_t last_eval_step = -1;
  Clock::time_point loop_start;
  double loop_s = 0;
  double loop_cpu_s = 0;  ///< the process's CPU time (every thread) in the loop
  std::vector<bool> announced;
  std::string stopped_by;
};

}  // namespace cfmo::train::detail
