#pragma once
/// Which CUDA devices there are, in every build: where the toolkit was not
/// found at configure time (meson -Dcuda=auto|enabled) each question has the
/// CPU-only answer, and asking for a device that is not there is a usage
/// error, never a crash. The one place outside the engine that says whether a
/// `--device` (tensor/device.h) can be used.

#include "core/error.h"
#include "tensor/device.h"

#include <string>
#include <string_view>

namespace cfmo::cuda {

/// The device of one rank: "cuda" becomes cuda:(local_rank mod the number of
/// GPUs), `local_rank` being its index among its host's ranks (the world's,
/// comm/world.h: WorldInfo::local_rank). A CPU or a fixed ordinal is returned as it is.
tensor::Device device_for_rank(const tensor::Device& device, int local_rank);

/// True when this build has the CUDA backend.
bool cuda_built();

/// Checks that `device` can be used in this process: always true for the CPU;
/// for CUDA, a kUsage error "no CUDA device" with the reason (built without
/// CUDA, no driver, no such ordinal) otherwise.
Status check_device(const tensor::Device& device, std::string_view flag = "--device");

/// "NVIDIA H200 (cuda:0, compute 9.0, 139 GiB)" or "cpu", for reports.
std::string device_description(const tensor::Device& device);

}  // namespace cfmo::cuda
