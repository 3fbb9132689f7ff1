#include "ckpt/cfd.h"

#include "core/atomic_file.h"

#include "integration/harness.h"
#include "support/expect_error.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>
#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace cfmo::ckpt {
namespace {

namespace fs = std::filesystem;

std::vector<float> random_values(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

uint32_t bits(float v) { return std::bit_cast<uint32_t>(v); }

std::vector<uint32_t> all_bits(std::span<const float> v) {
  std::vector<uint32_t> out;
  for (float x : v) out.push_back(bits(x));
  return out;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

uint64_t le64_at(const std::string& bytes, size_t offset) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(bytes[offset + static_cast<size_t>(i)]);
  return v;
}

void put_le(std::string& bytes, size_t offset, uint64_t value, int width) {
  for (int i = 0; i < width; ++i) bytes[offset + static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
}

// Replaces the header text and fixes the prelude's length and checksum, as a
// writer that made this header would: the data section follows unchanged.
std::string with_header_text(const std::string& file, std::string text) {
  const uint64_t old_length = le64_at(file, 16);
  text.append((64 - (32 + text.size()) % 64) % 64, ' ');
  std::string out = file.substr(0, 32);
  put_le(out, 16, text.size(), 8);
  put_le(out, 24, XXH3_64bits(text.data(), text.size()), 8);
  return out + text + file.substr(32 + old_length);
}

std::string with_header(const std::string& file, const std::function<void(nlohmann::json&)>& edit) {
  auto header = nlohmann::json::parse(file.substr(32, le64_at(file, 16)));
  edit(header);
  return with_header_text(file, header.dump());
}

// Two tensors: a weight of 2500 values in frames of 1000 and a bias.
struct Sample {
  std::vector<float> w_base = random_values(2500, 1, 0.05f);
  std::vector<float> w_delta = random_values(2500, 2, 1e-3f);
  std::vector<float> b_base = {0.5f, -0.25f, 1.0f};
  std::vector<float> b_delta = {0.125f, 0.0f, -0.5f};

  std::vector<CfdTensorInput> inputs() const {
    return {{"layers.0.weight", {50, 50}, w_base, w_delta}, {"layers.0.bias", {3}, b_base, b_delta}};
  }
};

class CfdTest : public ::testing::Test {
 protected:
  // The sample written with frames of 1000 values; returns its bytes.
  std::string sample_file(CfdCodec codec = CfdCodec::kZstd, CfdTransform transform = CfdTransform::kGroupedPlanes) {
    CfdWriteOptions options;
    options.codec = codec;
    options.transform = transform;
    options.chunk_elements = 1000;
    const auto path = dir_ / "sample.cfd";
    auto written = write_cfd(path, {1, 7, 140, 6, {}}, sample_.inputs(), options);
    EXPECT_TRUE(written) << (written ? "" : written.error().message);
    return read_bytes(path);
  }

  // Parses `bytes` and, when that succeeds, decodes and verifies every tensor.
  Status read_all(const std::string& bytes, const CfdLimits& limits = {}) {
    CFMO_ASSIGN_OR_RETURN(auto file, CfdFile::parse(bytes, "bad.cfd", limits));
    for (const auto& t : file.tensors()) {
      std::vector<float> values(static_cast<size_t>(t.elements));
      CFMO_TRY(file.decode(t, values));
      CFMO_TRY(file.verify(t));
    }
    return {};
  }

  testing::TempDir temp_;
  const fs::path dir_ = temp_.path();
  Sample sample_;
};

TEST(DeltaStatsTest, KnownAnswers) {
  const std::vector<float> base = {1.0f, 2.0f, 3.0f};
  const std::vector<float> delta = {0.5f, -1.0f, 0.0f};
  const DeltaStats s = delta_stats(base, delta);
  EXPECT_EQ(s.elements, 3);
  EXPECT_EQ(s.base_sq, 14.0);
  EXPECT_EQ(s.delta_sq, 1.25);
  EXPECT_EQ(s.base_dot_delta, -1.5);
  EXPECT_EQ(s.max_abs, 1.0);
  EXPECT_EQ(s.nonfinite, 0);
  EXPECT_EQ(s.base_nonfinite, 0);
}

TEST(DeltaStatsTest, NonFiniteValuesAreCountedAndLeftOutOfTheSums) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // Twelve values so that both the vector loop and the tail see non-finite ones.
  std::vector<float> base(12, 1.0f);
  std::vector<float> delta(12, 0.5f);
  delta[0] = nan;
  delta[3] = -inf;
  base[5] = inf;
  delta[10] = nan;
  base[11] = -nan;
  delta[11] = 4.0f;
  const DeltaStats s = delta_stats(base, delta);
  EXPECT_EQ(s.nonfinite, 3);
  EXPECT_EQ(s.base_nonfinite, 2);
  EXPECT_EQ(s.base_sq, 10.0);              // ten finite base values of 1
  EXPECT_EQ(s.delta_sq, 8 * 0.25 + 16.0);  // nine finite deltas
  EXPECT_EQ(s.base_dot_delta, 7 * 0.5);    // where both are finite: 12 - 3 - 2
  EXPECT_EQ(s.max_abs, 4.0);
  const DeltaStats d = delta_only_stats(delta);
  EXPECT_EQ(d.nonfinite, 3);
  EXPECT_EQ(d.delta_sq, s.delta_sq);
  EXPECT_EQ(d.max_abs, 4.0);
}

TEST(DeltaStatsTest, KernelsAgreeBitForBitAndWithADoubleReference) {
  for (size_t n : {0u, 1u, 7u, 8u, 9u, 63u, 1000u, 100003u}) {
    SCOPED_TRACE(n);
    const auto base = random_values(n, 3, 0.05f);
    const auto local = random_values(n, 4, 0.05f);
    std::vector<float> delta(n);
    for (size_t i = 0; i < n; ++i) delta[i] = local[i] - base[i];
    const DeltaStats full = delta_stats(base, delta);
    const DeltaStats only = delta_only_stats(delta);
    const DeltaStats pair = pair_stats(base, local);
    EXPECT_EQ(only.delta_sq, full.delta_sq);
    EXPECT_EQ(only.max_abs, full.max_abs);
    EXPECT_EQ(pair.delta_sq, full.delta_sq);
    EXPECT_EQ(pair.base_sq, full.base_sq);
    EXPECT_EQ(pair.base_dot_delta, full.base_dot_delta);
    double bsq = 0, dsq = 0, dot = 0, max_abs = 0;
    for (size_t i = 0; i < n; ++i) {
      bsq += static_cast<double>(base[i]) * base[i];
      dsq += static_cast<double>(delta[i]) * delta[i];
      dot += static_cast<double>(base[i]) * delta[i];
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(delta[i])));
    }
    EXPECT_NEAR(full.base_sq, bsq, 1e-12 * bsq);
    EXPECT_NEAR(full.delta_sq, dsq, 1e-12 * dsq);
    EXPECT_NEAR(full.base_dot_delta, dot, 1e-12 * (bsq + dsq));
    EXPECT_EQ(full.max_abs, max_abs);
    EXPECT_EQ(full.elements, static_cast<int64_t>(n));
  }
}

