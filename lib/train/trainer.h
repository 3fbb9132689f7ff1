#pragma once
/// The training loop. One worker runs it; how workers reconcile is a Mode,
/// asked after every step (the seam the distributed modes plug into).

#include "comm/communicator.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/modes.h"
#include "train/report.h"
#include "train/train_config.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::train {

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

/// What a worker reads and builds before it connects to its run (preload).
struct Preloaded;

struct TrainOptions {
  std::filesystem::path resume;             ///< a checkpoint directory (resolved), or empty
  std::string config_toml;                  ///< saved beside each checkpoint
  const std::atomic<bool>* stop = nullptr;  ///< set by a signal handler: stop cleanly
  TrainObserver* observer = nullptr;
  comm::Communicator* comm = nullptr;  ///< the other workers; null for a single worker
  int local_rank = -1;                 ///< this worker's index on its host (comm/world.h); -1: its rank
  /// A joiner: the ranks the run started with (connect_run), for which the
  /// run planned its length and learning-rate schedule; 0: comm's size.
  int first_world = 0;
  /// When this process started (a joiner's first_step_s counts from it); default: when train() starts.
  std::optional<std::chrono::steady_clock::time_point> process_start;
  /// preload()'s data and model, which train() takes over (it moves them
  /// out); null: train() reads them itself.
  std::shared_ptr<Preloaded> preloaded;
};

/// A worker's data, model and optimizer, read and built before it connects
/// to the other ranks: none of them needs its rank or the world (token
/// data's part of the tokens is taken in train(); with --expert-parallel the
/// model is built there, of its rank's experts). A process that joins a run
/// under way (--join, a restarted rank) is then taken in ready to serve what
/// is handed to it, not after its load; and one whose data cannot be read
/// fails alone, before any rank counts it in. Errors as train()'s.
Result<std::shared_ptr<Preloaded>> preload(const TrainConfig& config);

/// Trains as configured. Errors: kUsage for bad configuration, kInput for
/// unreadable data or checkpoints, kCheckFailed when the loss diverges.
Result<TrainSummary> train(const TrainConfig& config, const TrainOptions& options);

}  // namespace cfmo::train
