// libFuzzer target: the safetensors reader (used for --base/--against) must
// turn any bytes into a file or an input error, never a crash.
#include "ckpt/safetensors.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cfmo::ckpt::SafetensorsLimits limits;
  limits.max_header_bytes = size_t{1} << 20;
  auto file =
      cfmo::ckpt::SafetensorsFile::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz.st", limits);
  if (!file) {
    if (file.error().kind != cfmo::ErrorKind::kInput) std::abort();
    return 0;
  }
  for (const auto& entry : file->tensors()) {
    const auto bytes = file->bytes(entry);
    if (bytes.size() != entry.end - entry.begin) std::abort();
    if (entry.dtype == "F32" && entry.elements() <= (int64_t{1} << 16)) {
      std::vector<float> out(static_cast<size_t>(entry.elements()));
      if (!file->read_f32(entry.name, entry.shape, out)) std::abort();
    }
  }
  return 0;
}
