#include "data/tokens.h"

#include "core/fd.h"
#include "core/rng.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <iterator>
#include <set>
#include <string_view>

namespace cfmo::data {
namespace {

namespace fs = std::filesystem;

// llm.c writes its headers and tokens little-endian and so does every host
// cfmo builds on; tokens are read in place, without a byte swap.
static_assert(std::endian::native == std::endian::little, "token files are little-endian");

constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;
// Keeps the windows' generator apart from the other seeded draws of a run.
constexpr uint64_t kWindowStreamTag = 0x746F6B656E73ULL;  // "tokens"

/// A whole file mapped read-only; unmapped with the last view of it.
class MappedFile {
 public:
  static Result<std::shared_ptr<const MappedFile>> open(const fs::path& path) {
    const Fd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    const int fd = file.get();
    if (!file) return make_error(ErrorKind::kInput, "'{}': cannot open: {}", path.string(), std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      return make_error(ErrorKind::kInput, "'{}': cannot stat: {}", path.string(), std::strerror(errno));
    }
    const auto size = static_cast<size_t>(st.st_size);
    void* map = nullptr;  // mmap refuses a length of 0: an empty file maps nothing
    if (size > 0) {
      map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (map == MAP_FAILED) {
        return make_error(ErrorKind::kInput, "'{}': cannot map: {}", path.string(), std::strerror(errno));
      }
    }
    // The mapping stays valid once the descriptor is closed.
    return std::shared_ptr<const MappedFile>(std::make_shared<MappedFile>(static_cast<const uint8_t*>(map), size));
  }

