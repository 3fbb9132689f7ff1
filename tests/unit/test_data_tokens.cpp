#include "data/tokens.h"
#include "support/expect_error.h"

#include "integration/harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace cfmo::data {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void put_le32(std::string& out, int32_t value) {
  const auto u = static_cast<uint32_t>(value);
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>((u >> shift) & 0xFF));
}

// An llm.c token file built byte by byte, as llm.c's write_datafile does,
// independently of the reader under test; the header fields can be wrong on purpose.
std::string llmc_file(const std::vector<uint16_t>& tokens, int32_t magic = kLlmcTokenMagic,
                      int32_t version = kLlmcTokenVersion, int64_t header_count = -1) {
  std::string out;
  put_le32(out, magic);
  put_le32(out, version);
  put_le32(out, static_cast<int32_t>(header_count >= 0 ? header_count : static_cast<int64_t>(tokens.size())));
  out.resize(256 * 4, '\0');
  for (uint16_t t : tokens) {
    out.push_back(static_cast<char>(t & 0xFF));
    out.push_back(static_cast<char>(t >> 8));
  }
  return out;
}

void write_file(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::vector<uint16_t> iota_tokens(int n, uint16_t first) {
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

std::vector<int32_t> all_of(const TokenStream& stream) {
  std::vector<int32_t> out(static_cast<size_t>(stream.size()));
  if (!out.empty()) stream.copy(0, stream.size(), out.data());
  return out;
}

TokenDataOptions options_for(std::string spec) {
  TokenDataOptions options;
  options.spec = std::move(spec);
  return options;
}

TEST(Tokens, TextIsOneTokenPerByteAndTheLastShareValidates) {
  TempDir dir;
  write_file(dir / "a.txt", "hello ");
  write_file(dir / "b.txt", std::string("w\xC3\xB6rld\x00\xFF", 8));
  auto split = load_tokens(options_for(fmt::format("text:{},{}", (dir / "a.txt").string(), (dir / "b.txt").string())));
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->vocab_size, 256);
  // 14 bytes: floor(1.4) = 1 validates, 13 train.
  ASSERT_EQ(split->train.size(), 13);
  ASSERT_EQ(split->val.size(), 1);
  const std::vector<int32_t> train = all_of(split->train);
  EXPECT_EQ(train[0], 'h');
  EXPECT_EQ(train[6], 'w');
  EXPECT_EQ(train[7], 0xC3);  // bytes, not code points
  EXPECT_EQ(train[12], 0);
  EXPECT_EQ(all_of(split->val), std::vector<int32_t>{0xFF});
}

TEST(Tokens, ADirectoryReadsItsTextFilesOnceSkippingIndexes) {
  TempDir dir;
  // The layout of Debian's fortunes: each text beside its .dat index and a .u8 symlink to it.
  write_file(dir / "b", "BB");
  write_file(dir / "b.dat", "index");
  write_file(dir / "a", "A");
  fs::create_symlink(dir / "a", dir / "a.u8");
  write_file(dir / ".hidden", "hh");
  fs::create_directory(dir / "sub");
  write_file(dir / "sub" / "c", "CCC");
  TokenDataOptions options = options_for("text:" + dir.path().string());
  options.val_split = 0.34;  // floor(3 x 0.34) = 1
  auto split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(all_of(split->train), (std::vector<int32_t>{'A', 'B'}));
  EXPECT_EQ(all_of(split->val), (std::vector<int32_t>{'B'}));
  EXPECT_NE(split->source.find("2 files"), std::string::npos) << split->source;

  // A glob skips the same files; a file named twice is read once.
  options.spec = fmt::format("text:{}/b,{}/*", dir.path().string(), dir.path().string());
  split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->train.size() + split->val.size(), 3);
  EXPECT_EQ(all_of(split->train), (std::vector<int32_t>{'B', 'B'}));
  options.spec = fmt::format("text:{}/*.dat", dir.path().string());
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kInput, {"*.dat", "no text file"}));
}

