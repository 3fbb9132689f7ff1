#include "ckpt/cfd.h"

#include "core/atomic_file.h"
#include "core/fd.h"
#include "core/parallel.h"

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

static_assert(std::endian::native == std::endian::little, ".cfd I/O assumes a little-endian host");

namespace cfmo::ckpt {
namespace {

constexpr std::array<unsigned char, 8> kMagic = {0x89, 'C', 'F', 'D', '\r', '\n', 0x1a, '\n'};
constexpr uint32_t kVersion = 1;
constexpr size_t kPreludeBytes = 32;
constexpr uint64_t kAlignment = 64;
// A zstd block ends at each exponent group of at least this many bytes, so
// each block's entropy tables fit one group (see grouped_planes below).
constexpr size_t kMinGroupBlock = 4096;

struct ZstdCCtxFree {
  void operator()(ZSTD_CCtx* ctx) const { ZSTD_freeCCtx(ctx); }
};
struct ZstdDCtxFree {
  void operator()(ZSTD_DCtx* ctx) const { ZSTD_freeDCtx(ctx); }
};

// One compression and one decompression context per thread, reused across
// chunks (creating one costs more than a small chunk), freed at thread exit.
ZSTD_CCtx* thread_cctx() {
  thread_local std::unique_ptr<ZSTD_CCtx, ZstdCCtxFree> ctx(ZSTD_createCCtx());
  return ctx.get();
}
ZSTD_DCtx* thread_dctx() {
  thread_local std::unique_ptr<ZSTD_DCtx, ZstdDCtxFree> ctx(ZSTD_createDCtx());
  return ctx.get();
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

uint32_t read_le32(const std::byte* p) {
  uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  std::memcpy(&v, p, 8);
  return v;
}

// The transformed bytes of a chunk and where the encoder may end a zstd block.
struct Transformed {
  std::string bytes;
  std::vector<size_t> block_ends;  // ascending offsets into bytes
};

// grouped-planes: plane 0 holds each value's 8-bit exponent, in order. A
// stable counting sort by exponent, which the decoder recomputes from plane 0
// alone, orders the other three planes: sign and the top 7 mantissa bits,
// then the middle and the low mantissa byte. A delta computed as local - base
// has as many trailing zero bits as its exponent is below the base's, so
// values of one exponent share their mantissa statistics; ending a zstd block
// at each group gives each group its own Huffman table.
Transformed encode_grouped_planes(std::span<const float> values) {
  const size_t n = values.size();
  Transformed out;
  out.bytes.resize(4 * n);
  auto* e_plane = reinterpret_cast<unsigned char*>(out.bytes.data());
  unsigned char* m1 = e_plane + n;
  unsigned char* m2 = e_plane + 2 * n;
  unsigned char* m3 = e_plane + 3 * n;
  std::array<size_t, 257> start{};
  for (float v : values) ++start[((std::bit_cast<uint32_t>(v) >> 23) & 0xffu) + 1];
  for (size_t g = 0; g < 256; ++g) start[g + 1] += start[g];
  std::array<size_t, 256> next;
  std::copy(start.begin(), start.begin() + 256, next.begin());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t w = std::bit_cast<uint32_t>(values[i]);
    const uint32_t e = (w >> 23) & 0xffu;
    const size_t k = next[e]++;
    e_plane[i] = static_cast<unsigned char>(e);
    m1[k] = static_cast<unsigned char>(((w >> 31) << 7) | ((w >> 16) & 0x7fu));
    m2[k] = static_cast<unsigned char>(w >> 8);
    m3[k] = static_cast<unsigned char>(w);
  }
  out.block_ends.push_back(n);
  for (size_t plane = 1; plane < 4; ++plane) {
    size_t last = plane * n;
    for (size_t g = 1; g <= 256; ++g) {
      const size_t end = plane * n + start[g];
      if (end - last >= kMinGroupBlock) {
        out.block_ends.push_back(end);
        last = end;
      }
    }
    if (out.block_ends.back() != (plane + 1) * n) out.block_ends.push_back((plane + 1) * n);
  }
  return out;
}

void decode_grouped_planes(const unsigned char* in, std::span<float> out) {
  const size_t n = out.size();
  const unsigned char* e_plane = in;
  const unsigned char* m1 = in + n;
  const unsigned char* m2 = in + 2 * n;
  const unsigned char* m3 = in + 3 * n;
  std::array<size_t, 257> start{};
  for (size_t i = 0; i < n; ++i) ++start[e_plane[i] + 1u];
  for (size_t g = 0; g < 256; ++g) start[g + 1] += start[g];
  std::array<size_t, 256> next;
  std::copy(start.begin(), start.begin() + 256, next.begin());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t e = e_plane[i];
    const size_t k = next[e]++;
    const uint32_t w = ((static_cast<uint32_t>(m1[k]) >> 7) << 31) | (e << 23) |
                       ((static_cast<uint32_t>(m1[k]) & 0x7fu) << 16) | (static_cast<uint32_t>(m2[k]) << 8) | m3[k];
    out[i] = std::bit_cast<float>(w);
  }
}

Transformed encode_byte_planes(std::span<const float> values) {
  const size_t n = values.size();
  Transformed out;
  out.bytes.resize(4 * n);
  auto* p = reinterpret_cast<unsigned char*>(out.bytes.data());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t w = std::bit_cast<uint32_t>(values[i]);
    p[i] = static_cast<unsigned char>(w >> 24);
    p[n + i] = static_cast<unsigned char>(w >> 16);
    p[2 * n + i] = static_cast<unsigned char>(w >> 8);
    p[3 * n + i] = static_cast<unsigned char>(w);
  }
  for (size_t plane = 1; plane <= 4; ++plane) out.block_ends.push_back(plane * n);
  return out;
}