  /// Takes ownership of the mapping [data, data + size) (nullptr for an empty file).
  MappedFile(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  ~MappedFile() {
    if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_;
  size_t size_;
};

struct GlobResult {
  glob_t value{};
  ~GlobResult() { globfree(&value); }
};

bool has_glob_chars(std::string_view s) { return s.find_first_of("*?[") != std::string_view::npos; }

// What a directory or a glob contributes to text: fortune(6)'s directory
// holds each text beside its .dat index (binary offsets, not text), and
// hidden files are editors' and tools' business.
bool is_text_candidate(const fs::path& path) {
  const std::string name = path.filename().string();
  if (name.empty() || name.front() == '.' || path.extension() == ".dat") return false;
  std::error_code ec;
  return fs::is_regular_file(path, ec);  // follows symlinks; skips directories and dangling links
}

/// The files a glob matches, sorted by name (independent of the locale).
Result<std::vector<fs::path>> expand_glob(const std::string& pattern, std::string_view spec) {
  GlobResult matches;
  const int rc = glob(pattern.c_str(), 0, nullptr, &matches.value);
  if (rc == GLOB_NOMATCH) return make_error(ErrorKind::kInput, "{}: no file matches '{}'", spec, pattern);
  if (rc != 0) return make_error(ErrorKind::kInput, "{}: cannot expand '{}'", spec, pattern);
  std::vector<fs::path> paths(matches.value.gl_pathv, matches.value.gl_pathv + matches.value.gl_pathc);
  std::sort(paths.begin(), paths.end());
  return paths;
}

/// The text files a directory or a glob contributes, in name order.
Result<std::vector<fs::path>> text_files_in(const std::string& item, bool is_directory, std::string_view spec) {
  std::vector<fs::path> found;
  if (is_directory) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(item, ec)) {
      if (is_text_candidate(entry.path())) found.push_back(entry.path());
    }
    if (ec) return make_error(ErrorKind::kInput, "{}: cannot list '{}': {}", spec, item, ec.message());
    std::sort(found.begin(), found.end());
  } else {
    CFMO_ASSIGN_OR_RETURN(std::vector<fs::path> matches, expand_glob(item, spec));
    std::copy_if(matches.begin(), matches.end(), std::back_inserter(found), is_text_candidate);
  }
  if (found.empty()) {
    return make_error(ErrorKind::kInput, "{}: {} '{}' holds no text file", spec, is_directory ? "directory" : "glob",
                      item);
  }
  return found;
}

/// The files of a text: spec, in order, each once.
Result<std::vector<fs::path>> text_files(std::string_view list, std::string_view spec) {
  std::vector<std::string> items;
  for (size_t pos = 0; pos <= list.size();) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    items.emplace_back(list.substr(pos, comma - pos));
    if (items.back().empty()) return make_error(ErrorKind::kUsage, "{}: an empty file name", spec);
    pos = comma + 1;
  }
  std::vector<fs::path> files;
  std::set<fs::path> seen;  // canonical paths: a symlink to a file already read adds nothing
  auto add = [&](const fs::path& path) {
    std::error_code ec;
    fs::path canonical = fs::canonical(path, ec);
    if (ec) canonical = path;
    if (seen.insert(canonical).second) files.push_back(path);
  };
  for (const std::string& item : items) {
    std::error_code ec;
    const bool is_directory = fs::is_directory(item, ec);
    if (is_directory || (has_glob_chars(item) && !fs::exists(item, ec))) {
      CFMO_ASSIGN_OR_RETURN(std::vector<fs::path> found, text_files_in(item, is_directory, spec));
      for (const auto& path : found) add(path);
    } else if (fs::is_regular_file(item, ec)) {
      add(item);
    } else {
      return make_error(ErrorKind::kInput, "'{}': no such file", item);
    }
  }
  return files;
}

/// The first token at or above `vocab` in `count` tokens of `width` bytes, or -1.
int64_t first_out_of_vocab(const void* data, int width, int64_t count, int vocab) {
  auto scan = [&](const auto* tokens) -> int64_t {
    // A branch-free maximum first (vectorised), the position only on failure.
    uint32_t high = 0;
    for (int64_t i = 0; i < count; ++i) high = std::max<uint32_t>(high, tokens[i]);
    if (high < static_cast<uint32_t>(vocab)) return -1;
    for (int64_t i = 0; i < count; ++i) {
      if (tokens[i] >= static_cast<uint32_t>(vocab)) return i;
    }
    return -1;
  };
  if (width == 1) return scan(static_cast<const uint8_t*>(data));
  return scan(static_cast<const uint16_t*>(data));
}

Status check_vocab(const TokenStream::Segment& segment, const fs::path& path, int64_t header_bytes, int vocab) {
  // Text under a vocabulary of 256 or more cannot be out of range: no pass over it.
  if (segment.width == 1 && vocab >= kByteVocabSize) return {};
  const int64_t bad = first_out_of_vocab(segment.data, segment.width, segment.count, vocab);
  if (bad < 0) return {};
  const int token = segment.width == 1 ? static_cast<const uint8_t*>(segment.data)[bad]
                                       : static_cast<const uint16_t*>(segment.data)[bad];
  return make_error(ErrorKind::kInput, "'{}': token {} at byte {} is outside the vocabulary of {}", path.string(),
                    token, header_bytes + bad * segment.width, vocab);
}

struct Loaded {
  std::vector<TokenStream::Segment> segments;
  std::string what;  ///< "3 files" / "2 shards"
};

Result<Loaded> load_text(std::string_view list, std::string_view spec, int vocab) {
  CFMO_ASSIGN_OR_RETURN(std::vector<fs::path> files, text_files(list, spec));
  Loaded loaded;
  for (const auto& path : files) {
    CFMO_ASSIGN_OR_RETURN(auto file, MappedFile::open(path));
    if (file->size() == 0) continue;
    TokenStream::Segment segment{
        .owner = file, .data = file->data(), .width = 1, .count = static_cast<int64_t>(file->size())};
    CFMO_TRY(check_vocab(segment, path, 0, vocab));
    loaded.segments.push_back(std::move(segment));
  }
  loaded.what = fmt::format("{} file{}", files.size(), files.size() == 1 ? "" : "s");
  return loaded;
}

Result<TokenStream::Segment> open_llmc_shard(const fs::path& path) {
  CFMO_ASSIGN_OR_RETURN(auto file, MappedFile::open(path));
  const auto bytes = static_cast<int64_t>(file->size());
  if (bytes < kLlmcHeaderBytes) {
    return make_error(ErrorKind::kInput, "'{}': {} bytes, shorter than llm.c's {}-byte header", path.string(), bytes,
                      kLlmcHeaderBytes);
  }
  int32_t header[3];
  std::memcpy(header, file->data(), sizeof header);
  if (header[0] != kLlmcTokenMagic) {
    return make_error(ErrorKind::kInput, "'{}': magic {}, not llm.c's token-file magic {}", path.string(), header[0],
                      kLlmcTokenMagic);
  }
  if (header[1] != kLlmcTokenVersion) {
    return make_error(ErrorKind::kInput, "'{}': token-file version {}; only version {} (uint16 tokens) is read",
                      path.string(), header[1], kLlmcTokenVersion);
  }
  const int64_t count = header[2];
  if (count < 0 || kLlmcHeaderBytes + 2 * count != bytes) {
    return make_error(ErrorKind::kInput, "'{}': the header counts {} tokens but the file holds {} bytes of tokens",
                      path.string(), count, bytes - kLlmcHeaderBytes);
  }
  return TokenStream::Segment{.owner = file, .data = file->data() + kLlmcHeaderBytes, .width = 2, .count = count};
}

Result<Loaded> load_llmc(const std::string& pattern, std::string_view spec, int vocab) {
  CFMO_ASSIGN_OR_RETURN(std::vector<fs::path> files, expand_glob(pattern, spec));
  Loaded loaded;
  for (const auto& path : files) {
    CFMO_ASSIGN_OR_RETURN(TokenStream::Segment segment, open_llmc_shard(path));
    CFMO_TRY(check_vocab(segment, path, kLlmcHeaderBytes, vocab));
    if (segment.count > 0) loaded.segments.push_back(std::move(segment));
  }
  loaded.what = fmt::format("{} shard{}", files.size(), files.size() == 1 ? "" : "s");
  return loaded;
}

Result<Loaded> load_spec(const std::string& spec, int vocab) {
  if (spec.starts_with("text:")) return load_text(std::string_view(spec).substr(5), spec, vocab);
  if (spec.starts_with("tokens:")) {
    const std::string pattern = spec.substr(7);
    if (pattern.empty()) return make_error(ErrorKind::kUsage, "'{}': no file pattern after 'tokens:'", spec);
    return load_llmc(pattern, spec, vocab);
  }
  return make_error(ErrorKind::kUsage, "'{}': token data is 'text:FILE[,FILE...]' or 'tokens:PATTERN'", spec);
}

/// One generator per (seed, rank, step): no state carried from step to step,
/// so a run resumed at step s draws what the first run drew there.
Rng window_generator(uint64_t seed, int rank, int64_t step) {
  return Rng(seed ^ kWindowStreamTag ^ (static_cast<uint64_t>(rank) * 0x9E3779B97F4A7C15ULL),
             static_cast<uint64_t>(step));
}

Status check_split(const TokenStream& split, std::string_view name, std::string_view spec, int context) {
  if (split.size() == 0) return make_error(ErrorKind::kInput, "{}: the {} split is empty", spec, name);
  if (context > 0 && split.size() < int64_t{context} + 1) {
    return make_error(ErrorKind::kInput, "{}: the {} split holds {} tokens, fewer than a window of context + 1 = {}",
                      spec, name, split.size(), context + 1);
  }
  return {};
}

}  // namespace

