// train()'s last phase: the end of the modes' work, the reports, the final
// outputs and the summary.
#include "train/training_run.h"

#include "core/atomic_file.h"

#include <fmt/ranges.h>

#include <sys/resource.h>

#include <algorithm>
#include <mutex>
#include <thread>

namespace cfmo::train::detail {

Result<TrainSummary> TrainingRun::finish() {
  CFMO_TRY(last_reconciliation());
  // The end's checkpoint (rank 0's, below) holds every rank's inner state: all gather it here, together.
  if (gathers_optimizers && last_checkpoint_step != pos.step) CFMO_TRY(gather_optimizers());
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
  const WorkerReport own = own_report(mode_stats, deltas_written, deltas_skipped);
  summary.per_worker.push_back(own);
  keeper = mode->keeper();
  summary.keeper = keeper;
  // cfmo, asgd: each rank's last own state goes to the keeper for the end's checkpoint.
  if (rank_states && rank != keeper) {
    CFMO_ASSIGN_OR_RETURN(auto state, own_state());
    rank_states->send(keeper, RankStates::kFinal, std::move(state));
  }
  CFMO_TRY(gather_reports(own));
  at_end = true;
  if (rank == keeper) take_up_keeping();
  if (rank == keeper || expert_parallel) CFMO_TRY(write_final_outputs());
  // This rank's passes are over (the final evaluation's too): async dispatch
  // serves the others' rows until each is done.
  CFMO_TRY(model().finish_exchanges());
  add_totals();
  return summary;
}

TrainSummary TrainingRun::too_late_summary() const {
  TrainSummary late;
  late.mode = plan.mode_entry().name;
  late.workers = comm != nullptr ? comm->size() : world;
  late.rank = rank;
  late.keeper = -1;  // it keeps nothing: its tool prints no summary
  late.model = model_spec;
  late.stopped_by = "run-ended";
  late.wall_s = seconds_since(run_start);
  return late;
}

Status TrainingRun::last_reconciliation() {
  // Afterwards rank 0 holds the global parameters.
  CFMO_ASSIGN_OR_RETURN(auto params, engine->host_parameters());
  const Status finished = mode->finish(replicated_part(params), engine->mode_optimizer());
  // The mode takes nobody in from here on: a process that comes to join now
  // is told at the rendezvous that the run is ending, rather than taken in
  // there to wait for a state nobody sends.
  if (comm != nullptr) comm->close_joins();
  const Status announced_now = announce_lost();
  CFMO_TRY(finished);
  CFMO_TRY(announced_now);
  CFMO_TRY(engine->parameters_changed());  // the evaluation below runs where the engine is
  return sync_host();
}

WorkerReport TrainingRun::own_report(const ModeStats& mode_stats, int64_t deltas_written,
                                     int64_t deltas_skipped) const {
  WorkerReport own;
  own.rank = rank;
  own.steps = steps_this_run;
  own.samples = samples_this_run;
  own.samples_per_s = loop_s > 0 ? static_cast<double>(samples_this_run) / loop_s : 0;
  own.solo_samples_per_s = compute_s > 0 ? static_cast<double>(samples_this_run) / compute_s : 0;
  own.wait_s = mode_stats.wait_s;
  own.finish_wait_s = mode_stats.finish_wait_s;
  own.loop_s = loop_s;
  own.loop_cpu_s = loop_cpu_s;
  own.contributions_dropped = mode_stats.contributions_dropped;
  own.contributions_sent = mode_stats.contributions_sent;
  own.contributions_applied = mode_stats.contributions_applied;
  own.contributions_received = mode_stats.contributions_received;
  own.rounds = mode_stats.rounds;
  own.deferred = mode_stats.deferred;
  own.replies_held = mode_stats.replies_held;
  own.reply_rounds_cut = mode_stats.reply_rounds_cut;
  own.staleness_histogram = mode_stats.staleness_histogram;
  own.slowdown = simulated.slowdown;
  own.stopped_by = stopped_by;
  own.deltas_written = deltas_written;
  own.deltas_skipped = deltas_skipped;
  own.joined = joining;
  own.first_step_s = first_step_s;
  const auto moe = model_ptr->run_metrics();
  if (moe.is_object() && moe.contains("dispatch")) own.dispatch_wait_s = moe["dispatch"]["wait_s"].get<double>();
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) == 0) own.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  if (comm != nullptr) {
    const comm::CommStats cs = comm->stats();
    own.bytes_sent = cs.bytes_sent;
    own.bytes_received = cs.bytes_received;
  }
  return own;
}

