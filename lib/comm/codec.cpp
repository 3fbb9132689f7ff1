#include "comm/codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace cfmo::comm {
namespace {

constexpr size_t kInt8Chunk = 256;

uint16_t to_bf16(float value) {
  const auto bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stay a NaN
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float from_bf16(uint16_t half) { return std::bit_cast<float>(static_cast<uint32_t>(half) << 16); }

template <typename T>
void append(std::vector<std::byte>& out, const T& value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

}  // namespace

Result<WireDtype> parse_wire_dtype(const std::string& text) {
  if (text == "fp32") return WireDtype::kFp32;
  if (text == "bf16") return WireDtype::kBf16;
  if (text == "int8") return WireDtype::kInt8;
  return make_error(ErrorKind::kUsage, "--delta-dtype '{}': expected fp32, bf16 or int8", text);
}

std::string_view to_string(WireDtype dtype) {
  switch (dtype) {
    case WireDtype::kFp32:
      return "fp32";
    case WireDtype::kBf16:
      return "bf16";
    case WireDtype::kInt8:
      return "int8";
  }
  return "?";
}

size_t encoded_size(WireDtype dtype, size_t count) {
  switch (dtype) {
    case WireDtype::kFp32:
      return count * 4;
    case WireDtype::kBf16:
      return count * 2;
    case WireDtype::kInt8:
      return count + (count + kInt8Chunk - 1) / kInt8Chunk * 4;
  }
  return 0;
}

void encode_floats(WireDtype dtype, std::span<const float> values, std::span<float> residual,
                   std::vector<std::byte>& out) {
  const bool feedback = residual.size() == values.size();
  auto with_feedback = [&](size_t i) { return feedback ? values[i] + residual[i] : values[i]; };
  out.reserve(out.size() + encoded_size(dtype, values.size()));
  switch (dtype) {
    case WireDtype::kFp32: {
      const size_t at = out.size();
      out.resize(at + values.size_bytes());
      if (!values.empty()) std::memcpy(out.data() + at, values.data(), values.size_bytes());
      if (feedback) std::fill(residual.begin(), residual.end(), 0.0f);
      return;
    }
    case WireDtype::kBf16:
      for (size_t i = 0; i < values.size(); ++i) {
        const float x = with_feedback(i);
        const uint16_t h = to_bf16(x);
        append(out, h);
        if (feedback) residual[i] = x - from_bf16(h);
      }
      return;
    case WireDtype::kInt8:
      for (size_t first = 0; first < values.size(); first += kInt8Chunk) {
        const size_t last = std::min(values.size(), first + kInt8Chunk);
        float max_abs = 0;
        for (size_t i = first; i < last; ++i) max_abs = std::max(max_abs, std::fabs(with_feedback(i)));
        const float scale = max_abs > 0 && std::isfinite(max_abs) ? max_abs / 127.0f : 0.0f;
        append(out, scale);
        for (size_t i = first; i < last; ++i) {
          const float x = with_feedback(i);
          const float q = scale > 0 ? std::clamp(std::nearbyint(x / scale), -127.0f, 127.0f) : 0.0f;
          append(out, static_cast<int8_t>(q));
          if (feedback) residual[i] = x - q * scale;
        }
      }
      return;
  }
}

Status decode_floats(WireDtype dtype, std::span<const std::byte>& in, std::span<float> out) {
  const size_t need = encoded_size(dtype, out.size());
  if (in.size() < need) {
    return make_error(ErrorKind::kPeer, "a {} message is {} bytes short", to_string(dtype), need - in.size());
  }
  switch (dtype) {
    case WireDtype::kFp32:
      std::memcpy(out.data(), in.data(), out.size_bytes());
      break;
    case WireDtype::kBf16:
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t h = 0;
        std::memcpy(&h, in.data() + 2 * i, 2);
        out[i] = from_bf16(h);
      }
      break;
    case WireDtype::kInt8: {
      const std::byte* p = in.data();
      for (size_t first = 0; first < out.size(); first += kInt8Chunk) {
        const size_t last = std::min(out.size(), first + kInt8Chunk);
        float scale = 0;
        std::memcpy(&scale, p, 4);
        p += 4;
        for (size_t i = first; i < last; ++i) out[i] = static_cast<float>(static_cast<int8_t>(*p++)) * scale;
      }
      break;
    }
  }
  in = in.subspan(need);
  return {};
}

}  // namespace cfmo::comm
