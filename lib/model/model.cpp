#include "model/model.h"

#include <cmath>

namespace cfmo::model {

std::string_view to_string(ParamKind kind) {
  switch (kind) {
    case ParamKind::kMatrix:
      return "matrix";
    case ParamKind::kBias:
      return "bias";
    case ParamKind::kNorm:
      return "norm";
    case ParamKind::kEmbedding:
      return "embedding";
  }
  return "?";
}

size_t LayoutBuilder::add(std::vector<ParamInfo>& layout, std::string name, std::vector<int64_t> shape, ParamKind kind,
                          bool decays) {
  size_t size = 1;
  for (int64_t d : shape) size *= static_cast<size_t>(d);
  const size_t offset = offset_;
  layout.push_back({std::move(name), std::move(shape), offset, size, kind, decays});
  offset_ = (offset + size + 15) / 16 * 16;
  return offset;
}

size_t Model::num_trainable() const {
  size_t n = 0;
  for (const auto& p : params_) n += p.size;
  return n;
}

void Model::set_layout(std::vector<ParamInfo> layout, size_t size) {
  params_ = std::move(layout);
  parameters_.assign(size, 0.0f);
  gradients_.assign(size, 0.0f);
}

double softmax_cross_entropy(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, int64_t* correct) {
  double total = 0;
  for (int r = 0; r < batch; ++r) {
    const float* row = logits + static_cast<size_t>(r) * classes;
    int argmax = 0;
    for (int j = 1; j < classes; ++j) {
      if (row[j] > row[argmax]) argmax = j;
    }
    const float max = row[argmax];
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(static_cast<double>(row[j] - max));
    const int label = labels[r];
    const double log_sum = std::log(sum);
    total += log_sum - static_cast<double>(row[label] - max);
    if (correct != nullptr && argmax == label) ++*correct;
    if (dlogits != nullptr) {
      float* drow = dlogits + static_cast<size_t>(r) * classes;
      for (int j = 0; j < classes; ++j) {
        const double p = std::exp(static_cast<double>(row[j] - max) - log_sum);
        drow[j] = static_cast<float>(p - (j == label ? 1.0 : 0.0)) * grad_scale;
      }
    }
  }
  return total;
}

}  // namespace cfmo::model