Status TrainingRun::gather_reports(const WorkerReport& own) {
  if (comm == nullptr || world <= 1) return {};
  if (rank == keeper) {
    // (The handler, registered from the start: TrainingRun's constructor.)
    const auto deadline = Clock::now() + std::chrono::duration<double>(config.peer_timeout * 2);
    // Every rank of the world as it is (it may grow meanwhile), or of the
    // group (a joiner it did not take in before the end sends nothing).
    const std::vector<int> members = mode->members();
    for (;;) {
      {
        std::lock_guard lock(reports_mutex);
        bool all_in = true;
        for (int r = 0; r < comm->size() && all_in; ++r) {
          if (r == rank || comm->is_lost_rank(r)) continue;
          if (!members.empty() && std::find(members.begin(), members.end(), r) == members.end()) continue;
          all_in = std::any_of(reports.begin(), reports.end(), [r](const WorkerReport& w) { return w.rank == r; });
        }
        if (all_in || Clock::now() > deadline) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::lock_guard lock(reports_mutex);
    for (auto& r : reports) summary.per_worker.push_back(std::move(r));
    std::sort(summary.per_worker.begin(), summary.per_worker.end(),
              [](const WorkerReport& a, const WorkerReport& b) { return a.rank < b.rank; });
  } else {
    const std::string text = own.to_json();
    comm->post(keeper, channels::kReport,
               std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                      reinterpret_cast<const std::byte*>(text.data()) + text.size()));
  }
  summary.lost_ranks = comm->lost_ranks();
  summary.workers = std::max(summary.workers, comm->size());  // the ranks the world had at the end: it may grow
  CFMO_TRY(announce_lost());
  // The joiners' own figure of their start, from their reports.
  for (auto& joined : summary.joined) {
    for (const auto& w : summary.per_worker) {
      if (w.rank == joined.rank && w.joined) joined.first_step_s = w.first_step_s;
    }
  }
  if (!mode->survives_losses()) CFMO_TRY(comm->health());
  return {};
}

Status TrainingRun::write_final_outputs() {
  // Rank 0; with --expert-parallel every rank (the evaluation and the checkpoint are collectives then).
  // The final parameters are those of the last evaluation when the run ended on an epoch boundary.
  if (last_eval_step != pos.step || (world > 1 && !traits.evaluates_mid_run)) CFMO_TRY(evaluate(true));
  // Async dispatch: the others' final passes are served before the gather
  // below, a collective in which nobody serves.
  CFMO_TRY(model().finish_exchanges());
  if (rank_states && rank != keeper) return {};  // its last state went to the keeper in finish
  if (expert_parallel && !rank_states && !comm->lost_ranks().empty()) {
    // cfmo: a lost worker's experts exist nowhere else, so no whole model.
    observer().on_warning(fmt::format("experts {} were lost with their workers: no checkpoint or model.safetensors",
                                      fmt::join(lost_experts(), ",")));
    return {};
  }
  if (checkpoint_writer) {
    // Mid-run checkpoints first, then the end's, which holds the final global state.
    checkpoint_writer->close();
    CFMO_TRY(checkpoint_writer->status());
    if (checkpoints) {
      const auto global = mode->final_state();
      CheckpointData data = checkpoint_of(model().parameters(), global ? &*global : nullptr);
      add_gathered(data);  // cfmo --deterministic: every rank's own state at the end
      if (rank_states) CFMO_TRY(add_rank_states(data, final_rank_states()));
      CFMO_TRY(write_checkpoint(run_dir, model_spec, whole_model ? whole_model->params() : model().params(), data,
                                options.config_toml, config.keep_checkpoints));
    }
    if (expert_parallel && !comm->lost_ranks().empty()) name_lost_experts();
  } else if (last_checkpoint_step != pos.step || (expert_parallel && !whole_model)) {
    CFMO_TRY(checkpoint());  // with --expert-parallel every rank, and the whole model comes to rank 0
  }
  if (!run_dir.empty() && rank == keeper && (!expert_parallel || whole_model)) {
    CFMO_TRY(save_model(run_dir / "model.safetensors", whole_model ? *whole_model : model(),
                        {{"format", "pt"}, {"cfmo.model", model_spec}, {"cfmo.step", std::to_string(pos.step)}}));
    // Beside it, the Hugging Face config that makes RUN a model directory (the GPT's).
    if (const std::string hf = model().hf_config_json(); !hf.empty()) {
      CFMO_TRY(write_file_atomic(run_dir / "config.json", hf));
    }
  }
  return {};
}

void TrainingRun::name_lost_experts() {
  // A lost worker's experts existed nowhere else: the model holds them as the
  // newest checkpoint had them, or at their initial values.
  const std::string from = lost_experts_from.empty() ? "initial values" : lost_experts_from;
  observer().on_warning(fmt::format(
      "experts {} were lost with their workers: model.safetensors holds them {}", fmt::join(lost_experts(), ","),
      from == "initial values" ? "at their initial values" : fmt::format("as checkpoint '{}' had them", from)));
  for (auto& l : summary.lost) {
    if (!l.experts.empty()) l.experts_from = from;
  }
}

void TrainingRun::add_totals() {
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
  // What earlier processes in a joined rank's place trained up to their last contribution.
  for (int r = 0; r < (comm != nullptr ? comm->size() : 1); ++r) total_samples += mode->retired_samples(r);
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
  summary.model_metrics = model().run_metrics();
}

}  // namespace cfmo::train::detail