TEST(Tokens, DebiansFortunesAreTheirTextsOnce) {
  const fs::path dir = "/usr/share/games/fortunes";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "Debian's fortunes is not installed (scripts/install-deps.sh)";
  // Counted independently: the plain files (not the .u8 symlinks to them, not the .dat indexes).
  int64_t bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && !entry.is_symlink() && entry.path().extension() != ".dat" &&
        entry.path().filename().string().front() != '.') {
      bytes += static_cast<int64_t>(entry.file_size());
    }
  }
  auto split = load_tokens(options_for("text:" + dir.string()));
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->train.size() + split->val.size(), bytes);
  EXPECT_EQ(split->val.size(), bytes / 10);
}

TEST(Tokens, ShardsAreReadInNameOrderAcrossBoundaries) {
  TempDir dir;
  write_file(dir / "data_train_000001.bin", llmc_file(iota_tokens(5, 100)));
  write_file(dir / "data_train_000000.bin", llmc_file(iota_tokens(4, 0)));
  write_file(dir / "data_train_000002.bin", llmc_file({}));  // empty shards add nothing
  write_file(dir / "data_val_000000.bin", llmc_file({50256, 7, 8, 9}));
  TokenDataOptions options = options_for("tokens:" + (dir / "data_train_*.bin").string());
  options.val_spec = "tokens:" + (dir / "data_val_*.bin").string();
  options.context = 3;
  auto split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->vocab_size, kGpt2VocabSize);
  EXPECT_EQ(all_of(split->train), (std::vector<int32_t>{0, 1, 2, 3, 100, 101, 102, 103, 104}));
  EXPECT_EQ(all_of(split->val), (std::vector<int32_t>{50256, 7, 8, 9}));
  EXPECT_NE(split->source.find("3 shards"), std::string::npos) << split->source;

  // A window across the shard boundary, and a slice of a slice.
  std::vector<int32_t> window(4);
  split->train.copy(2, 4, window.data());
  EXPECT_EQ(window, (std::vector<int32_t>{2, 3, 100, 101}));
  const TokenStream middle = split->train.slice(3, 5).slice(1, 3);
  EXPECT_EQ(all_of(middle), (std::vector<int32_t>{100, 101, 102}));

  // Without a validation pattern the last share of the shards validates.
  options.val_spec.clear();
  options.val_split = 0.45;  // floor(9 x 0.45) = 4
  split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(all_of(split->val), (std::vector<int32_t>{101, 102, 103, 104}));
  EXPECT_EQ(split->train.size(), 5);
}

TEST(Tokens, ValTokensCapsTheValidationSplit) {
  TempDir dir;
  write_file(dir / "t.bin", llmc_file(iota_tokens(100, 0)));
  TokenDataOptions options = options_for("tokens:" + (dir / "t.bin").string());
  options.val_split = 0.5;
  options.val_tokens = 7;
  auto split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(all_of(split->val), (std::vector<int32_t>{50, 51, 52, 53, 54, 55, 56}));
  EXPECT_EQ(split->train.size(), 50);
}

TEST(Tokens, VocabularyCanBeGiven) {
  TempDir dir;
  write_file(dir / "t.bin", llmc_file({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  TokenDataOptions options = options_for("tokens:" + (dir / "t.bin").string());
  options.vocab_size = 11;
  auto split = load_tokens(options);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->vocab_size, 11);
  options.vocab_size = 10;
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kInput, {"t.bin", "token 10", "vocabulary of 10"}));
}

