#pragma once
/// safetensors files (https://huggingface.co/docs/safetensors): an 8-byte
/// little-endian header length, a JSON header mapping each tensor name to
/// {dtype, shape, data_offsets} plus optional "__metadata__" strings, then the
/// tensor bytes, contiguous, with no holes or overlaps. What cfmo writes loads
/// in PyTorch with safetensors.torch.load_file as it is.

#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace cfmo::ckpt {

/// A tensor to write: bytes in the dtype's little-endian layout.
struct TensorRef {
  std::string name;
  std::string dtype;  ///< "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
};

/// Returns the byte width of a safetensors dtype, or 0 when unknown.
size_t dtype_size(std::string_view dtype);

/// Writes atomically (temp file, fsync, rename).
Status write_safetensors(const std::filesystem::path& path, std::span<const TensorRef> tensors,
                         const std::map<std::string, std::string>& metadata = {});

/// Bounds on what a reader accepts before it allocates.
struct SafetensorsLimits {
  size_t max_header_bytes = size_t{100} << 20;  ///< as the reference implementation
};

/// A file read whole and validated; tensors() are in file order.
class SafetensorsFile {
 public:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    size_t begin = 0;  ///< into the data section
    size_t end = 0;
    int64_t elements() const;
  };

  static Result<SafetensorsFile> read(const std::filesystem::path& path, SafetensorsLimits limits = {});
  /// Parses bytes already in memory; `source` names them in errors.
  static Result<SafetensorsFile> parse(std::string bytes, const std::string& source, SafetensorsLimits limits = {});

  const std::vector<Entry>& tensors() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const Entry* find(std::string_view name) const;
  std::span<const std::byte> bytes(const Entry& entry) const;
  /// Copies an F32 tensor into `out`; errors name the file and tensor on a
  /// missing name, another dtype or a different shape.
  Status read_f32(std::string_view name, const std::vector<int64_t>& shape, std::span<float> out) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::string contents_;
  size_t data_start_ = 0;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace cfmo::ckpt