TEST(DeltaStatsTest, MergeAddsSumsAndKeepsTheLargestMaximum) {
  DeltaStats a{2, 1.0, 2.0, 0.5, 3.0, 1, 0};
  const DeltaStats b{3, 4.0, 1.0, -1.5, 2.0, 0, 2};
  a.merge(b);
  EXPECT_EQ(a.elements, 5);
  EXPECT_EQ(a.base_sq, 5.0);
  EXPECT_EQ(a.delta_sq, 3.0);
  EXPECT_EQ(a.base_dot_delta, -1.0);
  EXPECT_EQ(a.max_abs, 3.0);
  EXPECT_EQ(a.nonfinite, 1);
  EXPECT_EQ(a.base_nonfinite, 2);
}

TEST(CfdNamesTest, ParseAndPrint) {
  for (auto t : {CfdTransform::kNone, CfdTransform::kBytePlanes, CfdTransform::kGroupedPlanes}) {
    EXPECT_EQ(*parse_cfd_transform(to_string(t)), t);
  }
  for (auto c : {CfdCodec::kNone, CfdCodec::kZstd}) EXPECT_EQ(*parse_cfd_codec(to_string(c)), c);
  EXPECT_TRUE(fails_with(parse_cfd_transform("xor"), ErrorKind::kUsage, {"xor"}));
  EXPECT_TRUE(fails_with(parse_cfd_codec("lz4"), ErrorKind::kUsage, {"lz4"}));
}

