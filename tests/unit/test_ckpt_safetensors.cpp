#include "ckpt/safetensors.h"
#include "support/expect_error.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace cfmo::ckpt {
namespace {

namespace fs = std::filesystem;

template <typename T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& values) {
  return std::as_bytes(std::span<const T>(values));
}

std::vector<std::byte> to_vector(std::span<const std::byte> bytes) { return {bytes.begin(), bytes.end()}; }

std::string le64(uint64_t value) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  return out;
}

// An independent writer: the length prefix, the header text exactly as given, then the data.
std::string build_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

std::string f32_bytes(std::initializer_list<float> values) {
  std::string out(values.size() * sizeof(float), '\0');
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class SafetensorsTest : public ::testing::Test {
 protected:
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  testing::TempDir temp_;
  const fs::path dir_ = temp_.path();
};

// Tensors of several dtypes; "mask" has an odd byte count so later tensors start unaligned.
struct Sample {
  std::vector<float> weight = {1.5f, -2.0f, 0.0f, 3.25f, -0.125f, 1e-30f};
  std::vector<float> bias = {0.1f, 0.2f, 0.3f};
  std::vector<uint8_t> mask = {1, 0, 1, 1, 0};
  std::vector<int64_t> step = {1234567890123};
  std::vector<float> empty;
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "quote \" and \xc3\xa9"}, {"empty", ""}};

  std::vector<TensorRef> refs() const {
    return {
        {"weight", "F32", {2, 3}, as_bytes_of(weight)}, {"mask", "U8", {5}, as_bytes_of(mask)},
        {"bias", "F32", {3}, as_bytes_of(bias)},        {"step", "I64", {}, as_bytes_of(step)},
        {"empty", "F32", {0, 4}, as_bytes_of(empty)},
    };
  }
};

TEST(DtypeSizeTest, KnownAndUnknown) {
  EXPECT_EQ(dtype_size("F64"), 8u);
  EXPECT_EQ(dtype_size("I64"), 8u);
  EXPECT_EQ(dtype_size("F32"), 4u);
  EXPECT_EQ(dtype_size("BF16"), 2u);
  EXPECT_EQ(dtype_size("F16"), 2u);
  EXPECT_EQ(dtype_size("U8"), 1u);
  EXPECT_EQ(dtype_size("BOOL"), 1u);
  EXPECT_EQ(dtype_size("F8_E4M3"), 1u);
  EXPECT_EQ(dtype_size("f32"), 0u);
  EXPECT_EQ(dtype_size(""), 0u);
  EXPECT_EQ(dtype_size("F33"), 0u);
}

TEST_F(SafetensorsTest, RoundTrip) {
  const Sample sample;
  const auto refs = sample.refs();
  const auto path = dir_ / "model.safetensors";
  ASSERT_TRUE(write_safetensors(path, refs, sample.metadata));

  auto file = SafetensorsFile::read(path);
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_EQ(file->source(), path.string());
  EXPECT_EQ(file->metadata(), sample.metadata);
  ASSERT_EQ(file->tensors().size(), refs.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    const auto& entry = file->tensors()[i];  // file order is write order
    EXPECT_EQ(entry.name, refs[i].name);
    EXPECT_EQ(entry.dtype, refs[i].dtype);
    EXPECT_EQ(entry.shape, refs[i].shape);
    EXPECT_EQ(to_vector(file->bytes(entry)), to_vector(refs[i].bytes)) << entry.name;
    EXPECT_EQ(file->find(refs[i].name), &entry);
  }
  EXPECT_EQ(file->find("weight")->elements(), 6);
  EXPECT_EQ(file->find("step")->elements(), 1);  // a scalar has one element
  EXPECT_EQ(file->find("empty")->elements(), 0);
  EXPECT_EQ(file->find("missing"), nullptr);

  std::vector<float> weight(6);
  ASSERT_TRUE(file->read_f32("weight", {2, 3}, weight));
  EXPECT_EQ(weight, sample.weight);
  std::vector<float> none;
  EXPECT_TRUE(file->read_f32("empty", {0, 4}, none));
}

