#include "data/dataset.h"

#include "core/rng.h"
#include "core/simd.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <memory>

namespace cfmo::data {
namespace {

constexpr uint32_t kImageMagic = 0x00000803;  // unsigned byte, 3 dimensions
constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned byte, 1 dimension
// Far more than any IDX data set this tool reads; stops a corrupt header from
// asking for terabytes.
constexpr uint64_t kMaxElements = uint64_t{1} << 34;

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

/// An IDX file opened through zlib, which reads gzip and raw files alike.
class IdxReader {
 public:
  static Result<IdxReader> open(const std::filesystem::path& path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      return make_error(ErrorKind::kInput, "'{}': no such file", path.string());
    }
    gzFile f = gzopen(path.c_str(), "rb");
    if (f == nullptr) {
      return make_error(ErrorKind::kInput, "'{}': cannot open: {}", path.string(), std::strerror(errno));
    }
    gzbuffer(f, 1 << 17);
    return IdxReader(path, GzHandle(f));
  }

  Status read_exact(void* out, size_t bytes, std::string_view what) {
    auto* p = static_cast<unsigned char*>(out);
    while (bytes > 0) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes, 1u << 30));
      int n = gzread(file_.get(), p, chunk);
      if (n < 0) {
        int errnum = 0;
        const char* message = gzerror(file_.get(), &errnum);
        return make_error(ErrorKind::kInput, "'{}': corrupt compressed data while reading {}: {}", path_.string(), what,
                          message);
      }
      if (n == 0) return make_error(ErrorKind::kInput, "'{}': truncated while reading {}", path_.string(), what);
      p += n;
      bytes -= static_cast<size_t>(n);
    }
    return {};
  }

  Result<uint32_t> read_be32(std::string_view what) {
    unsigned char b[4];
    CFMO_TRY(read_exact(b, 4, what));
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  Status expect_end() {
    unsigned char extra;
    int n = gzread(file_.get(), &extra, 1);
    if (n < 0) {
      int errnum = 0;
      return make_error(ErrorKind::kInput, "'{}': corrupt compressed data: {}", path_.string(),
                        gzerror(file_.get(), &errnum));
    }
    if (n > 0) return make_error(ErrorKind::kInput, "'{}': unexpected bytes after the data", path_.string());
    // A gzip stream cut short after its last data byte (in the CRC/length trailer, so unchecked) is only
    // reported through gzerror: gzread then returns 0, as at a clean end.
    int errnum = Z_OK;
    gzerror(file_.get(), &errnum);
    if (errnum == Z_BUF_ERROR) return make_error(ErrorKind::kInput, "'{}': truncated compressed data", path_.string());
    return {};
  }

  const std::filesystem::path& path() const { return path_; }

 private:
  IdxReader(std::filesystem::path path, GzHandle file) : path_(std::move(path)), file_(std::move(file)) {}
  std::filesystem::path path_;
  GzHandle file_;
};

struct ImageHeader {
  uint32_t count = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
};

/// An IDX image file's header, checked: the magic and plausible dimensions.
Result<ImageHeader> read_image_header(IdxReader& file) {
  const std::string name = file.path().string();
  CFMO_ASSIGN_OR_RETURN(uint32_t magic, file.read_be32("the header"));
  if (magic != kImageMagic) {
    return make_error(ErrorKind::kInput, "'{}': not an IDX image file (magic 0x{:08x}, expected 0x{:08x})", name, magic,
                      kImageMagic);
  }
  ImageHeader h;
  CFMO_ASSIGN_OR_RETURN(h.count, file.read_be32("the header"));
  CFMO_ASSIGN_OR_RETURN(h.rows, file.read_be32("the header"));
  CFMO_ASSIGN_OR_RETURN(h.cols, file.read_be32("the header"));
  const uint64_t elements = uint64_t{h.count} * h.rows * h.cols;
  if (h.count == 0 || h.rows == 0 || h.cols == 0 || elements > kMaxElements || uint64_t{h.rows} * h.cols > (1u << 24)) {
    return make_error(ErrorKind::kInput, "'{}': implausible dimensions {}x{}x{}", name, h.count, h.rows, h.cols);
  }
  return h;
}

std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& stem) {
  std::error_code ec;
  for (const char* suffix : {".gz", ""}) {
    auto candidate = dir / (stem + suffix);
    if (std::filesystem::exists(candidate, ec)) return candidate;
  }
  return dir / (stem + ".gz");  // so the error names the file we expected
}

}  // namespace