TokenStream::TokenStream(std::vector<Segment> segments) : segments_(std::move(segments)) {
  offsets_.reserve(segments_.size());
  for (const auto& segment : segments_) {
    offsets_.push_back(size_);
    size_ += segment.count;
  }
}

void TokenStream::copy(int64_t start, int64_t n, int32_t* out) const {
  // The last segment that starts at or before `start`.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), start);
  auto index = static_cast<size_t>(it - offsets_.begin()) - 1;
  int64_t within = start - offsets_[index];
  while (n > 0) {
    const Segment& segment = segments_[index];
    const int64_t take = std::min(n, segment.count - within);
    if (segment.width == 1) {
      const uint8_t* from = static_cast<const uint8_t*>(segment.data) + within;
      for (int64_t i = 0; i < take; ++i) out[i] = from[i];
    } else {
      const uint16_t* from = static_cast<const uint16_t*>(segment.data) + within;
      for (int64_t i = 0; i < take; ++i) out[i] = from[i];
    }
    out += take;
    n -= take;
    within = 0;
    ++index;
  }
}

TokenStream TokenStream::slice(int64_t first, int64_t count) const {
  std::vector<Segment> parts;
  for (size_t i = 0; i < segments_.size() && count > 0; ++i) {
    const int64_t begin = offsets_[i];
    const int64_t end = begin + segments_[i].count;
    if (end <= first) continue;
    const int64_t skip = std::max<int64_t>(0, first - begin);
    const int64_t take = std::min(count, segments_[i].count - skip);
    Segment part = segments_[i];
    part.data = static_cast<const uint8_t*>(part.data) + skip * part.width;
    part.count = take;
    parts.push_back(std::move(part));
    first += take;
    count -= take;
  }
  return TokenStream(std::move(parts));
}

