#include "data/dataset.h"
#include "support/expect_error.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <numeric>
#include <string>
#include <vector>

namespace cfmo::data {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kImageMagic = 0x00000803;
constexpr uint32_t kLabelMagic = 0x00000801;

void put_be32(std::string& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((value >> shift) & 0xFF));
}

// IDX files built byte by byte, independently of the reader under test.
std::string image_file(uint32_t count, uint32_t rows, uint32_t cols, const std::vector<uint8_t>& pixels,
                       uint32_t magic = kImageMagic) {
  std::string out;
  put_be32(out, magic);
  put_be32(out, count);
  put_be32(out, rows);
  put_be32(out, cols);
  out.append(pixels.begin(), pixels.end());
  return out;
}

std::string label_file(const std::vector<uint8_t>& labels, uint32_t magic = kLabelMagic) {
  std::string out;
  put_be32(out, magic);
  put_be32(out, static_cast<uint32_t>(labels.size()));
  out.append(labels.begin(), labels.end());
  return out;
}

// Three 2x3 images whose pixels cover 0 and 255, and their labels.
const std::vector<uint8_t> kPixels = {0, 1, 2, 3, 4, 5, 255, 128, 64, 32, 16, 8, 10, 20, 30, 40, 50, 60};
const std::vector<uint8_t> kLabels = {3, 0, 9};

class DatasetTest : public ::testing::Test {
 protected:
  fs::path write_raw(const std::string& name, const std::string& bytes) {
    const auto path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << path;
    return path;
  }

  // Compressed with zlib's gzip writer, as the published files are.
  fs::path write_gz(const std::string& name, const std::string& bytes) {
    const auto path = dir_ / name;
    gzFile file = gzopen(path.c_str(), "wb");
    EXPECT_NE(file, nullptr) << path;
    if (file == nullptr) return path;
    EXPECT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    EXPECT_EQ(gzclose(file), Z_OK);
    return path;
  }

  std::string read_bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Both files good except for what a test replaces.
  Result<Dataset> read_with(const std::string& images, const std::string& labels) {
    images_ = write_raw("images-idx3-ubyte", images);
    labels_ = write_raw("labels-idx1-ubyte", labels);
    return read_idx(images_, labels_);
  }

  void expect_good(const Dataset& data) {
    EXPECT_EQ(data.count, 3);
    EXPECT_EQ(data.features, 6);
    EXPECT_EQ(data.classes, 10);
    ASSERT_EQ(data.pixels.size(), kPixels.size());
    std::vector<float> floats(kPixels.size());
    data.rows_to_float(0, data.count, floats.data());
    for (size_t i = 0; i < kPixels.size(); ++i) EXPECT_FLOAT_EQ(floats[i], kPixels[i] / 255.0f) << i;
    EXPECT_EQ(floats[0], 0.0f);
    EXPECT_EQ(floats[6], 1.0f);
    EXPECT_EQ(data.labels, (std::vector<int32_t>{3, 0, 9}));
    EXPECT_EQ(data.row(1), data.pixels.data() + 6);
  }

  testing::TempDir temp_;
  const fs::path dir_ = temp_.path();
  fs::path images_;
  fs::path labels_;
};

TEST_F(DatasetTest, ReadsRawFiles) {
  auto data = read_with(image_file(3, 2, 3, kPixels), label_file(kLabels));
  ASSERT_TRUE(data) << data.error().message;
  expect_good(*data);
}

TEST_F(DatasetTest, ReadsGzipFiles) {
  const auto images = write_gz("images.gz", image_file(3, 2, 3, kPixels));
  const auto labels = write_gz("labels.gz", label_file(kLabels));
  auto data = read_idx(images, labels);
  ASSERT_TRUE(data) << data.error().message;
  expect_good(*data);
}

TEST_F(DatasetTest, ReadsGzipImagesWithRawLabels) {
  const auto images = write_gz("images.gz", image_file(3, 2, 3, kPixels));
  const auto labels = write_raw("labels", label_file(kLabels));
  auto data = read_idx(images, labels);
  ASSERT_TRUE(data) << data.error().message;
  expect_good(*data);
}

TEST_F(DatasetTest, ClassesBoundTheLabels) {
  const auto images = write_raw("images", image_file(3, 2, 3, kPixels));
  const auto labels = write_raw("labels", label_file({0, 1, 1}));
  auto data = read_idx(images, labels, 2);
  ASSERT_TRUE(data) << data.error().message;
  EXPECT_EQ(data->classes, 2);
  EXPECT_TRUE(fails_with(read_idx(images, labels, 1), ErrorKind::kInput, {labels.string()}));
}