void decode_byte_planes(const unsigned char* p, std::span<float> out) {
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t w = (static_cast<uint32_t>(p[i]) << 24) | (static_cast<uint32_t>(p[n + i]) << 16) |
                       (static_cast<uint32_t>(p[2 * n + i]) << 8) | p[3 * n + i];
    out[i] = std::bit_cast<float>(w);
  }
}

Transformed transform_chunk(std::span<const float> values, CfdTransform transform) {
  switch (transform) {
    case CfdTransform::kGroupedPlanes:
      return encode_grouped_planes(values);
    case CfdTransform::kBytePlanes:
      return encode_byte_planes(values);
    case CfdTransform::kNone:
      break;
  }
  Transformed out;
  out.bytes.assign(reinterpret_cast<const char*>(values.data()), values.size_bytes());
  out.block_ends.push_back(out.bytes.size());
  return out;
}

Result<std::string> zstd_compress_blocks(const Transformed& input, int level) {
  ZSTD_CCtx* ctx = thread_cctx();
  if (ctx == nullptr) return make_error(ErrorKind::kInternal, "zstd: cannot create a compression context");
  auto check = [](size_t code) -> Status {
    if (ZSTD_isError(code)) return make_error(ErrorKind::kInternal, "zstd: {}", ZSTD_getErrorName(code));
    return {};
  };
  CFMO_TRY(check(ZSTD_CCtx_reset(ctx, ZSTD_reset_session_and_parameters)));
  CFMO_TRY(check(ZSTD_CCtx_setParameter(ctx, ZSTD_c_compressionLevel, level)));
  CFMO_TRY(check(ZSTD_CCtx_setPledgedSrcSize(ctx, input.bytes.size())));
  std::string out(ZSTD_compressBound(input.bytes.size()) + 64, '\0');
  ZSTD_outBuffer output{out.data(), out.size(), 0};
  std::vector<size_t> ends = input.block_ends;
  if (ends.empty() || ends.back() != input.bytes.size()) ends.push_back(input.bytes.size());
  size_t begin = 0;
  for (size_t b = 0; b < ends.size(); ++b) {
    // Flushing ends a zstd block; the last piece ends the frame.
    const ZSTD_EndDirective directive = b + 1 == ends.size() ? ZSTD_e_end : ZSTD_e_flush;
    ZSTD_inBuffer in{input.bytes.data() + begin, ends[b] - begin, 0};
    for (;;) {
      if (output.pos == output.size) {  // each ended block adds a header; grow if the bound was short
        out.resize(out.size() * 2);
        output.dst = out.data();
        output.size = out.size();
      }
      const size_t remaining = ZSTD_compressStream2(ctx, &output, &in, directive);
      CFMO_TRY(check(remaining));
      if (remaining == 0 && in.pos == in.size) break;
    }
    begin = ends[b];
  }
  out.resize(output.pos);
  return out;
}

std::string frame_label(const CfdFile::Tensor& tensor, size_t frame) {
  if (tensor.frames.size() <= 1) return fmt::format("tensor '{}'", tensor.name);
  return fmt::format("tensor '{}' frame {} of {}", tensor.name, frame + 1, tensor.frames.size());
}

}  // namespace

std::string_view to_string(CfdTransform transform) {
  switch (transform) {
    case CfdTransform::kNone:
      return "none";
    case CfdTransform::kBytePlanes:
      return "byteplanes";
    case CfdTransform::kGroupedPlanes:
      return "grouped-planes";
  }
  return "?";
}

std::string_view to_string(CfdCodec codec) { return codec == CfdCodec::kZstd ? "zstd" : "none"; }

Result<CfdTransform> parse_cfd_transform(std::string_view text) {
  for (auto t : {CfdTransform::kNone, CfdTransform::kBytePlanes, CfdTransform::kGroupedPlanes}) {
    if (text == to_string(t)) return t;
  }
  return make_error(ErrorKind::kUsage, "unknown transform '{}' (none, byteplanes, grouped-planes)", text);
}

Result<CfdCodec> parse_cfd_codec(std::string_view text) {
  for (auto c : {CfdCodec::kNone, CfdCodec::kZstd}) {
    if (text == to_string(c)) return c;
  }
  return make_error(ErrorKind::kUsage, "unknown codec '{}' (none, zstd)", text);
}

