// train()'s second phase: the steps, and what each one reports and decides.
#include "train/training_run.h"

#include "data/dataset.h"
#include "tensor/ops.h"
#include "train/sample.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <thread>

#include <time.h>

namespace cfmo::train::detail {
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

/// This process's CPU time so far, every thread's.
double process_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

Status TrainingRun::run_loop() {
  // Every worker starts its loop together: ranks finish loading data and
  // connecting at different times, and a loop started alone would count
  // time in which the others cannot yet run against the run's throughput.
  // A joiner comes after the others passed theirs.
  if (world > 1 && !joining) CFMO_TRY(comm->barrier());
  loop_start = Clock::now();
  const double cpu_start = process_cpu_s();
  for (;;) {
    CFMO_ASSIGN_OR_RETURN(const bool stop, should_stop());
    if (stop) break;
    CFMO_TRY(train_step());
    if (joining && first_step_s < 0) CFMO_TRY(announce_own_join());
  }
  loop_s = seconds_since(loop_start);
  loop_cpu_s = process_cpu_s() - cpu_start;
  return {};
}

Result<bool> TrainingRun::should_stop() {
  CFMO_TRY(announce_lost());
  if (pos.step >= step_limit) {
    stopped_by = config.steps > 0 && pos.step >= config.steps ? "steps"
                 : token_steps > 0 && pos.step >= token_steps ? "tokens"
                                                              : "epochs";
    return true;
  }
  std::string wish;
  if (time_limit_s > 0 && seconds_since(run_start) >= time_limit_s) wish = "time-limit";
  if (options.stop != nullptr && options.stop->load(std::memory_order_relaxed)) wish = "interrupt";
  if (!wish.empty()) {
    if (stopped_by.empty()) stopped_by = wish;
    // Lockstep workers stop together: the wish travels with the next collective.
    if (!mode->lockstep()) return true;
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
    return true;
  }
  // A lost rank 0 no longer ends the asynchronous modes: the budget, the
  // checkpoints and the final model move to the lowest live rank.
  return false;
}

Status TrainingRun::train_step() {
  // An indexed set is walked in each epoch's shuffled order; sampled windows come from the step.
  // This worker's share of the global batch: its rank's slice, or, with
  // --keep-global-batch once workers were lost, its slice of the batch cut
  // among the workers left.
  int share = batch;
  int64_t slot = rank;
  if (config.keep_global_batch) {
    const auto members = mode->members();
    if (!members.empty() && static_cast<int>(members.size()) < world) {
      const auto left = static_cast<int64_t>(members.size());
      share = static_cast<int>((global_batch + left - 1) / left);
      slot = std::find(members.begin(), members.end(), rank) - members.begin();
    }
  }
  BatchRequest request;
  request.step = pos.step;
  request.count = share;
  if (source->indexed()) {
    if (order_epoch != pos.epoch) {
      order = data::epoch_order(static_cast<uint64_t>(config.seed), pos.epoch, train_examples);
      order_epoch = pos.epoch;
    }
    const int64_t first = pos.batch_in_epoch * global_batch + slot * share;
    const int64_t end = std::min(train_examples, (pos.batch_in_epoch + 1) * global_batch);
    request.count = static_cast<int>(std::clamp<int64_t>(end - first, 0, share));
    if (request.count > 0) {
      request.indices =
          std::span<const int64_t>(order).subspan(static_cast<size_t>(first), static_cast<size_t>(request.count));
    }
  }

  const auto step_start = Clock::now();
  const double exchange_before = model().exchange_wait_s();
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
    CFMO_TRY(mode->on_gradients(replicated_part(grads), n, static_cast<float>(lr)));
    if (on_host && !mode->owns_update()) CFMO_TRY(engine->gradients_changed());
  }
  if (!mode->owns_update() && config.clip_grad_norm > 0) CFMO_TRY(clip_gradients());
  if (!mode->owns_update() && (n > 0 || traits.reduces_gradients)) CFMO_TRY(engine->step(static_cast<float>(lr)));
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
    CFMO_TRY(mode->after_step(pos, replicated_part(params), engine->mode_optimizer()));
    if (host_params) CFMO_TRY(engine->parameters_changed());
  }
  // Simulated heterogeneity: sleep so the step takes FACTOR times its natural time.
  // Waiting for others (the mode's collectives, expert dispatch) is not this worker's own work.
  const double waited_s = (mode->stats().wait_s - wait_before) + (model().exchange_wait_s() - exchange_before);
  const double natural_s = seconds_since(step_start) - waited_s;
  double factor = simulated.slowdown;
  if (simulated.straggler_p > 0 && straggler_rng.uniform() < simulated.straggler_p) {
    factor *= simulated.straggler_factor;
  }
  if (factor > 1) std::this_thread::sleep_for(std::chrono::duration<double>((factor - 1) * natural_s));
  const double step_s = seconds_since(step_start);
  // The solo rate: everything this step took except waiting on other workers.
  const double step_compute_s = step_s - waited_s;
  compute_s += step_compute_s;
  train_s += step_s;
  pos.train_s += step_s;
  CFMO_TRY(report_step(loss, lr, n, step_s, step_compute_s));
  return at_step_end();
}