TEST_F(DatasetTest, MissingImageFile) {
  const auto labels = write_raw("labels", label_file(kLabels));
  const auto images = dir_ / "no-such-images";
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string()}));
}

TEST_F(DatasetTest, MissingLabelFile) {
  const auto images = write_raw("images", image_file(3, 2, 3, kPixels));
  const auto labels = dir_ / "no-such-labels";
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {labels.string()}));
}

TEST_F(DatasetTest, DirectoryIsNotAnImageFile) {
  const auto labels = write_raw("labels", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(dir_, labels), ErrorKind::kInput, {dir_.string()}));
}

TEST_F(DatasetTest, WrongImageMagic) {
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels, 0x00000804), label_file(kLabels)), ErrorKind::kInput,
                         {images_.string(), "magic"}));
  // An IDX file of another element type (0x0D: float) is not an image file either.
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels, 0x00000D03), label_file(kLabels)), ErrorKind::kInput,
                         {images_.string(), "magic"}));
}

TEST_F(DatasetTest, LabelFileGivenAsImageFile) {
  const auto labels = write_raw("labels", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(labels, labels), ErrorKind::kInput, {labels.string(), "image"}));
}

TEST_F(DatasetTest, ImageFileGivenAsLabelFile) {
  const auto images = write_raw("images", image_file(3, 2, 3, kPixels));
  EXPECT_TRUE(fails_with(read_idx(images, images), ErrorKind::kInput, {images.string(), "label"}));
}

TEST_F(DatasetTest, EmptyImageFile) {
  EXPECT_TRUE(fails_with(read_with("", label_file(kLabels)), ErrorKind::kInput, {images_.string(), "truncated"}));
}

TEST_F(DatasetTest, TruncatedImageHeader) {
  const std::string full = image_file(3, 2, 3, kPixels);
  for (size_t size : {2u, 4u, 7u, 8u, 12u, 15u}) {
    EXPECT_TRUE(fails_with(read_with(full.substr(0, size), label_file(kLabels)), ErrorKind::kInput,
                           {images_.string(), "truncated"}))
        << size << " bytes";
  }
}

TEST_F(DatasetTest, TruncatedLabelHeader) {
  const std::string full = label_file(kLabels);
  for (size_t size : {0u, 3u, 4u, 7u}) {
    EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), full.substr(0, size)), ErrorKind::kInput,
                           {labels_.string(), "truncated"}))
        << size << " bytes";
  }
}

TEST_F(DatasetTest, TruncatedPixels) {
  const std::string full = image_file(3, 2, 3, kPixels);
  for (size_t missing : {1u, 6u, 17u, 18u}) {
    EXPECT_TRUE(fails_with(read_with(full.substr(0, full.size() - missing), label_file(kLabels)), ErrorKind::kInput,
                           {images_.string(), "truncated"}))
        << missing << " bytes missing";
  }
}

TEST_F(DatasetTest, TruncatedLabels) {
  const std::string full = label_file(kLabels);
  for (size_t missing : {1u, 3u}) {
    EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), full.substr(0, full.size() - missing)),
                           ErrorKind::kInput, {labels_.string(), "truncated"}))
        << missing << " bytes missing";
  }
}

TEST_F(DatasetTest, TruncatedGzipPixels) {
  const std::string full = image_file(3, 2, 3, kPixels);
  const auto images = write_gz("images.gz", full.substr(0, full.size() - 5));
  const auto labels = write_gz("labels.gz", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string(), "truncated"}));
}

TEST_F(DatasetTest, TrailingBytesAfterPixels) {
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels) + "x", label_file(kLabels)), ErrorKind::kInput,
                         {images_.string()}));
}

TEST_F(DatasetTest, TrailingBytesAfterLabels) {
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), label_file(kLabels) + std::string(1, '\0')),
                         ErrorKind::kInput, {labels_.string()}));
}

TEST_F(DatasetTest, TrailingBytesInsideGzip) {
  const auto images = write_gz("images.gz", image_file(3, 2, 3, kPixels) + "extra");
  const auto labels = write_gz("labels.gz", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string()}));
}

