#pragma once
/// Training checkpoints in a run directory:
///
///   RUN/checkpoints/step-00001234/model.safetensors      parameters (PyTorch loads them as they are)
///   RUN/checkpoints/step-00001234/optimizer.safetensors  state, "<param>.<state>" per tensor
///   RUN/checkpoints/step-00001234/state.json             step, epoch, data position, counters, workers
///   RUN/checkpoints/step-00001234/outer.safetensors      outer momentum, "<param>.outer_momentum" (if any)
///   RUN/checkpoints/step-00001234/optimizer-rank-K.safetensors  localsgd, cfmo: rank K's own inner state (K >= 1)
///   RUN/checkpoints/step-00001234/wire-rank-K.safetensors       cfmo --deterministic: rank K's error feedback
///   RUN/checkpoints/step-00001234/config.toml            the merged configuration
///   RUN/checkpoints/latest                               name of the newest complete checkpoint
///
/// A checkpoint is built in a temporary directory and renamed into place (a
/// checkpoint of the same step is swapped in atomically), so a directory named
/// step-N is always complete. With several workers the parameters are the
/// global ones; see docs/FORMATS.md for what else a checkpoint of each mode holds.

#include "core/background_writer.h"
#include "core/dir_lock.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "tensor/buffer.h"

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace cfmo::train {

/// Where a run is: enough to continue it exactly.
struct TrainPosition {
  int64_t step = 0;            ///< optimizer steps completed
  int64_t epoch = 0;           ///< current epoch (0-based)
  int64_t batch_in_epoch = 0;  ///< batches of the current epoch already used
  int64_t samples = 0;         ///< examples seen in total
  double train_s = 0;          ///< seconds spent in training steps, all runs together
  /// The ranks this epoch's global batches are cut among (the world, grown
  /// at an epoch's start by the ranks that joined: a joiner of a lockstep
  /// group takes its members' cut from its welcome); 0: the run's workers.
  /// In a checkpoint's state.json only where the run grew.
  int64_t data_world = 0;
};

/// How the run that wrote a checkpoint was distributed. An older checkpoint
/// says nothing of it: workers 1, mode empty, batch_size 0.
struct CheckpointWorld {
  int workers = 1;  ///< the ranks recorded: the world at the checkpoint (grown by joins)
  /// A run that grew by joins: the ranks it started with, for which its
  /// length, budget and learning-rate schedule were planned; 0: `workers`.
  int first_workers = 0;
  std::string mode;                            ///< empty: not recorded
  int batch_size = 0;                          ///< 0: not recorded
  std::vector<TrainPosition> ranks;            ///< cfmo, asgd: each rank's; empty: every rank at the position
  std::vector<int64_t> shard_optimizer_steps;  ///< asgd: each owner's optimizer steps
  std::vector<int64_t> shard_versions;         ///< cfmo, asgd: each shard's version (the staleness counters)
  std::vector<int64_t> outer_in_round;         ///< cfmo with nesterov: each owner's pending round's contributions
  std::vector<int64_t> rank_optimizer_steps;   ///< with per-rank optimizer state: each rank's optimizer steps
};

/// A checkpoint to write, with copies of everything, flat in the model's layout.
struct CheckpointData {
  TrainPosition position;
  CheckpointWorld world;
  tensor::FloatBuffer params;
  std::string optimizer_name;
  int64_t optimizer_steps = 0;
  std::vector<std::pair<std::string, tensor::FloatBuffer>> optimizer_state;
  tensor::FloatBuffer outer_momentum;   ///< empty: none
  tensor::FloatBuffer outer_round_sum;  ///< cfmo: the owners' pending rounds' weighted sums; empty: none
  /// Ranks 1 to W-1's own inner optimizer state (rank 0's is
  /// optimizer_state), where the ranks' optimizers drift apart between
  /// rounds (localsgd); empty: every rank resumes with rank 0's.
  std::vector<std::vector<std::pair<std::string, tensor::FloatBuffer>>> rank_optimizer_state;
  /// Every rank's error feedback of a lossy --delta-dtype (cfmo
  /// --deterministic), rank 0 first; empty: none.
  std::vector<tensor::FloatBuffer> wire_residuals;
};

/// Copies the model's parameters and the optimizer's state.
CheckpointData checkpoint_data(const model::Model& model, optim::Optimizer& optimizer, const TrainPosition& position);

/// Writes a checkpoint of a model of this spec ("mlp:256,128") and layout and
/// keeps only the newest `keep`; returns its directory.
Result<std::filesystem::path> write_checkpoint(const std::filesystem::path& run_dir, const std::string& model_spec,
                                               const std::vector<model::ParamInfo>& layout, const CheckpointData& data,
                                               const std::string& config_toml, int keep);

/// Writes a checkpoint of one worker's model and optimizer (write_checkpoint of checkpoint_data).
Result<std::filesystem::path> save_checkpoint(const std::filesystem::path& run_dir, const model::Model& model,
                                              optim::Optimizer& optimizer, const TrainPosition& position,
                                              const std::string& config_toml, int keep);

/// Writes checkpoints on a thread of its own, one at a time, so that the
/// training loop never waits for the disk. While one is being written, one
/// more waits; a newer one replaces it (the replaced one counts as skipped).
class CheckpointWriter {
 public:
  CheckpointWriter(std::filesystem::path run_dir, std::string model_spec, std::vector<model::ParamInfo> layout,
                   std::string config_toml, int keep);
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();
  /// Writes what was submitted, then stops the thread.
  void close();
  /// Queues `data`; false when it replaced one that was waiting (or the writer
  /// is closed or failed: then `data` is dropped).
  bool submit(CheckpointData data);
  /// The step of the last checkpoint written, or -1.
  int64_t last_step() const { return last_step_.load(); }

  /// The first write error, if any (the tool reports it at the end).
  Status status() const { return writer_.status(); }
  int64_t written() const { return writer_.written(); }
  int64_t skipped() const { return writer_.skipped(); }

 private:
  Status write(CheckpointData& data);

  const std::filesystem::path run_dir_;
  const std::string spec_;
  const std::vector<model::ParamInfo> layout_;
  const std::string config_toml_;
  const int keep_;
  std::atomic<int64_t> last_step_{-1};
  /// One checkpoint waits at most: a newer one replaces it. Last: its thread
  /// starts after, and stops before, the members it uses.
  BackgroundWriter<CheckpointData> writer_;
};

/// Writes the parameters alone as a safetensors file (the run's final model).
Status save_model(const std::filesystem::path& path, const model::Model& model,
                  const std::map<std::string, std::string>& metadata);

/// `path` is a checkpoint directory or a run directory (its latest checkpoint);
/// returns the checkpoint directory as an absolute, normalised path.
Result<std::filesystem::path> resolve_checkpoint(const std::filesystem::path& path);

/// RUN for RUN/checkpoints/step-N; empty for a checkpoint kept anywhere else.
std::filesystem::path run_dir_of(const std::filesystem::path& checkpoint_dir);

/// The lock on a run directory (RUN/.cfmo-train.lock, created with RUN):
/// one run at a time writes into it. Held by another process: kUsage naming
/// that process's pid; RUN cannot be made: kUsage naming it.
Result<DirLock> lock_run_dir(const std::filesystem::path& run_dir);

/// Restores parameters, optimizer state and position. Shapes and the
/// optimizer's name must match; errors name the file and tensor. `world` and
/// `outer_momentum` (the model's layout; left empty when the checkpoint has
/// none), when given, receive the rest.
Result<TrainPosition> load_checkpoint(const std::filesystem::path& checkpoint_dir, model::Model& model,
                                      optim::Optimizer& optimizer, CheckpointWorld* world = nullptr,
                                      tensor::FloatBuffer* outer_momentum = nullptr,
                                      tensor::FloatBuffer* outer_round_sum = nullptr);

/// Rank `rank`'s own inner optimizer state, where the checkpoint holds one
/// for it (state.json's rank_optimizers, written by localsgd and cfmo runs of
/// several workers), with its step count where rank_optimizer_steps has it:
/// true when it was read into `optimizer`, false when there is none (rank 0,
/// or an older checkpoint). Errors name the file and tensor.
Result<bool> load_rank_optimizer(const std::filesystem::path& checkpoint_dir, const model::Model& model,
                                 optim::Optimizer& optimizer, int rank);

/// Rank `rank`'s error feedback (state.json's wire_residuals) over the
/// model's whole vector; empty where the checkpoint has none for it.
Result<tensor::FloatBuffer> load_wire_residual(const std::filesystem::path& checkpoint_dir, const model::Model& model,
                                               int rank);

/// A loaded checkpoint's positions (`position` and each of `world.ranks`)
/// against the data they index: `examples` training examples cut into
/// batches of `batch` per worker, `world.workers` workers. Every counter
/// must be one the run could have reached: batch_in_epoch within an epoch
/// (equal to its batches at its end, which resume_position turns into the
/// next epoch's start),
/// step = epoch x batches an epoch + batch_in_epoch, samples those steps'
/// examples, optimizer steps no more than the steps; errors are kInput
/// naming state.json and the field. A grown world's (`first_workers`) epochs
/// were cut among first_workers to workers ranks, each epoch's cut as a
/// rank saw it: there batch_in_epoch is checked against the position's own
/// cut (data_world), step against the fewest and the most batches an epoch
/// can have, and samples as at most those steps' examples.
Status check_positions(const std::filesystem::path& checkpoint_dir, const TrainPosition& position,
                       const CheckpointWorld& world, int64_t optimizer_steps, int64_t examples, int batch);

/// A checked position to continue from: the end of an epoch becomes the
/// start of the next, where the training loop would have turned to it.
TrainPosition resume_position(TrainPosition position, int64_t batches_per_epoch);

}  // namespace cfmo::train
