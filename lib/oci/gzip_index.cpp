// The layer index. The tar headers are walked here rather than through
// libarchive, which does not expose where an entry's contents start in the
// stream (libarchive#2295); only offsets and the metadata a mount needs are
// read, and libarchive remains the unpacker. Checkpoints follow zran.c:
// inflate with Z_BLOCK stops at every deflate block boundary, and a
// checkpoint is taken at one when `span` bytes of output have passed since
// the last. A zstd layer's checkpoints are frame starts, where a fresh
// decoder begins: zstd's streaming decoder stops at the end of each frame
// (it returns 0 there), which is where the next frame's bytes start.
#include "oci/gzip_index.h"

#include "core/atomic_file.h"
#include "oci/blob.h"
#include "oci/hot_set.h"
#include "oci/pull_state.h"
#include "oci/unpack.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

constexpr size_t kWindow = 32768;
constexpr uint64_t kBlock = 512;
constexpr uint64_t kMinSpan = 64 << 10;
constexpr size_t kExtensionLimit = 16 << 20;  ///< a pax or GNU long-name header larger than this is refused
constexpr char kMagic[8] = {'C', 'F', 'M', 'O', 'L', 'I', 'D', 'X'};
/// Version 2 added each entry's mtime; version 1 files are still read (their times are the epoch).
constexpr uint32_t kVersion = 2;
/// zstd's default window cap (128 MiB), as the unpacker has it: a frame asking for more is refused, not allocated.
constexpr int kZstdWindowLogMax = 27;
constexpr std::string_view kShortLayer = "not the layer's size";

uint64_t round_up(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

struct MdFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using Md = std::unique_ptr<EVP_MD_CTX, MdFree>;

Md sha256_start() {
  Md ctx(EVP_MD_CTX_new());
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  return ctx;
}

std::array<uint8_t, 32> sha256_end(EVP_MD_CTX* ctx) {
  std::array<uint8_t, 32> out{};
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx, out.data(), &length);
  return out;
}

std::array<uint8_t, 32> sha256_of(std::string_view data) {
  Md ctx = sha256_start();
  EVP_DigestUpdate(ctx.get(), data.data(), data.size());
  return sha256_end(ctx.get());
}

/// A tar header's number: octal (spaces and NULs around it), or GNU's base-256.
std::optional<uint64_t> tar_number(const char* field, size_t size) {
  const auto* p = reinterpret_cast<const unsigned char*>(field);
  if ((p[0] & 0x80) != 0) {
    if ((p[0] & 0x40) != 0) return std::nullopt;  // negative
    uint64_t value = p[0] & 0x3f;
    for (size_t i = 1; i < size; ++i) {
      if (value >> 56 != 0) return std::nullopt;
      value = value << 8 | p[i];
    }
    return value;
  }
  size_t i = 0;
  while (i < size && (field[i] == ' ' || field[i] == '\0')) ++i;
  uint64_t value = 0;
  bool any = false;
  for (; i < size && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (value >> 60 != 0) return std::nullopt;
    value = value * 8 + static_cast<uint64_t>(field[i] - '0');
    any = true;
  }
  for (; i < size; ++i) {
    if (field[i] != ' ' && field[i] != '\0') return std::nullopt;
  }
  if (!any) return 0;
  return value;
}

std::string tar_string(const char* field, size_t size) { return std::string(field, strnlen(field, size)); }

/// A pax value's number: decimal digits only.
std::optional<uint64_t> decimal(std::string_view text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  return value;
}

/// Walks the tar in the uncompressed stream as it is produced, recording each entry.
class TarWalker {
 public:
  TarWalker(std::vector<IndexEntry>& entries, const std::string& what) : entries_(entries), what_(what) {}

  Status feed(const unsigned char* data, size_t size) {
    while (size > 0) {
      if (state_ == State::kDone) {
        pos_ += size;
        return {};
      }
      size_t used = 0;
      if (state_ == State::kHeader) {
        used = std::min(size, static_cast<size_t>(kBlock) - header_.size());
        header_.append(reinterpret_cast<const char*>(data), used);
      } else {
        used = static_cast<size_t>(std::min<uint64_t>(size, skip_));
        if (state_ == State::kExtension) {
          const uint64_t want = extension_size_ - std::min<uint64_t>(extension_size_, extension_.size());
          extension_.append(reinterpret_cast<const char*>(data), std::min<uint64_t>(used, want));
        }
        skip_ -= used;
      }
      data += used;
      size -= used;
      pos_ += used;
      if (state_ == State::kHeader && header_.size() == kBlock) {
        CFMO_TRY(header());
      } else if (state_ == State::kExtension && skip_ == 0) {
        CFMO_TRY(extension());
      } else if (state_ == State::kData && skip_ == 0) {
        state_ = State::kHeader;
      }
    }
    return {};
  }

  /// The stream ended: at the end-of-archive block, or at least between entries.
  Status finish() const {
    if (state_ == State::kDone || (state_ == State::kHeader && header_.empty())) return {};
    return make_error(ErrorKind::kInput, "{}: the tar ends inside an entry (at byte {})", what_, pos_);
  }

 private:
  enum class State { kHeader, kExtension, kData, kDone };

  Error bad(const std::string& problem) const {
    return make_error(ErrorKind::kInput, "{}: tar header at byte {}: {}", what_, pos_ - kBlock, problem);
  }

