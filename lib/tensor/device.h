#pragma once
/// Where a tool's dense work runs: `--device cpu|cuda[:N]`. The CPU path is
/// always built; the CUDA path only where the toolkit was found at configure
/// time (meson -Dcuda=auto|enabled). Asking for a device that is not there,
/// or a build without CUDA, is a usage error, never a crash.

#include "core/error.h"

#include <string>
#include <string_view>

namespace cfmo {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  ///< the CUDA device ordinal; -1: each rank its own (see for_rank)

  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  std::string to_string() const;  ///< "cpu", "cuda", "cuda:0"
};

/// "cpu", "cuda" (each rank its local GPU) or "cuda:N"; else kUsage naming `flag`.
Result<Device> parse_device(std::string_view text, std::string_view flag = "--device");

/// The device of one rank: "cuda" becomes cuda:(local_rank mod the number of
/// GPUs), `local_rank` being its index among its host's ranks (the world's,
/// comm/world.h: WorldInfo::local_rank). A CPU or a fixed ordinal is returned as it is.
Device device_for_rank(const Device& device, int local_rank);

/// True when this build has the CUDA backend.
bool cuda_built();

/// Checks that `device` can be used in this process: always true for the CPU;
/// for CUDA, a kUsage error "no CUDA device" with the reason (built without
/// CUDA, no driver, no such ordinal) otherwise.
Status check_device(const Device& device, std::string_view flag = "--device");

/// "NVIDIA H200 (cuda:0, compute 9.0, 139 GiB)" or "cpu", for reports.
std::string device_description(const Device& device);

}  // namespace cfmo
