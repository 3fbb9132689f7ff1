// libFuzzer target: the .cfd reader must turn any bytes into a file or an
// input error, never a crash, a hang or an unbounded allocation; a file it
// accepts must decode, reduce and verify (or fail with an input error).
#include "ckpt/cfd.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cfmo::ckpt::CfdLimits limits;
  limits.max_header_bytes = size_t{1} << 20;
  limits.max_chunk_elements = int64_t{1} << 16;  // bounds each frame's buffers
  auto file = cfmo::ckpt::CfdFile::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz.cfd", limits);
  if (!file) {
    if (file.error().kind != cfmo::ErrorKind::kInput) std::abort();
    return 0;
  }
  size_t frames_read = 0;
  for (const auto& tensor : file->tensors()) {
    for (size_t k = 0; k < tensor.frames.size() && frames_read < 256; ++k, ++frames_read) {
      std::vector<float> out(static_cast<size_t>(tensor.frames[k].elements));
      auto decoded = file->decode_frame(tensor, k, out);
      auto reduced = file->reduce_frame(tensor, k);
      if (decoded.has_value() != reduced.has_value()) std::abort();  // same bytes, same verdict
      if (!decoded && decoded.error().kind != cfmo::ErrorKind::kInput) std::abort();
    }
    if (tensor.frames.size() <= 16) (void)file->verify(tensor);
  }
  return 0;
}