TEST(Tokens, BadTokenFilesNameTheFile) {
  TempDir dir;
  const std::vector<uint16_t> tokens = iota_tokens(20, 0);
  struct Case {
    std::string name;
    std::string bytes;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"magic.bin", llmc_file(tokens, 20240521), "magic 20240521"},
      {"version.bin", llmc_file(tokens, kLlmcTokenMagic, 2), "version 2"},
      {"count_high.bin", llmc_file(tokens, kLlmcTokenMagic, kLlmcTokenVersion, 21), "counts 21 tokens"},
      {"count_low.bin", llmc_file(tokens, kLlmcTokenMagic, kLlmcTokenVersion, 19), "counts 19 tokens"},
      {"odd.bin", llmc_file(tokens) + "x", "counts 20 tokens"},
      {"short.bin", std::string(100, '\0'), "shorter than"},
      {"vocab.bin", llmc_file({1, 2, 50257, 3}), "token 50257"},
  };
  for (const auto& c : cases) {
    write_file(dir / c.name, c.bytes);
    EXPECT_TRUE(
        fails_with(load_tokens(options_for("tokens:" + (dir / c.name).string())), ErrorKind::kInput, {c.name, c.says}))
        << c.name;
  }
  // A bad validation file is named too.
  write_file(dir / "good.bin", llmc_file(tokens));
  TokenDataOptions options = options_for("tokens:" + (dir / "good.bin").string());
  options.val_spec = "tokens:" + (dir / "magic.bin").string();
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kInput, {"magic.bin"}));
}

TEST(Tokens, MissingFilesAndEmptyOrShortSplitsAreBadInput) {
  TempDir dir;
  const std::string pattern = (dir / "none_*.bin").string();
  EXPECT_TRUE(fails_with(load_tokens(options_for("tokens:" + pattern)), ErrorKind::kInput, {pattern, "no file"}));
  const std::string missing = (dir / "missing.txt").string();
  EXPECT_TRUE(fails_with(load_tokens(options_for("text:" + missing)), ErrorKind::kInput, {missing}));
  fs::create_directory(dir / "empty");
  write_file(dir / "empty" / "x.dat", "index only");
  EXPECT_TRUE(
      fails_with(load_tokens(options_for("text:" + (dir / "empty").string())), ErrorKind::kInput, {"no text file"}));

  // Nine bytes: floor(0.9) = 0 validation tokens.
  write_file(dir / "nine.txt", "123456789");
  const std::string nine = "text:" + (dir / "nine.txt").string();
  EXPECT_TRUE(fails_with(load_tokens(options_for(nine)), ErrorKind::kInput, {nine, "validation split is empty"}));
  write_file(dir / "zero.txt", "");
  EXPECT_TRUE(fails_with(load_tokens(options_for("text:" + (dir / "zero.txt").string())), ErrorKind::kInput,
                         {"zero.txt", "empty"}));

  // 100 bytes: 90 train, 10 validate; a context of 10 needs 11.
  write_file(dir / "hundred.txt", std::string(100, 'x'));
  TokenDataOptions options = options_for("text:" + (dir / "hundred.txt").string());
  options.context = 9;
  EXPECT_TRUE(load_tokens(options));
  options.context = 10;
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kInput, {"hundred.txt", "validation split holds 10"}));
  options.context = 100;
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kInput, {"hundred.txt", "training split holds 90"}));
}

TEST(Tokens, MalformedSpecsAreUsageErrors) {
  EXPECT_TRUE(fails_with(load_tokens(options_for("bytes:x")), ErrorKind::kUsage, {"bytes:x"}));
  EXPECT_TRUE(fails_with(load_tokens(options_for("tokens:")), ErrorKind::kUsage, {"tokens:"}));
  EXPECT_TRUE(fails_with(load_tokens(options_for("text:a,,b")), ErrorKind::kUsage, {"text:a,,b"}));
  TokenDataOptions options = options_for("text:x");
  options.val_split = 1.0;
  EXPECT_TRUE(fails_with(load_tokens(options), ErrorKind::kUsage, {"--val-split"}));
  EXPECT_TRUE(is_token_spec("text:x"));
  EXPECT_TRUE(is_token_spec("tokens:x"));
  EXPECT_FALSE(is_token_spec("synthetic"));
}

