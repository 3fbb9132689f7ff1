#include "tensor/device.h"

#include <charconv>

namespace cfmo::tensor {

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

}  // namespace cfmo::tensor
