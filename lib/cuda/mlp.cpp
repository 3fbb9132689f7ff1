#include "cuda/mlp.h"

#include "cuda/kernels.h"

#include <algorithm>
#include <numeric>

namespace cfmo::cuda {

#define CFMO_LAUNCH(call, what) CFMO_CUDA_TRY(call, what)

Result<DeviceDataset> DeviceDataset::upload(const Context& ctx, const data::Dataset& data, std::string_view what) {
  DeviceDataset d;
  d.count_ = data.count;
  d.features_ = data.features;
  CFMO_TRY(d.pixels_.resize(data.pixels.size(), what));
  CFMO_TRY(d.labels_.resize(data.labels.size(), what));
  CFMO_TRY(d.pixels_.upload(data.pixels, ctx.stream(), what));
  CFMO_TRY(d.labels_.upload(data.labels, ctx.stream(), what));
  CFMO_TRY(ctx.synchronize(what));
  return d;
}

Result<std::unique_ptr<CudaMlp>> CudaMlp::create(Context& ctx, const model::Mlp& model) {
  std::unique_ptr<CudaMlp> m(new CudaMlp(ctx));
  m->widths_.push_back(model.spec().inputs);
  for (int h : model.spec().hidden) m->widths_.push_back(h);
  m->widths_.push_back(model.spec().classes);
  m->params_ = model.params();
  m->size_ = model.num_params();
  CFMO_TRY(m->parameters_.resize(m->size_, "allocating the parameters"));
  CFMO_TRY(m->gradients_.resize(m->size_, "allocating the gradients"));
  CFMO_TRY(m->gradients_.zero(ctx.stream(), "clearing the gradients"));  // the padding stays 0, as on the CPU
  CFMO_TRY(m->loss_.resize(1, "allocating the loss"));
  CFMO_TRY(m->correct_.resize(1, "allocating the loss"));
  CFMO_TRY(m->upload_parameters(model.parameters()));
  CFMO_TRY(ctx.synchronize("uploading the parameters"));
  return m;
}

Status CudaMlp::upload_parameters(std::span<const float> host) {
  return parameters_.upload(host, ctx_.stream(), "uploading the parameters");
}
Status CudaMlp::download_parameters(std::span<float> host) {
  CFMO_TRY(parameters_.download(host, ctx_.stream(), "downloading the parameters"));
  return ctx_.synchronize("downloading the parameters");
}
Status CudaMlp::upload_gradients(std::span<const float> host) {
  return gradients_.upload(host, ctx_.stream(), "uploading the gradients");
}
Status CudaMlp::download_gradients(std::span<float> host) {
  CFMO_TRY(gradients_.download(host, ctx_.stream(), "downloading the gradients"));
  return ctx_.synchronize("downloading the gradients");
}
Status CudaMlp::zero_gradients() { return gradients_.zero(ctx_.stream(), "clearing the gradients"); }

Status CudaMlp::ensure_workspace(int batch) {
  if (batch <= workspace_batch_) return {};
  const auto b = static_cast<size_t>(batch);
  activations_.resize(widths_.size());
  int widest = 0;
  for (size_t l = 1; l < widths_.size(); ++l) {
    CFMO_TRY(activations_[l].resize(b * static_cast<size_t>(widths_[l]), "allocating activations"));
    widest = std::max(widest, widths_[l]);
  }
  CFMO_TRY(logits_.resize(b * static_cast<size_t>(widths_.back()), "allocating logits"));
  CFMO_TRY(grad_a_.resize(b * static_cast<size_t>(widest), "allocating gradient scratch"));
  CFMO_TRY(grad_z_.resize(b * static_cast<size_t>(widest), "allocating gradient scratch"));
  CFMO_TRY(inputs_.resize(b * static_cast<size_t>(widths_.front()), "allocating the batch"));
  CFMO_TRY(labels_.resize(b, "allocating the batch"));
  CFMO_TRY(indices_.resize(b, "allocating the batch"));
  CFMO_TRY(ones_.resize(b, "allocating the batch"));
  const std::vector<float> ones(b, 1.0f);
  CFMO_TRY(ones_.upload(ones, ctx_.stream(), "allocating the batch"));
  CFMO_TRY(ctx_.synchronize("allocating the batch"));  // `ones` is freed on return
  workspace_batch_ = batch;
  return {};
}

Status CudaMlp::forward(const float* inputs, int batch) {
  const float* a = inputs;
  for (int l = 0; l < layers(); ++l) {
    const int in = widths_[l];
    const int out = widths_[l + 1];
    const bool last = l == layers() - 1;
    float* z = last ? logits_.data() : activations_[l + 1].data();
    CFMO_TRY(gemm(ctx_, Trans::kNo, Trans::kYes, batch, out, in, 1.0f, a, in, weight(l), in, 0.0f, z, out));
    CFMO_LAUNCH(kernels::add_bias_rows(z, bias(l), batch, out, !last, ctx_.stream()), "bias and ReLU");
    a = z;
  }
  return {};
}

Status CudaMlp::backward(const float* inputs, const int32_t* labels, int batch) {
  CFMO_TRY(loss_.zero(ctx_.stream(), "clearing the loss"));
  CFMO_LAUNCH(kernels::softmax_cross_entropy(logits_.data(), labels, batch, widths_.back(), grad_z_.data(),
                                             1.0f / static_cast<float>(batch), loss_.data(), nullptr, ctx_.stream()),
              "softmax cross-entropy");
  const float one = 1.0f;
  const float zero = 0.0f;
  for (int l = layers() - 1; l >= 0; --l) {
    const int in = widths_[l];
    const int out = widths_[l + 1];
    const float* a = l == 0 ? inputs : activations_[l].data();
    float* dw = gradients_.data() + params_[2 * l].offset;
    float* db = gradients_.data() + params_[2 * l + 1].offset;
    const float* dz = grad_z_.data();
    CFMO_TRY(gemm(ctx_, Trans::kYes, Trans::kNo, out, in, batch, 1.0f, dz, out, a, in, 0.0f, dw, in));
    // db = column sums of dz [batch, out]: read column-major it is [out, batch], times a vector of ones.
    CFMO_CUBLAS_TRY(
        ctx_.cublas().sgemv(ctx_.blas(), CUBLAS_OP_N, out, batch, &one, dz, out, ones_.data(), 1, &zero, db, 1),
        "bias gradient");
    if (l == 0) break;
    CFMO_TRY(
        gemm(ctx_, Trans::kNo, Trans::kNo, batch, in, out, 1.0f, dz, out, weight(l), in, 0.0f, grad_a_.data(), in));
    CFMO_LAUNCH(kernels::relu_backward(activations_[l].data(), grad_a_.data(), grad_z_.data(),
                                       static_cast<size_t>(batch) * static_cast<size_t>(in), ctx_.stream()),
                "ReLU backward");
  }
  return {};
}

Result<double> CudaMlp::read_loss() {
  double loss = 0;
  CFMO_CUDA_TRY(cudaMemcpyAsync(&loss, loss_.data(), sizeof(double), cudaMemcpyDeviceToHost, ctx_.stream()),
                "reading the loss");
  CFMO_TRY(ctx_.synchronize("a training step"));
  return loss;
}

Result<float> CudaMlp::forward_backward(const DeviceDataset& data, std::span<const int64_t> indices) {
  const int batch = static_cast<int>(indices.size());
  CFMO_TRY(ensure_workspace(batch));
  CFMO_TRY(indices_.upload(indices, ctx_.stream(), "uploading the batch"));
  CFMO_LAUNCH(kernels::gather_rows(data.pixels(), data.labels(), indices_.data(), batch, data.features(),
                                   inputs_.data(), labels_.data(), ctx_.stream()),
              "gathering the batch");
  CFMO_TRY(forward(inputs_.data(), batch));
  CFMO_TRY(backward(inputs_.data(), labels_.data(), batch));
  CFMO_ASSIGN_OR_RETURN(const double loss, read_loss());
  return static_cast<float>(loss / batch);
}

Result<float> CudaMlp::forward_backward(const float* inputs, const int32_t* labels, int batch) {
  CFMO_TRY(ensure_workspace(batch));
  const auto b = static_cast<size_t>(batch);
  CFMO_TRY(inputs_.upload({inputs, b * static_cast<size_t>(widths_.front())}, ctx_.stream(), "uploading the batch"));
  CFMO_TRY(labels_.upload({labels, b}, ctx_.stream(), "uploading the batch"));
  CFMO_TRY(forward(inputs_.data(), batch));
  CFMO_TRY(backward(inputs_.data(), labels_.data(), batch));
  CFMO_ASSIGN_OR_RETURN(const double loss, read_loss());
  return static_cast<float>(loss / batch);
}

Result<model::EvalResult> CudaMlp::evaluate(const DeviceDataset& data, int chunk) {
  chunk = static_cast<int>(std::min<int64_t>(chunk, std::max<int64_t>(data.count(), 1)));
  CFMO_TRY(ensure_workspace(chunk));
  CFMO_TRY(loss_.zero(ctx_.stream(), "clearing the loss"));
  CFMO_TRY(correct_.zero(ctx_.stream(), "clearing the loss"));
  std::vector<int64_t> indices(static_cast<size_t>(chunk));
  for (int64_t first = 0; first < data.count(); first += chunk) {
    const int n = static_cast<int>(std::min<int64_t>(chunk, data.count() - first));
    std::iota(indices.begin(), indices.begin() + n, first);
    CFMO_TRY(indices_.upload({indices.data(), static_cast<size_t>(n)}, ctx_.stream(), "uploading the batch"));
    CFMO_LAUNCH(kernels::gather_rows(data.pixels(), data.labels(), indices_.data(), n, data.features(), inputs_.data(),
                                     labels_.data(), ctx_.stream()),
                "gathering the batch");
    CFMO_TRY(forward(inputs_.data(), n));
    CFMO_LAUNCH(kernels::softmax_cross_entropy(logits_.data(), labels_.data(), n, widths_.back(), nullptr, 0.0f,
                                               loss_.data(), correct_.data(), ctx_.stream()),
                "evaluation");
    // `indices` is rewritten next round: the pageable upload has copied it on return, but
    // wait anyway so the order of host writes and device reads is plain to see.
    CFMO_TRY(ctx_.synchronize("evaluation"));
  }
  model::EvalResult result;
  unsigned long long correct = 0;
  CFMO_CUDA_TRY(cudaMemcpyAsync(&result.loss_sum, loss_.data(), sizeof(double), cudaMemcpyDeviceToHost, ctx_.stream()),
                "reading the evaluation");
  CFMO_CUDA_TRY(cudaMemcpyAsync(&correct, correct_.data(), sizeof(correct), cudaMemcpyDeviceToHost, ctx_.stream()),
                "reading the evaluation");
  CFMO_TRY(ctx_.synchronize("evaluation"));
  result.correct = static_cast<int64_t>(correct);
  result.count = data.count();
  return result;
}

}  // namespace cfmo::cuda