Status TrainingRun::report_step(float loss, double lr, int n, double step_s, double step_compute_s) {
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
    nlohmann::ordered_json line = {{"type", "step"},
                                   {"rank", rank},
                                   {"step", pos.step},
                                   {"epoch", epochs_done()},
                                   {"loss", event.loss},
                                   {"lr", lr},
                                   {"samples", pos.samples},
                                   {"samples_per_s", event.samples_per_s},
                                   {"compute_s", step_compute_s},
                                   {"wait_s", step_s - step_compute_s},
                                   {"wall_s", event.elapsed_s}};
    // The model's own figures of the window (a MoE's auxiliary losses and expert load).
    if (auto extra = model().take_metrics(); !extra.is_null()) line["moe"] = std::move(extra);
    CFMO_TRY(metrics.write(line));
    window_loss = 0;
    window_steps = 0;
    window_samples = 0;
    window_s = 0;
    progress_loss = 0;
    progress_steps = 0;
  }
  observer().on_step(event);
  if (sample_every > 0 && pos.step % sample_every == 0) {
    // Rank 0's own parameters, sampled between steps: the workspaces are free then.
    SampleOptions sample;
    sample.tokens = 64;
    sample.seed = static_cast<uint64_t>(pos.step);
    CFMO_ASSIGN_OR_RETURN(const auto text, sample_tokens(model(), {}, sample));
    observer().on_note(fmt::format("step {} sample: {}", pos.step, one_line(tokens_to_text(text, vocab))));
  }
  return {};
}

Status TrainingRun::clip_gradients() {
  if (!expert_parallel) return engine->clip_gradients(config.clip_grad_norm);
  // The whole gradient's norm: this rank's replicated part (the all-reduced
  // one in sync) and every rank's experts, each held by one rank.
  CFMO_ASSIGN_OR_RETURN(auto grads, engine->host_gradients());
  const double dense = tensor::ops::norm2(replicated_part(grads));
  const double local = tensor::ops::norm2(grads.subspan(replicated_part(grads).size()));
  std::array<float, 1> experts{static_cast<float>(local * local)};
  // cfmo: no collective in a step; the norm over this rank's experts.
  if (traits.lockstep) CFMO_TRY(comm->all_reduce_sum(experts));
  optim::clip_to_norm(grads, config.clip_grad_norm, std::sqrt(dense * dense + static_cast<double>(experts[0])));
  return engine->gradients_changed();
}

Status TrainingRun::at_step_end() {
  // (>=: a joiner's position, of the world before it grew, may be past its own epoch's end.)
  if (pos.batch_in_epoch >= batches_per_epoch) {
    ++pos.epoch;
    pos.batch_in_epoch = 0;
    take_up_growth();
    // With --expert-parallel every rank's experts take part in the evaluation's passes.
    if ((rank == mode->keeper() || expert_parallel) && (world == 1 || traits.evaluates_mid_run)) {
      CFMO_TRY(evaluate(false));
      last_eval_step = pos.step;
    }
    take_up_keeping();
    checkpoint_due = checkpoints || gathers_optimizers || joins_checkpoints || gives_own_state;
  } else if ((checkpoints || gathers_optimizers || joins_checkpoints || gives_own_state) &&
             config.checkpoint_every > 0 && pos.step % config.checkpoint_every == 0) {
    checkpoint_due = true;
  }
  if (async && !checkpoints && config.checkpoint_every > 0 && pos.step % config.checkpoint_every == 0) {
    take_up_keeping();
    checkpoint_due = checkpoints || gathers_optimizers;
  }
  // cfmo with --expert-parallel: the experts come with the ranks' own states
  // (rank_states), else (no run directory, --deterministic) by a collective at the end.
  if (expert_parallel && async && !rank_states) checkpoint_due = false;
  // The checkpoint policy: at once where this rank's parameters are the
  // global ones, else a snapshot asked of the owners and written when whole.
  if (checkpoint_due && mode->params_are_global()) {
    CFMO_TRY(checkpoint());
    whole_model.reset();
    checkpoint_due = false;
  } else if (checkpoint_due && !settings.deterministic && mode->request_snapshot()) {
    // (--deterministic waits for a round's end, where every rank takes part.)
    // The ranks' own states too, unless a request for them is still being answered.
    if (rank_states && (states_asked == 0 || seconds_since(states_asked_at) > config.peer_timeout)) {
      states_asked = rank_states->request();
      states_asked_at = Clock::now();
    }
    checkpoint_due = false;
  }
  CFMO_TRY(answer_state_request());
  if (checkpoint_writer) CFMO_TRY(submit_async_checkpoint());
  return {};
}

}  // namespace cfmo::train::detail
