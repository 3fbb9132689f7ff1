#pragma once
/// cfmo-moe's experts on a CUDA device: an `ExpertDevice` (moe/experts.h)
/// per expert, cuBLAS on weights uploaded once. The tool hands
/// `place_experts` to `run_benchmark` (moe/benchmark.h), so moe itself does
/// not link the CUDA backend.

#include "core/error.h"
#include "moe/experts.h"
#include "tensor/device.h"

#include <string>
#include <vector>

namespace cfmo::cuda {

/// Moves this rank's `experts` to `device` (for "cuda", the GPU of
/// `local_rank`: device_for_rank) and returns the device's description;
/// "cpu" leaves them where they are. kUsage "no CUDA device" where it cannot
/// be used, in a build without CUDA too.
Result<std::string> place_experts(std::vector<moe::ExpertFfn>& experts, const tensor::Device& device, int local_rank);

}  // namespace cfmo::cuda
