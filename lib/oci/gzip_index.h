#pragma once
/// A seekable index of one layer (`cfmo-pull index`; the format is in
/// docs/FORMATS.md), made by reading the layer once and leaving it as it is:
/// the tar's file table (path, type, mode, owner, size, link target, and
/// where a file's contents start in the uncompressed stream, whiteouts
/// marked), and, for a gzip layer, inflate checkpoints every `span` bytes of
/// output as zlib's zran example makes them (the compressed offset, the bits
/// of the byte before it that belong to the next deflate block, and the 32
/// KiB of output before it, deflated), each with the SHA-256 of the
/// compressed span up to the next checkpoint, so that a span fetched on its
/// own is verified on its own. A file's bytes are inflated from the nearest
/// checkpoint before them (inflatePrime and inflateSetDictionary), crossing
/// gzip member boundaries. An uncompressed tar is indexed by its own offsets
/// (checkpoints without windows). A zstd layer is indexed by its own frames:
/// each frame decodes on its own, so a checkpoint is a frame's start (the
/// first after `span` bytes of output), again without a window; a layer of
/// one frame has a single checkpoint, and is not lazily loadable (a span
/// would be the whole layer): it is fetched whole, then read from its start
/// (LayerStream).

#include "core/error.h"
#include "oci/manifest.h"
#include "oci/registry.h"

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::oci {

inline constexpr uint64_t kDefaultIndexSpan = uint64_t{4} << 20;
inline constexpr const char* kIndexDir = "cfmo-index";

enum class IndexedCompression : uint8_t { kNone = 0, kGzip = 1, kZstd = 2 };
enum class IndexWhiteout : uint8_t { kNone = 0, kFile = 1, kOpaque = 2 };

struct IndexEntry {
  std::string path;  ///< as in the tar, without a leading "./" or a trailing "/"
  /// The tar typeflag: '0' file, '1' hard link, '2' symlink, '3' character
  /// device, '4' block device, '5' directory, '6' FIFO.
  char type = '0';
  uint32_t mode = 0;  ///< permission bits (07777)
  uint64_t uid = 0;
  uint64_t gid = 0;
  uint64_t size = 0;    ///< a regular file's size
  uint64_t offset = 0;  ///< where its contents start in the uncompressed stream
  int64_t mtime = 0;    ///< modification time, whole seconds since the epoch (pax mtime's, else the header's)
  std::string link;     ///< a symlink's or hard link's target
  IndexWhiteout whiteout = IndexWhiteout::kNone;
  bool sparse = false;  ///< a GNU sparse file: its contents are not one range (read the layer whole)
};

struct IndexCheckpoint {
  uint64_t out = 0;    ///< offset in the uncompressed stream
  uint64_t in = 0;     ///< offset of the first compressed byte to feed from here
  uint8_t bits = 0;    ///< bits (0-7) of the byte before `in` that belong after the checkpoint
  uint8_t byte = 0;    ///< that byte, so the span before is not needed
  std::string window;  ///< the (up to) 32 KiB of output before `out`, zlib-compressed; empty for kNone
  std::array<uint8_t, 32> span_sha256{};  ///< of compressed [in, the next checkpoint's in, or the layer's end)
};

struct LayerIndex {
  IndexedCompression compression = IndexedCompression::kGzip;
  uint64_t span = kDefaultIndexSpan;
  std::string layer_digest;
  uint64_t compressed_size = 0;
  uint64_t uncompressed_size = 0;
  uint32_t members = 0;  ///< gzip members (1 for most layers; several for concatenated streams), or zstd frames
  std::vector<IndexCheckpoint> checkpoints;
  std::vector<IndexEntry> entries;

  /// The entry of that path (the last one, as a tar's later entries win), or null.
  const IndexEntry* find(std::string_view path) const;
  /// The checkpoints [first, last] whose spans hold uncompressed [offset, offset + length).
  std::pair<size_t, size_t> spans_for(uint64_t offset, uint64_t length) const;
  /// Checkpoint k's span in the compressed layer: [begin, end).
  std::pair<uint64_t, uint64_t> span_range(size_t k) const;
  /// Whether a read needs only the spans that hold it: false for a zstd
  /// layer of one frame larger than one span (its one span is the layer).
  bool lazily_loadable() const;
};

/// A layer's compressed bytes in order, from its first: the next up to
/// `size` into `buffer`, 0 at its end. A file, or a download as it arrives
/// (index_sink.h).
class LayerBytes {
 public:
  virtual ~LayerBytes() = default;
  virtual Result<size_t> read(unsigned char* buffer, size_t size) = 0;
};

/// Reads the layer's bytes once and indexes them; fewer or more than the
/// layer's size is kInput.
Result<LayerIndex> build_layer_index(LayerBytes& bytes, const Descriptor& layer, uint64_t span,
                                     const std::string& what);

/// Reads the layer blob at `blob` once and indexes it. A tar the index
/// cannot describe, or a stream that does not decode, is kInput naming it;
/// `span` below 64 KiB is kUsage.
Result<LayerIndex> build_layer_index(const std::filesystem::path& blob, const Descriptor& layer, uint64_t span,
                                     const std::string& what);

/// The index as bytes, and back; a damaged, truncated or foreign file is kInput naming `what`.
std::string serialize_index(const LayerIndex& index);
/// serialize_index(index).size(), without making it.
uint64_t serialized_size(const LayerIndex& index);
Result<LayerIndex> parse_index(std::string_view bytes, const std::string& what);
Result<LayerIndex> read_index(const std::filesystem::path& path);
/// The layer an index is of, from its header alone (the rest is checked
/// when it is parsed): for bytes whose digest was checked already, as an
/// index fetched from the registry, which the lazy mount parses anyway.
Result<std::string> index_layer_digest(std::string_view bytes, const std::string& what);

/// Where the index of `digest` lives in a pull's directory: DIR/cfmo-index/<hex>.
std::filesystem::path index_path(const std::filesystem::path& dir, const std::string& digest);

/// The compressed layer's bytes by offset: a local blob, or ranges fetched from a registry.
class CompressedSource {
 public:
  virtual ~CompressedSource() = default;
  virtual Result<std::string> read(uint64_t offset, uint64_t length) = 0;
};

/// A local file.
class FileSource : public CompressedSource {
 public:
  explicit FileSource(std::filesystem::path path) : path_(std::move(path)) {}
  ~FileSource() override;
  Result<std::string> read(uint64_t offset, uint64_t length) override;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

/// Ranges of the layer blob fetched from its registry with HTTP Range
/// requests (one a read, retried as the client retries), for a layer that
/// is not on disk; read_range checks each span against its digest. A
/// registry that answers a Range request with the whole blob (200) is
/// kPeer, said as such: a caller can fetch the layer whole instead.
class RegistrySource : public CompressedSource {
 public:
  RegistrySource(RegistryApi& client, std::string digest, std::string what)
      : client_(client), digest_(std::move(digest)), what_(std::move(what)) {}
  Result<std::string> read(uint64_t offset, uint64_t length) override;
  uint64_t bytes_fetched() const { return fetched_; }
  int requests() const { return requests_; }
  /// The registry answered a Range request with the whole blob.
  bool ranges_refused() const { return ranges_refused_; }

 private:
  RegistryApi& client_;
  std::string digest_;
  std::string what_;
  uint64_t fetched_ = 0;
  int requests_ = 0;
  bool ranges_refused_ = false;
};

/// Uncompressed bytes [offset, offset + length) of the layer, inflated from
/// the nearest checkpoint before them; each span is checked against its
/// SHA-256 before it is used (a mismatch is kInput naming the span).
Result<std::string> read_range(const LayerIndex& index, CompressedSource& source, uint64_t offset, uint64_t length,
                               const std::string& what);

/// The uncompressed stream of a layer read from its start, for a layer that
/// is not lazily loadable (one zstd frame), once its blob is local: the
/// blob's digest was checked when it was fetched, so its spans are not
/// checked again. Holds one input chunk and the codec's window.
class LayerStream {
 public:
  LayerStream(const LayerIndex& index, CompressedSource& source, std::string what);
  ~LayerStream();
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;
  /// The next up to `length` bytes (fewer only at the layer's end).
  Result<std::string> read(uint64_t length);
  uint64_t position() const { return position_; }

 private:
  struct Codec;
  std::unique_ptr<Codec> codec_;
  CompressedSource& source_;
  std::string what_;
  uint64_t compressed_size_ = 0;
  uint64_t uncompressed_size_ = 0;
  uint64_t position_ = 0;  ///< uncompressed bytes handed out
  uint64_t fed_ = 0;       ///< compressed bytes read from the source
};

/// A regular file's contents (a hard link: its target's).
Result<std::string> read_entry(const LayerIndex& index, CompressedSource& source, const IndexEntry& entry,
                               const std::string& what);

/// One layer of `index_pull`'s work.
struct LayerIndexReport {
  size_t layer = 0;
  std::string digest;
  std::string media_type;
  bool indexed = false;
  std::string note;  ///< why not (not fetched), or why a lazy mount fetches it whole (one zstd frame)
  std::filesystem::path path;
  size_t entries = 0;
  size_t checkpoints = 0;
  uint32_t members = 0;
  uint64_t uncompressed_size = 0;
  uint64_t index_bytes = 0;
};

/// Indexes every fetched layer of the pull in `dir` into DIR/cfmo-index/;
/// the others are reported with the reason.
Result<std::vector<LayerIndexReport>> index_pull(const std::filesystem::path& dir, uint64_t span);

/// The indexes `index_pull` made for the pull in `dir`, with their layer
/// numbers; a fetched layer without one is kInput.
Result<std::vector<std::pair<size_t, LayerIndex>>> read_pull_indexes(const std::filesystem::path& dir);

/// Why a layer whose index is not lazily_loadable() is fetched whole, in a few words.
std::string not_lazily_loadable(const LayerIndex& index);

/// "file", "hardlink", "symlink", "char", "block", "dir", "fifo".
const char* entry_type_name(char type);

}  // namespace cfmo::oci