TEST_F(SafetensorsTest, IndependentReaderAcceptsWhatIsWritten) {
  const Sample sample;
  const auto refs = sample.refs();
  const auto path = dir_ / "model.safetensors";
  ASSERT_TRUE(write_safetensors(path, refs, sample.metadata));

  // A reader written from the format description alone.
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  ASSERT_LE(8 + header_length, bytes.size());
  EXPECT_EQ((8 + header_length) % 8, 0u) << "data section must start 8-byte aligned";
  const std::string header_text = bytes.substr(8, header_length);
  // Padding, if any, is spaces after the JSON object.
  const auto close = header_text.rfind('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(header_text.find_first_not_of(' ', close + 1), std::string::npos);
  EXPECT_LT(header_text.size() - close - 1, 8u);

  const auto header = nlohmann::json::parse(header_text);
  ASSERT_TRUE(header.is_object());
  ASSERT_TRUE(header.contains("__metadata__"));
  using Metadata = std::map<std::string, std::string>;
  EXPECT_EQ(header["__metadata__"].get<Metadata>(), sample.metadata);
  EXPECT_EQ(header.size(), refs.size() + 1);

  const std::string data = bytes.substr(8 + header_length);
  uint64_t expected_begin = 0;
  for (const auto& ref : refs) {
    ASSERT_TRUE(header.contains(ref.name)) << ref.name;
    const auto& entry = header[ref.name];
    EXPECT_EQ(entry["dtype"], ref.dtype);
    EXPECT_EQ(entry["shape"].get<std::vector<int64_t>>(), ref.shape);
    const auto offsets = entry["data_offsets"].get<std::vector<uint64_t>>();
    ASSERT_EQ(offsets.size(), 2u);
    EXPECT_EQ(offsets[0], expected_begin) << ref.name << ": tensors are contiguous in write order";
    ASSERT_LE(offsets[0], offsets[1]);
    ASSERT_LE(offsets[1], data.size());
    const std::string tensor = data.substr(offsets[0], offsets[1] - offsets[0]);
    ASSERT_EQ(tensor.size(), ref.bytes.size()) << ref.name;
    EXPECT_TRUE(std::equal(ref.bytes.begin(), ref.bytes.end(), reinterpret_cast<const std::byte*>(tensor.data())))
        << ref.name;
    expected_begin = offsets[1];
  }
  EXPECT_EQ(expected_begin, data.size()) << "no bytes after the last tensor";
}

TEST_F(SafetensorsTest, NoMetadataAndNoTensors) {
  const auto path = dir_ / "empty.safetensors";
  ASSERT_TRUE(write_safetensors(path, {}));
  const std::string bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  EXPECT_EQ(bytes.size() % 8, 0u);
  // No "__metadata__" key at all when there is none to write.
  EXPECT_EQ(nlohmann::json::parse(bytes.substr(8)), nlohmann::json::object());

  auto file = SafetensorsFile::read(path);
  ASSERT_TRUE(file) << file.error().message;
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST_F(SafetensorsTest, WriteIsAtomicAndReplaces) {
  const auto path = dir_ / "model.safetensors";
  const std::vector<float> first = {1, 2, 3, 4};
  const std::vector<float> second = {5, 6};
  const TensorRef a[] = {{"w", "F32", {4}, as_bytes_of(first)}};
  const TensorRef b[] = {{"w", "F32", {2}, as_bytes_of(second)}};
  ASSERT_TRUE(write_safetensors(path, a));
  EXPECT_EQ(entries(), std::vector<std::string>{"model.safetensors"});
  ASSERT_TRUE(write_safetensors(path, b));
  EXPECT_EQ(entries(), std::vector<std::string>{"model.safetensors"});
  auto file = SafetensorsFile::read(path);
  ASSERT_TRUE(file) << file.error().message;
  std::vector<float> out(2);
  ASSERT_TRUE(file->read_f32("w", {2}, out));
  EXPECT_EQ(out, second);
}

TEST_F(SafetensorsTest, WriterRejectsBadTensorsAndLeavesNoFile) {
  const std::vector<float> values = {1, 2, 3};
  const auto path = dir_ / "bad.safetensors";
  const TensorRef wrong_size[] = {{"w", "F32", {4}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, wrong_size), ErrorKind::kInternal, {path.string(), "'w'"}));
  const TensorRef unknown_dtype[] = {{"w", "F31", {3}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, unknown_dtype), ErrorKind::kInternal, {path.string(), "'w'"}));
  // A second tensor of the same name would leave the first one's bytes as a hole no reader accepts.
  const TensorRef duplicate[] = {{"w", "F32", {3}, as_bytes_of(values)}, {"w", "F32", {3}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, duplicate), ErrorKind::kInternal, {path.string(), "'w'"}));
  const TensorRef reserved[] = {{"__metadata__", "F32", {3}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, reserved), ErrorKind::kInternal, {path.string(), "__metadata__"}));
  EXPECT_TRUE(entries().empty());
}