  Status header() {
    const std::string block = std::move(header_);
    header_.clear();
    const char* h = block.data();
    if (std::all_of(block.begin(), block.end(), [](char c) { return c == '\0'; })) {
      state_ = State::kDone;  // the end-of-archive block
      return {};
    }
    uint64_t unsigned_sum = 0;
    int64_t signed_sum = 0;
    for (size_t i = 0; i < kBlock; ++i) {
      const char c = i >= 148 && i < 156 ? ' ' : h[i];
      unsigned_sum += static_cast<unsigned char>(c);
      signed_sum += static_cast<signed char>(c);
    }
    const auto checksum = tar_number(h + 148, 8);
    if (!checksum || (*checksum != unsigned_sum && static_cast<int64_t>(*checksum) != signed_sum)) {
      return bad("checksum mismatch (not a tar, or damaged)");
    }
    const auto size = tar_number(h + 124, 12);
    const auto mode = tar_number(h + 100, 8);
    const auto uid = tar_number(h + 108, 8);
    const auto gid = tar_number(h + 116, 8);
    // A time that is not a number is the epoch: a file's bytes do not depend on it.
    const uint64_t mtime = tar_number(h + 136, 12).value_or(0);
    if (!size || !mode || !uid || !gid) return bad("a number field is not a number");
    const char type = h[156];
    if (type == 'x' || type == 'g' || type == 'L' || type == 'K') {
      if (*size > kExtensionLimit) return bad(fmt::format("an extended header of {} bytes", *size));
      extension_type_ = type;
      extension_size_ = *size;
      extension_.clear();
      skip_ = round_up(*size);
      state_ = skip_ > 0 ? State::kExtension : State::kHeader;
      if (skip_ == 0) CFMO_TRY(extension());
      return {};
    }
    IndexEntry e;
    const bool ustar = std::string_view(h + 257, 6) == std::string_view("ustar\0", 6);
    std::string name = tar_string(h, 100);
    if (ustar && h[345] != '\0') name = tar_string(h + 345, 155) + "/" + name;
    e.path = pax("path").value_or(long_name_.empty() ? name : long_name_);
    e.link = pax("linkpath").value_or(long_link_.empty() ? tar_string(h + 157, 100) : long_link_);
    uint64_t data = *size;
    if (const auto s = pax("size")) {
      const auto parsed = decimal(*s);
      if (!parsed) return bad("pax size is not a number");
      data = *parsed;
    }
    e.mode = static_cast<uint32_t>(*mode & 07777);
    e.uid = *uid;
    e.gid = *gid;
    for (auto [key, field] : {std::pair{"uid", &e.uid}, std::pair{"gid", &e.gid}}) {
      if (const auto v = pax(key)) *field = decimal(*v).value_or(*field);
    }
    e.mtime = static_cast<int64_t>(mtime);
    if (const auto t = pax("mtime")) {
      // "1700000000.123": the whole seconds; a negative time is left as the header has it.
      e.mtime = static_cast<int64_t>(decimal(t->substr(0, t->find('.'))).value_or(mtime));
    }
    e.sparse = type == 'S' || pax("GNU.sparse.map") || pax("GNU.sparse.major") || pax("GNU.sparse.size");
    switch (type) {
      case '\0':
      case '0':
      case '7':
      case 'S':
        e.type = '0';
        break;
      case '1':
      case '2':
      case '3':
      case '4':
      case '5':
      case '6':
        e.type = type;
        if (type != '1') data = 0;  // only a hard link may carry data (pax)
        break;
      case 'D':  // a GNU dumpdir: a directory, its data a listing
        e.type = '5';
        break;
      default:
        e.type = 0;  // a volume label or other bookkeeping: skipped
    }
    pax_.clear();
    long_name_.clear();
    long_link_.clear();
    e.offset = pos_;  // the byte after the header
    e.size = e.type == '0' ? data : 0;
    while (e.path.starts_with("./")) e.path.erase(0, 2);
    while (e.path.ends_with('/')) e.path.pop_back();
    while (e.type == '1' && e.link.starts_with("./")) e.link.erase(0, 2);
    if (e.type != 0 && !e.path.empty() && e.path != ".") {
      const std::string_view base = std::string_view(e.path).substr(e.path.rfind('/') + 1);
      if (base == ".wh..wh..opq") {
        e.whiteout = IndexWhiteout::kOpaque;
      } else if (base.starts_with(".wh.") && !base.starts_with(".wh..wh.")) {
        e.whiteout = IndexWhiteout::kFile;
      }
      entries_.push_back(std::move(e));
    }
    skip_ = round_up(data);
    state_ = skip_ > 0 ? State::kData : State::kHeader;
    return {};
  }

  Status extension() {
    state_ = State::kHeader;
    if (extension_type_ == 'L' || extension_type_ == 'K') {
      (extension_type_ == 'L' ? long_name_ : long_link_) =
          extension_.substr(0, strnlen(extension_.data(), extension_.size()));
      return {};
    }
    auto& records = extension_type_ == 'g' ? global_ : pax_;
    // "LENGTH KEY=VALUE\n", LENGTH counting the whole record.
    size_t at = 0;
    while (at < extension_.size()) {
      const size_t space = extension_.find(' ', at);
      if (space == std::string::npos) return bad("a pax record without a length");
      const auto length = decimal(std::string_view(extension_).substr(at, space - at));
      if (!length || *length < space - at + 3 || at + *length > extension_.size() ||
          extension_[at + *length - 1] != '\n') {
        return bad("a malformed pax record");
      }
      const std::string record = extension_.substr(space + 1, at + *length - 1 - space - 1);
      const size_t eq = record.find('=');
      if (eq == std::string::npos) return bad("a pax record without '='");
      records[record.substr(0, eq)] = record.substr(eq + 1);
      at += *length;
    }
    return {};
  }

  std::optional<std::string> pax(const char* key) const {
    if (const auto it = pax_.find(key); it != pax_.end()) return it->second;
    if (const auto it = global_.find(key); it != global_.end()) return it->second;
    return std::nullopt;
  }

  std::vector<IndexEntry>& entries_;
  const std::string& what_;
  State state_ = State::kHeader;
  uint64_t pos_ = 0;  ///< stream offset of the next byte fed
  std::string header_;
  uint64_t skip_ = 0;  ///< bytes of data or extension (padded) still to come
  char extension_type_ = 0;
  uint64_t extension_size_ = 0;
  std::string extension_;
  std::map<std::string, std::string> pax_;
  std::map<std::string, std::string> global_;
  std::string long_name_;
  std::string long_link_;
};

struct Inflater {
  z_stream z{};
  bool open = false;
  ~Inflater() {
    if (open) inflateEnd(&z);
  }
};

std::string deflated(std::string_view data) {
  uLongf size = compressBound(static_cast<uLong>(data.size()));
  std::string out(size, '\0');
  compress2(reinterpret_cast<Bytef*>(out.data()), &size, reinterpret_cast<const Bytef*>(data.data()),
            static_cast<uLong>(data.size()), 6);
  out.resize(size);
  return out;
}

/// Reads the layer's bytes sequentially in chunks, hashing the compressed spans as checkpoints close them.
class BlobReader {
 public:
  explicit BlobReader(LayerBytes& source) : source_(source), chunk_(1 << 16) {}

