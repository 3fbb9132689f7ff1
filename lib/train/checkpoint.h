#pragma once
/// Training checkpoints in a run directory:
///
///   RUN/checkpoints/step-00001234/model.safetensors      parameters (PyTorch loads them as they are)
///   RUN/checkpoints/step-00001234/optimizer.safetensors  state, "<param>.<state>" per tensor
///   RUN/checkpoints/step-00001234/state.json             step, epoch, data position, counters
///   RUN/checkpoints/step-00001234/config.toml            the merged configuration
///   RUN/checkpoints/latest                               name of the newest complete checkpoint
///
/// A checkpoint is built in a temporary directory and renamed into place, so
/// a directory named step-N is always complete.

#include "core/error.h"
#include "model/mlp.h"
#include "optim/optimizer.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

namespace cfmo {

/// Where a run is: enough to continue it exactly.
struct TrainPosition {
  int64_t step = 0;            ///< optimizer steps completed
  int64_t epoch = 0;           ///< current epoch (0-based)
  int64_t batch_in_epoch = 0;  ///< batches of the current epoch already used
  int64_t samples = 0;         ///< examples seen in total
  double train_s = 0;          ///< seconds spent in training steps, all runs together
};

/// Writes a checkpoint and keeps only the newest `keep`; returns its directory.
Result<std::filesystem::path> save_checkpoint(const std::filesystem::path& run_dir, const Mlp& model,
                                              Optimizer& optimizer, const TrainPosition& position,
                                              const std::string& config_toml, int keep);

/// Writes the parameters alone as a safetensors file (the run's final model).
Status save_model(const std::filesystem::path& path, const Mlp& model, const std::map<std::string, std::string>& metadata);

/// `path` is a checkpoint directory or a run directory (its latest checkpoint);
/// returns the checkpoint directory as an absolute, normalised path.
Result<std::filesystem::path> resolve_checkpoint(const std::filesystem::path& path);

/// RUN for RUN/checkpoints/step-N; empty for a checkpoint kept anywhere else.
std::filesystem::path run_dir_of(const std::filesystem::path& checkpoint_dir);

/// Restores parameters, optimizer state and position. Shapes and the
/// optimizer's name must match; errors name the file and tensor.
Result<TrainPosition> load_checkpoint(const std::filesystem::path& checkpoint_dir, Mlp& model, Optimizer& optimizer);

}  // namespace cfmo