Result<CfdChunk> cfd_encode_chunk(std::span<const float> values, CfdCodec codec, CfdTransform transform,
                                  int zstd_level) {
  Transformed transformed = transform_chunk(values, transform);
  CfdChunk chunk;
  chunk.checksum = XXH3_64bits(transformed.bytes.data(), transformed.bytes.size());
  if (codec == CfdCodec::kNone) {
    chunk.stored = std::move(transformed.bytes);
  } else {
    CFMO_ASSIGN_OR_RETURN(chunk.stored, zstd_compress_blocks(transformed, zstd_level));
  }
  return chunk;
}

namespace {

// The frame's content (the transformed bytes), checksum verified: the stored
// bytes themselves for codec none, else decompressed into a per-thread buffer.
Result<const unsigned char*> frame_content(std::span<const std::byte> stored, CfdCodec codec, uint64_t checksum,
                                           size_t raw, const std::string& source) {
  thread_local std::vector<unsigned char> scratch;
  const unsigned char* content = nullptr;
  if (codec == CfdCodec::kNone) {
    if (stored.size() != raw) {
      return make_error(ErrorKind::kInput, "{}: {} stored bytes, expected {}", source, stored.size(), raw);
    }
    content = reinterpret_cast<const unsigned char*>(stored.data());
  } else {
    const unsigned long long size = ZSTD_getFrameContentSize(stored.data(), stored.size());
    if (size == ZSTD_CONTENTSIZE_ERROR) {
      return make_error(ErrorKind::kInput, "{}: not a zstd frame, or a truncated one", source);
    }
    if (size != raw) {
      return make_error(ErrorKind::kInput, "{}: zstd frame holds {} bytes, expected {}", source,
                        size == ZSTD_CONTENTSIZE_UNKNOWN ? std::string("an unknown number of") : std::to_string(size),
                        raw);
    }
    const size_t frame_size = ZSTD_findFrameCompressedSize(stored.data(), stored.size());
    if (ZSTD_isError(frame_size)) {
      return make_error(ErrorKind::kInput, "{}: truncated zstd frame ({})", source, ZSTD_getErrorName(frame_size));
    }
    if (frame_size != stored.size()) {
      return make_error(ErrorKind::kInput, "{}: {} bytes after the zstd frame", source, stored.size() - frame_size);
    }
    if (scratch.size() < raw) scratch.resize(raw);
    ZSTD_DCtx* ctx = thread_dctx();
    if (ctx == nullptr) return make_error(ErrorKind::kInternal, "zstd: cannot create a decompression context");
    const size_t got = ZSTD_decompressDCtx(ctx, scratch.data(), raw, stored.data(), stored.size());
    if (ZSTD_isError(got)) {
      return make_error(ErrorKind::kInput, "{}: corrupt zstd frame ({})", source, ZSTD_getErrorName(got));
    }
    if (got != raw)
      return make_error(ErrorKind::kInput, "{}: zstd frame holds {} bytes, expected {}", source, got, raw);
    content = scratch.data();
  }
  if (XXH3_64bits(content, raw) != checksum) {
    return make_error(ErrorKind::kInput, "{}: checksum mismatch (corrupt data)", source);
  }
  return content;
}

// The values in the order the transform stores them: for grouped-planes,
// grouped by exponent (each group's values in their original order), for the
// others the original order. A reduction that ignores order reads this
// sequential form instead of undoing the permutation.
void values_in_storage_order(const unsigned char* content, CfdTransform transform, std::span<float> out) {
  const size_t n = out.size();
  if (transform == CfdTransform::kNone) {
    if (n > 0) std::memcpy(out.data(), content, n * 4);
  } else if (transform == CfdTransform::kBytePlanes) {
    decode_byte_planes(content, out);
  } else {
    const unsigned char* m1 = content + n;
    const unsigned char* m2 = content + 2 * n;
    const unsigned char* m3 = content + 3 * n;
    std::array<size_t, 257> start{};
    for (size_t i = 0; i < n; ++i) ++start[content[i] + 1u];
    for (size_t g = 0; g < 256; ++g) start[g + 1] += start[g];
    for (uint32_t e = 0; e < 256; ++e) {
      const uint32_t exponent = e << 23;
      for (size_t k = start[e]; k < start[e + 1]; ++k) {
        const uint32_t w = ((static_cast<uint32_t>(m1[k]) >> 7) << 31) | exponent |
                           ((static_cast<uint32_t>(m1[k]) & 0x7fu) << 16) | (static_cast<uint32_t>(m2[k]) << 8) | m3[k];
        out[k] = std::bit_cast<float>(w);
      }
    }
  }
}

}  // namespace

Status cfd_decode_chunk(std::span<const std::byte> stored, CfdCodec codec, CfdTransform transform, uint64_t checksum,
                        std::span<float> out, const std::string& source) {
  CFMO_ASSIGN_OR_RETURN(const unsigned char* content, frame_content(stored, codec, checksum, out.size_bytes(), source));
  switch (transform) {
    case CfdTransform::kGroupedPlanes:
      decode_grouped_planes(content, out);
      break;
    case CfdTransform::kBytePlanes:
      decode_byte_planes(content, out);
      break;
    case CfdTransform::kNone:
      if (!out.empty()) std::memcpy(out.data(), content, out.size_bytes());
      break;
  }
  return {};
}