  /// The next chunk; false at the end of the layer.
  Result<bool> refill() {
    hash_upto(chunk_start_ + chunk_size_);
    if (chunk_size_ > 0) prev_last_ = chunk_[chunk_size_ - 1];
    chunk_start_ += chunk_size_;
    CFMO_ASSIGN_OR_RETURN(chunk_size_, source_.read(chunk_.data(), chunk_.size()));
    return chunk_size_ > 0;
  }

  /// Hashes the consumed bytes up to `position` into the open span.
  void hash_upto(uint64_t position) {
    if (span_ && position > hashed_) {
      const uint64_t from = std::max(hashed_, chunk_start_);
      EVP_DigestUpdate(span_.get(), chunk_.data() + (from - chunk_start_), position - from);
    }
    hashed_ = std::max(hashed_, position);
  }

  /// Closes the open span at `position` (its SHA-256 returned) and opens the next there.
  std::optional<std::array<uint8_t, 32>> cut(uint64_t position) {
    std::optional<std::array<uint8_t, 32>> done;
    hash_upto(position);
    if (span_) done = sha256_end(span_.get());
    span_ = sha256_start();
    hashed_ = position;
    return done;
  }

  unsigned char byte_before(uint64_t position) const {
    return position > chunk_start_ ? chunk_[position - 1 - chunk_start_] : prev_last_;
  }

  unsigned char* data() { return chunk_.data(); }
  size_t size() const { return chunk_size_; }
  uint64_t start() const { return chunk_start_; }

 private:
  LayerBytes& source_;
  std::vector<unsigned char> chunk_;
  uint64_t chunk_start_ = 0;
  size_t chunk_size_ = 0;
  unsigned char prev_last_ = 0;
  uint64_t hashed_ = 0;
  Md span_;
};

Status index_gzip(BlobReader& blob, LayerIndex& index, TarWalker& walker, const std::string& what) {
  Inflater inf;
  if (inflateInit2(&inf.z, 15 + 16) != Z_OK) return make_error(ErrorKind::kInternal, "{}: zlib failed to start", what);
  inf.open = true;
  z_stream& z = inf.z;
  std::vector<unsigned char> window(kWindow);
  size_t written = 0;  ///< next write position in the circular window
  bool wrapped = false;
  uint64_t total_out = 0;
  bool member_ended = false;
  index.members = 1;
  z.next_out = window.data();
  z.avail_out = kWindow;
  while (true) {
    if (z.avail_in == 0) {
      CFMO_ASSIGN_OR_RETURN(const bool more, blob.refill());
      if (!more) {
        if (!member_ended) return make_error(ErrorKind::kInput, "{}: the gzip stream is truncated", what);
        break;
      }
      z.next_in = blob.data();
      z.avail_in = static_cast<uInt>(blob.size());
    }
    if (member_ended) {
      // Another member follows, or what is left is not gzip (padding): it is kept in the last span.
      if (z.avail_in < 2 || z.next_in[0] != 0x1f || z.next_in[1] != 0x8b) {
        while (true) {
          CFMO_ASSIGN_OR_RETURN(const bool more, blob.refill());
          if (!more) break;
        }
        break;
      }
      inflateReset(&z);
      member_ended = false;
      ++index.members;
    }
    if (z.avail_out == 0) {
      z.next_out = window.data();
      z.avail_out = kWindow;
      written = 0;
      wrapped = true;
    }
    unsigned char* before = z.next_out;
    const int rc = inflate(&z, Z_BLOCK);
    const size_t produced = static_cast<size_t>(z.next_out - before);
    written += produced;
    total_out += produced;
    CFMO_TRY(walker.feed(before, produced));
    if (rc == Z_STREAM_END) {
      member_ended = true;
      continue;
    }
    if (rc != Z_OK && rc != Z_BUF_ERROR) {
      return make_error(ErrorKind::kInput, "{}: not a valid gzip stream ({})", what,
                        z.msg != nullptr ? z.msg : "inflate failed");
    }
    if ((z.data_type & 128) != 0 && (z.data_type & 64) == 0 &&
        (index.checkpoints.empty() || total_out - index.checkpoints.back().out >= index.span)) {
      IndexCheckpoint c;
      c.out = total_out;
      c.in = blob.start() + (blob.size() - z.avail_in);
      c.bits = static_cast<uint8_t>(z.data_type & 7);
      c.byte = c.bits != 0 ? blob.byte_before(c.in) : 0;
      std::string last(reinterpret_cast<const char*>(window.data()) + written, wrapped ? kWindow - written : 0);
      last.append(reinterpret_cast<const char*>(window.data()), written);
      c.window = deflated(last);
      if (auto closed = blob.cut(c.in); closed && !index.checkpoints.empty())
        index.checkpoints.back().span_sha256 = *closed;
      index.checkpoints.push_back(std::move(c));
    }
  }
  if (auto closed = blob.cut(blob.start() + blob.size()); closed && !index.checkpoints.empty()) {
    index.checkpoints.back().span_sha256 = *closed;
  }
  index.uncompressed_size = total_out;
  return {};
}

Status index_plain(BlobReader& blob, LayerIndex& index, TarWalker& walker) {
  uint64_t total = 0;
  while (true) {
    CFMO_ASSIGN_OR_RETURN(const bool more, blob.refill());
    if (!more) break;
    size_t at = 0;
    while (at < blob.size()) {
      // A checkpoint every `span` bytes: the stream is its own offsets.
      if (total % index.span == 0) {
        IndexCheckpoint c;
        c.out = total;
        c.in = total;
        if (auto closed = blob.cut(total); closed && !index.checkpoints.empty())
          index.checkpoints.back().span_sha256 = *closed;
        index.checkpoints.push_back(std::move(c));
      }
      const size_t n = static_cast<size_t>(std::min<uint64_t>(blob.size() - at, index.span - total % index.span));
      CFMO_TRY(walker.feed(blob.data() + at, n));
      at += n;
      total += n;
    }
  }
  if (auto closed = blob.cut(total); closed && !index.checkpoints.empty())
    index.checkpoints.back().span_sha256 = *closed;
  index.uncompressed_size = total;
  return {};
}

struct ZstdFree {
  void operator()(ZSTD_DCtx* ctx) const { ZSTD_freeDCtx(ctx); }
};
using ZstdDecoder = std::unique_ptr<ZSTD_DCtx, ZstdFree>;

