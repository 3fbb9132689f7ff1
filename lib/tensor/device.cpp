#include "tensor/device.h"

#include <algorithm>
#include <charconv>

#if CFMO_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace cfmo {

std::string Device::to_string() const {
  if (kind == DeviceKind::kCpu) return "cpu";
  return index < 0 ? std::string("cuda") : fmt::format("cuda:{}", index);
}

Result<Device> parse_device(std::string_view text, std::string_view flag) {
  if (text == "cpu") return Device{};
  if (text == "cuda") return Device{DeviceKind::kCuda, -1};
  constexpr std::string_view kPrefix = "cuda:";
  if (text.starts_with(kPrefix)) {
    const std::string_view digits = text.substr(kPrefix.size());
    int index = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0 && index < 1024) {
      return Device{DeviceKind::kCuda, index};
    }
  }
  return make_error(ErrorKind::kUsage, "{} '{}': expected cpu, cuda or cuda:N", flag, text);
}

Device device_for_rank(const Device& device, int local_rank) {
  if (!device.is_cuda() || device.index >= 0) return device;
  const int local = std::max(0, local_rank);
  int count = 1;
#if CFMO_HAVE_CUDA
  count = std::max(1, cuda::device_count());
#endif
  return Device{DeviceKind::kCuda, local % count};
}

bool cuda_built() { return CFMO_HAVE_CUDA != 0; }

Status check_device(const Device& device, std::string_view flag) {
  if (!device.is_cuda()) return {};
#if CFMO_HAVE_CUDA
  return cuda::check_device(device.index < 0 ? 0 : device.index, flag, device.to_string());
#else
  return make_error(ErrorKind::kUsage,
                    "{} {}: no CUDA device: this build has no CUDA backend (configure with meson -Dcuda=enabled "
                    "where the CUDA toolkit is installed)",
                    flag, device.to_string());
#endif
}

std::string device_description(const Device& device) {
  if (!device.is_cuda()) return "cpu";
#if CFMO_HAVE_CUDA
  return cuda::describe_device(device.index < 0 ? 0 : device.index);
#else
  return device.to_string();
#endif
}

}  // namespace cfmo