Result<DeltaStats> cfd_reduce_chunk(std::span<const std::byte> stored, CfdCodec codec, CfdTransform transform,
                                    uint64_t checksum, size_t elements, const std::string& source) {
  CFMO_ASSIGN_OR_RETURN(const unsigned char* content, frame_content(stored, codec, checksum, elements * 4, source));
  thread_local std::vector<float> values;
  if (values.size() < elements) values.resize(elements);
  std::span<float> view(values.data(), elements);
  values_in_storage_order(content, transform, view);
  return delta_only_stats(view);
}

// ---------------------------------------------------------------- writing

std::filesystem::path delta_path(const std::filesystem::path& run_dir, int rank, int64_t round) {
  return run_dir / "deltas" / fmt::format("rank-{}", rank) / fmt::format("round-{:06}.cfd", round);
}

Status write_cfd(const std::filesystem::path& path, const CfdFileInfo& info, std::span<const CfdTensorInput> tensors,
                 const CfdWriteOptions& options) {
  const std::string file = path.string();
  auto bad_input = [&](std::string_view what) { return make_error(ErrorKind::kInternal, "'{}': {}", file, what); };
  if (info.rank < 0 || info.round < 0 || info.step < 0 || info.base_version < 0) {
    return bad_input("rank, round, step and base version must not be negative");
  }
  if (options.chunk_elements < 1 || options.chunk_elements > CfdLimits{}.max_chunk_elements) {
    return bad_input(
        fmt::format("chunk of {} values is outside 1..{}", options.chunk_elements, CfdLimits{}.max_chunk_elements));
  }
  if (options.codec == CfdCodec::kZstd &&
      (options.zstd_level < ZSTD_minCLevel() || options.zstd_level > ZSTD_maxCLevel())) {
    return bad_input(
        fmt::format("zstd level {} is outside {}..{}", options.zstd_level, ZSTD_minCLevel(), ZSTD_maxCLevel()));
  }
  std::set<std::string_view> names;
  struct Job {
    size_t tensor;
    int64_t first;
    int64_t elements;
  };
  std::vector<Job> jobs;
  std::vector<size_t> first_job(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& tensor = tensors[t];
    if (tensor.name.empty() || !names.insert(tensor.name).second) {
      return bad_input(fmt::format("tensor name '{}' is empty or repeated", tensor.name));
    }
    int64_t elements = 1;
    for (int64_t d : tensor.shape) {
      if (d < 0 || (d != 0 && elements > std::numeric_limits<int64_t>::max() / 4 / d)) {
        return bad_input(
            fmt::format("tensor '{}' has an invalid shape [{}]", tensor.name, fmt::join(tensor.shape, ",")));
      }
      elements *= d;
    }
    if (tensor.base.size() != static_cast<size_t>(elements) || tensor.delta.size() != static_cast<size_t>(elements)) {
      return bad_input(fmt::format("tensor '{}' of shape [{}] has {} base and {} delta values", tensor.name,
                                   fmt::join(tensor.shape, ","), tensor.base.size(), tensor.delta.size()));
    }
    first_job[t] = jobs.size();
    for (int64_t first = 0; first < elements; first += options.chunk_elements) {
      jobs.push_back({t, first, std::min(options.chunk_elements, elements - first)});
    }
  }
  first_job[tensors.size()] = jobs.size();

  struct Done {
    std::string stored;
    uint64_t checksum = 0;
    DeltaStats stats;
    Status status;
  };
  std::vector<Done> done(jobs.size());
  parallel_for(jobs.size(), options.threads, "cfd-write", [&](size_t j) {
    const Job& job = jobs[j];
    const auto& tensor = tensors[job.tensor];
    const auto first = static_cast<size_t>(job.first);
    const auto count = static_cast<size_t>(job.elements);
    auto delta = tensor.delta.subspan(first, count);
    done[j].stats = delta_stats(tensor.base.subspan(first, count), delta);
    auto chunk = cfd_encode_chunk(delta, options.codec, options.transform, options.zstd_level);
    if (chunk) {
      done[j].stored = std::move(chunk->stored);
      done[j].checksum = chunk->checksum;
    } else {
      done[j].status = std::move(chunk).error();
    }
  });
  for (auto& d : done) {
    if (!d.status) return make_error(d.status.error().kind, "'{}': {}", file, d.status.error().message);
  }

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["rank"] = info.rank;
  header["round"] = info.round;
  header["step"] = info.step;
  header["base_version"] = info.base_version;
  if (!info.metadata.empty()) header["metadata"] = info.metadata;
  header["tensors"] = nlohmann::ordered_json::array();
  uint64_t offset = 0;  // into the data section
  std::vector<uint64_t> tensor_offsets(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& tensor = tensors[t];
    DeltaStats stats;
    uint64_t size = 0;
    auto frames = nlohmann::ordered_json::array();
    for (size_t j = first_job[t]; j < first_job[t + 1]; ++j) {
      stats.merge(done[j].stats);
      size += done[j].stored.size();
      frames.push_back({{"size", done[j].stored.size()}, {"checksum", "xxh3:" + hex64(done[j].checksum)}});
    }
    offset = (offset + kAlignment - 1) / kAlignment * kAlignment;
    tensor_offsets[t] = offset;
    int64_t elements = 1;
    for (int64_t d : tensor.shape) elements *= d;
    stats.elements = elements;
    header["tensors"].push_back({
        {"name", tensor.name},
        {"dtype", "F32"},
        {"shape", tensor.shape},
        {"offset", offset},
        {"size", size},
        {"raw_size", static_cast<uint64_t>(elements) * 4},
        {"codec", to_string(options.codec)},
        {"transform", to_string(options.transform)},
        {"chunk_elements", options.chunk_elements},
        {"frames", std::move(frames)},
        {"stats",
         {{"base_sq", stats.base_sq},
          {"delta_sq", stats.delta_sq},
          {"base_dot_delta", stats.base_dot_delta},
          {"max_abs", stats.max_abs},
          {"nonfinite", stats.nonfinite},
          {"base_nonfinite", stats.base_nonfinite}}},
    });
    offset += size;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::type_error& e) {  // a name or metadata that is not UTF-8
    return bad_input(fmt::format("cannot write the header: {}", e.what()));
  }
  // Spaces after the JSON end the header on a 64-byte boundary, where the data section starts.
  text.append((kAlignment - (kPreludeBytes + text.size()) % kAlignment) % kAlignment, ' ');

  std::string prelude(kPreludeBytes, '\0');
  std::memcpy(prelude.data(), kMagic.data(), kMagic.size());
  const uint32_t version = kVersion;
  const uint32_t flags = 0;
  const uint64_t header_length = text.size();
  const uint64_t header_checksum = XXH3_64bits(text.data(), text.size());
  std::memcpy(prelude.data() + 8, &version, 4);
  std::memcpy(prelude.data() + 12, &flags, 4);
  std::memcpy(prelude.data() + 16, &header_length, 8);
  std::memcpy(prelude.data() + 24, &header_checksum, 8);

  CFMO_ASSIGN_OR_RETURN(auto out, AtomicFile::create(path));
  CFMO_TRY(out.write(prelude));
  CFMO_TRY(out.write(text));
  uint64_t written = 0;
  const std::string zeros(kAlignment, '\0');
  for (size_t t = 0; t < tensors.size(); ++t) {
    CFMO_TRY(out.write(std::string_view(zeros.data(), tensor_offsets[t] - written)));
    written = tensor_offsets[t];
    for (size_t j = first_job[t]; j < first_job[t + 1]; ++j) {
      CFMO_TRY(out.write(done[j].stored));
      written += done[j].stored.size();
    }
  }
  return out.commit();
}