TEST_F(SafetensorsTest, WriterRejectsTextThatIsNotUtf8) {
  // JSON text is UTF-8; the writer must report it rather than throw.
  const std::vector<float> values = {1};
  const auto path = dir_ / "bad.safetensors";
  const TensorRef bad_name[] = {{"w\xff", "F32", {1}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, bad_name), ErrorKind::kInternal, {path.string()}));
  const TensorRef good[] = {{"w", "F32", {1}, as_bytes_of(values)}};
  EXPECT_TRUE(fails_with(write_safetensors(path, good, {{"note", "\xc3"}}), ErrorKind::kInternal, {path.string()}));
  EXPECT_TRUE(entries().empty());
}

TEST_F(SafetensorsTest, WriteIntoAMissingDirectoryFails) {
  const auto path = dir_ / "missing" / "model.safetensors";
  EXPECT_TRUE(fails_with(write_safetensors(path, {}), ErrorKind::kInternal, {path.string()}));
}

TEST_F(SafetensorsTest, ReadMissingFileNamesIt) {
  const auto path = dir_ / "absent.safetensors";
  EXPECT_TRUE(fails_with(SafetensorsFile::read(path), ErrorKind::kInput, {path.string()}));
  EXPECT_TRUE(fails_with(SafetensorsFile::read(dir_), ErrorKind::kInput, {dir_.string()}));
}

TEST_F(SafetensorsTest, ReadsAFileBuiltByHand) {
  // Tensors listed out of file order in the header, extra whitespace, and a spec-conforming padding.
  const std::string header = R"({ "b": {"dtype":"F32","shape":[1],"data_offsets":[8,12]},
    "a": {"dtype":"F32","shape":[2],"data_offsets":[0,8]},
    "__metadata__": {"epoch": "3"} }   )";
  const auto path = dir_ / "hand.safetensors";
  const std::string bytes = build_file(header, f32_bytes({1.0f, 2.0f, 3.0f}));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));

  auto file = SafetensorsFile::read(path);
  ASSERT_TRUE(file) << file.error().message;
  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->tensors()[0].name, "a");
  EXPECT_EQ(file->tensors()[1].name, "b");
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"epoch", "3"}}));
  std::vector<float> a(2);
  std::vector<float> b(1);
  ASSERT_TRUE(file->read_f32("a", {2}, a));
  ASSERT_TRUE(file->read_f32("b", {1}, b));
  EXPECT_EQ(a, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(b, (std::vector<float>{3.0f}));
}

TEST(SafetensorsParseTest, AcceptsEmptyHeaderAndZeroSizedTensors) {
  auto empty = SafetensorsFile::parse(build_file("{}", ""), "mem");
  ASSERT_TRUE(empty) << empty.error().message;
  EXPECT_TRUE(empty->tensors().empty());

  auto zero = SafetensorsFile::parse(
      build_file(R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[1],)"
                 R"("data_offsets":[0,1]}})",
                 "x"),
      "mem");
  ASSERT_TRUE(zero) << zero.error().message;
  EXPECT_EQ(zero->tensors().size(), 2u);
}