TEST_F(DatasetTest, LabelCountDiffersFromImageCount) {
  // Two labels for three images, and four for three: both name the label file and the counts.
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), label_file({1, 2})), ErrorKind::kInput,
                         {labels_.string(), "2", "3"}));
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), label_file({1, 2, 3, 4})), ErrorKind::kInput,
                         {labels_.string(), "4", "3"}));
}

TEST_F(DatasetTest, LabelOutOfRange) {
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), label_file({1, 10, 2})), ErrorKind::kInput,
                         {labels_.string(), "10"}));
  EXPECT_TRUE(fails_with(read_with(image_file(3, 2, 3, kPixels), label_file({1, 2, 255})), ErrorKind::kInput,
                         {labels_.string(), "255"}));
}

TEST_F(DatasetTest, ZeroDimension) {
  for (auto [count, rows, cols] : {std::array<uint32_t, 3>{0, 2, 3}, {3, 0, 3}, {3, 2, 0}}) {
    EXPECT_TRUE(fails_with(read_with(image_file(count, rows, cols, {}), label_file(std::vector<uint8_t>(count))),
                           ErrorKind::kInput, {images_.string()}))
        << count << "x" << rows << "x" << cols;
  }
}

TEST_F(DatasetTest, ImplausiblyLargeDimensions) {
  // The header alone must not make the reader allocate terabytes.
  EXPECT_TRUE(fails_with(read_with(image_file(0xFFFFFFFF, 0xFFFF, 0xFFFF, kPixels), label_file(kLabels)),
                         ErrorKind::kInput, {images_.string()}));
  EXPECT_TRUE(fails_with(read_with(image_file(1, 0x10000, 0x10000, kPixels), label_file(kLabels)), ErrorKind::kInput,
                         {images_.string()}));
}

// The gzip header written by gzopen is 10 bytes; the deflate stream starts right after it.
constexpr size_t kGzipHeaderBytes = 10;

TEST_F(DatasetTest, CorruptGzipImages) {
  const auto good = write_gz("good.gz", image_file(3, 2, 3, kPixels));
  std::string bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), kGzipHeaderBytes + 8);
  // 0xFF starts a final block of the reserved type 3, which inflate must reject.
  bytes[kGzipHeaderBytes] = static_cast<char>(0xFF);
  const auto images = write_raw("images.gz", bytes);
  const auto labels = write_raw("labels", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string()}));
}

TEST_F(DatasetTest, GzipChecksumMismatch) {
  const auto good = write_gz("good.gz", image_file(3, 2, 3, kPixels));
  std::string bytes = read_bytes(good);
  bytes[bytes.size() - 8] ^= 0x01;  // the CRC-32 of the trailer
  const auto images = write_raw("images.gz", bytes);
  const auto labels = write_raw("labels", label_file(kLabels));
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string()}));
}

TEST_F(DatasetTest, CorruptGzipLabels) {
  const auto good = write_gz("good.gz", label_file(kLabels));
  std::string bytes = read_bytes(good);
  bytes[kGzipHeaderBytes] = static_cast<char>(0xFF);
  const auto images = write_raw("images", image_file(3, 2, 3, kPixels));
  const auto labels = write_raw("labels.gz", bytes);
  EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {labels.string()}));
}

TEST_F(DatasetTest, GzipCutShort) {
  const auto good = write_gz("good.gz", image_file(3, 2, 3, kPixels));
  const std::string bytes = read_bytes(good);
  // Cut in the data, and in the 8-byte CRC/length trailer after the last data byte.
  for (size_t keep : {kGzipHeaderBytes, kGzipHeaderBytes + 4, bytes.size() - 8, bytes.size() - 4, bytes.size() - 1}) {
    const auto images = write_raw("images.gz", bytes.substr(0, keep));
    const auto labels = write_raw("labels", label_file(kLabels));
    EXPECT_TRUE(fails_with(read_idx(images, labels), ErrorKind::kInput, {images.string()})) << keep << " bytes kept";
  }
}