TokenStream TokenStream::from_bytes(std::vector<uint8_t> bytes) {
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
  if (owned->empty()) return TokenStream();
  return TokenStream(
      {Segment{.owner = owned, .data = owned->data(), .width = 1, .count = static_cast<int64_t>(owned->size())}});
}

bool is_token_spec(const std::string& spec) { return spec.starts_with("text:") || spec.starts_with("tokens:"); }

Result<TokenSplit> load_tokens(const TokenDataOptions& options) {
  if (options.val_spec.empty() && !(options.val_split > 0.0 && options.val_split < 1.0)) {
    return make_error(ErrorKind::kUsage, "--val-split {}: must lie between 0 and 1", options.val_split);
  }
  if (options.vocab_size < 0 || options.context < 0 || options.val_tokens < 0) {
    return make_error(ErrorKind::kUsage, "{}: negative vocabulary, context or validation budget", options.spec);
  }
  const int vocab = options.vocab_size > 0                ? options.vocab_size
                    : options.spec.starts_with("tokens:") ? kGpt2VocabSize
                                                          : kByteVocabSize;
  CFMO_ASSIGN_OR_RETURN(Loaded train, load_spec(options.spec, vocab));

  TokenSplit split;
  split.vocab_size = vocab;
  if (options.val_spec.empty()) {
    TokenStream all(std::move(train.segments));
    const auto val_count = static_cast<int64_t>(std::floor(static_cast<double>(all.size()) * options.val_split));
    split.train = all.slice(0, all.size() - val_count);
    split.val = all.slice(all.size() - val_count, val_count);
    split.source = fmt::format("{} ({}, {} tokens; the last {} validate)", options.spec, train.what, all.size(),
                               options.val_split);
  } else {
    CFMO_ASSIGN_OR_RETURN(Loaded val, load_spec(options.val_spec, vocab));
    split.train = TokenStream(std::move(train.segments));
    split.val = TokenStream(std::move(val.segments));
    split.source = fmt::format("{} ({}, {} tokens); validation {} ({}, {} tokens)", options.spec, train.what,
                               split.train.size(), options.val_spec, val.what, split.val.size());
  }
  if (options.val_tokens > 0 && options.val_tokens < split.val.size()) {
    split.val = split.val.slice(0, options.val_tokens);
  }
  CFMO_TRY(check_split(split.train, "training", options.spec, options.context));
  CFMO_TRY(check_split(split.val, "validation", options.val_spec.empty() ? options.spec : options.val_spec,
                       options.context));
  return split;
}

Result<WindowSampler> WindowSampler::make(int64_t train_tokens, int context, int rank, int world, uint64_t seed) {
  if (context < 1 || world < 1 || rank < 0 || rank >= world) {
    return make_error(ErrorKind::kUsage, "windows: context {} and rank {} of {} workers", context, rank, world);
  }
  const int64_t begin = static_cast<int64_t>(static_cast<uint128_t>(train_tokens) * rank / world);
  const int64_t end = static_cast<int64_t>(static_cast<uint128_t>(train_tokens) * (rank + 1) / world);
  if (end - begin < int64_t{context} + 1) {
    return make_error(ErrorKind::kInput,
                      "the training split of {} tokens gives worker {} of {} a part of {}, fewer than a window of "
                      "context + 1 = {}",
                      train_tokens, rank, world, end - begin, context + 1);
  }
  return WindowSampler(begin, end, context, rank, seed);
}

void WindowSampler::starts(int64_t step, std::span<int64_t> out) const {
  Rng rng = window_generator(seed_, rank_, step);
  for (auto& start : out) start = begin_ + static_cast<int64_t>(rng.below(start_choices()));
}

void WindowSampler::fill(const TokenStream& train, int64_t step, int batch, int32_t* out) const {
  // Draws as starts() does, without a buffer: this runs in the step loop.
  Rng rng = window_generator(seed_, rank_, step);
  const int64_t window = int64_t{context_} + 1;
  for (int b = 0; b < batch; ++b) {
    train.copy(begin_ + static_cast<int64_t>(rng.below(start_choices())), window, out + b * window);
  }
}

int64_t val_window_count(int64_t val_tokens, int context) {
  if (context < 1 || val_tokens < int64_t{context} + 1) return 0;
  return (val_tokens - 1) / context;
}

}  // namespace cfmo::data