TEST(SafetensorsParseTest, HeaderLimit) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const std::string bytes = build_file(header, "x");
  SafetensorsLimits small;
  small.max_header_bytes = header.size() - 1;
  EXPECT_TRUE(fails_with(SafetensorsFile::parse(bytes, "limited", small), ErrorKind::kInput, {"limited"}));
  small.max_header_bytes = header.size();
  EXPECT_TRUE(SafetensorsFile::parse(bytes, "limited", small));
}

// One malformed file and what its error must name besides the source.
struct BadFile {
  const char* why;
  std::string bytes;
  std::string names;
};

std::vector<BadFile> bad_files() {
  const std::string one = f32_bytes({1.0f});
  const std::string two = f32_bytes({1.0f, 2.0f});
  const std::string three = f32_bytes({1.0f, 2.0f, 3.0f});
  auto tensor = [](const std::string& name, const std::string& body) { return "{\"" + name + "\":" + body + "}"; };
  return {
      {"empty file", "", ""},
      {"shorter than the length prefix", std::string(7, '\0'), ""},
      {"header length past the end", le64(1000) + "{}", ""},
      {"header length of 2^64-1", le64(std::numeric_limits<uint64_t>::max()) + "{}", ""},
      {"header length one past the end", le64(3) + "{}", ""},
      {"header not JSON", build_file("{not json}", ""), ""},
      {"header empty", build_file("", ""), ""},
      {"header truncated JSON", build_file(R"({"a":{"dtype":"F32")", ""), ""},
      {"header an array", build_file("[1,2]", ""), ""},
      {"header a string", build_file("\"text\"", ""), ""},
      {"header null", build_file("null", ""), ""},
      {"entry not an object", build_file(tensor("w", "5"), ""), "w"},
      {"dtype missing", build_file(tensor("w", R"({"shape":[1],"data_offsets":[0,4]})"), one), "w"},
      {"dtype not a string", build_file(tensor("w", R"({"dtype":4,"shape":[1],"data_offsets":[0,4]})"), one), "w"},
      {"dtype unknown", build_file(tensor("w", R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})"), one), "F33"},
      {"dtype lower case", build_file(tensor("w", R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})"), one), "w"},
      {"shape missing", build_file(tensor("w", R"({"dtype":"F32","data_offsets":[0,4]})"), one), "w"},
      {"shape not an array", build_file(tensor("w", R"({"dtype":"F32","shape":1,"data_offsets":[0,4]})"), one), "w"},
      {"shape negative", build_file(tensor("w", R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), one), "w"},
      {"shape fractional", build_file(tensor("w", R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})"), one), "w"},
      {"shape whole but float", build_file(tensor("w", R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})"), one),
       "w"},
      {"shape a string", build_file(tensor("w", R"({"dtype":"F32","shape":["1"],"data_offsets":[0,4]})"), one), "w"},
      {"shape overflows",
       build_file(tensor("w", R"({"dtype":"F32","shape":[4294967296,4294967296],)"
                              R"("data_offsets":[0,4]})"),
                  one),
       "w"},
      {"shape beyond int64 next to a zero",
       build_file(tensor("w", R"({"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]})"), ""), "w"},
      {"data_offsets missing", build_file(tensor("w", R"({"dtype":"F32","shape":[1]})"), one), "w"},
      {"data_offsets one number", build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[4]})"), one),
       "w"},
      {"data_offsets three numbers",
       build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})"), one), "w"},
      {"data_offsets negative", build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})"), one),
       "w"},
      {"data_offsets not numbers",
       build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":["0","4"]})"), one), "w"},
      {"data_offsets past the end", build_file(tensor("w", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), one),
       "w"},
      {"data_offsets far past the end",
       build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,)"
                              R"(18446744073709551615]})"),
                  one),
       "w"},
      {"begin after end", build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})"), two), "w"},
      {"size smaller than dtype*shape",
       build_file(tensor("w", R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), one), "w"},
      {"size larger than dtype*shape",
       build_file(tensor("w", R"({"dtype":"F32","shape":[1],"data_offsets":[0,8]})"), two), "w"},
      {"size for another dtype", build_file(tensor("w", R"({"dtype":"F64","shape":[1],"data_offsets":[0,4]})"), one),
       "w"},
      {"overlapping tensors",
       build_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  three),
       "b"},
      {"two tensors on the same bytes",
       build_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                  one),
       "overlaps"},
      {"hole between tensors",
       build_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                  three),
       "b"},
      {"hole before the first tensor",
       build_file(tensor("a", R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"), two), "a"},
      {"bytes after the last tensor",
       build_file(tensor("a", R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})"), two), "after"},
      {"data but no tensors", build_file("{}", one), "after"},
      {"metadata a string", build_file(R"({"__metadata__":"x"})", ""), "__metadata__"},
      {"metadata an array", build_file(R"({"__metadata__":["a","b"]})", ""), "__metadata__"},
      {"metadata value a number", build_file(R"({"__metadata__":{"epoch":3}})", ""), "epoch"},
      {"metadata value an object", build_file(R"({"__metadata__":{"nested":{"a":"b"}}})", ""), "nested"},
      {"metadata value null", build_file(R"({"__metadata__":{"gone":null}})", ""), "gone"},
  };
}

TEST(SafetensorsParseTest, RejectsMalformedFilesNamingSourceAndTensor) {
  for (const auto& bad : bad_files()) {
    auto result = SafetensorsFile::parse(bad.bytes, "src.safetensors");
    std::initializer_list<std::string> with_name = {"src.safetensors", bad.names};
    std::initializer_list<std::string> source_only = {"src.safetensors"};
    EXPECT_TRUE(fails_with(result, ErrorKind::kInput, bad.names.empty() ? source_only : with_name)) << bad.why;
  }
}

TEST_F(SafetensorsTest, ReadRejectsMalformedFilesNamingThePath) {
  const auto path = dir_ / "bad.safetensors";
  for (const auto& bad : bad_files()) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(bad.bytes.data(), static_cast<std::streamsize>(bad.bytes.size()));
    EXPECT_TRUE(fails_with(SafetensorsFile::read(path), ErrorKind::kInput, {path.string()})) << bad.why;
  }
}

TEST(SafetensorsParseTest, ReadF32Errors) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("n":{"dtype":"I32","shape":[4],"data_offsets":[16,32]}})";
  auto file = SafetensorsFile::parse(build_file(header, f32_bytes({1, 2, 3, 4}) + std::string(16, '\0')), "ckpt");
  ASSERT_TRUE(file) << file.error().message;

  std::vector<float> out(4, -1.0f);
  EXPECT_TRUE(fails_with(file->read_f32("nope", {2, 2}, out), ErrorKind::kInput, {"ckpt", "nope"}));
  EXPECT_TRUE(fails_with(file->read_f32("n", {4}, out), ErrorKind::kInput, {"ckpt", "'n'", "I32"}));
  EXPECT_TRUE(fails_with(file->read_f32("w", {4}, out), ErrorKind::kInput, {"ckpt", "'w'", "[2,2]", "[4]"}));
  EXPECT_TRUE(fails_with(file->read_f32("w", {2, 2, 1}, out), ErrorKind::kInput, {"ckpt", "'w'"}));
  std::vector<float> too_small(3);
  EXPECT_TRUE(fails_with(file->read_f32("w", {2, 2}, too_small), ErrorKind::kInput, {"ckpt", "'w'"}));
  // Nothing is written into the output on a failure.
  EXPECT_EQ(out, std::vector<float>(4, -1.0f));
  ASSERT_TRUE(file->read_f32("w", {2, 2}, out));
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3, 4}));
}

}  // namespace
}  // namespace cfmo::ckpt