// Writes the four Fashion-MNIST files: train has `train` examples of 2x2 pixels, test has `test` of
// test_rows x test_cols.
void write_split(const fs::path& dir, uint32_t train, uint32_t test, bool gzip, uint32_t test_cols = 2,
                 uint32_t test_rows = 2) {
  auto write = [&](const std::string& stem, const std::string& bytes) {
    if (gzip) {
      gzFile file = gzopen((dir / (stem + ".gz")).c_str(), "wb");
      ASSERT_NE(file, nullptr);
      ASSERT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
      ASSERT_EQ(gzclose(file), Z_OK);
    } else {
      std::ofstream(dir / stem, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  };
  auto pixels = [](uint32_t count, uint32_t rows, uint32_t cols, uint8_t base) {
    std::vector<uint8_t> out(count * rows * cols);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(base + i);
    return out;
  };
  auto labels = [](uint32_t count) {
    std::vector<uint8_t> out(count);
    for (uint32_t i = 0; i < count; ++i) out[i] = static_cast<uint8_t>(i % 10);
    return out;
  };
  write("train-images-idx3-ubyte", image_file(train, 2, 2, pixels(train, 2, 2, 0)));
  write("train-labels-idx1-ubyte", label_file(labels(train)));
  write("t10k-images-idx3-ubyte", image_file(test, test_rows, test_cols, pixels(test, test_rows, test_cols, 100)));
  write("t10k-labels-idx1-ubyte", label_file(labels(test)));
}

TEST_F(DatasetTest, LoadFashionMnistFromGzipFiles) {
  write_split(dir_, 12, 5, /*gzip=*/true);
  auto split = load_fashion_mnist(dir_);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->source, dir_.string());
  EXPECT_EQ(split->train.count, 12);
  EXPECT_EQ(split->test.count, 5);
  EXPECT_EQ(split->train.features, 4);
  EXPECT_EQ(split->test.features, 4);
  EXPECT_EQ(split->train.labels[11], 1);
  EXPECT_EQ(split->train.pixels[5], 5);
  EXPECT_EQ(split->test.pixels[0], 100);
}

TEST_F(DatasetTest, LoadFashionMnistFromRawFiles) {
  write_split(dir_, 7, 3, /*gzip=*/false);
  auto split = load_fashion_mnist(dir_);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->train.count, 7);
  EXPECT_EQ(split->test.count, 3);
  EXPECT_EQ(split->test.labels, (std::vector<int32_t>{0, 1, 2}));
}

TEST_F(DatasetTest, LoadDataReadsADirectory) {
  write_split(dir_, 4, 2, /*gzip=*/true);
  auto split = load_data(dir_.string(), 1);
  ASSERT_TRUE(split) << split.error().message;
  EXPECT_EQ(split->train.count, 4);
  EXPECT_EQ(split->test.count, 2);
}

TEST_F(DatasetTest, LoadFashionMnistMissingDirectory) {
  const auto missing = dir_ / "nothing-here";
  EXPECT_TRUE(fails_with(load_fashion_mnist(missing), ErrorKind::kInput, {missing.string()}));
  EXPECT_TRUE(fails_with(load_data(missing.string(), 1), ErrorKind::kInput, {missing.string()}));
}

TEST_F(DatasetTest, LoadFashionMnistMissingFileNamesIt) {
  write_split(dir_, 4, 2, /*gzip=*/true);
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  EXPECT_TRUE(fails_with(load_fashion_mnist(dir_), ErrorKind::kInput, {"t10k-labels-idx1-ubyte"}));
}

TEST_F(DatasetTest, LoadFashionMnistRejectsDifferentImageSizes) {
  write_split(dir_, 4, 2, /*gzip=*/true, /*test_cols=*/3);
  EXPECT_TRUE(fails_with(load_fashion_mnist(dir_), ErrorKind::kInput, {dir_.string()}));
}

TEST_F(DatasetTest, LoadFashionMnistRejectsAnotherShapeOfAsManyPixels) {
  // 1x4 test images beside 2x2 training images: the pixel counts agree, the images do not.
  write_split(dir_, 4, 2, /*gzip=*/false, /*test_cols=*/4, /*test_rows=*/1);
  EXPECT_TRUE(fails_with(load_fashion_mnist(dir_), ErrorKind::kInput, {dir_.string(), "2x2", "1x4"}));
  write_split(dir_, 4, 2, /*gzip=*/false, /*test_cols=*/2, /*test_rows=*/2);
  auto same = load_fashion_mnist(dir_);
  ASSERT_TRUE(same) << same.error().message;
  EXPECT_EQ(same->test.rows, 2);
  EXPECT_EQ(same->test.cols, 2);
}