Result<Dataset> read_idx(const std::filesystem::path& images, const std::filesystem::path& labels, int classes) {
  Dataset data;
  data.classes = classes;

  CFMO_ASSIGN_OR_RETURN(auto image_file, IdxReader::open(images));
  CFMO_ASSIGN_OR_RETURN(const ImageHeader header, read_image_header(image_file));
  const uint32_t count = header.count;
  const uint64_t elements = uint64_t{count} * header.rows * header.cols;

  std::vector<unsigned char> pixels(elements);
  CFMO_TRY(image_file.read_exact(pixels.data(), pixels.size(), "the pixels"));
  CFMO_TRY(image_file.expect_end());
  CFMO_ASSIGN_OR_RETURN(auto label_file, IdxReader::open(labels));
  CFMO_ASSIGN_OR_RETURN(uint32_t label_magic, label_file.read_be32("the header"));
  if (label_magic != kLabelMagic) {
    return make_error(ErrorKind::kInput, "'{}': not an IDX label file (magic 0x{:08x}, expected 0x{:08x})",
                      labels.string(), label_magic, kLabelMagic);
  }
  CFMO_ASSIGN_OR_RETURN(uint32_t label_count, label_file.read_be32("the header"));
  if (label_count != count) {
    return make_error(ErrorKind::kInput, "'{}': {} labels for {} images in '{}'", labels.string(), label_count, count,
                      images.string());
  }

  std::vector<unsigned char> raw_labels(count);
  CFMO_TRY(label_file.read_exact(raw_labels.data(), raw_labels.size(), "the labels"));
  CFMO_TRY(label_file.expect_end());

  data.count = count;
  data.rows = static_cast<int>(header.rows);
  data.cols = static_cast<int>(header.cols);
  data.features = data.rows * data.cols;
  data.pixels = std::move(pixels);
  data.labels.resize(count);
  for (size_t i = 0; i < count; ++i) {
    if (raw_labels[i] >= classes) {
      return make_error(ErrorKind::kInput, "'{}': label {} of example {} is out of range 0..{}", labels.string(),
                        raw_labels[i], i, classes - 1);
    }
    data.labels[i] = raw_labels[i];
  }
  return data;
}

Result<DataSplit> load_fashion_mnist(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return make_error(
        ErrorKind::kInput,
        "data directory '{}': not found (install Debian's dataset-fashion-mnist, or use --data synthetic)",
        dir.string());
  }
  DataSplit split;
  split.source = dir.string();
  CFMO_ASSIGN_OR_RETURN(split.train,
                        read_idx(find_file(dir, "train-images-idx3-ubyte"), find_file(dir, "train-labels-idx1-ubyte")));
  CFMO_ASSIGN_OR_RETURN(split.test,
                        read_idx(find_file(dir, "t10k-images-idx3-ubyte"), find_file(dir, "t10k-labels-idx1-ubyte")));
  // The same shape, not only the same pixel count: 56x14 test images beside 28x28 training images are another data set.
  if (split.train.rows != split.test.rows || split.train.cols != split.test.cols) {
    return make_error(ErrorKind::kInput, "data directory '{}': training images are {}x{}, test images {}x{}",
                      dir.string(), split.train.rows, split.train.cols, split.test.rows, split.test.cols);
  }
  return split;
}

DataSplit make_synthetic(uint64_t seed, int64_t train_count, int64_t test_count) {
  constexpr int kSide = 28;
  constexpr int kFeatures = kSide * kSide;
  constexpr int kClasses = 10;
  Rng rng(seed, /*stream=*/0x5E7);
  // Prototypes: a few Gaussian blobs per class, so classes overlap somewhat.
  std::vector<float> prototypes(static_cast<size_t>(kClasses) * kFeatures, 0.0f);
  for (int c = 0; c < kClasses; ++c) {
    for (int blob = 0; blob < 4; ++blob) {
      const float cx = rng.uniform(6, 22);
      const float cy = rng.uniform(6, 22);
      const float radius = rng.uniform(2, 6);
      const float weight = rng.uniform(0.4f, 1.0f);
      for (int y = 0; y < kSide; ++y) {
        for (int x = 0; x < kSide; ++x) {
          const float d2 = (static_cast<float>(x) - cx) * (static_cast<float>(x) - cx) +
                           (static_cast<float>(y) - cy) * (static_cast<float>(y) - cy);
          prototypes[static_cast<size_t>(c) * kFeatures + y * kSide + x] +=
              weight * std::exp(-d2 / (2 * radius * radius));
        }
      }
    }
  }
  auto fill = [&](Dataset& data, int64_t count, uint64_t stream) {
    Rng local(seed, stream);
    data.count = count;
    data.features = kFeatures;
    data.rows = kSide;
    data.cols = kSide;
    data.classes = kClasses;
    data.pixels.resize(static_cast<size_t>(count) * kFeatures);
    data.labels.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      const auto label = static_cast<int32_t>(local.below(kClasses));
      const auto other = static_cast<int32_t>(local.below(kClasses));
      const float mix = local.uniform(0.0f, 0.45f);  // blend with another class: overlap
      const float gain = local.uniform(0.7f, 1.2f);
      data.labels[static_cast<size_t>(i)] = label;
      uint8_t* row = data.pixels.data() + static_cast<size_t>(i) * kFeatures;
      const float* p = prototypes.data() + static_cast<size_t>(label) * kFeatures;
      const float* q = prototypes.data() + static_cast<size_t>(other) * kFeatures;
      for (int k = 0; k < kFeatures; ++k) {
        const float v = gain * ((1 - mix) * p[k] + mix * q[k]) + 0.15f * local.normal();
        row[k] = static_cast<uint8_t>(std::lround(std::clamp(v, 0.0f, 1.0f) * 255.0f));
      }
    }
  };
  DataSplit split;
  split.source = "synthetic";
  fill(split.train, train_count, 1);
  fill(split.test, test_count, 2);
  return split;
}

