#pragma once
/// Token data for language models: a sequence of token ids read from text
/// (one token per byte) or from llm.c's token shards, split into training and
/// validation tokens, and the windows of context+1 tokens a model trains and
/// is evaluated on.
///
/// Files are memory-mapped, never read whole into memory: a FineWeb shard is
/// 200 MB and a run may name dozens. A TokenStream is a view over one or more
/// mapped files; it copies token ids out as int32 a window at a time.
///
/// Specs (the value of `--data` / `--val-data`):
///   text:ITEM[,ITEM...]   each ITEM a file, a directory (its regular files,
///                         not recursive, sorted by name, skipping hidden
///                         files and *.dat, as fortune(6) keeps its indexes
///                         there) or a glob; a file reached twice (a symlink
///                         to a file already named) is read once. The files'
///                         bytes are concatenated in that order.
///   tokens:PATTERN        a glob of llm.c token files, in sorted order: a
///                         header of 256 little-endian int32 (magic 20240520,
///                         version 1, token count), then that many uint16.
/// Without a separate validation spec the validation split is the last
/// `val_split` share of the tokens (rounded down), the rest trains.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cfmo::data {

/// The magic and version of llm.c's token files (llm.c dev/data/data_common.py).
inline constexpr int32_t kLlmcTokenMagic = 20240520;
inline constexpr int32_t kLlmcTokenVersion = 1;
inline constexpr int kLlmcHeaderInts = 256;
/// GPT-2's vocabulary: the default for token files.
inline constexpr int kGpt2VocabSize = 50257;
/// One token per byte.
inline constexpr int kByteVocabSize = 256;

/// A read-only sequence of token ids over one or more mapped files (or parts
/// of them). Cheap to copy: views share the mappings.
class TokenStream {
 public:
  int64_t size() const { return size_; }
  /// Writes tokens [start, start + n) to `out`, across file boundaries.
  /// Precondition: 0 <= start, start + n <= size().
  void copy(int64_t start, int64_t n, int32_t* out) const;
  /// Tokens [first, first + count) as a stream of their own.
  TokenStream slice(int64_t first, int64_t count) const;

  /// A stream over bytes held in memory (tests, `sample --prompt`).
  static TokenStream from_bytes(std::vector<uint8_t> bytes);

  /// One contiguous run of tokens inside one file. Public so tokens.cpp's
  /// loaders can build streams; users need only the members above.
  struct Segment {
    std::shared_ptr<const void> owner;  ///< keeps the mapping (or the bytes) alive
    const void* data = nullptr;         ///< the first token of this segment
    int width = 1;                      ///< bytes per token: 1 (text) or 2 (uint16)
    int64_t count = 0;
  };
  TokenStream() = default;
  explicit TokenStream(std::vector<Segment> segments);

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> offsets_;  ///< offsets_[i]: the stream position of segments_[i]'s first token
  int64_t size_ = 0;
};

struct TokenDataOptions {
  std::string spec;        ///< "text:..." or "tokens:..."
  std::string val_spec;    ///< "" or "tokens:..."/"text:...": validation from separate files
  double val_split = 0.1;  ///< without val_spec: the share of the tokens that validates
  int vocab_size = 0;      ///< 0: 256 for text, kGpt2VocabSize for token files
  int context = 0;         ///< > 0: each split must hold at least context + 1 tokens
  int64_t val_tokens = 0;  ///< > 0: validate on the first N validation tokens only
};

struct TokenSplit {
  TokenStream train;
  TokenStream val;
  int vocab_size = 0;
  std::string source;  ///< what was read, for the summary: "SPEC (N files, M tokens; ...)"
};

/// True where `spec` names token data ("text:" or "tokens:"), so the caller
/// can tell it from an image data set.
bool is_token_spec(const std::string& spec);

/// Reads (maps) the files of `options.spec` (and `val_spec`) and splits them.
/// Every failure is kInput with one line naming the file or the spec: no file
/// matching, wrong magic or version, a header count that disagrees with the
/// file's size, a token id >= the vocabulary, an empty split, a split shorter
/// than context + 1 tokens. A malformed spec or option is kUsage.
Result<TokenSplit> load_tokens(const TokenDataOptions& options);

/// Where the training windows of one worker start: rank r of W draws from
/// the r-th of W equal contiguous parts of the training tokens (so workers
/// never share a window), uniformly, from a generator keyed by (seed, rank,
/// step) only, so a resumed run draws the same windows from its step counter.
class WindowSampler {
 public:
  /// kInput if a part is shorter than context + 1 tokens.
  static Result<WindowSampler> make(int64_t train_tokens, int context, int rank, int world, uint64_t seed);

  /// The starts of step `step`'s `out.size()` windows (each window is
  /// tokens [start, start + context], context + 1 of them).
  void starts(int64_t step, std::span<int64_t> out) const;
  /// Copies step `step`'s `batch` windows into `out` [batch, context + 1].
  void fill(const TokenStream& train, int64_t step, int batch, int32_t* out) const;

  int context() const { return context_; }
  int64_t part_begin() const { return begin_; }
  int64_t part_end() const { return end_; }

 private:
  WindowSampler(int64_t begin, int64_t end, int context, int rank, uint64_t seed)
      : begin_(begin), end_(end), context_(context), rank_(rank), seed_(seed) {}
  /// Starts s with s + context < end_: the window's last token is inside the part.
  uint64_t start_choices() const { return static_cast<uint64_t>(end_ - begin_ - context_); }
  int64_t begin_ = 0;  ///< this rank's part of the training tokens: [begin_, end_)
  int64_t end_ = 0;
  int context_ = 0;
  int rank_ = 0;
  uint64_t seed_ = 0;
};

/// The validation windows, defined so anyone can recompute val_loss: the
/// validation tokens cut into consecutive windows of context + 1 tokens that
/// overlap by one, window i starting at token i * context; a last incomplete
/// window is dropped. val_loss is the mean cross-entropy over every predicted
/// token (context per window) of every window.
int64_t val_window_count(int64_t val_tokens, int context);
inline int64_t val_window_start(int64_t window, int context) { return window * context; }

}  // namespace cfmo::data