// ---------------------------------------------------------------- reading

struct CfdFile::Storage {
  Fd fd;
  std::string bytes;  // used when there is no fd
};

CfdFile::CfdFile() = default;
CfdFile::CfdFile(CfdFile&&) noexcept = default;
CfdFile& CfdFile::operator=(CfdFile&&) noexcept = default;
CfdFile::~CfdFile() = default;

const CfdFile::Tensor* CfdFile::find(std::string_view name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

namespace {

Error corrupt(const std::string& source, std::string_view what) {
  return make_error(ErrorKind::kInput, "'{}': {}", source, what);
}

// Reads `out.size()` bytes at `offset`; short reads are truncation.
Status pread_all(int fd, uint64_t offset, std::span<std::byte> out, const std::string& source, std::string_view what) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return corrupt(source, fmt::format("{}: cannot read: {}", what, std::strerror(errno)));
    if (n == 0) return corrupt(source, fmt::format("{}: truncated file", what));
    done += static_cast<size_t>(n);
  }
  return {};
}

// Parses and validates the header JSON against the file's size.
Status parse_header(const std::string& source, std::string_view text, uint64_t data_start, uint64_t file_size,
                    const CfdLimits& limits, CfdFileInfo& info, std::vector<CfdFile::Tensor>& tensors) {
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    return corrupt(source, fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!header.is_object()) return corrupt(source, "header is not a JSON object");
  auto unsigned_field = [&](const nlohmann::json& object, const char* key, uint64_t max,
                            const std::string& where) -> Result<uint64_t> {
    const auto it = object.find(key);
    if (it == object.end() || !it->is_number_unsigned() || it->get<uint64_t>() > max) {
      return corrupt(source, fmt::format("{}'{}' must be an integer in 0..{}", where, key, max));
    }
    return it->get<uint64_t>();
  };
  constexpr auto kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  CFMO_ASSIGN_OR_RETURN(const uint64_t rank, unsigned_field(header, "rank", std::numeric_limits<int>::max(), ""));
  CFMO_ASSIGN_OR_RETURN(const uint64_t round, unsigned_field(header, "round", kInt64Max, ""));
  CFMO_ASSIGN_OR_RETURN(const uint64_t step, unsigned_field(header, "step", kInt64Max, ""));
  CFMO_ASSIGN_OR_RETURN(const uint64_t base_version, unsigned_field(header, "base_version", kInt64Max, ""));
  info.rank = static_cast<int>(rank);
  info.round = static_cast<int64_t>(round);
  info.step = static_cast<int64_t>(step);
  info.base_version = static_cast<int64_t>(base_version);
  if (const auto meta = header.find("metadata"); meta != header.end()) {
    if (!meta->is_object()) return corrupt(source, "metadata is not an object");
    for (const auto& [key, value] : meta->items()) {
      if (!value.is_string()) return corrupt(source, fmt::format("metadata '{}' is not a string", key));
      info.metadata[key] = value.get<std::string>();
    }
  }
  const auto list = header.find("tensors");
  if (list == header.end() || !list->is_array()) return corrupt(source, "header has no 'tensors' array");

  const uint64_t data_size = file_size - data_start;
  std::set<std::string> names;
  for (const auto& entry : *list) {
    CfdFile::Tensor tensor;
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        entry["name"].get_ref<const std::string&>().empty()) {
      return corrupt(source, "a tensor entry has no name");
    }
    tensor.name = entry["name"].get<std::string>();
    const std::string where = fmt::format("tensor '{}': ", tensor.name);
    auto bad = [&](std::string_view why) { return corrupt(source, where + std::string(why)); };
    if (!names.insert(tensor.name).second) return bad("name repeated");
    if (!entry.contains("dtype") || entry["dtype"] != "F32") return bad("dtype must be \"F32\"");
    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) return bad("missing shape");
    uint64_t elements = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > kInt64Max) return bad("shape has an invalid dimension");
      const auto dim = d.get<uint64_t>();
      if (dim != 0 && elements > kInt64Max / 4 / dim) return bad("shape overflows");
      elements *= dim;
      tensor.shape.push_back(static_cast<int64_t>(dim));
    }
    tensor.elements = static_cast<int64_t>(elements);
    CFMO_ASSIGN_OR_RETURN(const uint64_t raw_size, unsigned_field(entry, "raw_size", kInt64Max, where));
    if (raw_size != elements * 4) return bad(fmt::format("raw_size {} is not 4 x {} values", raw_size, elements));
    CFMO_ASSIGN_OR_RETURN(const uint64_t offset, unsigned_field(entry, "offset", kInt64Max, where));
    CFMO_ASSIGN_OR_RETURN(const uint64_t size, unsigned_field(entry, "size", kInt64Max, where));
    if (offset % kAlignment != 0) return bad(fmt::format("offset {} is not a multiple of {}", offset, kAlignment));
    if (offset > data_size || size > data_size - offset) {
      return bad(fmt::format("bytes {}..{} of the data section lie past the end of the file ({} bytes of data)", offset,
                             offset + size, data_size));
    }
    tensor.offset = data_start + offset;
    tensor.size = size;
    if (!entry.contains("codec") || !entry["codec"].is_string()) return bad("missing codec");
    auto codec = parse_cfd_codec(entry["codec"].get<std::string>());
    if (!codec) return bad(codec.error().message);
    tensor.codec = *codec;
    if (!entry.contains("transform") || !entry["transform"].is_string()) return bad("missing transform");
    auto transform = parse_cfd_transform(entry["transform"].get<std::string>());
    if (!transform) return bad(transform.error().message);
    tensor.transform = *transform;
    CFMO_ASSIGN_OR_RETURN(
        const uint64_t chunk,
        unsigned_field(entry, "chunk_elements", static_cast<uint64_t>(limits.max_chunk_elements), where));
    if (chunk == 0) return bad("chunk_elements must be positive");
    tensor.chunk_elements = static_cast<int64_t>(chunk);
    const auto frames = entry.find("frames");
    if (frames == entry.end() || !frames->is_array()) return bad("missing frames");
    const uint64_t expected_frames = (elements + chunk - 1) / chunk;
    if (frames->size() != expected_frames) {
      return bad(fmt::format("{} frames, expected {} for {} values in chunks of {}", frames->size(), expected_frames,
                             elements, chunk));
    }
    uint64_t frame_offset = tensor.offset;
    uint64_t total = 0;
    for (size_t k = 0; k < frames->size(); ++k) {
      const auto& f = (*frames)[k];
      const std::string frame_where = where + fmt::format("frame {}: ", k + 1);
      if (!f.is_object()) return corrupt(source, frame_where + "not an object");
      CFMO_ASSIGN_OR_RETURN(const uint64_t frame_size, unsigned_field(f, "size", data_size, frame_where));
      const auto checksum = f.find("checksum");
      if (checksum == f.end() || !checksum->is_string()) return corrupt(source, frame_where + "missing checksum");
      const auto& text_sum = checksum->get_ref<const std::string&>();
      CfdFile::Frame frame;
      if (text_sum.size() != 21 || !text_sum.starts_with("xxh3:") ||
          std::from_chars(text_sum.data() + 5, text_sum.data() + 21, frame.checksum, 16).ptr != text_sum.data() + 21) {
        return corrupt(source, frame_where + "checksum must be \"xxh3:\" and 16 hex digits");
      }
      frame.offset = frame_offset;
      frame.size = frame_size;
      frame.first = static_cast<int64_t>(k * chunk);
      frame.elements = static_cast<int64_t>(std::min<uint64_t>(chunk, elements - k * chunk));
      if (tensor.codec == CfdCodec::kNone && frame_size != static_cast<uint64_t>(frame.elements) * 4) {
        return corrupt(source, frame_where + fmt::format("{} bytes stored without a codec, expected {}", frame_size,
                                                         frame.elements * 4));
      }
      total += frame_size;  // total <= size < 2^63 before, frame_size < 2^63: no overflow
      if (total > size) break;
      frame_offset += frame_size;
      tensor.frames.push_back(frame);
    }
    if (total != size) return bad(fmt::format("frames hold {} bytes, size says {}", total, size));
    const auto stats = entry.find("stats");
    if (stats == entry.end() || !stats->is_object()) return bad("missing stats");
    auto number = [&](const char* key, double& out) -> Status {
      const auto it = stats->find(key);
      if (it == stats->end() || !it->is_number() || !std::isfinite(it->get<double>())) {
        return bad(fmt::format("stats '{}' must be a finite number", key));
      }
      out = it->get<double>();
      return {};
    };
    DeltaStats& s = tensor.stats;
    s.elements = tensor.elements;
    CFMO_TRY(number("base_sq", s.base_sq));
    CFMO_TRY(number("delta_sq", s.delta_sq));
    CFMO_TRY(number("base_dot_delta", s.base_dot_delta));
    CFMO_TRY(number("max_abs", s.max_abs));
    if (s.base_sq < 0 || s.delta_sq < 0 || s.max_abs < 0) return bad("stats: a square or maximum is negative");
    CFMO_ASSIGN_OR_RETURN(const uint64_t nonfinite, unsigned_field(*stats, "nonfinite", elements, where + "stats "));
    CFMO_ASSIGN_OR_RETURN(const uint64_t base_nonfinite,
                          unsigned_field(*stats, "base_nonfinite", elements, where + "stats "));
    s.nonfinite = static_cast<int64_t>(nonfinite);
    s.base_nonfinite = static_cast<int64_t>(base_nonfinite);
    tensors.push_back(std::move(tensor));
  }
  // Extents must not overlap; gaps (the writer's alignment padding) are allowed.
  std::vector<const CfdFile::Tensor*> by_offset;
  for (const auto& t : tensors) {
    if (t.size > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->size < b->size;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->offset < by_offset[i - 1]->offset + by_offset[i - 1]->size) {
      return corrupt(source,
                     fmt::format("tensor '{}' overlaps tensor '{}'", by_offset[i]->name, by_offset[i - 1]->name));
    }
  }
  return {};
}

}  // namespace

