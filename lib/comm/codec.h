#pragma once
/// How float vectors travel: fp32 as they are, bf16 (round to nearest even),
/// or int8 with one fp32 scale per chunk of 256 values. Lossy encodings keep
/// an error-feedback residual so what one message rounds away the next one
/// carries (the residual is the caller's, one per stream).

#include "core/error.h"

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace cfmo::comm {

enum class WireDtype : uint8_t { kFp32 = 0, kBf16 = 1, kInt8 = 2 };

Result<WireDtype> parse_wire_dtype(const std::string& text);
std::string_view to_string(WireDtype dtype);

/// Appends the encoding of `values` (+ `residual`, which is updated) to `out`.
/// `residual` may be empty for fp32 (no error to feed back).
void encode_floats(WireDtype dtype, std::span<const float> values, std::span<float> residual,
                   std::vector<std::byte>& out);

/// Decodes `count` values from `in` (advanced past them) into `out`.
Status decode_floats(WireDtype dtype, std::span<const std::byte>& in, std::span<float> out);

/// Bytes that encode_floats appends for `count` values.
size_t encoded_size(WireDtype dtype, size_t count);

}  // namespace cfmo::comm