TEST(CfdChunkTest, EveryCodecAndTransformRoundTripsExactBits) {
  std::vector<float> values = random_values(5000, 9, 1e-3f);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::max(),
                            1.0f};
  for (size_t i = 0; i < std::size(specials); ++i) values[i * 7] = specials[i];
  for (auto codec : {CfdCodec::kNone, CfdCodec::kZstd}) {
    for (auto transform : {CfdTransform::kNone, CfdTransform::kBytePlanes, CfdTransform::kGroupedPlanes}) {
      SCOPED_TRACE(std::string(to_string(codec)) + "/" + std::string(to_string(transform)));
      auto chunk = cfd_encode_chunk(values, codec, transform, 3);
      ASSERT_TRUE(chunk) << chunk.error().message;
      std::vector<float> out(values.size());
      auto decoded =
          cfd_decode_chunk(std::as_bytes(std::span(chunk->stored)), codec, transform, chunk->checksum, out, "chunk");
      ASSERT_TRUE(decoded) << decoded.error().message;
      EXPECT_EQ(all_bits(out), all_bits(values));
      auto reduced = cfd_reduce_chunk(std::as_bytes(std::span(chunk->stored)), codec, transform, chunk->checksum,
                                      values.size(), "chunk");
      ASSERT_TRUE(reduced) << reduced.error().message;
      const DeltaStats direct = delta_only_stats(values);
      EXPECT_EQ(reduced->nonfinite, direct.nonfinite);
      EXPECT_EQ(reduced->max_abs, direct.max_abs);
      EXPECT_NEAR(reduced->delta_sq, direct.delta_sq, 1e-12 * direct.delta_sq);
      if (codec == CfdCodec::kZstd) {
        // Trailing bytes after the frame, a truncated frame, a wrong checksum.
        std::string stored = chunk->stored + "x";
        EXPECT_TRUE(fails_with(
            cfd_decode_chunk(std::as_bytes(std::span(stored)), codec, transform, chunk->checksum, out, "chunk 7"),
            ErrorKind::kInput, {"chunk 7", "after the zstd frame"}));
        stored = chunk->stored.substr(0, chunk->stored.size() - 5);
        EXPECT_TRUE(fails_with(
            cfd_decode_chunk(std::as_bytes(std::span(stored)), codec, transform, chunk->checksum, out, "chunk 7"),
            ErrorKind::kInput, {"chunk 7", "truncated"}));
      }
      EXPECT_TRUE(fails_with(cfd_decode_chunk(std::as_bytes(std::span(chunk->stored)), codec, transform,
                                              chunk->checksum ^ 1, out, "chunk 7"),
                             ErrorKind::kInput, {"chunk 7", "checksum"}));
    }
  }
}

TEST(CfdChunkTest, GroupedPlanesAreSmallerThanPlainZstdOnSubtractedDeltas) {
  // A delta computed as local - base carries the base's precision: its low
  // mantissa bits are zero where its exponent is below the base's.
  const auto base = random_values(200000, 5, 0.05f);
  const auto step = random_values(200000, 6, 2e-3f);
  std::vector<float> delta(base.size());
  for (size_t i = 0; i < base.size(); ++i) delta[i] = (base[i] + step[i]) - base[i];
  const auto plain = cfd_encode_chunk(delta, CfdCodec::kZstd, CfdTransform::kNone, 3);
  const auto planes = cfd_encode_chunk(delta, CfdCodec::kZstd, CfdTransform::kBytePlanes, 3);
  const auto grouped = cfd_encode_chunk(delta, CfdCodec::kZstd, CfdTransform::kGroupedPlanes, 3);
  ASSERT_TRUE(plain && planes && grouped);
  EXPECT_LT(planes->stored.size(), plain->stored.size());
  EXPECT_LT(grouped->stored.size(), planes->stored.size());
}