Status CfdFile::read_at(uint64_t offset, std::span<std::byte> out, const Tensor& tensor, size_t frame) const {
  const std::string what = frame_label(tensor, frame);
  if (storage_->fd) return pread_all(storage_->fd.get(), offset, out, source_, what);
  const auto& bytes = storage_->bytes;
  if (offset > bytes.size() || out.size() > bytes.size() - offset) return corrupt(source_, what + ": truncated file");
  if (!out.empty()) std::memcpy(out.data(), bytes.data() + offset, out.size());
  return {};
}

Result<CfdFile> CfdFile::load(std::unique_ptr<Storage> storage, uint64_t file_size, std::string source,
                              const CfdLimits& limits) {
  CfdFile file;
  file.source_ = std::move(source);
  file.storage_ = std::move(storage);
  file.file_size_ = file_size;
  file.limits_ = limits;
  const std::string& name = file.source_;
  auto read = [&](uint64_t offset, std::span<std::byte> out, std::string_view what) -> Status {
    if (file.storage_->fd) return pread_all(file.storage_->fd.get(), offset, out, name, what);
    if (!out.empty()) std::memcpy(out.data(), file.storage_->bytes.data() + offset, out.size());
    return {};
  };
  if (file_size < kPreludeBytes) return corrupt(name, "too short for a .cfd file");
  std::array<std::byte, kPreludeBytes> prelude{};
  CFMO_TRY(read(0, prelude, "prelude"));
  if (std::memcmp(prelude.data(), kMagic.data(), kMagic.size()) != 0)
    return corrupt(name, "not a .cfd file (bad magic)");
  const uint32_t version = read_le32(prelude.data() + 8);
  if (version != kVersion) {
    return corrupt(name, fmt::format("unsupported .cfd version {} (this reader knows {})", version, kVersion));
  }
  const uint32_t flags = read_le32(prelude.data() + 12);
  if (flags != 0) return corrupt(name, fmt::format("unknown flags 0x{:x}", flags));
  const uint64_t header_length = read_le64(prelude.data() + 16);
  // Bounded before anything is allocated.
  if (header_length > limits.max_header_bytes) {
    return corrupt(name,
                   fmt::format("header of {} bytes exceeds the limit of {}", header_length, limits.max_header_bytes));
  }
  if (header_length > file_size - kPreludeBytes) {
    return corrupt(
        name, fmt::format("truncated header ({} bytes, {} in the file)", header_length, file_size - kPreludeBytes));
  }
  if ((kPreludeBytes + header_length) % kAlignment != 0) {
    return corrupt(name,
                   fmt::format("header of {} bytes does not end on a {}-byte boundary", header_length, kAlignment));
  }
  std::string header(header_length, '\0');
  CFMO_TRY(read(kPreludeBytes, std::as_writable_bytes(std::span(header)), "header"));
  if (XXH3_64bits(header.data(), header.size()) != read_le64(prelude.data() + 24)) {
    return corrupt(name, "header checksum mismatch (corrupt header)");
  }
  CFMO_TRY(parse_header(name, header, kPreludeBytes + header_length, file_size, limits, file.info_, file.tensors_));
  return file;
}