ZstdDecoder zstd_decoder() {
  ZstdDecoder d(ZSTD_createDCtx());
  if (d) ZSTD_DCtx_setParameter(d.get(), ZSTD_d_windowLogMax, kZstdWindowLogMax);
  return d;
}

Status index_zstd(BlobReader& blob, LayerIndex& index, TarWalker& walker, const std::string& what) {
  ZstdDecoder d = zstd_decoder();
  if (!d) return make_error(ErrorKind::kInternal, "{}: zstd failed to start", what);
  std::vector<unsigned char> out(ZSTD_DStreamOutSize());
  ZSTD_inBuffer in{nullptr, 0, 0};
  uint64_t total_out = 0;
  size_t rc = 1;  ///< ZSTD_decompressStream's last answer: 0 at a frame's end
  // A frame's end becomes a checkpoint only once more input is known to follow it.
  bool boundary = false;
  uint64_t boundary_in = 0;
  uint64_t boundary_out = 0;
  IndexCheckpoint first;  // the first frame starts at the layer's first byte
  blob.cut(0);
  index.checkpoints.push_back(std::move(first));
  index.members = 0;
  bool full = false;  ///< the last call filled the output: call again before asking for input
  while (true) {
    if (in.pos == in.size && !full) {
      CFMO_ASSIGN_OR_RETURN(const bool more, blob.refill());
      if (!more) break;
      in = {blob.data(), blob.size(), 0};
    }
    if (boundary && boundary_out - index.checkpoints.back().out >= index.span) {
      IndexCheckpoint c;
      c.in = boundary_in;
      c.out = boundary_out;
      if (auto closed = blob.cut(c.in)) index.checkpoints.back().span_sha256 = *closed;
      index.checkpoints.push_back(std::move(c));
    }
    boundary = false;
    ZSTD_outBuffer o{out.data(), out.size(), 0};
    rc = ZSTD_decompressStream(d.get(), &o, &in);
    if (ZSTD_isError(rc)) {
      return make_error(ErrorKind::kInput, "{}: not a valid zstd stream ({}, at compressed byte {})", what,
                        ZSTD_getErrorName(rc), blob.start() + in.pos);
    }
    full = rc != 0 && o.pos == o.size;  // 0: the frame is done and flushed
    total_out += o.pos;
    CFMO_TRY(walker.feed(out.data(), o.pos));
    if (rc == 0) {
      ++index.members;
      boundary = true;
      boundary_in = blob.start() + in.pos;
      boundary_out = total_out;
    }
  }
  if (rc != 0) return make_error(ErrorKind::kInput, "{}: the zstd stream is truncated", what);
  if (auto closed = blob.cut(blob.start() + blob.size())) index.checkpoints.back().span_sha256 = *closed;
  index.uncompressed_size = total_out;
  return {};
}

/// Little-endian fields, appended; or, with `counting`, only their size counted.
class Writer {
 public:
  explicit Writer(bool counting = false) : counting_(counting) {}
  void u8(uint8_t v) {
    ++size;
    if (!counting_) out.push_back(static_cast<char>(v));
  }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void raw(std::string_view s) {
    size += s.size();
    if (!counting_) out.append(s);
  }
  void bytes(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    raw(s);
  }
  std::string out;
  uint64_t size = 0;

 private:
  bool counting_;
};

/// Little-endian fields, read with bounds checks; the first failure is kept.
class Reader {
 public:
  Reader(std::string_view data, const std::string& what) : data_(data), what_(what) {}
  bool take(size_t n) {
    if (failed_ || data_.size() - at_ < n) {
      failed_ = true;
      return false;
    }
    return true;
  }
  uint8_t u8() {
    if (!take(1)) return 0;
    return static_cast<uint8_t>(data_[at_++]);
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(u8()) << (8 * i);
    return v;
  }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(u8()) << (8 * i);
    return v;
  }
  std::string bytes(size_t limit) {
    const uint32_t n = u32();
    if (n > limit || !take(n)) {
      failed_ = true;
      return {};
    }
    std::string s(data_.substr(at_, n));
    at_ += n;
    return s;
  }
  bool failed() const { return failed_; }
  size_t left() const { return data_.size() - at_; }

 private:
  std::string_view data_;
  const std::string& what_;
  size_t at_ = 0;
  bool failed_ = false;
};

Error bad_index(const std::string& what, std::string_view problem) {
  return make_error(ErrorKind::kInput, "index '{}': {}", what, problem);
}

/// Appends what of `produced` bytes of output at uncompressed `position` falls in [offset, offset + length).
void keep(std::string& out, uint64_t position, const unsigned char* data, uint64_t produced, uint64_t offset,
          uint64_t length) {
  if (position + produced <= offset) return;
  const uint64_t from = position >= offset ? 0 : offset - position;
  const uint64_t take = std::min<uint64_t>(produced - from, length - out.size());
  out.append(reinterpret_cast<const char*>(data) + from, take);
}

/// Checks a span's bytes against the index before they are used.
Result<std::string> verified_span(const LayerIndex& index, CompressedSource& source, size_t k,
                                  const std::string& what) {
  const auto [begin, end] = index.span_range(k);
  CFMO_ASSIGN_OR_RETURN(std::string bytes, source.read(begin, end - begin));
  if (bytes.size() != end - begin) {
    return make_error(ErrorKind::kInput, "{}: span {} (bytes {}-{}): only {} bytes could be read", what, k, begin, end,
                      bytes.size());
  }
  if (sha256_of(bytes) != index.checkpoints[k].span_sha256) {
    return make_error(ErrorKind::kInput, "{}: span {} (bytes {}-{}): SHA-256 mismatch", what, k, begin, end);
  }
  return bytes;
}

}  // namespace

const IndexEntry* LayerIndex::find(std::string_view path) const {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->path == path) return &*it;
  }
  return nullptr;
}

std::pair<size_t, size_t> LayerIndex::spans_for(uint64_t offset, uint64_t length) const {
  auto after = [&](uint64_t position) {
    return static_cast<size_t>(std::upper_bound(checkpoints.begin(), checkpoints.end(), position,
                                                [](uint64_t p, const IndexCheckpoint& c) { return p < c.out; }) -
                               checkpoints.begin());
  };
  const size_t first = std::max<size_t>(after(offset), 1) - 1;
  // The output before checkpoint k comes from input before its `in` (its `byte` included): spans up to k - 1.
  const uint64_t end = offset + length;
  size_t last = first;
  while (last + 1 < checkpoints.size() && checkpoints[last + 1].out < end) ++last;
  return {first, last};
}

