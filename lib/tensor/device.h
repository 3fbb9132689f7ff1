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
  int index = 0;  ///< the CUDA device ordinal

  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  std::string to_string() const;  ///< "cpu", "cuda:0"
};

/// "cpu", "cuda" (device 0) or "cuda:N"; anything else is kUsage naming `flag`.
Result<Device> parse_device(std::string_view text, std::string_view flag = "--device");

/// True when this build has the CUDA backend.
bool cuda_built();

/// Checks that `device` can be used in this process: always true for the CPU;
/// for CUDA, a kUsage error "no CUDA device" with the reason (built without
/// CUDA, no driver, no such ordinal) otherwise.
Status check_device(const Device& device, std::string_view flag = "--device");

/// "NVIDIA H200 (cuda:0, compute 9.0, 139 GiB)" or "cpu", for reports.
std::string device_description(const Device& device);

}  // namespace cfmo