TEST_F(DatasetTest, DataShapeReadsOnlyTheHeaders) {
  write_split(dir_, 12, 5, /*gzip=*/true);
  auto shape = data_shape(dir_.string());
  ASSERT_TRUE(shape) << shape.error().message;
  EXPECT_EQ(shape->train, 12);
  EXPECT_EQ(shape->test, 5);
  EXPECT_EQ(shape->features, 4);
  auto synthetic = data_shape("synthetic:300:40");
  ASSERT_TRUE(synthetic) << synthetic.error().message;
  EXPECT_EQ(synthetic->train, 300);
  EXPECT_EQ(synthetic->test, 40);
  EXPECT_EQ(synthetic->features, make_synthetic(1, 2, 2).train.features);
  EXPECT_TRUE(fails_with(data_shape("synthetic:x"), ErrorKind::kUsage, {"synthetic:x"}));
  fs::remove(dir_ / "t10k-images-idx3-ubyte.gz");
  EXPECT_TRUE(fails_with(data_shape(dir_.string()), ErrorKind::kInput, {"t10k-images-idx3-ubyte"}));
}

TEST(FashionMnistTest, ReadsTheInstalledDataSet) {
  const fs::path dir = kDefaultFashionMnistDir;
  if (!fs::is_directory(dir)) GTEST_SKIP() << dir << " is not installed (Debian package dataset-fashion-mnist)";
  auto split = load_fashion_mnist(dir);
  ASSERT_TRUE(split) << split.error().message;
  for (const Dataset* data : {&split->train, &split->test}) {
    EXPECT_EQ(data->features, 784);
    EXPECT_EQ(data->classes, 10);
    ASSERT_EQ(data->pixels.size(), static_cast<size_t>(data->count) * 784);
    const auto [lo, hi] = std::minmax_element(data->pixels.begin(), data->pixels.end());
    EXPECT_EQ(*lo, 0);
    EXPECT_EQ(*hi, 255);
  }
  EXPECT_EQ(split->train.count, 60000);
  EXPECT_EQ(split->test.count, 10000);
  std::array<int, 10> train_per_class{};
  for (int32_t label : split->train.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 10);
    ++train_per_class[static_cast<size_t>(label)];
  }
  for (int c = 0; c < 10; ++c) EXPECT_EQ(train_per_class[static_cast<size_t>(c)], 6000) << "class " << c;
  std::array<int, 10> test_per_class{};
  for (int32_t label : split->test.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 10);
    ++test_per_class[static_cast<size_t>(label)];
  }
  for (int c = 0; c < 10; ++c) EXPECT_EQ(test_per_class[static_cast<size_t>(c)], 1000) << "class " << c;
}

TEST(SyntheticTest, ShapesAndRanges) {
  const DataSplit split = make_synthetic(7, 300, 50);
  EXPECT_EQ(split.source, "synthetic");
  EXPECT_EQ(split.train.count, 300);
  EXPECT_EQ(split.test.count, 50);
  for (const Dataset* data : {&split.train, &split.test}) {
    EXPECT_EQ(data->features, 784);
    EXPECT_EQ(data->classes, 10);
    ASSERT_EQ(data->pixels.size(), static_cast<size_t>(data->count) * 784);
    ASSERT_EQ(data->labels.size(), static_cast<size_t>(data->count));
    // Both ends of the byte range are used: the data is not a constant image.
    const auto [lo, hi] = std::minmax_element(data->pixels.begin(), data->pixels.end());
    EXPECT_EQ(*lo, 0);
    EXPECT_GT(*hi, 200);
    for (int32_t label : data->labels) {
      ASSERT_GE(label, 0);
      ASSERT_LT(label, 10);
    }
  }
  // 300 draws from ten classes: each class appears (fixed for this seed, so not flaky).
  std::array<int, 10> per_class{};
  for (int32_t label : split.train.labels) ++per_class[static_cast<size_t>(label)];
  for (int c = 0; c < 10; ++c) EXPECT_GT(per_class[static_cast<size_t>(c)], 0) << "class " << c;
}

TEST(SyntheticTest, DeterministicPerSeed) {
  const DataSplit a = make_synthetic(42, 100, 20);
  const DataSplit b = make_synthetic(42, 100, 20);
  EXPECT_EQ(a.train.pixels, b.train.pixels);
  EXPECT_EQ(a.train.labels, b.train.labels);
  EXPECT_EQ(a.test.pixels, b.test.pixels);
  EXPECT_EQ(a.test.labels, b.test.labels);
}