std::pair<uint64_t, uint64_t> LayerIndex::span_range(size_t k) const {
  return {checkpoints[k].in, k + 1 < checkpoints.size() ? checkpoints[k + 1].in : compressed_size};
}

bool LayerIndex::lazily_loadable() const {
  return compression != IndexedCompression::kZstd || checkpoints.size() > 1 || uncompressed_size <= span;
}

fs::path index_path(const fs::path& dir, const std::string& digest) {
  return dir / kIndexDir / digest.substr(std::string_view("sha256:").size());
}

FileSource::~FileSource() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::string> FileSource::read(uint64_t offset, uint64_t length) {
  if (fd_ < 0) fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) return make_error(ErrorKind::kInput, "'{}': cannot open: {}", path_.string(), std::strerror(errno));
  std::string out(length, '\0');
  size_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd_, out.data() + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return make_error(ErrorKind::kInput, "'{}': read failed: {}", path_.string(), std::strerror(errno));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

namespace {

/// The body of one Range request: exactly what was asked, and only as a 206.
class RangeSink : public BodySink {
 public:
  RangeSink(const std::string& what, uint64_t length) : what_(what), length_(length) {}
  Status begin(long status) override {
    refused = status == 200;
    if (status != 206) {
      return make_error(ErrorKind::kPeer,
                        "{}: the registry answered HTTP {} to a Range request: it does not serve parts of a blob "
                        "(fetch the layer whole)",
                        what_, status);
    }
    body.clear();
    body.reserve(length_);  // once: growing by doubling held twice the span at its end
    return {};
  }
  Status write(std::string_view chunk) override {
    if (body.size() + chunk.size() > length_) {
      return make_error(ErrorKind::kPeer, "{}: the registry sent more than the {} bytes asked for", what_, length_);
    }
    body.append(chunk);
    return {};
  }
  std::string body;
  bool refused = false;

 private:
  const std::string& what_;
  uint64_t length_;
};

}  // namespace

Result<std::string> RegistrySource::read(uint64_t offset, uint64_t length) {
  if (length == 0) return std::string();
  RangeSink sink(what_, length);
  ++requests_;
  auto got = client_.get("/v2/" + client_.reference().repository + "/blobs/" + digest_,
                         {fmt::format("Range: bytes={}-{}", offset, offset + length - 1)}, sink, what_);
  ranges_refused_ = ranges_refused_ || sink.refused;
  if (!got) return got.error();
  fetched_ += sink.body.size();
  return std::move(sink.body);
}

