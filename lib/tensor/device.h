#pragma once
/// Where a tool's dense work runs: `--device cpu|cuda[:N]`, as parsed. Whether
/// such a device is there (and which GPU a rank gets) is the CUDA backend's
/// to say: cuda/devices.h, in every build.

#include "core/error.h"

#include <string>
#include <string_view>

namespace cfmo::tensor {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  ///< the CUDA device ordinal; -1: each rank its own (see for_rank)

  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  std::string to_string() const;  ///< "cpu", "cuda", "cuda:0"
};

/// "cpu", "cuda" (each rank its local GPU) or "cuda:N"; else kUsage naming `flag`.
Result<Device> parse_device(std::string_view text, std::string_view flag = "--device");

}  // namespace cfmo::tensor