TEST(Tokens, WindowsAreDeterministicAndDisjointAcrossRanks) {
  constexpr int64_t kTokens = 1000;
  constexpr int kContext = 16;
  constexpr int kWorld = 3;
  std::vector<std::set<int64_t>> covered(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    auto sampler = WindowSampler::make(kTokens, kContext, rank, kWorld, 42);
    ASSERT_TRUE(sampler) << sampler.error().message;
    EXPECT_EQ(sampler->part_begin(), kTokens * rank / kWorld);
    EXPECT_EQ(sampler->part_end(), kTokens * (rank + 1) / kWorld);
    for (int64_t step = 0; step < 200; ++step) {
      std::vector<int64_t> starts(8);
      sampler->starts(step, starts);
      for (int64_t start : starts) {
        ASSERT_GE(start, sampler->part_begin());
        ASSERT_LE(start + kContext, sampler->part_end() - 1);  // the last token of the window is in the part
        for (int64_t t = start; t <= start + kContext; ++t) covered[static_cast<size_t>(rank)].insert(t);
      }
    }
  }
  for (int a = 0; a < kWorld; ++a) {
    for (int b = a + 1; b < kWorld; ++b) {
      for (int64_t t : covered[static_cast<size_t>(a)]) EXPECT_EQ(covered[static_cast<size_t>(b)].count(t), 0u);
    }
  }
  // 1600 draws over 317 starts reach both ends of the part.
  EXPECT_EQ(*covered[0].begin(), 0);
  EXPECT_EQ(*covered[0].rbegin(), kTokens / kWorld - 1);

  // The same (seed, rank, step) gives the same windows, whatever came before; another seed or step does not.
  auto first = WindowSampler::make(kTokens, kContext, 1, kWorld, 42);
  auto again = WindowSampler::make(kTokens, kContext, 1, kWorld, 42);
  auto other = WindowSampler::make(kTokens, kContext, 1, kWorld, 43);
  std::vector<int64_t> a(16), b(16), c(16), d(16);
  first->starts(7, a);
  again->starts(3, d);
  again->starts(7, b);
  other->starts(7, c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
}

TEST(Tokens, FillCopiesTheWindowsAtTheDrawnStarts) {
  std::vector<uint8_t> bytes(200);
  std::iota(bytes.begin(), bytes.end(), uint8_t{0});
  const TokenStream train = TokenStream::from_bytes(bytes);
  auto sampler = WindowSampler::make(train.size(), 5, 0, 1, 9);
  ASSERT_TRUE(sampler);
  std::vector<int64_t> starts(4);
  sampler->starts(11, starts);
  std::vector<int32_t> windows(4 * 6);
  sampler->fill(train, 11, 4, windows.data());
  for (size_t w = 0; w < 4; ++w) {
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(windows[w * 6 + i], starts[w] + static_cast<int64_t>(i));
  }
}

TEST(Tokens, APartShorterThanAWindowIsBadInput) {
  EXPECT_TRUE(fails_with(WindowSampler::make(40, 10, 3, 4, 1), ErrorKind::kInput, {"worker 3 of 4", "10"}));
  EXPECT_TRUE(WindowSampler::make(44, 10, 3, 4, 1));
  EXPECT_TRUE(fails_with(WindowSampler::make(100, 10, 4, 4, 1), ErrorKind::kUsage));
}

TEST(Tokens, ValidationWindowsOverlapByOneAndDropTheLastIncompleteOne) {
  // 10 tokens, context 3: windows [0..3], [3..6], [6..9]; 9 predicted tokens.
  EXPECT_EQ(val_window_count(10, 3), 3);
  EXPECT_EQ(val_window_start(2, 3), 6);
  // 12 tokens: [9..12] would need a 13th; dropped.
  EXPECT_EQ(val_window_count(12, 3), 3);
  EXPECT_EQ(val_window_count(13, 3), 4);
  EXPECT_EQ(val_window_count(4, 3), 1);
  EXPECT_EQ(val_window_count(3, 3), 0);
  EXPECT_EQ(val_window_count(0, 3), 0);
  for (int64_t n = 4; n < 60; ++n) {
    const int64_t count = val_window_count(n, 3);
    EXPECT_LE(val_window_start(count - 1, 3) + 3, n - 1);  // the last window fits
    EXPECT_GT(val_window_start(count, 3) + 3, n - 1);      // the next would not
  }
}

}  // namespace
}  // namespace cfmo::data