namespace {

/// A blob file read from its start.
class FileBytes : public LayerBytes {
 public:
  explicit FileBytes(const fs::path& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), path_(path) {}
  ~FileBytes() override {
    if (fd_ >= 0) ::close(fd_);
  }
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;
  bool is_open() const { return fd_ >= 0; }
  Result<size_t> read(unsigned char* buffer, size_t size) override {
    ssize_t n = 0;
    do {
      n = ::read(fd_, buffer, size);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return make_error(ErrorKind::kInternal, "'{}': read failed: {}", path_.string(), std::strerror(errno));
    return static_cast<size_t>(n);
  }

 private:
  int fd_;
  fs::path path_;
};

}  // namespace

Result<LayerIndex> build_layer_index(const fs::path& blob, const Descriptor& layer, uint64_t span,
                                     const std::string& what) {
  if (span < kMinSpan) return make_error(ErrorKind::kUsage, "--span {}: at least 64K", span);
  FileBytes bytes(blob);
  if (!bytes.is_open()) {
    return make_error(ErrorKind::kInput, "'{}': cannot open: {}", blob.string(), std::strerror(errno));
  }
  auto index = build_layer_index(bytes, layer, span, what);
  if (!index && index.error().message.ends_with(kShortLayer)) {
    return make_error(ErrorKind::kInput, "{}: '{}' is not the layer's {} bytes", what, blob.string(), layer.size);
  }
  return index;
}

Result<LayerIndex> build_layer_index(LayerBytes& bytes, const Descriptor& layer, uint64_t span,
                                     const std::string& what) {
  if (span < kMinSpan) return make_error(ErrorKind::kUsage, "--span {}: at least 64K", span);
  CFMO_ASSIGN_OR_RETURN(const Compression compression, layer_compression(layer.media_type));
  BlobReader reader(bytes);
  LayerIndex index;
  index.span = span;
  index.layer_digest = layer.digest;
  TarWalker walker(index.entries, what);
  switch (compression) {
    case Compression::kGzip:
      index.compression = IndexedCompression::kGzip;
      CFMO_TRY(index_gzip(reader, index, walker, what));
      break;
    case Compression::kZstd:
      index.compression = IndexedCompression::kZstd;
      CFMO_TRY(index_zstd(reader, index, walker, what));
      break;
    case Compression::kNone:
      index.compression = IndexedCompression::kNone;
      CFMO_TRY(index_plain(reader, index, walker));
      break;
  }
  CFMO_TRY(walker.finish());
  // Every decoder reads to the layer's end, so the reader's end is its size.
  index.compressed_size = reader.start() + reader.size();
  if (static_cast<int64_t>(index.compressed_size) != layer.size) {
    return make_error(ErrorKind::kInput, "{}: {} bytes, {}", what, index.compressed_size, kShortLayer);
  }
  if (index.checkpoints.empty()) return make_error(ErrorKind::kInput, "{}: an empty layer", what);
  return index;
}

namespace {

/// The index's fields in the file's order (FORMATS.md), its checksum not included.
void write_index(Writer& w, const LayerIndex& index) {
  w.raw(std::string_view(kMagic, sizeof kMagic));
  w.u32(kVersion);
  w.u8(static_cast<uint8_t>(index.compression));
  w.u8(0);
  w.u8(0);
  w.u8(0);
  w.u64(index.span);
  w.u64(index.compressed_size);
  w.u64(index.uncompressed_size);
  w.u32(index.members);
  w.bytes(index.layer_digest);
  w.u32(static_cast<uint32_t>(index.checkpoints.size()));
  for (const auto& c : index.checkpoints) {
    w.u64(c.out);
    w.u64(c.in);
    w.u8(c.bits);
    w.u8(c.byte);
    w.raw(std::string_view(reinterpret_cast<const char*>(c.span_sha256.data()), c.span_sha256.size()));
    w.bytes(c.window);
  }
  w.u32(static_cast<uint32_t>(index.entries.size()));
  for (const auto& e : index.entries) {
    w.u8(static_cast<uint8_t>(e.type));
    w.u8(static_cast<uint8_t>(e.whiteout));
    w.u8(e.sparse ? 1 : 0);
    w.u8(0);
    w.u32(e.mode);
    w.u64(e.uid);
    w.u64(e.gid);
    w.u64(e.size);
    w.u64(e.offset);
    w.u64(static_cast<uint64_t>(e.mtime));
    w.bytes(e.path);
    w.bytes(e.link);
  }
}

}  // namespace

uint64_t serialized_size(const LayerIndex& index) {
  Writer w(true);
  write_index(w, index);
  return w.size + 32;
}

std::string serialize_index(const LayerIndex& index) {
  Writer w;
  w.out.reserve(serialized_size(index));  // once: MBs of windows, copied at every doubling otherwise
  write_index(w, index);
  const auto sum = sha256_of(w.out);
  w.out.append(reinterpret_cast<const char*>(sum.data()), sum.size());
  return std::move(w.out);
}

Result<LayerIndex> parse_index(std::string_view bytes, const std::string& what) {
  if (bytes.size() < sizeof kMagic + 32 || bytes.substr(0, sizeof kMagic) != std::string_view(kMagic, sizeof kMagic)) {
    return bad_index(what, "not a cfmo layer index");
  }
  const std::string_view body = bytes.substr(0, bytes.size() - 32);
  const auto sum = sha256_of(body);
  if (std::memcmp(sum.data(), bytes.data() + body.size(), sum.size()) != 0) {
    return bad_index(what, "checksum mismatch (damaged or truncated)");
  }
  Reader r(body.substr(sizeof kMagic), what);
  LayerIndex index;
  const uint32_t version = r.u32();
  if (version != 1 && version != kVersion) {
    return bad_index(what, fmt::format("version {} (this cfmo-pull reads versions 1 and {})", version, kVersion));
  }
  const uint8_t compression = r.u8();
  r.u8();
  r.u8();
  r.u8();
  if (compression > 2) return bad_index(what, fmt::format("unknown compression {}", compression));
  index.compression = static_cast<IndexedCompression>(compression);
  index.span = r.u64();
  index.compressed_size = r.u64();
  index.uncompressed_size = r.u64();
  index.members = r.u32();
  index.layer_digest = r.bytes(71);
  const uint32_t checkpoints = r.u32();
  if (r.failed() || checkpoints == 0 || checkpoints > r.left() / 54) return bad_index(what, "bad checkpoint count");
  for (uint32_t k = 0; k < checkpoints && !r.failed(); ++k) {
    IndexCheckpoint c;
    c.out = r.u64();
    c.in = r.u64();
    c.bits = r.u8();
    c.byte = r.u8();
    for (auto& b : c.span_sha256) b = r.u8();
    c.window = r.bytes(2 * kWindow);
    const bool ordered =
        k == 0 ? c.out == 0 : c.out > index.checkpoints.back().out && c.in > index.checkpoints.back().in;
    const bool plain = index.compression == IndexedCompression::kNone;
    const bool frames = index.compression == IndexedCompression::kZstd;
    if (c.bits > 7 || !ordered || c.in > index.compressed_size || c.out > index.uncompressed_size ||
        (plain && (c.in != c.out || !c.window.empty())) || (frames && (c.bits != 0 || !c.window.empty())) ||
        (k == 0 && (plain || frames) && c.in != 0)) {
      return bad_index(what, fmt::format("checkpoint {} is out of order or out of range", k));
    }
    index.checkpoints.push_back(std::move(c));
  }
  const uint32_t entries = r.u32();
  if (r.failed() || entries > r.left() / 48) return bad_index(what, "bad entry count");
  for (uint32_t k = 0; k < entries && !r.failed(); ++k) {
    IndexEntry e;
    e.type = static_cast<char>(r.u8());
    const uint8_t whiteout = r.u8();
    e.sparse = r.u8() != 0;
    r.u8();
    e.mode = r.u32();
    e.uid = r.u64();
    e.gid = r.u64();
    e.size = r.u64();
    e.offset = r.u64();
    if (version >= 2) e.mtime = static_cast<int64_t>(r.u64());
    e.path = r.bytes(1 << 20);
    e.link = r.bytes(1 << 20);
    if (std::string_view("0123456").find(e.type) == std::string_view::npos || e.type == '\0' || whiteout > 2 ||
        e.path.empty() || e.offset > index.uncompressed_size || e.size > index.uncompressed_size - e.offset) {
      return bad_index(what, fmt::format("entry {} is malformed", k));
    }
    e.whiteout = static_cast<IndexWhiteout>(whiteout);
    index.entries.push_back(std::move(e));
  }
  if (r.failed()) return bad_index(what, "truncated");
  if (r.left() != 0) return bad_index(what, "bytes after the entries");
  if (!is_sha256_digest(index.layer_digest)) return bad_index(what, "the layer digest is not sha256");
  return index;
}

Result<std::string> index_layer_digest(std::string_view bytes, const std::string& what) {
  if (bytes.size() < sizeof kMagic + 32 || bytes.substr(0, sizeof kMagic) != std::string_view(kMagic, sizeof kMagic)) {
    return bad_index(what, "not a cfmo layer index");
  }
  Reader r(bytes.substr(sizeof kMagic, bytes.size() - sizeof kMagic - 32), what);
  const uint32_t version = r.u32();
  if (version != 1 && version != kVersion) {
    return bad_index(what, fmt::format("version {} (this cfmo-pull reads versions 1 and {})", version, kVersion));
  }
  for (int i = 0; i < 4; ++i) r.u8();   // compression and padding
  for (int i = 0; i < 3; ++i) r.u64();  // span, compressed and uncompressed size
  r.u32();                              // members
  std::string digest = r.bytes(71);
  if (r.failed() || !is_sha256_digest(digest)) return bad_index(what, "the layer digest is not sha256");
  return digest;
}

Result<LayerIndex> read_index(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    return make_error(ErrorKind::kInput, "index '{}': no such file", path.string());
  }
  // Mapped, its pages populated at once: read into a string, each index
  // (MBs) was zeroed, then copied, each page of the copy a fault of its
  // own, most of a lazy mount's start on a virtual machine.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd >= 0 && ::fstat(fd, &st) == 0 && st.st_size > 0) {
    const auto size = static_cast<size_t>(st.st_size);
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    ::close(fd);
    if (map != MAP_FAILED) {
      auto parsed = parse_index(std::string_view(static_cast<const char*>(map), size), path.string());
      ::munmap(map, size);
      return parsed;
    }
  } else if (fd >= 0) {
    ::close(fd);
  }
  CFMO_ASSIGN_OR_RETURN(const std::string bytes, read_file(path));
  return parse_index(bytes, path.string());
}

