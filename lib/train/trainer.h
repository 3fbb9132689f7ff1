#pragma once
/// The training loop. One worker runs it; how workers reconcile is a Mode,
/// asked after every step (the seam the distributed modes plug into).

#include "comm/communicator.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/modes.h"
#include "train/train_config.h"

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo {

struct StepEvent {
  int64_t step = 0;
  int64_t epoch = 0;  ///< the epoch in progress, 0-based
  double loss = 0;    ///< mean over the steps since the last event of this kind
  double lr = 0;
  double samples_per_s = 0;  ///< over the same window, training steps only
  double elapsed_s = 0;
  double fraction = -1;  ///< of the run, or negative when unknown
  double eta_s = -1;     ///< seconds of training left, or negative when unknown
  bool logged = false;   ///< true every log_every steps
};

struct EvalEvent {
  int64_t step = 0;
  double epochs = 0;  ///< epochs completed, fractional after a mid-epoch stop
  double test_loss = 0;
  double test_accuracy = 0;
  double elapsed_s = 0;
  bool final = false;
};

/// Receives progress; the tool decides what to show. Called on the training thread.
class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  virtual void on_step(const StepEvent& /*event*/) {}
  virtual void on_eval(const EvalEvent& /*event*/) {}
  virtual void on_note(std::string_view /*text*/) {}
  /// Something the user must hear of even when progress is quiet (a peer lost
  /// while the run goes on).
  virtual void on_warning(std::string_view text) { on_note(text); }
};

struct TrainOptions {
  std::filesystem::path resume;             ///< a checkpoint directory (resolved), or empty
  std::string config_toml;                  ///< saved beside each checkpoint
  const std::atomic<bool>* stop = nullptr;  ///< set by a signal handler: stop cleanly
  TrainObserver* observer = nullptr;
  Communicator* comm = nullptr;  ///< the other workers; null for a single worker
  int local_rank = -1;           ///< this worker's index on its host (comm/world.h); -1: its rank
};

struct WorkerReport {
  int rank = 0;
  int64_t steps = 0;
  int64_t samples = 0;
  double samples_per_s = 0;       ///< samples / this worker's time in the training loop
  double solo_samples_per_s = 0;  ///< samples / time computing (and simulated slowness), without waits
  double wait_s = 0;              ///< blocked on communication in the training loop
  double finish_wait_s = 0;       ///< after the loop: the last replies and the other ranks
  double loop_s = 0;              ///< time in the training loop
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t contributions_dropped = 0;
  uint64_t contributions_sent = 0;
  uint64_t contributions_applied = 0;   ///< as an owner
  uint64_t contributions_received = 0;  ///< as an owner
  int64_t rounds = 0;
  int64_t deferred = 0;
  std::vector<uint64_t> staleness_histogram;
  double slowdown = 1.0;
  std::string stopped_by;
  int64_t deltas_written = 0;  ///< .cfd files written to RUN/deltas/rank-K/
  int64_t deltas_skipped = 0;  ///< rounds not written because the disk fell behind

  std::string to_json() const;
  static Result<WorkerReport> from_json(std::string_view text);
};

struct TrainSummary {
  std::string mode;
  int workers = 1;
  std::string model;
  std::string optimizer;
  std::string data;
  std::string blas;    ///< library and kernel, e.g. "OpenBLAS 0.3.21 SkylakeX"
  std::string device;  ///< where rank 0 trained: "cpu (OpenBLAS ...)" or the GPU's description
  size_t parameters = 0;
  int64_t steps = 0;    ///< total, including steps before a resume
  int64_t samples = 0;  ///< total
  int64_t epochs_completed = 0;
  double wall_s = 0;         ///< this invocation, including evaluation and checkpoints
  double train_s = 0;        ///< this invocation, training steps only
  double eval_s = 0;         ///< this invocation, test-set evaluation
  double samples_per_s = 0;  ///< this invocation's samples / train_s
  double test_accuracy = 0;
  double test_loss = 0;
  double final_train_loss = 0;
  double train_loss = 0;  ///< rank 0's mean loss over the steps of its last log window (--log-every)
  // A language model's figures (context > 0): tokens are samples x context.
  int context = 0;
  int64_t tokens = 0;       ///< training tokens, all workers, including before a resume
  double tokens_per_s = 0;  ///< this invocation's, as samples_per_s
  double val_loss = 0;      ///< mean cross-entropy (nats) over the validation windows' predicted tokens
  double flops_per_example = 0;
  double gflops_per_s = 0;  ///< samples_per_s x flops_per_example / 1e9
  std::string flops_formula;
  /// With --optimizer muon: the tensors Muon updates; AdamW updates the rest.
  std::vector<std::string> muon_tensors;
  std::vector<std::string> adamw_tensors;
  uint64_t bytes_sent = 0;
  std::string stopped_by;  ///< "epochs", "steps", "time-limit" or "interrupt"
  std::string run_dir;
  std::string resumed_from;
  std::vector<WorkerReport> per_worker;
  int rank = 0;           ///< the rank that made this summary (only rank 0's is complete)
  double efficiency = 0;  ///< total samples/s over the sum of the workers' solo samples/s
  std::vector<int> lost_ranks;
  ModeSettings mode_settings;
  std::vector<std::string> slowdown;
  std::string straggler;

  std::string to_json() const;
};

/// Trains as configured. Errors: kUsage for bad configuration, kInput for
/// unreadable data or checkpoints, kCheckFailed when the loss diverges.
Result<TrainSummary> train(const TrainConfig& config, const TrainOptions& options);

}  // namespace cfmo