Result<CfdFile> CfdFile::open(const std::filesystem::path& path, const CfdLimits& limits) {
  auto storage = std::make_unique<Storage>();
  storage->fd.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!storage->fd) return corrupt(path.string(), fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st {};
  if (::fstat(storage->fd.get(), &st) != 0)
    return corrupt(path.string(), fmt::format("cannot stat: {}", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return corrupt(path.string(), "not a regular file");
  return load(std::move(storage), static_cast<uint64_t>(st.st_size), path.string(), limits);
}

Result<CfdFile> CfdFile::parse(std::string bytes, const std::string& source, const CfdLimits& limits) {
  auto storage = std::make_unique<Storage>();
  const uint64_t size = bytes.size();
  storage->bytes = std::move(bytes);
  return load(std::move(storage), size, source, limits);
}

// Reads a frame's stored bytes into a per-thread buffer.
Result<std::span<const std::byte>> CfdFile::stored_frame(const Tensor& tensor, size_t frame) const {
  if (frame >= tensor.frames.size()) {
    return make_error(ErrorKind::kInternal, "'{}': {}: no such frame", source_, frame_label(tensor, frame));
  }
  const Frame& f = tensor.frames[frame];
  thread_local std::vector<std::byte> stored;
  stored.resize(f.size);
  CFMO_TRY(read_at(f.offset, stored, tensor, frame));
  return std::span<const std::byte>(stored);
}

Status CfdFile::decode_frame(const Tensor& tensor, size_t frame, std::span<float> out) const {
  CFMO_ASSIGN_OR_RETURN(auto stored, stored_frame(tensor, frame));
  const Frame& f = tensor.frames[frame];
  if (out.size() != static_cast<size_t>(f.elements)) {
    return make_error(ErrorKind::kInternal, "'{}': {}: output of {} values, expected {}", source_,
                      frame_label(tensor, frame), out.size(), f.elements);
  }
  return cfd_decode_chunk(stored, tensor.codec, tensor.transform, f.checksum, out,
                          fmt::format("'{}': {}", source_, frame_label(tensor, frame)));
}

Status CfdFile::decode(const Tensor& tensor, std::span<float> out) const {
  if (out.size() != static_cast<size_t>(tensor.elements)) {
    return make_error(ErrorKind::kInternal, "'{}': tensor '{}': output of {} values, expected {}", source_, tensor.name,
                      out.size(), tensor.elements);
  }
  for (size_t k = 0; k < tensor.frames.size(); ++k) {
    const Frame& f = tensor.frames[k];
    CFMO_TRY(decode_frame(tensor, k, out.subspan(static_cast<size_t>(f.first), static_cast<size_t>(f.elements))));
  }
  return {};
}

Result<DeltaStats> CfdFile::reduce_frame(const Tensor& tensor, size_t frame) const {
  CFMO_ASSIGN_OR_RETURN(auto stored, stored_frame(tensor, frame));
  const Frame& f = tensor.frames[frame];
  return cfd_reduce_chunk(stored, tensor.codec, tensor.transform, f.checksum, static_cast<size_t>(f.elements),
                          fmt::format("'{}': {}", source_, frame_label(tensor, frame)));
}

Status CfdFile::check_reduced(const Tensor& tensor, const DeltaStats& reduced) const {
  const DeltaStats& h = tensor.stats;
  // The reduction reads values in storage order, so its sum of squares may
  // differ from the writer's in the last bits; the maximum and count are exact.
  const double tolerance = 1e-9 * std::max(h.delta_sq, reduced.delta_sq);
  if (reduced.elements != h.elements || std::fabs(reduced.delta_sq - h.delta_sq) > tolerance ||
      reduced.max_abs != h.max_abs || reduced.nonfinite != h.nonfinite) {
    return make_error(ErrorKind::kInput,
                      "'{}': tensor '{}': the header's statistics disagree with the data (delta_sq {} vs {}, "
                      "max_abs {} vs {}, nonfinite {} vs {})",
                      source_, tensor.name, h.delta_sq, reduced.delta_sq, h.max_abs, reduced.max_abs, h.nonfinite,
                      reduced.nonfinite);
  }
  return {};
}

Result<DeltaStats> CfdFile::verify(const Tensor& tensor, int threads) const {
  std::vector<Result<DeltaStats>> parts(tensor.frames.size(), DeltaStats{});
  parallel_for(tensor.frames.size(), threads, "cfd-verify", [&](size_t k) { parts[k] = reduce_frame(tensor, k); });
  DeltaStats reduced;
  for (auto& part : parts) {
    if (!part) return std::move(part).error();
    reduced.merge(*part);
  }
  CFMO_TRY(check_reduced(tensor, reduced));
  return tensor.stats;
}

}  // namespace cfmo::ckpt