namespace {

/// read_range of a zstd layer: a new decoder at checkpoint `first` (a frame's start), fed the spans from there on.
Result<std::string> read_zstd(const LayerIndex& index, CompressedSource& source, size_t first, uint64_t offset,
                              uint64_t length, const std::string& what) {
  ZstdDecoder d = zstd_decoder();
  if (!d) return make_error(ErrorKind::kInternal, "{}: zstd failed to start", what);
  std::string out;
  out.reserve(length);
  uint64_t position = index.checkpoints[first].out;
  std::vector<unsigned char> buffer(ZSTD_DStreamOutSize());
  std::string span;
  ZSTD_inBuffer in{nullptr, 0, 0};
  size_t next = first;
  bool full = false;
  while (out.size() < length) {
    if (in.pos == in.size && !full) {
      if (next >= index.checkpoints.size()) {
        return make_error(ErrorKind::kInput, "{}: the layer ends before byte {}", what, offset + length);
      }
      CFMO_ASSIGN_OR_RETURN(span, verified_span(index, source, next, what));
      ++next;
      in = {span.data(), span.size(), 0};
    }
    ZSTD_outBuffer o{buffer.data(), buffer.size(), 0};
    const size_t rc = ZSTD_decompressStream(d.get(), &o, &in);
    if (ZSTD_isError(rc)) {
      return make_error(ErrorKind::kInput, "{}: decoding from checkpoint {} failed ({})", what, first,
                        ZSTD_getErrorName(rc));
    }
    full = o.pos == o.size;
    keep(out, position, buffer.data(), o.pos, offset, length);
    position += o.pos;
  }
  return out;
}

}  // namespace

struct LayerStream::Codec {
  ZstdDecoder decoder = zstd_decoder();
  std::string chunk;
  ZSTD_inBuffer in{nullptr, 0, 0};
  bool full = false;
};

LayerStream::LayerStream(const LayerIndex& index, CompressedSource& source, std::string what)
    : codec_(std::make_unique<Codec>()),
      source_(source),
      what_(std::move(what)),
      compressed_size_(index.compressed_size),
      uncompressed_size_(index.uncompressed_size) {}

LayerStream::~LayerStream() = default;

Result<std::string> LayerStream::read(uint64_t length) {
  if (!codec_->decoder) return make_error(ErrorKind::kInternal, "{}: zstd failed to start", what_);
  length = std::min(length, uncompressed_size_ - position_);
  std::string out(length, '\0');
  size_t done = 0;
  Codec& c = *codec_;
  while (done < length) {
    if (c.in.pos == c.in.size && !c.full) {
      if (fed_ >= compressed_size_) {
        return make_error(ErrorKind::kInput, "{}: the zstd stream ends at byte {} of {}", what_, position_ + done,
                          uncompressed_size_);
      }
      CFMO_ASSIGN_OR_RETURN(c.chunk, source_.read(fed_, std::min<uint64_t>(1 << 20, compressed_size_ - fed_)));
      if (c.chunk.empty()) return make_error(ErrorKind::kInput, "{}: the blob is shorter than the index says", what_);
      fed_ += c.chunk.size();
      c.in = {c.chunk.data(), c.chunk.size(), 0};
    }
    ZSTD_outBuffer o{out.data(), length, done};
    const size_t rc = ZSTD_decompressStream(c.decoder.get(), &o, &c.in);
    if (ZSTD_isError(rc)) {
      return make_error(ErrorKind::kInput, "{}: corrupt zstd stream ({})", what_, ZSTD_getErrorName(rc));
    }
    c.full = o.pos == o.size;
    done = o.pos;
  }
  position_ += length;
  return out;
}

