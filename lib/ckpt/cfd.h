#pragma once
/// The .cfd delta container: one worker's parameter delta (local - base) for
/// one round, as cfmo-train writes it to RUN/deltas/rank-K/round-RRRRRR.cfd.
///
///   bytes 0..31   prelude: magic, version, flags, header length, header checksum
///   then          the header: JSON with the file's rank, round, step and base
///                 version and, per tensor, name, shape, codec, transform,
///                 frames with their checksums, and precomputed statistics
///   then          the data section: each tensor's zstd frames, 64-byte aligned
///
/// Each tensor is cut into chunks, each its own zstd frame with its own
/// checksum, so tensors and chunks decode independently and in parallel. The
/// header's statistics answer "how far did this worker drift" without
/// decompressing anything. docs/FORMATS.md specifies the bytes.

#include "ckpt/delta_stats.h"
#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::ckpt {

/// How a chunk's floats become the bytes zstd compresses.
enum class CfdTransform {
  kNone,           ///< "none": the float32 values as they are, little-endian
  kBytePlanes,     ///< "byteplanes": byte 3 of every value, then byte 2, 1, 0
  kGroupedPlanes,  ///< "grouped-planes": exponents, then sign+mantissa planes grouped by exponent (the default)
};

enum class CfdCodec {
  kNone,  ///< "none": the transformed bytes stored as they are
  kZstd,  ///< "zstd": one zstd frame per chunk
};

std::string_view to_string(CfdTransform transform);
std::string_view to_string(CfdCodec codec);
/// Parses "none", "byteplanes", "grouped-planes" / "none", "zstd"; usage errors otherwise.
Result<CfdTransform> parse_cfd_transform(std::string_view text);
Result<CfdCodec> parse_cfd_codec(std::string_view text);

/// One tensor to write; `delta` is local - base, element for element.
struct CfdTensorInput {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> base;
  std::span<const float> delta;
};

struct CfdFileInfo {
  int rank = 0;
  int64_t round = 0;
  int64_t step = 0;
  int64_t base_version = 0;
  std::map<std::string, std::string> metadata;  ///< free-form strings, kept as written
};

struct CfdWriteOptions {
  CfdCodec codec = CfdCodec::kZstd;
  CfdTransform transform = CfdTransform::kGroupedPlanes;  ///< smallest on real deltas (bench/RESULTS.md)
  int zstd_level = 3;
  int threads = 1;                            ///< compress chunks on this many threads; 0: all cores
  int64_t chunk_elements = int64_t{1} << 20;  ///< values per zstd frame (4 MiB of float32)
};

/// Where a run directory keeps rank `rank`'s delta of round `round`:
/// RUN/deltas/rank-K/round-RRRRRR.cfd, the round zero-padded to six digits.
/// The trainer writes there and cfmo-diverge reads there.
std::filesystem::path delta_path(const std::filesystem::path& run_dir, int rank, int64_t round);

/// Writes atomically (temp file, fsync, rename) into an existing directory. Computes every tensor's
/// statistics and each frame's checksum. Inputs that do not fit together
/// (sizes against shapes, repeated names) are internal errors, as are
/// failures to write.
Status write_cfd(const std::filesystem::path& path, const CfdFileInfo& info, std::span<const CfdTensorInput> tensors,
                 const CfdWriteOptions& options = {});

/// Bounds a reader enforces before it allocates.
struct CfdLimits {
  uint64_t max_header_bytes = uint64_t{100} << 20;
  /// 64 MiB of float32 per frame: a reader thread holds a frame twice (stored and decoded).
  int64_t max_chunk_elements = int64_t{1} << 24;
};

/// One frame: the stored bytes and the XXH3-64 checksum of its content (the
/// transformed bytes, which is what zstd decompresses to).
struct CfdChunk {
  std::string stored;
  uint64_t checksum = 0;
};