TEST_F(CfdTest, RoundTripWithEveryCodecAndTransform) {
  for (auto codec : {CfdCodec::kNone, CfdCodec::kZstd}) {
    for (auto transform : {CfdTransform::kNone, CfdTransform::kBytePlanes, CfdTransform::kGroupedPlanes}) {
      SCOPED_TRACE(std::string(to_string(codec)) + "/" + std::string(to_string(transform)));
      sample_file(codec, transform);
      auto file = CfdFile::open(dir_ / "sample.cfd");
      ASSERT_TRUE(file) << file.error().message;
      EXPECT_EQ(file->info().rank, 1);
      EXPECT_EQ(file->info().round, 7);
      EXPECT_EQ(file->info().step, 140);
      EXPECT_EQ(file->info().base_version, 6);
      ASSERT_EQ(file->tensors().size(), 2u);
      const auto* w = file->find("layers.0.weight");
      ASSERT_NE(w, nullptr);
      EXPECT_EQ(w->shape, (std::vector<int64_t>{50, 50}));
      EXPECT_EQ(w->elements, 2500);
      EXPECT_EQ(w->codec, codec);
      EXPECT_EQ(w->transform, transform);
      ASSERT_EQ(w->frames.size(), 3u);
      EXPECT_EQ(w->frames[2].first, 2000);
      EXPECT_EQ(w->frames[2].elements, 500);
      EXPECT_EQ(w->offset % 64, 0u);
      EXPECT_EQ(file->tensors()[1].offset % 64, 0u);
      std::vector<float> out(2500);
      ASSERT_TRUE(file->decode(*w, out));
      EXPECT_EQ(all_bits(out), all_bits(sample_.w_delta));
      std::vector<float> bias(3);
      ASSERT_TRUE(file->decode(*file->find("layers.0.bias"), bias));
      EXPECT_EQ(bias, sample_.b_delta);
      EXPECT_EQ(file->find("missing"), nullptr);
    }
  }
}

TEST_F(CfdTest, HeaderStatisticsMatchTheData) {
  sample_file();
  auto file = CfdFile::open(dir_ / "sample.cfd");
  ASSERT_TRUE(file) << file.error().message;
  const auto* w = file->find("layers.0.weight");
  // The writer reduces frame by frame, in order.
  DeltaStats expected;
  for (size_t first = 0; first < 2500; first += 1000) {
    const size_t n = std::min<size_t>(1000, 2500 - first);
    expected.merge(
        delta_stats(std::span(sample_.w_base).subspan(first, n), std::span(sample_.w_delta).subspan(first, n)));
  }
  EXPECT_EQ(w->stats.base_sq, expected.base_sq);
  EXPECT_EQ(w->stats.delta_sq, expected.delta_sq);
  EXPECT_EQ(w->stats.base_dot_delta, expected.base_dot_delta);
  EXPECT_EQ(w->stats.max_abs, expected.max_abs);
  EXPECT_EQ(w->stats.elements, 2500);
  const auto& b = file->find("layers.0.bias")->stats;
  EXPECT_EQ(b.base_sq, 0.25 + 0.0625 + 1.0);
  EXPECT_EQ(b.delta_sq, 0.015625 + 0.25);
  EXPECT_EQ(b.base_dot_delta, 0.0625 - 0.5);
  EXPECT_EQ(b.max_abs, 0.5);
  for (int threads : {1, 2, 4}) {
    auto verified = file->verify(*w, threads);
    ASSERT_TRUE(verified) << verified.error().message;
    EXPECT_EQ(verified->delta_sq, expected.delta_sq);
    EXPECT_EQ(verified->base_sq, expected.base_sq);
  }
}