Result<std::string> read_range(const LayerIndex& index, CompressedSource& source, uint64_t offset, uint64_t length,
                               const std::string& what) {
  if (length == 0) return std::string();
  if (offset > index.uncompressed_size || length > index.uncompressed_size - offset) {
    return make_error(ErrorKind::kInput, "{}: bytes {}+{} are past the layer's end ({})", what, offset, length,
                      index.uncompressed_size);
  }
  const auto [first, last] = index.spans_for(offset, length);
  std::string out;
  out.reserve(length);
  if (index.compression == IndexedCompression::kNone) {
    for (size_t k = first; k <= last; ++k) {
      CFMO_ASSIGN_OR_RETURN(const std::string span, verified_span(index, source, k, what));
      const uint64_t begin = index.checkpoints[k].out;
      const uint64_t from = std::max(offset, begin) - begin;
      const uint64_t to = std::min<uint64_t>(offset + length - begin, span.size());
      if (from < to) out.append(span, from, to - from);
    }
    return out;
  }
  if (index.compression == IndexedCompression::kZstd) return read_zstd(index, source, first, offset, length, what);
  const IndexCheckpoint& start = index.checkpoints[first];
  Inflater inf;
  if (inflateInit2(&inf.z, -15) != Z_OK) return make_error(ErrorKind::kInternal, "{}: zlib failed to start", what);
  inf.open = true;
  z_stream& z = inf.z;
  if (start.bits != 0) inflatePrime(&z, start.bits, start.byte >> (8 - start.bits));
  if (!start.window.empty()) {
    std::string window(kWindow, '\0');
    uLongf size = kWindow;
    if (uncompress(reinterpret_cast<Bytef*>(window.data()), &size, reinterpret_cast<const Bytef*>(start.window.data()),
                   static_cast<uLong>(start.window.size())) != Z_OK) {
      return make_error(ErrorKind::kInput, "{}: checkpoint {}: its window does not inflate", what, first);
    }
    inflateSetDictionary(&z, reinterpret_cast<const Bytef*>(window.data()), static_cast<uInt>(size));
  }
  uint64_t position = start.out;  ///< uncompressed offset of the next byte out
  bool raw = true;                ///< inside the member the checkpoint is in (raw deflate, no header)
  uint64_t trailer = 0;           ///< bytes of a gzip trailer still to step over
  std::string span;
  size_t next = first;
  std::vector<unsigned char> buffer(1 << 16);
  while (out.size() < length) {
    if (z.avail_in == 0) {
      if (next >= index.checkpoints.size()) {
        return make_error(ErrorKind::kInput, "{}: the layer ends before byte {}", what, offset + length);
      }
      CFMO_ASSIGN_OR_RETURN(span, verified_span(index, source, next, what));
      ++next;
      z.next_in = reinterpret_cast<Bytef*>(span.data());
      z.avail_in = static_cast<uInt>(span.size());
    }
    if (trailer > 0) {
      const uInt step = static_cast<uInt>(std::min<uint64_t>(trailer, z.avail_in));
      z.next_in += step;
      z.avail_in -= step;
      trailer -= step;
      if (trailer == 0) {
        inflateReset2(&z, 15 + 16);  // the next member, header included
        raw = false;
      }
      continue;
    }
    z.next_out = buffer.data();
    z.avail_out = static_cast<uInt>(buffer.size());
    const int rc = inflate(&z, Z_NO_FLUSH);
    const uint64_t produced = buffer.size() - z.avail_out;
    keep(out, position, buffer.data(), produced, offset, length);
    position += produced;
    if (rc == Z_STREAM_END) {
      if (raw) {
        trailer = 8;  // CRC-32 and size, which raw inflate leaves
      } else {
        inflateReset(&z);
      }
      continue;
    }
    if (rc == Z_BUF_ERROR && z.avail_in == 0) continue;
    if (rc != Z_OK) {
      return make_error(ErrorKind::kInput, "{}: inflating from checkpoint {} failed ({})", what, first,
                        z.msg != nullptr ? z.msg : "corrupt data");
    }
  }
  return out;
}

Result<std::string> read_entry(const LayerIndex& index, CompressedSource& source, const IndexEntry& entry,
                               const std::string& what) {
  const IndexEntry* file = &entry;
  if (entry.type == '1') {
    // The hard link's target: the last entry of that path before this one.
    file = nullptr;
    for (const auto& e : index.entries) {
      if (&e == &entry) break;
      if (e.path == entry.link) file = &e;
    }
    if (file == nullptr)
      return make_error(ErrorKind::kInput, "{}: '{}': hard link to '{}', which is not before it", what, entry.path,
                        entry.link);
  }
  if (file->type != '0') return make_error(ErrorKind::kUsage, "{}: '{}' is not a regular file", what, entry.path);
  if (file->sparse) {
    return make_error(ErrorKind::kInput, "{}: '{}' is a sparse file: read it from the whole layer", what, entry.path);
  }
  return read_range(index, source, file->offset, file->size, fmt::format("{}: '{}'", what, entry.path));
}

Result<std::vector<std::pair<size_t, LayerIndex>>> read_pull_indexes(const fs::path& dir) {
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  std::vector<std::pair<size_t, LayerIndex>> out;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    const auto& layer = state.layers[i];
    if (layer.status != LayerStatus::kFetched) continue;
    const fs::path path = index_path(dir, layer.blob.digest);
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      return make_error(ErrorKind::kInput, "layer {} ({}) has no index; 'cfmo-pull index {}' makes it", i,
                        short_digest(layer.blob.digest), dir.string());
    }
    CFMO_ASSIGN_OR_RETURN(LayerIndex index, read_index(path));
    if (index.layer_digest != layer.blob.digest) {
      return make_error(ErrorKind::kInput, "index '{}': is the index of {}, not of layer {}", path.string(),
                        index.layer_digest, i);
    }
    out.emplace_back(i, std::move(index));
  }
  return out;
}

std::string not_lazily_loadable(const LayerIndex& index) {
  return fmt::format("one zstd frame of {}: not lazily loadable (a lazy mount fetches it whole)",
                     human_bytes(static_cast<int64_t>(index.uncompressed_size)));
}

const char* entry_type_name(char type) {
  switch (type) {
    case '0':
      return "file";
    case '1':
      return "hardlink";
    case '2':
      return "symlink";
    case '3':
      return "char";
    case '4':
      return "block";
    case '5':
      return "dir";
    case '6':
      return "fifo";
    default:
      return "?";
  }
}

Result<std::vector<LayerIndexReport>> index_pull(const fs::path& dir, uint64_t span) {
  if (span < kMinSpan) return make_error(ErrorKind::kUsage, "--span {}: at least 64K", span);
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  std::vector<LayerIndexReport> reports;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    const auto& layer = state.layers[i];
    LayerIndexReport report;
    report.layer = i;
    report.digest = layer.blob.digest;
    report.media_type = layer.blob.media_type;
    const std::string what = fmt::format("layer {} ({})", short_digest(layer.blob.digest), i);
    const fs::path blob = blob_path(dir, layer.blob.digest);
    std::error_code ec;
    if (layer.status != LayerStatus::kFetched || !fs::exists(blob, ec)) {
      report.note = "not fetched yet ('cfmo-pull fetch' brings it)";
    } else {
      CFMO_ASSIGN_OR_RETURN(const LayerIndex index, build_layer_index(blob, layer.blob, span, what));
      report.path = index_path(dir, layer.blob.digest);
      fs::create_directories(report.path.parent_path(), ec);
      if (ec) {
        return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", report.path.parent_path().string(),
                          ec.message());
      }
      const std::string bytes = serialize_index(index);
      CFMO_TRY(write_file_atomic(report.path, bytes));
      report.indexed = true;
      report.entries = index.entries.size();
      report.checkpoints = index.checkpoints.size();
      report.members = index.members;
      report.uncompressed_size = index.uncompressed_size;
      report.index_bytes = bytes.size();
      if (!index.lazily_loadable()) report.note = not_lazily_loadable(index);
    }
    reports.push_back(std::move(report));
  }
  return reports;
}

}  // namespace cfmo::oci
