#include "optim/optimizer.h"

#include "core/simd.h"
#include "tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace cfmo::optim {

AdamCoefficients adam_coefficients(const OptimizerConfig& c, int64_t step, float lr) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  return {static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
}

namespace {

// ---- element-wise kernels (PyTorch's for-each formulas, float arithmetic) ----

CFMO_SIMD_CLONES
void sgd_kernel(float* __restrict p, const float* __restrict g, float* __restrict buf, size_t n, float lr,
                float momentum, float weight_decay, bool nesterov, bool first) {
  for (size_t i = 0; i < n; ++i) {
    float d = g[i] + weight_decay * p[i];
    if (momentum != 0.0f) {
      const float b = first ? d : momentum * buf[i] + d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

/// Adam and AdamW: `l2` adds weight decay to the gradient (Adam), `decay`
/// shrinks the parameter first (AdamW's 1 - lr * wd).
CFMO_SIMD_CLONES
void adam_kernel(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, size_t n,
                 float beta1, float beta2, float step_size, float inv_sqrt_bc2, float eps, float l2, float decay) {
  for (size_t i = 0; i < n; ++i) {
    const float pi = p[i] * decay;
    const float gi = g[i] + l2 * pi;
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

CFMO_SIMD_CLONES
void scale_kernel(float* __restrict x, size_t n, float factor) {
  for (size_t i = 0; i < n; ++i) x[i] *= factor;
}

void scale_range(tensor::FloatBuffer& buffer, float factor, size_t offset, size_t count) {
  if (offset >= buffer.size()) return;
  scale_kernel(buffer.data() + offset, std::min(count, buffer.size() - offset), factor);
}

/// Calls f(offset, count, weight_decay) for each tensor of `layout`, the
/// decay `wd` only where the tensor takes it (a GPT's matrices, not its
/// biases, norms and embeddings); the whole buffer when `layout` is empty.
template <typename F>
void for_each_tensor(const std::vector<model::ParamInfo>& layout, size_t size, double wd, F&& f) {
  if (layout.empty()) {
    f(size_t{0}, size, static_cast<float>(wd));
    return;
  }
  for (const auto& info : layout) f(info.offset, info.size, info.decays ? static_cast<float>(wd) : 0.0f);
}

class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerConfig& config, std::vector<model::ParamInfo> layout, size_t size)
      : config_(config), layout_(std::move(layout)), buffer_(size, 0.0f) {}
  std::string_view name() const override { return "sgd"; }

  void step(std::span<float> params, std::span<const float> grads, float lr) override {
    for_each_tensor(layout_, params.size(), config_.weight_decay, [&](size_t offset, size_t count, float wd) {
      sgd_kernel(params.data() + offset, grads.data() + offset, buffer_.data() + offset, count, lr,
                 static_cast<float>(config_.momentum), wd, config_.nesterov, steps_ == 0);
    });
    ++steps_;
  }
  void scale_first_moment(float factor, size_t offset, size_t count) override {
    scale_range(buffer_, factor, offset, count);
  }
  std::vector<OptimizerState> state() override { return {{"momentum_buffer", &buffer_}}; }

 private:
  OptimizerConfig config_;
  std::vector<model::ParamInfo> layout_;
  tensor::FloatBuffer buffer_;
};

class Adam final : public Optimizer {
 public:
  Adam(const OptimizerConfig& config, std::vector<model::ParamInfo> layout, size_t size, bool decoupled)
      : config_(config),
        layout_(std::move(layout)),
        decoupled_(decoupled),
        exp_avg_(size, 0.0f),
        exp_avg_sq_(size, 0.0f) {}
  std::string_view name() const override { return decoupled_ ? "adamw" : "adam"; }

  void step(std::span<float> params, std::span<const float> grads, float lr) override {
    ++steps_;
    const auto k = adam_coefficients(config_, steps_, lr);
    for_each_tensor(layout_, params.size(), config_.weight_decay, [&](size_t offset, size_t count, float wd) {
      adam_kernel(params.data() + offset, grads.data() + offset, exp_avg_.data() + offset, exp_avg_sq_.data() + offset,
                  count, static_cast<float>(config_.beta1), static_cast<float>(config_.beta2), k.step_size,
                  k.inv_sqrt_bc2, static_cast<float>(config_.eps), decoupled_ ? 0.0f : wd,
                  decoupled_ ? 1.0f - lr * wd : 1.0f);
    });
  }
  void scale_first_moment(float factor, size_t offset, size_t count) override {
    scale_range(exp_avg_, factor, offset, count);
  }
  std::vector<OptimizerState> state() override { return {{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}}; }

 private:
  OptimizerConfig config_;
  std::vector<model::ParamInfo> layout_;
  bool decoupled_;
  tensor::FloatBuffer exp_avg_;
  tensor::FloatBuffer exp_avg_sq_;
};

/// Muon for the matrices (ParamInfo::is_matrix: a GPT's blocks' hidden
/// weights, not its embeddings), AdamW for everything else (biases, norms, embeddings). The update of a
/// weight is scaled by 0.2 * sqrt(max(rows, cols)) so its RMS matches AdamW's
/// (Moonshot AI, "Muon is Scalable for LLM Training", 2025): one --lr serves both.
class Muon final : public Optimizer {
 public:
  Muon(const OptimizerConfig& config, std::vector<model::ParamInfo> layout, size_t size)
      : config_(config),
        layout_(std::move(layout)),
        momentum_(size, 0.0f),
        exp_avg_(size, 0.0f),
        exp_avg_sq_(size, 0.0f) {
    size_t largest = 0;
    for (const auto& p : layout_) largest = std::max(largest, p.size);
    update_.resize(largest);
  }
  std::string_view name() const override { return "muon"; }

  void step(std::span<float> params, std::span<const float> grads, float lr) override {
    ++steps_;
    const auto k = adam_coefficients(config_, steps_, lr);
    const auto mu = static_cast<float>(config_.momentum);
    for (const auto& info : layout_) {
      const auto wd = info.decays ? static_cast<float>(config_.weight_decay) : 0.0f;
      float* p = params.data() + info.offset;
      const float* g = grads.data() + info.offset;
      if (!info.is_matrix()) {
        adam_kernel(p, g, exp_avg_.data() + info.offset, exp_avg_sq_.data() + info.offset, info.size,
                    static_cast<float>(config_.beta1), static_cast<float>(config_.beta2), k.step_size, k.inv_sqrt_bc2,
                    static_cast<float>(config_.eps), 0.0f, 1.0f - lr * wd);
        continue;
      }
      float* buf = momentum_.data() + info.offset;
      float* u = update_.data();
      for (size_t i = 0; i < info.size; ++i) {
        buf[i] = mu * buf[i] + g[i];
        u[i] = config_.nesterov ? g[i] + mu * buf[i] : buf[i];
      }
      const auto rows = static_cast<int>(info.shape[0]);
      const auto cols = static_cast<int>(info.shape[1]);
      newton_schulz(std::span<float>(u, info.size), rows, cols, config_.ns_steps, workspace_);
      const float scale = lr * 0.2f * std::sqrt(static_cast<float>(std::max(rows, cols)));
      const float decay = 1.0f - lr * wd;
      for (size_t i = 0; i < info.size; ++i) p[i] = p[i] * decay - scale * u[i];
    }
  }
  void scale_first_moment(float factor, size_t offset, size_t count) override {
    scale_range(momentum_, factor, offset, count);
    scale_range(exp_avg_, factor, offset, count);
  }
  std::vector<OptimizerState> state() override {
    return {{"momentum_buffer", &momentum_}, {"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}};
  }

 private:
  OptimizerConfig config_;
  std::vector<model::ParamInfo> layout_;
  tensor::FloatBuffer momentum_;
  tensor::FloatBuffer exp_avg_;
  tensor::FloatBuffer exp_avg_sq_;
  tensor::FloatBuffer update_;
  NewtonSchulzWorkspace workspace_;
};

}  // namespace

void newton_schulz(std::span<float> g, int rows, int cols, int steps) {
  NewtonSchulzWorkspace workspace;
  newton_schulz(g, rows, cols, steps, workspace);
}

void newton_schulz(std::span<float> g, int rows, int cols, int steps, NewtonSchulzWorkspace& workspace) {
  constexpr float a = 3.4445f;
  constexpr float b = -4.7750f;
  constexpr float c = 2.0315f;
  // Work on the wide orientation (r <= c) so X X^T is the small Gram matrix.
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows;
  const int k = transpose ? rows : cols;
  const size_t n = static_cast<size_t>(r) * static_cast<size_t>(k);
  tensor::FloatBuffer& x = workspace.x;
  tensor::FloatBuffer& x_next = workspace.x_next;
  tensor::FloatBuffer& gram = workspace.gram;
  tensor::FloatBuffer& poly = workspace.poly;
  x.resize(n);
  x_next.resize(n);
  gram.resize(static_cast<size_t>(r) * r);
  poly.resize(static_cast<size_t>(r) * r);
  const float inv_norm = 1.0f / (static_cast<float>(tensor::ops::norm2(g)) + 1e-7f);
  if (transpose) {
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < cols; ++j) {
        x[static_cast<size_t>(j) * k + i] = g[static_cast<size_t>(i) * cols + j] * inv_norm;
      }
    }
  } else {
    for (size_t i = 0; i < n; ++i) x[i] = g[i] * inv_norm;
  }
  using tensor::ops::Trans;
  for (int s = 0; s < steps; ++s) {
    // A = X X^T; B = b A + c A A; X = a X + B X
    tensor::ops::gemm(Trans::kNo, Trans::kYes, r, r, k, 1.0f, x.data(), k, x.data(), k, 0.0f, gram.data(), r);
    std::copy(gram.begin(), gram.end(), poly.begin());
    tensor::ops::gemm(Trans::kNo, Trans::kNo, r, r, r, c, gram.data(), r, gram.data(), r, b, poly.data(), r);
    std::copy(x.begin(), x.end(), x_next.begin());
    tensor::ops::gemm(Trans::kNo, Trans::kNo, r, k, r, 1.0f, poly.data(), r, x.data(), k, a, x_next.data(), k);
    x.swap(x_next);
  }
  if (transpose) {
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < cols; ++j) g[static_cast<size_t>(i) * cols + j] = x[static_cast<size_t>(j) * k + i];
    }
  } else {
    std::copy(x.begin(), x.end(), g.begin());
  }
}

double clip_grad_norm(std::span<float> grads, double max_norm) {
  const double norm = tensor::ops::norm2(grads);
  clip_to_norm(grads, max_norm, norm);
  return norm;
}

void clip_to_norm(std::span<float> grads, double max_norm, double norm) {
  if (max_norm > 0 && norm > max_norm) {
    // PyTorch's clip_grad_norm_: coefficient max_norm / (norm + 1e-6).
    scale_kernel(grads.data(), grads.size(), static_cast<float>(max_norm / (norm + 1e-6)));
  }
}

Result<OptimizerKind> parse_optimizer_kind(std::string_view name) {
  for (auto kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kMuon}) {
    if (name == optimizer_kind_name(kind)) return kind;
  }
  return make_error(ErrorKind::kUsage, "--optimizer: '{}' is not sgd, adam, adamw or muon", name);
}

std::string_view optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kMuon:
      return "muon";
  }
  return "?";
}

Result<std::unique_ptr<Optimizer>> make_optimizer(const OptimizerConfig& config,
                                                  const std::vector<model::ParamInfo>& layout, size_t size) {
  switch (config.kind) {
    case OptimizerKind::kSgd:
      return std::unique_ptr<Optimizer>(std::make_unique<Sgd>(config, layout, size));
    case OptimizerKind::kAdam:
      return std::unique_ptr<Optimizer>(std::make_unique<Adam>(config, layout, size, false));
    case OptimizerKind::kAdamW:
      return std::unique_ptr<Optimizer>(std::make_unique<Adam>(config, layout, size, true));
    case OptimizerKind::kMuon:
      return std::unique_ptr<Optimizer>(std::make_unique<Muon>(config, layout, size));
  }
  return make_error(ErrorKind::kInternal, "unknown optimizer kind");
}

}  // namespace cfmo::optim