TEST_F(CfdTest, EmptyScalarAndNonFiniteTensorsAndMetadata) {
  const std::vector<float> none;
  const std::vector<float> one_base = {2.0f};
  const std::vector<float> one_delta = {std::numeric_limits<float>::quiet_NaN()};
  const std::vector<CfdTensorInput> inputs = {{"empty", {0, 4}, none, none}, {"scalar", {}, one_base, one_delta}};
  CfdFileInfo info{3, 12, 1200, 11, {{"mode", "cfmo"}, {"note", "\xc3\xa9"}}};
  ASSERT_TRUE(write_cfd(dir_ / "x.cfd", info, inputs, {.threads = 2}));
  auto file = CfdFile::open(dir_ / "x.cfd");
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_EQ(file->info().metadata, info.metadata);
  const auto* empty = file->find("empty");
  EXPECT_EQ(empty->elements, 0);
  EXPECT_TRUE(empty->frames.empty());
  std::vector<float> nothing;
  EXPECT_TRUE(file->decode(*empty, nothing));
  EXPECT_TRUE(file->verify(*empty));
  const auto* scalar = file->find("scalar");
  EXPECT_EQ(scalar->elements, 1);
  EXPECT_EQ(scalar->stats.nonfinite, 1);
  EXPECT_EQ(scalar->stats.delta_sq, 0.0);
  EXPECT_EQ(scalar->stats.base_sq, 4.0);
  std::vector<float> value(1);
  ASSERT_TRUE(file->decode(*scalar, value));
  EXPECT_TRUE(std::isnan(value[0]));
  EXPECT_TRUE(file->verify(*scalar));
}

TEST_F(CfdTest, IndependentReaderAcceptsWhatIsWritten) {
  const std::string bytes = sample_file(CfdCodec::kZstd, CfdTransform::kBytePlanes);
  // Read from the format description alone (docs/FORMATS.md).
  ASSERT_GE(bytes.size(), 32u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89"
                                            "CFD\r\n\x1a\n",
                                            8));
  EXPECT_EQ(le64_at(bytes, 8) & 0xffffffffu, 1u);  // version
  EXPECT_EQ(le64_at(bytes, 8) >> 32, 0u);          // flags
  const uint64_t header_length = le64_at(bytes, 16);
  EXPECT_EQ((32 + header_length) % 64, 0u);
  const std::string header_text = bytes.substr(32, header_length);
  EXPECT_EQ(XXH3_64bits(header_text.data(), header_text.size()), le64_at(bytes, 24));
  const auto header = nlohmann::json::parse(header_text);
  EXPECT_EQ(header["rank"], 1);
  EXPECT_EQ(header["round"], 7);
  EXPECT_EQ(header["step"], 140);
  EXPECT_EQ(header["base_version"], 6);
  const std::string data = bytes.substr(32 + header_length);
  const auto& w = header["tensors"][0];
  EXPECT_EQ(w["name"], "layers.0.weight");
  EXPECT_EQ(w["dtype"], "F32");
  EXPECT_EQ(w["raw_size"], 10000);
  EXPECT_EQ(w["codec"], "zstd");
  EXPECT_EQ(w["transform"], "byteplanes");
  EXPECT_EQ(w["chunk_elements"], 1000);
  EXPECT_EQ(w["offset"], 0);
  uint64_t at = w["offset"].get<uint64_t>();
  std::vector<float> delta;
  for (const auto& frame : w["frames"]) {
    const auto size = frame["size"].get<uint64_t>();
    std::string content(ZSTD_getFrameContentSize(data.data() + at, size), '\0');
    ASSERT_EQ(ZSTD_decompress(content.data(), content.size(), data.data() + at, size), content.size());
    EXPECT_EQ(frame["checksum"], fmt::format("xxh3:{:016x}", XXH3_64bits(content.data(), content.size())));
    const size_t n = content.size() / 4;
    for (size_t i = 0; i < n; ++i) {
      uint32_t word = 0;
      for (size_t plane = 0; plane < 4; ++plane) word = (word << 8) | static_cast<uint8_t>(content[plane * n + i]);
      delta.push_back(std::bit_cast<float>(word));
    }
    at += size;
  }
  EXPECT_EQ(at, w["size"].get<uint64_t>());
  EXPECT_EQ(all_bits(delta), all_bits(sample_.w_delta));
  const auto& stats = w["stats"];
  double dsq = 0;
  for (float d : sample_.w_delta) dsq += static_cast<double>(d) * d;
  EXPECT_NEAR(stats["delta_sq"].get<double>(), dsq, 1e-12 * dsq);
  EXPECT_EQ(stats["nonfinite"], 0);
  const auto& b = header["tensors"][1];
  EXPECT_EQ(b["offset"].get<uint64_t>() % 64, 0u);
  EXPECT_GE(b["offset"].get<uint64_t>(), w["size"].get<uint64_t>());
}

