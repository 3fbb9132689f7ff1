#pragma once
/// Whether N worker processes fit in this host's memory, asked before any
/// starts: each holds the whole data set, the model with its gradients and
/// optimizer state, the mode's copies and a batch's activations.

#include "core/error.h"
#include "train/train_config.h"

#include <cstdint>
#include <optional>

namespace cfmo::train {

/// One worker's resident memory as configured, in bytes: from the data's
/// and the model's sizes (without loading the data), plus what a process of
/// this program holds before it has any (libraries, UCX, thread stacks).
Result<uint64_t> estimate_worker_bytes(const TrainConfig& config);

/// MemAvailable from /proc/meminfo, in bytes; nullopt when it cannot be read.
std::optional<uint64_t> available_memory();

/// kUsage naming the estimate and the memory available when `workers`
/// workers would not fit; fine when either cannot be known (the workers then
/// report what is wrong with the data themselves).
Status check_workers_fit(const TrainConfig& config, int workers);

}  // namespace cfmo::train
