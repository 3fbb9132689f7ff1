#include "train/trainer.h"

#include "core/atomic_file.h"
#include "data/dataset.h"
#include "optim/schedule.h"
#include "tensor/ops.h"

#include <nlohmann/json.hpp>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>

namespace cfmo {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// metrics.jsonl: one JSON object per line, flushed as written so a reader
/// (cfmo-diverge watch, tail -f) sees each line whole.
class MetricsLog {
 public:
  static Result<MetricsLog> open(const fs::path& run_dir, int64_t resume_step) {
    const fs::path path = run_dir / "metrics.jsonl";
    std::error_code ec;
    if (resume_step >= 0 && fs::exists(path, ec)) CFMO_TRY(truncate_after(path, resume_step));
    MetricsLog log;
    log.out_ = std::make_unique<std::ofstream>(path, resume_step >= 0 ? std::ios::app : std::ios::trunc);
    if (!*log.out_) return make_error(ErrorKind::kInternal, "Failed to open '{}' for writing", path.string());
    log.path_ = path;
    return log;
  }

  Status write(const nlohmann::ordered_json& line) {
    if (!out_) return {};
    *out_ << line.dump() << '\n';
    out_->flush();
    if (!*out_) return make_error(ErrorKind::kInternal, "Failed to write '{}'", path_.string());
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

  std::unique_ptr<std::ofstream> out_;
  fs::path path_;
};

/// The model's loss and accuracy over a whole data set, converted to floats
/// a chunk at a time so the set itself stays in bytes.
EvalResult evaluate_dataset(Mlp& model, const Dataset& data) {
  constexpr int64_t kChunk = 1000;
  FloatBuffer chunk(static_cast<size_t>(std::min(kChunk, data.count)) * static_cast<size_t>(data.features));
  EvalResult total;
  for (int64_t first = 0; first < data.count; first += kChunk) {
    const int64_t n = std::min(kChunk, data.count - first);
    data.rows_to_float(first, n, chunk.data());
    const EvalResult r = model.evaluate(chunk.data(), data.labels.data() + first, n, static_cast<int>(kChunk));
    total.loss_sum += r.loss_sum;
    total.correct += r.correct;
    total.count += r.count;
  }
  return total;
}

}  // namespace

std::string TrainSummary::to_json() const {
  nlohmann::ordered_json workers_json = nlohmann::ordered_json::array();
  for (const auto& w : per_worker) {
    workers_json.push_back({{"rank", w.rank},
                            {"steps", w.steps},
                            {"samples_per_s", w.samples_per_s},
                            {"wait_s", w.wait_s},
                            {"bytes_sent", w.bytes_sent},
                            {"bytes_received", w.bytes_received}});
  }
  nlohmann::ordered_json j = {{"mode", mode},
                              {"workers", workers},
                              {"model", model},
                              {"optimizer", optimizer},
                              {"data", data},
                              {"blas", blas},
                              {"parameters", parameters},
                              {"steps", steps},
                              {"samples", samples},
                              {"epochs_completed", epochs_completed},
                              {"wall_s", wall_s},
                              {"train_s", train_s},
                              {"eval_s", eval_s},
                              {"samples_per_s", samples_per_s},
                              {"test_accuracy", test_accuracy},
                              {"test_loss", test_loss},
                              {"final_train_loss", final_train_loss},
                              {"bytes_sent", bytes_sent},
                              {"stopped_by", stopped_by},
                              {"run_dir", run_dir.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(run_dir)},
                              {"resumed_from",
                               resumed_from.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(resumed_from)},
                              {"per_worker", workers_json}};
  return j.dump();
}

Result<TrainSummary> train(const TrainConfig& config, const TrainOptions& options) {
  const auto run_start = Clock::now();
  CFMO_TRY(validate(config));
  TrainObserver null_observer;
  TrainObserver& observer = options.observer != nullptr ? *options.observer : null_observer;
  ops::set_num_threads(config.threads);
#if defined(__x86_64__)
  // Flush denormals to zero on this thread: Adam's first moment of a weight
  // that stops receiving gradient decays into the denormal range within a
  // few hundred steps, where every multiply costs ~100 cycles. PyTorch's
  // torch.set_flush_denormal(True) does the same.
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
#endif

  CFMO_ASSIGN_OR_RETURN(DataSplit data, load_data(config.data, static_cast<uint64_t>(config.seed)));
  const Dataset& train_set = data.train;
  CFMO_ASSIGN_OR_RETURN(MlpSpec spec, MlpSpec::parse(config.model, train_set.features, train_set.classes));
  Mlp model(spec);
  model.init(static_cast<uint64_t>(config.seed));

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
  if (!options.resume.empty()) {
    CFMO_ASSIGN_OR_RETURN(pos, load_checkpoint(options.resume, model, *optimizer));
    observer.on_note(fmt::format("resumed from {} at step {}", options.resume.string(), pos.step));
  }

  const int batch = config.batch_size;
  const int64_t batches_per_epoch = (train_set.count + batch - 1) / batch;
  int64_t step_limit = config.steps > 0 ? config.steps : INT64_MAX;
  if (config.epochs > 0) step_limit = std::min(step_limit, config.epochs * batches_per_epoch);
  double time_limit_s = 0;
  if (!config.time_limit.empty()) {
    CFMO_ASSIGN_OR_RETURN(time_limit_s, parse_duration(config.time_limit));
  }

  Schedule schedule;
  CFMO_ASSIGN_OR_RETURN(schedule.kind, Schedule::parse_kind(config.schedule));
  schedule.base_lr = config.lr;
  schedule.min_lr = config.min_lr;
  schedule.warmup_steps = config.warmup_steps;
  schedule.total_steps = step_limit == INT64_MAX ? 0 : step_limit;

  const fs::path run_dir = config.out;
  MetricsLog metrics;
  if (!run_dir.empty()) {
    std::error_code ec;
    fs::create_directories(run_dir, ec);
    if (ec) return make_error(ErrorKind::kUsage, "--out '{}': {}", run_dir.string(), ec.message());
    CFMO_ASSIGN_OR_RETURN(metrics, MetricsLog::open(run_dir, options.resume.empty() ? -1 : pos.step));
  }

  SoloMode mode;
  TrainSummary summary;
  summary.mode = std::string(mode.name());
  summary.model = spec.to_string();
  summary.optimizer = config.optimizer;
  summary.data = data.source;
  summary.blas = ops::blas_info();
  summary.parameters = model.num_trainable();
  summary.run_dir = run_dir.string();
  summary.resumed_from = options.resume.string();

  // metrics.jsonl's "epoch": epochs completed, fractional within an epoch (as step/steps-per-epoch).
  auto epochs_done = [&] {
    return static_cast<double>(pos.epoch) +
           static_cast<double>(pos.batch_in_epoch) / static_cast<double>(batches_per_epoch);
  };
  auto evaluate = [&](bool final) -> Status {
    const auto t0 = Clock::now();
    const EvalResult r = evaluate_dataset(model, data.test);
    EvalEvent event{pos.step, epochs_done(), r.loss(), r.accuracy(), seconds_since(run_start), final};
    summary.test_loss = event.test_loss;
    summary.test_accuracy = event.test_accuracy;
    summary.eval_s += seconds_since(t0);
    observer.on_eval(event);
    return metrics.write({{"type", "eval"},
                          {"rank", 0},
                          {"step", pos.step},
                          {"epoch", event.epochs},
                          {"test_loss", event.test_loss},
                          {"test_accuracy", event.test_accuracy},
                          {"wall_s", event.elapsed_s}});
  };
  int64_t last_checkpoint_step = options.resume.empty() ? -1 : pos.step;
  auto checkpoint = [&]() -> Status {
    if (run_dir.empty()) return {};
    CFMO_ASSIGN_OR_RETURN(auto dir, save_checkpoint(run_dir, model, *optimizer, pos, options.config_toml,
                                                    config.keep_checkpoints));
    (void)dir;
    last_checkpoint_step = pos.step;
    return {};
  };

  FloatBuffer batch_inputs(static_cast<size_t>(batch) * static_cast<size_t>(train_set.features));
  std::vector<int32_t> batch_labels(static_cast<size_t>(batch));
  std::vector<int64_t> order;
  int64_t order_epoch = -1;

  double window_loss = 0;
  int64_t window_steps = 0;
  int64_t window_samples = 0;
  double window_s = 0;
  double progress_loss = 0;
  int64_t progress_steps = 0;
  double train_s = 0;
  int64_t samples_this_run = 0;
  int64_t steps_this_run = 0;
  int64_t last_eval_step = -1;

  std::string stopped_by;
  for (;;) {
    if (pos.step >= step_limit) {
      stopped_by = config.steps > 0 && pos.step >= config.steps ? "steps" : "epochs";
      break;
    }
    if (time_limit_s > 0 && seconds_since(run_start) >= time_limit_s) {
      stopped_by = "time-limit";
      break;
    }
    if (options.stop != nullptr && options.stop->load(std::memory_order_relaxed)) {
      stopped_by = "interrupt";
      break;
    }
    if (order_epoch != pos.epoch) {
      order = epoch_order(static_cast<uint64_t>(config.seed), pos.epoch, train_set.count);
      order_epoch = pos.epoch;
    }

    const auto step_start = Clock::now();
    const int64_t first = pos.batch_in_epoch * batch;
    const int n = static_cast<int>(std::min<int64_t>(batch, train_set.count - first));
    gather_batch(train_set, order, first, n, batch_inputs.data(), batch_labels.data());
    const float loss = model.forward_backward(batch_inputs.data(), batch_labels.data(), n);
    if (!std::isfinite(loss)) {
      return make_error(ErrorKind::kCheckFailed, "training diverged: loss is {} at step {} (lower --lr or set --clip-grad-norm)",
                        loss, pos.step + 1);
    }
    CFMO_TRY(mode.on_gradients(model.gradients()));
    if (config.clip_grad_norm > 0) clip_grad_norm(model.gradients(), config.clip_grad_norm);
    const double lr = schedule.at(pos.step);
    optimizer->step(model.parameters(), model.gradients(), static_cast<float>(lr));
    ++pos.step;
    ++steps_this_run;
    pos.samples += n;
    samples_this_run += n;
    ++pos.batch_in_epoch;
    CFMO_TRY(mode.after_step(pos.step, model.parameters(), *optimizer));
    const double step_s = seconds_since(step_start);
    train_s += step_s;
    pos.train_s += step_s;

    window_loss += loss;
    progress_loss += loss;
    ++window_steps;
    ++progress_steps;
    window_samples += n;
    window_s += step_s;
    summary.final_train_loss = loss;

    StepEvent event;
    event.step = pos.step;
    event.epoch = pos.epoch;
    event.lr = lr;
    event.elapsed_s = seconds_since(run_start);
    double fraction = -1;
    if (step_limit != INT64_MAX) fraction = static_cast<double>(pos.step) / static_cast<double>(step_limit);
    if (time_limit_s > 0) fraction = std::max(fraction, event.elapsed_s / time_limit_s);
    event.fraction = std::min(fraction, 1.0);
    if (step_limit != INT64_MAX) event.eta_s = static_cast<double>(step_limit - pos.step) * train_s / steps_this_run;
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
                              {"rank", 0},
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

    if (pos.batch_in_epoch == batches_per_epoch) {
      ++pos.epoch;
      pos.batch_in_epoch = 0;
      CFMO_TRY(evaluate(false));
      last_eval_step = pos.step;
      CFMO_TRY(checkpoint());
    } else if (config.checkpoint_every > 0 && pos.step % config.checkpoint_every == 0) {
      CFMO_TRY(checkpoint());
    }
  }

  // The final parameters are those of the last evaluation when the run ended on an epoch boundary.
  if (last_eval_step != pos.step) CFMO_TRY(evaluate(true));
  if (last_checkpoint_step != pos.step) CFMO_TRY(checkpoint());
  if (!run_dir.empty()) {
    CFMO_TRY(save_model(run_dir / "model.safetensors", model,
                        {{"format", "pt"}, {"cfmo.model", spec.to_string()}, {"cfmo.step", std::to_string(pos.step)}}));
  }

  summary.steps = pos.step;
  summary.samples = pos.samples;
  summary.epochs_completed = pos.epoch;
  summary.wall_s = seconds_since(run_start);
  summary.train_s = train_s;
  summary.samples_per_s = train_s > 0 ? static_cast<double>(samples_this_run) / train_s : 0;
  summary.stopped_by = stopped_by;
  summary.bytes_sent = mode.bytes_sent();
  summary.per_worker.push_back(
      {0, steps_this_run, summary.samples_per_s, mode.wait_s(), mode.bytes_sent(), mode.bytes_received()});
  return summary;
}

}  // namespace cfmo