TEST_F(CfdTest, WriterRejectsInputsThatDoNotFit) {
  const std::vector<float> three = {1, 2, 3};
  const std::vector<float> two = {1, 2};
  const fs::path path = dir_ / "w.cfd";
  std::vector<CfdTensorInput> bad_size = {{"t", {3}, three, two}};
  EXPECT_TRUE(fails_with(write_cfd(path, {}, bad_size), ErrorKind::kInternal, {"w.cfd", "'t'"}));
  std::vector<CfdTensorInput> bad_shape = {{"t", {2, 2}, three, three}};
  EXPECT_TRUE(fails_with(write_cfd(path, {}, bad_shape), ErrorKind::kInternal, {"'t'"}));
  std::vector<CfdTensorInput> repeated = {{"t", {3}, three, three}, {"t", {3}, three, three}};
  EXPECT_TRUE(fails_with(write_cfd(path, {}, repeated), ErrorKind::kInternal, {"repeated"}));
  std::vector<CfdTensorInput> unnamed = {{"", {3}, three, three}};
  EXPECT_TRUE(fails_with(write_cfd(path, {}, unnamed), ErrorKind::kInternal, {"empty"}));
  std::vector<CfdTensorInput> not_utf8 = {{"\xff", {3}, three, three}};
  EXPECT_TRUE(fails_with(write_cfd(path, {}, not_utf8), ErrorKind::kInternal, {"w.cfd"}));
  std::vector<CfdTensorInput> good = {{"t", {3}, three, three}};
  EXPECT_TRUE(fails_with(write_cfd(path, {-1, 0, 0, 0, {}}, good), ErrorKind::kInternal, {"negative"}));
  EXPECT_TRUE(fails_with(write_cfd(path, {}, good, {.zstd_level = 99}), ErrorKind::kInternal, {"level"}));
  EXPECT_TRUE(fails_with(write_cfd(path, {}, good, {.chunk_elements = 0}), ErrorKind::kInternal, {"chunk"}));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fails_with(write_cfd(dir_ / "no" / "such" / "dir.cfd", {}, good), ErrorKind::kInternal, {"dir.cfd"}));
  ASSERT_TRUE(write_cfd(path, {}, good));
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename(), "w.cfd") << "a temporary file was left behind";
  }
}

TEST_F(CfdTest, PreludeDamageIsAnInputErrorNamingTheFile) {
  const std::string good = sample_file();
  ASSERT_TRUE(read_all(good));
  EXPECT_TRUE(fails_with(read_all(good.substr(0, 20)), ErrorKind::kInput, {"bad.cfd", "too short"}));
  std::string bad = good;
  bad[1] = 'X';
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"bad.cfd", "magic"}));
  bad = good;
  put_le(bad, 8, 2, 4);
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"version 2"}));
  bad = good;
  put_le(bad, 12, 1, 4);
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"flags"}));
  bad = good;
  put_le(bad, 16, uint64_t{1} << 60, 8);  // refused before anything is allocated
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"exceeds the limit"}));
  EXPECT_TRUE(fails_with(read_all(good, {.max_header_bytes = 64}), ErrorKind::kInput, {"exceeds the limit of 64"}));
  EXPECT_TRUE(fails_with(read_all(good.substr(0, 100)), ErrorKind::kInput, {"truncated header"}));
  bad = good;
  bad[40] ^= 0x20;
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"header checksum"}));
  bad = good;
  put_le(bad, 16, le64_at(good, 16) - 1, 8);
  EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"64-byte boundary"}));
}

