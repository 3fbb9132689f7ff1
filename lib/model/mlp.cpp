#include "model/mlp.h"

#include "core/rng.h"
#include "tensor/ops.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace cfmo::model {

Result<MlpSpec> MlpSpec::parse(std::string_view text, int inputs, int classes) {
  constexpr std::string_view kPrefix = "mlp:";
  auto bad = [&](std::string_view why) {
    return make_error(ErrorKind::kUsage, "--model '{}': {} (expected e.g. mlp:256,128)", text, why);
  };
  if (!text.starts_with(kPrefix)) return bad("unknown model");
  MlpSpec spec;
  spec.inputs = inputs;
  spec.classes = classes;
  spec.hidden.clear();
  std::string_view rest = text.substr(kPrefix.size());
  while (!rest.empty()) {
    auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    int width = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), width);
    if (ec != std::errc() || end != item.data() + item.size() || width <= 0 || width > 65536) {
      return bad("hidden sizes must be integers in 1..65536");
    }
    spec.hidden.push_back(width);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) return bad("trailing comma");
  }
  return spec;
}

std::string MlpSpec::to_string() const {
  std::string out = "mlp:";
  for (size_t i = 0; i < hidden.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(hidden[i]);
  }
  return out;
}

Mlp::Mlp(MlpSpec spec) : spec_(std::move(spec)) {
  widths_.push_back(spec_.inputs);
  for (int h : spec_.hidden) widths_.push_back(h);
  widths_.push_back(spec_.classes);
  std::vector<ParamInfo> layout;
  LayoutBuilder builder;
  for (int l = 0; l < layers(); ++l) {
    const int64_t in = widths_[l];
    const int64_t out = widths_[l + 1];
    // torch.optim decays every tensor it is given: so does the MLP, to stay comparable.
    builder.add(layout, fmt::format("layers.{}.weight", l), {out, in}, ParamKind::kMatrix, true);
    builder.add(layout, fmt::format("layers.{}.bias", l), {out}, ParamKind::kBias, true);
  }
  set_layout(std::move(layout), builder.size());
}

double Mlp::flops_per_example() const {
  // Forward 2*in*out per layer; backward twice that (weights and inputs), less the first layer's input gradient.
  double flops = 0;
  for (int l = 0; l < layers(); ++l) {
    const double mac = static_cast<double>(widths_[l]) * widths_[l + 1];
    flops += (l == 0 ? 4.0 : 6.0) * mac;
  }
  return flops;
}

float Mlp::forward_backward(const Examples& batch) {
  return forward_backward(batch.features, batch.labels, batch.count);
}

EvalResult Mlp::evaluate(const Examples& batch) { return evaluate(batch.features, batch.labels, batch.count); }

void Mlp::init(uint64_t seed) {
  Rng rng(seed, /*stream=*/0x1417);
  std::fill(parameters_.begin(), parameters_.end(), 0.0f);
  for (int l = 0; l < layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(widths_[l]));
    for (int which = 0; which < 2; ++which) {
      const ParamInfo& p = params_[2 * l + which];
      for (size_t i = 0; i < p.size; ++i) parameters_[p.offset + i] = rng.uniform(-bound, bound);
    }
  }
}

size_t Mlp::workspace_floats(int batch) const {
  // What ensure_workspace allocates: every layer's outputs and two rows of the widest.
  size_t floats = 0;
  int widest = 0;
  for (size_t l = 1; l < widths_.size(); ++l) {
    floats += static_cast<size_t>(widths_[l]);
    widest = std::max(widest, widths_[l]);
  }
  return static_cast<size_t>(batch) * (floats + static_cast<size_t>(spec_.classes) + 2 * static_cast<size_t>(widest));
}

void Mlp::ensure_workspace(int batch) {
  if (batch <= workspace_batch_) return;
  workspace_batch_ = batch;
  const auto b = static_cast<size_t>(batch);
  activations_.assign(widths_.size(), tensor::FloatBuffer());
  int widest = 0;
  for (size_t l = 1; l < widths_.size(); ++l) {
    activations_[l].resize(b * static_cast<size_t>(widths_[l]));
    widest = std::max(widest, widths_[l]);
  }
  logits_.resize(b * static_cast<size_t>(spec_.classes));
  grad_a_.resize(b * static_cast<size_t>(widest));
  grad_z_.resize(b * static_cast<size_t>(widest));
}

void Mlp::forward(const float* inputs, int batch) {
  ensure_workspace(batch);
  const float* a = inputs;
  for (int l = 0; l < layers(); ++l) {
    const int in = widths_[l];
    const int out = widths_[l + 1];
    const bool last = l == layers() - 1;
    float* z = last ? logits_.data() : activations_[l + 1].data();
    tensor::ops::gemm(tensor::ops::Trans::kNo, tensor::ops::Trans::kYes, batch, out, in, 1.0f, a, in, weight(l), in,
                      0.0f, z, out);
    tensor::ops::add_bias_rows(z, bias(l), batch, out, !last);
    a = z;
  }
}

float Mlp::forward_backward(const float* inputs, const int32_t* labels, int batch) {
  forward(inputs, batch);
  const int classes = spec_.classes;
  const double loss = softmax_cross_entropy(logits_.data(), labels, batch, classes, grad_z_.data(),
                                            1.0f / static_cast<float>(batch), nullptr);
  // grad_z_ holds dL/dZ for the current layer; grad_a_ receives dL/dA below it.
  for (int l = layers() - 1; l >= 0; --l) {
    const int in = widths_[l];
    const int out = widths_[l + 1];
    const float* a = l == 0 ? inputs : activations_[l].data();
    const ParamInfo& w = params_[2 * l];
    const ParamInfo& bp = params_[2 * l + 1];
    float* dw = gradients_.data() + w.offset;
    float* db = gradients_.data() + bp.offset;
    const float* dz = grad_z_.data();
    tensor::ops::gemm(tensor::ops::Trans::kYes, tensor::ops::Trans::kNo, out, in, batch, 1.0f, dz, out, a, in, 0.0f, dw,
                      in);
    tensor::ops::column_sums(dz, batch, out, db);
    if (l == 0) break;  // no gradient is needed for the inputs
    tensor::ops::gemm(tensor::ops::Trans::kNo, tensor::ops::Trans::kNo, batch, in, out, 1.0f, dz, out, weight(l), in,
                      0.0f, grad_a_.data(), in);
    // ReLU backward: dZ = dA where the activation was positive.
    tensor::ops::relu_backward(activations_[l].data(), grad_a_.data(), grad_z_.data(),
                               static_cast<size_t>(batch) * static_cast<size_t>(in));
  }
  return static_cast<float>(loss / batch);
}

EvalResult Mlp::evaluate(const float* inputs, const int32_t* labels, int64_t count, int chunk) {
  EvalResult result;
  for (int64_t start = 0; start < count; start += chunk) {
    const int n = static_cast<int>(std::min<int64_t>(chunk, count - start));
    forward(inputs + static_cast<size_t>(start) * static_cast<size_t>(spec_.inputs), n);
    result.loss_sum +=
        softmax_cross_entropy(logits_.data(), labels + start, n, spec_.classes, nullptr, 0.0f, &result.correct);
    result.count += n;
  }
  return result;
}

}  // namespace cfmo::model