namespace {

constexpr std::string_view kSynthetic = "synthetic";

/// "synthetic[:TRAIN[:TEST]]" -> {TRAIN, TEST}.
Result<std::array<int64_t, 2>> synthetic_sizes(const std::string& spec) {
  std::array<int64_t, 2> sizes = {12000, 2000};
  std::string_view rest = std::string_view(spec).substr(kSynthetic.size());
  for (int64_t& size : sizes) {
    if (rest.empty()) break;
    if (rest.front() != ':') break;
    rest.remove_prefix(1);
    auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), size);
    if (ec != std::errc() || size <= 0 || size > (int64_t{1} << 24)) {
      return make_error(ErrorKind::kUsage, "--data '{}': expected synthetic[:TRAIN[:TEST]]", spec);
    }
    rest = std::string_view(end, static_cast<size_t>(rest.data() + rest.size() - end));
  }
  if (!rest.empty()) return make_error(ErrorKind::kUsage, "--data '{}': expected synthetic[:TRAIN[:TEST]]", spec);
  return sizes;
}

}  // namespace

Result<DataSplit> load_data(const std::string& spec, uint64_t seed) {
  if (!spec.starts_with(kSynthetic)) return load_fashion_mnist(spec);
  CFMO_ASSIGN_OR_RETURN(const auto sizes, synthetic_sizes(spec));
  return make_synthetic(seed, sizes[0], sizes[1]);
}

Result<DatasetSize> data_shape(const std::string& spec) {
  DatasetSize shape;
  if (spec.starts_with(kSynthetic)) {
    CFMO_ASSIGN_OR_RETURN(const auto sizes, synthetic_sizes(spec));
    shape.train = sizes[0];
    shape.test = sizes[1];
    shape.features = 28 * 28;  // make_synthetic's images
    return shape;
  }
  // The image headers only: a gzip file is read no further than its first bytes.
  int64_t* counts[2] = {&shape.train, &shape.test};
  const char* stems[2] = {"train-images-idx3-ubyte", "t10k-images-idx3-ubyte"};
  for (int i = 0; i < 2; ++i) {
    CFMO_ASSIGN_OR_RETURN(auto file, IdxReader::open(find_file(spec, stems[i])));
    CFMO_ASSIGN_OR_RETURN(const ImageHeader header, read_image_header(file));
    *counts[i] = header.count;
    shape.features = static_cast<int>(header.rows * header.cols);
  }
  return shape;
}

std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch, int64_t count) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) order[static_cast<size_t>(i)] = i;
  Rng rng(seed, 0xE90C0000ULL + static_cast<uint64_t>(epoch));
  for (int64_t i = count - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

namespace {

CFMO_SIMD_CLONES
void bytes_to_unit_floats(const uint8_t* __restrict in, size_t n, float* __restrict out) {
  constexpr float kScale = 1.0f / 255.0f;
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]) * kScale;
}

}  // namespace

void Dataset::rows_to_float(int64_t first, int64_t n, float* out) const {
  const size_t width = static_cast<size_t>(features);
  bytes_to_unit_floats(row(first), static_cast<size_t>(n) * width, out);
}

void gather_batch(const Dataset& data, const std::vector<int64_t>& order, int64_t first, int n, float* inputs,
                  int32_t* labels) {
  const auto features = static_cast<size_t>(data.features);
  for (int i = 0; i < n; ++i) {
    const int64_t index = order[static_cast<size_t>(first + i)];
    bytes_to_unit_floats(data.row(index), features, inputs + static_cast<size_t>(i) * features);
    labels[i] = data.labels[static_cast<size_t>(index)];
  }
}

}  // namespace cfmo::data