TEST_F(CfdTest, HeaderDamageIsAnInputErrorNamingTheTensor) {
  const std::string good = sample_file();
  auto expect = [&](const std::function<void(nlohmann::json&)>& edit, std::initializer_list<std::string> parts) {
    EXPECT_TRUE(fails_with(read_all(with_header(good, edit)), ErrorKind::kInput, parts));
  };
  EXPECT_TRUE(fails_with(read_all(with_header_text(good, "{\"rank\": 1,")), ErrorKind::kInput, {"not valid JSON"}));
  EXPECT_TRUE(fails_with(read_all(with_header_text(good, "[1, 2]")), ErrorKind::kInput, {"not a JSON object"}));
  const std::string w = "'layers.0.weight'";
  expect([](auto& h) { h.erase("round"); }, {"'round'"});
  expect([](auto& h) { h["rank"] = -1; }, {"'rank'"});
  expect([](auto& h) { h["rank"] = int64_t{1} << 40; }, {"'rank'"});
  expect([](auto& h) { h["step"] = "7"; }, {"'step'"});
  expect([](auto& h) { h["metadata"] = {{"k", 1}}; }, {"metadata 'k'"});
  expect([](auto& h) { h["tensors"] = 3; }, {"tensors"});
  expect([](auto& h) { h["tensors"][1]["name"] = "layers.0.weight"; }, {w, "repeated"});
  expect([](auto& h) { h["tensors"][0].erase("name"); }, {"no name"});
  expect([](auto& h) { h["tensors"][0]["dtype"] = "F16"; }, {w, "dtype"});
  expect([](auto& h) { h["tensors"][0]["shape"] = {50, -50}; }, {w, "dimension"});
  expect([](auto& h) { h["tensors"][0]["shape"] = {uint64_t{1} << 40, uint64_t{1} << 40}; }, {w, "overflows"});
  expect([](auto& h) { h["tensors"][0]["raw_size"] = 9996; }, {w, "raw_size"});
  expect([](auto& h) { h["tensors"][0]["codec"] = "lz4"; }, {w, "lz4"});
  expect([](auto& h) { h["tensors"][0]["transform"] = "xor"; }, {w, "xor"});
  expect([](auto& h) { h["tensors"][0]["chunk_elements"] = 0; }, {w, "chunk_elements"});
  expect([](auto& h) { h["tensors"][0]["chunk_elements"] = int64_t{1} << 40; }, {w, "chunk_elements"});
  expect([](auto& h) { h["tensors"][0]["chunk_elements"] = 2500; }, {w, "3 frames, expected 1"});
  expect([](auto& h) { h["tensors"][0]["offset"] = 32; }, {w, "multiple of 64"});
  // Offsets and sizes past the end of the file.
  expect([](auto& h) { h["tensors"][1]["offset"] = uint64_t{1} << 40; }, {"'layers.0.bias'", "past the end"});
  expect(
      [](auto& h) {
        h["tensors"][0]["size"] = h["tensors"][0]["size"].template get<uint64_t>() + 100000;
        h["tensors"][0]["frames"][2]["size"] = h["tensors"][0]["frames"][2]["size"].template get<uint64_t>() + 100000;
      },
      {w, "past the end"});
  expect([](auto& h) { h["tensors"][0]["size"] = 64; }, {w, "frames hold"});
  // Overlapping extents.
  expect([](auto& h) { h["tensors"][1]["offset"] = 0; }, {"overlaps"});
  expect([](auto& h) { h["tensors"][0]["frames"][1]["checksum"] = "md5:00"; }, {w, "frame 2", "checksum"});
  expect([](auto& h) { h["tensors"][0]["frames"][1]["checksum"] = "xxh3:zz34567890abcdef"; }, {w, "checksum"});
  expect([](auto& h) { h["tensors"][0]["frames"][1] = 5; }, {w, "frame 2"});
  expect([](auto& h) { h["tensors"][0].erase("stats"); }, {w, "stats"});
  expect([](auto& h) { h["tensors"][0]["stats"]["delta_sq"] = -1.0; }, {w, "negative"});
  expect([](auto& h) { h["tensors"][0]["stats"]["max_abs"] = "big"; }, {w, "max_abs"});
  expect([](auto& h) { h["tensors"][0]["stats"]["nonfinite"] = 2501; }, {w, "nonfinite"});
}

