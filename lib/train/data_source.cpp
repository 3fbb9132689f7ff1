#include "train/data_source.h"

#include "data/tokens.h"
#include "train/train_config.h"

#include <algorithm>
#include <optional>

namespace cfmo::train {
namespace {

class ImageSource final : public DataSource {
 public:
  explicit ImageSource(data::DataSplit split) : split_(std::move(split)) {}

  std::string description() const override { return split_.source; }
  model::DataShape shape() const override {
    return {model::InputKind::kFeatures, split_.train.features, split_.train.classes};
  }
  int64_t train_examples() const override { return split_.train.count; }
  bool indexed() const override { return true; }

  model::Examples train_batch(const BatchRequest& request) override {
    const data::Dataset& train = split_.train;
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

  void for_each_eval_batch(int chunk, const std::function<void(const model::Examples&)>& f) override {
    // Converted to floats a chunk at a time, so the set itself stays in bytes.
    const data::Dataset& test = split_.test;
    tensor::FloatBuffer floats(static_cast<size_t>(std::min<int64_t>(chunk, test.count)) *
                               static_cast<size_t>(test.features));
    for (int64_t first = 0; first < test.count; first += chunk) {
      const int64_t n = std::min<int64_t>(chunk, test.count - first);
      test.rows_to_float(first, n, floats.data());
      f({static_cast<int>(n), floats.data(), test.labels.data() + first, nullptr});
    }
  }

  const data::DataSplit* images() const override { return &split_; }

 private:
  data::DataSplit split_;
  tensor::FloatBuffer inputs_;
  std::vector<int32_t> labels_;
};

/// Token windows: training windows drawn from the step (each worker from its
/// own part of the tokens, once it took it), evaluation over the exact
/// validation windows.
class TokenSource final : public DataSource {
 public:
  TokenSource(data::TokenSplit split, int context, uint64_t seed)
      : split_(std::move(split)), context_(context), seed_(seed) {}

  std::string description() const override { return split_.source; }
  model::DataShape shape() const override { return {model::InputKind::kTokens, 0, split_.vocab_size}; }
  int64_t train_examples() const override { return std::max<int64_t>(1, split_.train.size() / context_); }
  bool indexed() const override { return false; }

  Status take_part(int rank, int world) override {
    CFMO_ASSIGN_OR_RETURN(sampler_, data::WindowSampler::make(split_.train.size(), context_, rank, world, seed_));
    return {};
  }

  model::Examples train_batch(const BatchRequest& request) override {
    windows_.resize(static_cast<size_t>(request.count) * static_cast<size_t>(context_ + 1));
    sampler_->fill(split_.train, request.step, request.count, windows_.data());
    return {request.count, nullptr, nullptr, windows_.data()};
  }

  void for_each_eval_batch(int chunk, const std::function<void(const model::Examples&)>& f) override {
    const int64_t count = data::val_window_count(split_.val.size(), context_);
    const auto width = static_cast<size_t>(context_ + 1);
    std::vector<int32_t> windows(static_cast<size_t>(std::min<int64_t>(chunk, count)) * width);
    for (int64_t first = 0; first < count; first += chunk) {
      const int n = static_cast<int>(std::min<int64_t>(chunk, count - first));
      for (int i = 0; i < n; ++i) {
        split_.val.copy(data::val_window_start(first + i, context_), context_ + 1,
                        windows.data() + static_cast<size_t>(i) * width);
      }
      f({n, nullptr, nullptr, windows.data()});
    }
  }

 private:
  data::TokenSplit split_;
  std::optional<data::WindowSampler> sampler_;  ///< this worker's part (take_part)
  int context_;
  uint64_t seed_;
  std::vector<int32_t> windows_;
};

}  // namespace

std::unique_ptr<DataSource> make_image_source(data::DataSplit split) {
  return std::make_unique<ImageSource>(std::move(split));
}

Result<std::unique_ptr<DataSource>> load_data_source(const TrainConfig& config, int context) {
  if (data::is_token_spec(config.data)) {
    if (context <= 0) {
      return make_error(ErrorKind::kUsage, "--data '{}' is token data: train it with --model gpt:...", config.data);
    }
    data::TokenDataOptions options;
    options.spec = config.data;
    options.val_spec = config.val_data;
    options.val_split = config.val_split;
    options.vocab_size = config.vocab_size;
    options.context = context;
    options.val_tokens = config.val_tokens;
    CFMO_ASSIGN_OR_RETURN(data::TokenSplit split, data::load_tokens(options));
    return std::unique_ptr<DataSource>(
        std::make_unique<TokenSource>(std::move(split), context, static_cast<uint64_t>(config.seed)));
  }
  if (!config.val_data.empty()) {
    return make_error(ErrorKind::kUsage, "--val-data '{}': only token data (text:, tokens:) has separate validation",
                      config.val_data);
  }
  CFMO_ASSIGN_OR_RETURN(data::DataSplit split, data::load_data(config.data, static_cast<uint64_t>(config.seed)));
  return make_image_source(std::move(split));
}

}  // namespace cfmo::train
