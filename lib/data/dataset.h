#pragma once
/// Labelled examples in memory: 8-bit features (as IDX files store them),
/// converted to float32 in [0, 1] a batch at a time, and int32 labels.
/// Fashion-MNIST from IDX files (gzip or raw) or seeded synthetic data.
/// Keeping bytes, not floats, makes the training set 47 MB instead of 188 MB
/// per worker process.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::data {

struct Dataset {
  int64_t count = 0;
  int features = 0;
  int rows = 0;  ///< the images' shape: rows x cols = features
  int cols = 0;
  int classes = 0;
  std::vector<uint8_t> pixels;  ///< [count, features], row-major; feature value = pixel / 255
  std::vector<int32_t> labels;  ///< [count], each in [0, classes)

  const uint8_t* row(int64_t i) const { return pixels.data() + static_cast<size_t>(i) * static_cast<size_t>(features); }
  /// Writes rows [first, first + n) as floats in [0, 1] to `out` [n, features].
  void rows_to_float(int64_t first, int64_t n, float* out) const;
};

struct DataSplit {
  Dataset train;
  Dataset test;
  std::string source;  ///< the directory read, or "synthetic"
};

/// Where Debian's dataset-fashion-mnist package installs the files.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// Reads an IDX image file and its label file (each gzip-compressed or raw).
/// Errors name the file: missing, wrong magic, truncated, trailing bytes,
/// counts that disagree, labels out of range.
Result<Dataset> read_idx(const std::filesystem::path& images, const std::filesystem::path& labels, int classes = 10);

/// Loads {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] from `dir`.
Result<DataSplit> load_fashion_mnist(const std::filesystem::path& dir);

/// Ten classes of 28x28 "images": each class a smooth random prototype,
/// each example the prototype shifted, scaled and with noise. Learnable but
/// not trivially separable; the same for the same seed everywhere.
DataSplit make_synthetic(uint64_t seed, int64_t train_count = 12000, int64_t test_count = 2000);

/// `spec` is a directory, "synthetic" or "synthetic:TRAIN[:TEST]".
Result<DataSplit> load_data(const std::string& spec, uint64_t seed);

/// How big the data set `spec` names is, without loading it: from the IDX
/// images' headers, or the synthetic sizes. For estimates (memory).
struct DatasetSize {
  int64_t train = 0;
  int64_t test = 0;
  int features = 0;
  int classes = 10;
};
Result<DatasetSize> data_shape(const std::string& spec);

/// The order of examples in each epoch: a permutation of [0, count) that
/// depends only on (seed, epoch), so a resumed run sees the same batches.
std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch, int64_t count);

/// Copies rows `order[first..first+n)` of `data` into `inputs`/`labels`.
void gather_batch(const Dataset& data, const std::vector<int64_t>& order, int64_t first, int n, float* inputs,
                  int32_t* labels);

}  // namespace cfmo::data