/// Chunk-level coding, public for benchmarks and tests: `values` become one
/// frame, and back. Decoding checks the frame's size, that it is one complete
/// zstd frame, and the checksum; `source` names the frame in errors.
Result<CfdChunk> cfd_encode_chunk(std::span<const float> values, CfdCodec codec, CfdTransform transform,
                                  int zstd_level);
Status cfd_decode_chunk(std::span<const std::byte> stored, CfdCodec codec, CfdTransform transform, uint64_t checksum,
                        std::span<float> out, const std::string& source);
/// Decodes and reduces (delta_only_stats) `elements` values without undoing
/// the transform's ordering: the fast path of reading and reducing.
Result<DeltaStats> cfd_reduce_chunk(std::span<const std::byte> stored, CfdCodec codec, CfdTransform transform,
                                    uint64_t checksum, size_t elements, const std::string& source);

/// A .cfd file whose header has been read and validated; payloads are read
/// on demand, from any thread.
class CfdFile {
 public:
  struct Frame {
    uint64_t offset = 0;  ///< into the file
    uint64_t size = 0;    ///< stored bytes
    int64_t first = 0;    ///< index of the frame's first value in the tensor
    int64_t elements = 0;
    uint64_t checksum = 0;  ///< XXH3-64 of the frame's content (the transformed bytes)
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    int64_t elements = 0;
    uint64_t offset = 0;  ///< into the file
    uint64_t size = 0;    ///< stored bytes of all frames
    CfdCodec codec = CfdCodec::kZstd;
    CfdTransform transform = CfdTransform::kGroupedPlanes;
    int64_t chunk_elements = 0;
    std::vector<Frame> frames;
    DeltaStats stats;  ///< as the writer computed them
  };

  /// Reads and validates the prelude and header only.
  static Result<CfdFile> open(const std::filesystem::path& path, const CfdLimits& limits = {});
  /// The same over bytes in memory; `source` names them in errors.
  static Result<CfdFile> parse(std::string bytes, const std::string& source, const CfdLimits& limits = {});

  CfdFile(CfdFile&&) noexcept;
  CfdFile& operator=(CfdFile&&) noexcept;
  ~CfdFile();

  const std::string& source() const { return source_; }
  const CfdFileInfo& info() const { return info_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor* find(std::string_view name) const;
  uint64_t file_size() const { return file_size_; }

  /// Decodes one frame into `out` (frame.elements values) and verifies its checksum.
  Status decode_frame(const Tensor& tensor, size_t frame, std::span<float> out) const;
  /// Decodes a whole tensor into `out` (tensor.elements values).
  Status decode(const Tensor& tensor, std::span<float> out) const;
  /// Decodes one frame, verifies its checksum and reduces it
  /// (delta_only_stats, in storage order) without keeping the values.
  Result<DeltaStats> reduce_frame(const Tensor& tensor, size_t frame) const;
  /// Every frame of a tensor reduced, merged in order and compared with the
  /// header's statistics (check_reduced); returns the header's statistics.
  Result<DeltaStats> verify(const Tensor& tensor, int threads = 1) const;
  /// Checks recomputed delta fields against the header's: the count and
  /// maximum exactly, the sum of squares to a relative 1e-9 (the reduction's
  /// order may differ from the writer's). A mismatch is an input error.
  Status check_reduced(const Tensor& tensor, const DeltaStats& reduced) const;

 private:
  struct Storage;
  CfdFile();
  static Result<CfdFile> load(std::unique_ptr<Storage> storage, uint64_t file_size, std::string source,
                              const CfdLimits& limits);
  Status read_at(uint64_t offset, std::span<std::byte> out, const Tensor& tensor, size_t frame) const;
  Result<std::span<const std::byte>> stored_frame(const Tensor& tensor, size_t frame) const;

  std::string source_;
  std::unique_ptr<Storage> storage_;
  uint64_t file_size_ = 0;
  CfdFileInfo info_;
  std::vector<Tensor> tensors_;
  CfdLimits limits_;
};

}  // namespace cfmo::ckpt