TEST_F(CfdTest, PayloadDamageIsAnInputErrorNamingTheTensorAndFrame) {
  // Without a codec a flipped byte reaches the checksum.
  std::string plain = sample_file(CfdCodec::kNone, CfdTransform::kNone);
  const uint64_t data_start = 32 + le64_at(plain, 16);
  plain[data_start + 4005] ^= 0x01;  // in the weight's second frame
  EXPECT_TRUE(fails_with(read_all(plain), ErrorKind::kInput,
                         {"bad.cfd", "'layers.0.weight' frame 2 of 3", "checksum mismatch"}));

  const std::string good = sample_file();
  const auto header = nlohmann::json::parse(good.substr(32, le64_at(good, 16)));
  const uint64_t start = 32 + le64_at(good, 16);
  const uint64_t frame1 = header["tensors"][0]["frames"][0]["size"].get<uint64_t>();
  // A flipped byte inside a zstd frame: zstd or the checksum notices.
  for (uint64_t at : {start + 20, start + frame1 / 2, start + frame1 - 3}) {
    std::string bad = good;
    bad[at] ^= 0x55;
    EXPECT_TRUE(fails_with(read_all(bad), ErrorKind::kInput, {"bad.cfd", "'layers.0.weight' frame 1 of 3"}));
  }
  // A frame cut short: the header gives it fewer bytes than the frame has.
  const std::string truncated_frame = with_header(good, [](auto& h) {
    auto& t = h["tensors"][0];
    t["frames"][0]["size"] = t["frames"][0]["size"].template get<uint64_t>() - 10;
    t["frames"][1]["size"] = t["frames"][1]["size"].template get<uint64_t>() + 10;
  });
  EXPECT_TRUE(fails_with(read_all(truncated_frame), ErrorKind::kInput, {"'layers.0.weight' frame 1 of 3"}));
  // The header's statistics edited (and its checksum fixed): the data disagree.
  const std::string edited = with_header(good, [](auto& h) { h["tensors"][1]["stats"]["max_abs"] = 0.25; });
  EXPECT_TRUE(fails_with(read_all(edited), ErrorKind::kInput, {"'layers.0.bias'", "disagree"}));
  // The file cut in the middle of the last tensor's data.
  EXPECT_TRUE(
      fails_with(read_all(good.substr(0, good.size() - 4)), ErrorKind::kInput, {"'layers.0.bias'", "past the end"}));
}

TEST_F(CfdTest, FileShortenedAfterOpeningIsReportedOnRead) {
  sample_file();
  const fs::path path = dir_ / "sample.cfd";
  auto file = CfdFile::open(path);
  ASSERT_TRUE(file) << file.error().message;
  fs::resize_file(path, fs::file_size(path) - 8);
  std::vector<float> bias(3);
  EXPECT_TRUE(fails_with(file->decode(*file->find("layers.0.bias"), bias), ErrorKind::kInput,
                         {"sample.cfd", "'layers.0.bias'", "truncated"}));
  EXPECT_TRUE(fails_with(CfdFile::open(dir_ / "missing.cfd"), ErrorKind::kInput, {"missing.cfd"}));
  EXPECT_TRUE(fails_with(CfdFile::open(dir_), ErrorKind::kInput, {"not a regular file"}));
}

}  // namespace
}  // namespace cfmo::ckpt
