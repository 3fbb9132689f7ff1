#include "train/data_source.h"

#include "train/train_config.h"

#include <algorithm>

namespace cfmo {
namespace {

class ImageSource final : public DataSource {
 public:
  explicit ImageSource(DataSplit split) : split_(std::move(split)) {}

  std::string description() const override { return split_.source; }
  DataShape shape() const override { return {InputKind::kFeatures, split_.train.features, split_.train.classes}; }
  int64_t train_examples() const override { return split_.train.count; }
  bool indexed() const override { return true; }

  Examples train_batch(const BatchRequest& request) override {
    const Dataset& train = split_.train;
    const auto features = static_cast<size_t>(train.features);
    const size_t n = request.indices.size();
    inputs_.resize(n * features);
    labels_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      train.rows_to_float(request.indices[i], 1, inputs_.data() + i * features);
      labels_[i] = train.labels[static_cast<size_t>(request.indices[i])];
    }
    return {static_cast<int>(n), inputs_.data(), labels_.data(), nullptr};
  }

  void for_each_eval_batch(int chunk, const std::function<void(const Examples&)>& f) override {
    // Converted to floats a chunk at a time, so the set itself stays in bytes.
    const Dataset& test = split_.test;
    FloatBuffer floats(static_cast<size_t>(std::min<int64_t>(chunk, test.count)) * static_cast<size_t>(test.features));
    for (int64_t first = 0; first < test.count; first += chunk) {
      const int64_t n = std::min<int64_t>(chunk, test.count - first);
      test.rows_to_float(first, n, floats.data());
      f({static_cast<int>(n), floats.data(), test.labels.data() + first, nullptr});
    }
  }

  const DataSplit* images() const override { return &split_; }

 private:
  DataSplit split_;
  FloatBuffer inputs_;
  std::vector<int32_t> labels_;
};

}  // namespace

std::unique_ptr<DataSource> make_image_source(DataSplit split) {
  return std::make_unique<ImageSource>(std::move(split));
}

Result<std::unique_ptr<DataSource>> load_data_source(const TrainConfig& config, int /*rank*/, int /*world*/,
                                                     int /*context*/) {
  CFMO_ASSIGN_OR_RETURN(DataSplit split, load_data(config.data, static_cast<uint64_t>(config.seed)));
  return make_image_source(std::move(split));
}

}  // namespace cfmo