TEST(SyntheticTest, DiffersAcrossSeedsAndSplits) {
  const DataSplit a = make_synthetic(1, 100, 100);
  const DataSplit b = make_synthetic(2, 100, 100);
  EXPECT_NE(a.train.pixels, b.train.pixels);
  EXPECT_NE(a.train.labels, b.train.labels);
  EXPECT_NE(a.test.pixels, b.test.pixels);
  EXPECT_NE(a.train.pixels, a.test.pixels);  // train and test are different draws
}

TEST(LoadDataTest, SyntheticSpecs) {
  auto both = load_data("synthetic:100:20", 5);
  ASSERT_TRUE(both) << both.error().message;
  EXPECT_EQ(both->train.count, 100);
  EXPECT_EQ(both->test.count, 20);
  EXPECT_EQ(both->source, "synthetic");
  const DataSplit direct = make_synthetic(5, 100, 20);
  EXPECT_EQ(both->train.pixels, direct.train.pixels);
  EXPECT_EQ(both->test.labels, direct.test.labels);

  auto train_only = load_data("synthetic:50", 5);
  ASSERT_TRUE(train_only) << train_only.error().message;
  EXPECT_EQ(train_only->train.count, 50);
  EXPECT_EQ(train_only->test.count, 2000);

  auto defaults = load_data("synthetic", 5);
  ASSERT_TRUE(defaults) << defaults.error().message;
  EXPECT_EQ(defaults->train.count, 12000);
  EXPECT_EQ(defaults->test.count, 2000);
}

TEST(LoadDataTest, BadSyntheticSpecsAreUsageErrors) {
  for (const char* spec : {"synthetic:x", "synthetic:0", "synthetic:", "synthetic:-5", "synthetic:10:0",
                           "synthetic:10:", "synthetic:10:20:30", "synthetic:10x", "synthetic100", "synthetic:+10",
                           "synthetic:99999999999", "synthetic:10:x"}) {
    EXPECT_TRUE(fails_with(load_data(spec, 1), ErrorKind::kUsage, {spec})) << spec;
  }
}

TEST(EpochOrderTest, IsAPermutation) {
  for (int64_t count : {0, 1, 2, 17, 1000}) {
    std::vector<int64_t> order = epoch_order(3, 0, count);
    ASSERT_EQ(order.size(), static_cast<size_t>(count));
    std::sort(order.begin(), order.end());
    std::vector<int64_t> expected(static_cast<size_t>(count));
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(order, expected) << count;
  }
}

TEST(EpochOrderTest, DeterministicPerSeedAndEpoch) {
  EXPECT_EQ(epoch_order(9, 4, 500), epoch_order(9, 4, 500));
  std::vector<int64_t> identity(500);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(epoch_order(9, 4, 500), identity);  // shuffled at all
}

TEST(EpochOrderTest, DiffersAcrossEpochsAndSeeds) {
  EXPECT_NE(epoch_order(9, 0, 500), epoch_order(9, 1, 500));
  EXPECT_NE(epoch_order(9, 1, 500), epoch_order(9, 2, 500));
  EXPECT_NE(epoch_order(9, 0, 500), epoch_order(10, 0, 500));
}

TEST(GatherBatchTest, CopiesTheRowsInOrder) {
  Dataset data;
  data.count = 5;
  data.features = 3;
  data.classes = 10;
  data.pixels.resize(15);
  for (size_t i = 0; i < data.pixels.size(); ++i) data.pixels[i] = static_cast<uint8_t>(i * 17);
  data.labels = {10, 11, 12, 13, 14};
  const std::vector<int64_t> order = {4, 2, 0, 3, 1};

  // Sentinels past the batch show nothing is written beyond n rows.
  std::vector<float> inputs(3 * 3, -1.0f);
  std::vector<int32_t> labels(3, -1);
  gather_batch(data, order, 1, 2, inputs.data(), labels.data());
  auto unit = [](std::vector<float> v) {
    for (float& x : v) x = x < 0 ? x : (x * 17) * (1.0f / 255.0f);  // the reader's own scaling
    return v;
  };
  EXPECT_EQ(inputs, unit({6, 7, 8, 0, 1, 2, -1, -1, -1}));
  EXPECT_EQ(labels, (std::vector<int32_t>{12, 10, -1}));

  gather_batch(data, order, 0, 3, inputs.data(), labels.data());
  EXPECT_EQ(inputs, unit({12, 13, 14, 6, 7, 8, 0, 1, 2}));
  EXPECT_EQ(labels, (std::vector<int32_t>{14, 12, 10}));
}

}  // namespace
}  // namespace cfmo::data
