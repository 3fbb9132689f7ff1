#include "cuda/optimizer.h"

#include "cuda/kernels.h"

#include <algorithm>
#include <cmath>

namespace cfmo::cuda {

Result<std::unique_ptr<CudaOptimizer>> CudaOptimizer::create(Context& ctx, const optim::OptimizerConfig& config,
                                                             const std::vector<model::ParamInfo>& layout, size_t size) {
  std::vector<std::string> names;
  switch (config.kind) {
    case optim::OptimizerKind::kSgd:
      names = {"momentum_buffer"};
      break;
    case optim::OptimizerKind::kAdam:
    case optim::OptimizerKind::kAdamW:
      names = {"exp_avg", "exp_avg_sq"};
      break;
    case optim::OptimizerKind::kMuon:
      names = {"momentum_buffer", "exp_avg", "exp_avg_sq"};
      break;
  }
  std::unique_ptr<CudaOptimizer> opt(new CudaOptimizer(ctx, config, layout));
  for (const auto& name : names) {
    Named state{name, {}};
    CFMO_TRY(state.buffer.resize(size, "allocating optimizer state"));
    CFMO_TRY(state.buffer.zero(ctx.stream(), "allocating optimizer state"));
    opt->state_.push_back(std::move(state));
  }
  if (config.kind == optim::OptimizerKind::kMuon) {
    size_t largest = 0;
    for (const auto& p : layout) largest = std::max(largest, p.size);
    size_t gram = 0;
    for (const auto& p : layout) {
      if (!p.is_matrix()) continue;
      const auto r = static_cast<size_t>(std::min(p.shape[0], p.shape[1]));
      gram = std::max(gram, r * r);
    }
    CFMO_TRY(opt->update_.resize(largest, "allocating Muon scratch"));
    CFMO_TRY(opt->x_.resize(largest, "allocating Muon scratch"));
    CFMO_TRY(opt->x_next_.resize(largest, "allocating Muon scratch"));
    CFMO_TRY(opt->gram_.resize(std::max<size_t>(gram, 1), "allocating Muon scratch"));
    CFMO_TRY(opt->poly_.resize(std::max<size_t>(gram, 1), "allocating Muon scratch"));
    CFMO_TRY(opt->sumsq_.resize(1, "allocating Muon scratch"));
  }
  CFMO_TRY(ctx.synchronize("allocating optimizer state"));
  return opt;
}

DeviceArray<float>* CudaOptimizer::find(const std::string& name) {
  for (auto& s : state_) {
    if (s.name == name) return &s.buffer;
  }
  return nullptr;
}

Status CudaOptimizer::step(float* params, const float* grads, float lr) {
  const cudaStream_t stream = ctx_.stream();
  const auto wd = static_cast<float>(config_.weight_decay);
  const size_t n = state_.front().buffer.size();
  if (config_.kind == optim::OptimizerKind::kSgd) {
    CFMO_CUDA_TRY(kernels::sgd_step(params, grads, find("momentum_buffer")->data(), n, lr,
                                    static_cast<float>(config_.momentum), wd, config_.nesterov, steps_ == 0, stream),
                  "SGD step");
    ++steps_;
    return {};
  }
  ++steps_;
  const auto k = optim::adam_coefficients(config_, steps_, lr);
  float* m = find("exp_avg")->data();
  float* v = find("exp_avg_sq")->data();
  if (config_.kind == optim::OptimizerKind::kAdam || config_.kind == optim::OptimizerKind::kAdamW) {
    const bool decoupled = config_.kind == optim::OptimizerKind::kAdamW;
    CFMO_CUDA_TRY(
        kernels::adam_step(params, grads, m, v, n, static_cast<float>(config_.beta1), static_cast<float>(config_.beta2),
                           k.step_size, k.inv_sqrt_bc2, static_cast<float>(config_.eps), decoupled ? 0.0f : wd,
                           decoupled ? 1.0f - lr * wd : 1.0f, stream),
        "Adam step");
    return {};
  }
  for (const auto& info : layout_) {
    float* p = params + info.offset;
    const float* g = grads + info.offset;
    if (info.is_matrix()) {
      CFMO_TRY(muon_matrix(p, g, info, lr));
      continue;
    }
    CFMO_CUDA_TRY(kernels::adam_step(p, g, m + info.offset, v + info.offset, info.size,
                                     static_cast<float>(config_.beta1), static_cast<float>(config_.beta2), k.step_size,
                                     k.inv_sqrt_bc2, static_cast<float>(config_.eps), 0.0f, 1.0f - lr * wd, stream),
                  "Muon's AdamW step");
  }
  return {};
}

Status CudaOptimizer::muon_matrix(float* p, const float* g, const model::ParamInfo& info, float lr) {
  constexpr float a = 3.4445f;
  constexpr float b = -4.7750f;
  constexpr float c = 2.0315f;
  const cudaStream_t stream = ctx_.stream();
  const auto rows = static_cast<int>(info.shape[0]);
  const auto cols = static_cast<int>(info.shape[1]);
  float* u = update_.data();
  CFMO_CUDA_TRY(kernels::muon_momentum(find("momentum_buffer")->data() + info.offset, g, u, info.size,
                                       static_cast<float>(config_.momentum), config_.nesterov, stream),
                "Muon momentum");
  // As newton_schulz on the CPU: the wide orientation, so X X^T is the small Gram matrix.
  const bool transpose = rows > cols;
  const int r = transpose ? cols : rows;
  const int k = transpose ? rows : cols;
  const size_t bytes = info.size * sizeof(float);
  CFMO_TRY(sumsq_.zero(stream, "Muon norm"));
  CFMO_CUDA_TRY(kernels::sum_squares(u, info.size, sumsq_.data(), stream), "Muon norm");
  CFMO_CUDA_TRY(kernels::normalize(u, x_.data(), rows, cols, sumsq_.data(), transpose, stream), "Muon normalise");
  const size_t gram_bytes = static_cast<size_t>(r) * static_cast<size_t>(r) * sizeof(float);
  for (int s = 0; s < config_.ns_steps; ++s) {
    // A = X X^T; B = b A + c A A; X = a X + B X
    CFMO_TRY(gemm(ctx_, Trans::kNo, Trans::kYes, r, r, k, 1.0f, x_.data(), k, x_.data(), k, 0.0f, gram_.data(), r));
    CFMO_CUDA_TRY(cudaMemcpyAsync(poly_.data(), gram_.data(), gram_bytes, cudaMemcpyDeviceToDevice, stream),
                  "Newton-Schulz");
    CFMO_TRY(gemm(ctx_, Trans::kNo, Trans::kNo, r, r, r, c, gram_.data(), r, gram_.data(), r, b, poly_.data(), r));
    CFMO_CUDA_TRY(cudaMemcpyAsync(x_next_.data(), x_.data(), bytes, cudaMemcpyDeviceToDevice, stream), "Newton-Schulz");
    CFMO_TRY(gemm(ctx_, Trans::kNo, Trans::kNo, r, k, r, 1.0f, poly_.data(), r, x_.data(), k, a, x_next_.data(), k));
    std::swap(x_, x_next_);
  }
  const float* update = x_.data();
  if (transpose) {
    CFMO_CUDA_TRY(kernels::transpose(x_.data(), u, rows, cols, stream), "Muon transpose");
    update = u;
  }
  const float scale = lr * 0.2f * std::sqrt(static_cast<float>(std::max(rows, cols)));
  const float decay = 1.0f - lr * static_cast<float>(config_.weight_decay);
  CFMO_CUDA_TRY(kernels::muon_apply(p, update, info.size, decay, scale, stream), "Muon update");
  return {};
}

Status CudaOptimizer::scale_first_moment(float factor, size_t offset, size_t count) {
  for (auto& s : state_) {
    if (s.name == "exp_avg_sq") continue;  // the second moment is left alone (ALGORITHM.md)
    if (offset >= s.buffer.size()) continue;
    CFMO_CUDA_TRY(
        kernels::scale(s.buffer.data() + offset, std::min(count, s.buffer.size() - offset), factor, ctx_.stream()),
        "momentum discount");
  }
  return {};
}

Status CudaOptimizer::download_state(optim::Optimizer& host) {
  for (auto& target : host.state()) {
    DeviceArray<float>* source = find(target.name);
    if (source == nullptr || target.buffer->size() != source->size()) {
      return make_error(ErrorKind::kInternal, "optimizer state '{}' differs between CPU and CUDA", target.name);
    }
    CFMO_TRY(source->download(*target.buffer, ctx_.stream(), "downloading optimizer state"));
  }
  host.set_step_count(steps_);
  return ctx_.synchronize("downloading optimizer state");
}

Status CudaOptimizer::upload_state(optim::Optimizer& host) {
  for (auto& source : host.state()) {
    DeviceArray<float>* target = find(source.name);
    if (target == nullptr || source.buffer->size() != target->size()) {
      return make_error(ErrorKind::kInternal, "optimizer state '{}' differs between CPU and CUDA", source.name);
    }
    CFMO_TRY(target->upload(*source.buffer, ctx_.stream(), "uploading optimizer state"));
  }
  steps_ = host.step_count();
  return ctx_.synchronize("uploading optimizer state");
}

Status clip_grad_norm(Context& ctx, float* grads, size_t n, double max_norm, DeviceArray<double>& scratch) {
  if (max_norm <= 0) return {};
  CFMO_TRY(scratch.resize(1, "gradient norm"));
  CFMO_TRY(scratch.zero(ctx.stream(), "gradient norm"));
  CFMO_CUDA_TRY(kernels::sum_squares(grads, n, scratch.data(), ctx.stream()), "gradient norm");
  CFMO_CUDA_TRY(kernels::clip_by_norm(grads, n, scratch.data(), static_cast<float>(max_norm), ctx.stream()),
                "gradient clipping");
  return {};
}

}  // namespace cfmo::cuda
