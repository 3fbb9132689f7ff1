#pragma once
/// The CUDA kernels of the model and the optimizers, as host functions that
/// launch on a stream and return the launch's status. Their arithmetic is the
/// CPU kernels' (tensor/ops.h, optim/optimizer.cpp), element for element, so
/// both paths train the same model within float tolerance.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace cfmo::cuda::kernels {

/// Rows `indices[0..n)` of the byte matrix `pixels` [*, features] as floats
/// pixel / 255 into `out` [n, features], and their labels into `labels_out`.
cudaError_t gather_rows(const uint8_t* pixels, const int32_t* labels, const int64_t* indices, int n, int features,
                        float* out, int32_t* labels_out, cudaStream_t stream);

/// Each row of z [rows, cols] += bias, then max(0, .) when `relu`.
cudaError_t add_bias_rows(float* z, const float* bias, int rows, int cols, bool relu, cudaStream_t stream);

/// x = max(0, x).
cudaError_t relu(float* x, size_t n, cudaStream_t stream);

/// grad_z = grad_a where activation > 0, else 0.
cudaError_t relu_backward(const float* activation, const float* grad_a, float* grad_z, size_t n, cudaStream_t stream);

/// Softmax cross-entropy over rows of logits [batch, classes], one warp a row:
/// adds the summed loss to *loss_sum and the rows whose argmax (first maximum)
/// is the label to *correct; writes (softmax - onehot) * grad_scale to
/// dlogits when it is not null. Labels outside [0, classes) count as wrong
/// and add no loss or gradient (the data loader has checked them already).
cudaError_t softmax_cross_entropy(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                                  float grad_scale, double* loss_sum, unsigned long long* correct, cudaStream_t stream);

/// *out += sum of x[i]^2, accumulated in double (clear *out first).
cudaError_t sum_squares(const float* x, size_t n, double* out, cudaStream_t stream);

/// x *= factor.
cudaError_t scale(float* x, size_t n, float factor, cudaStream_t stream);
/// x *= max_norm / (sqrt(*sumsq) + 1e-6) when sqrt(*sumsq) > max_norm: PyTorch's
/// clip_grad_norm_, decided on the device so the step never waits for the host.
cudaError_t clip_by_norm(float* x, size_t n, const double* sumsq, float max_norm, cudaStream_t stream);
/// y += alpha * x.
cudaError_t axpy(float alpha, const float* x, float* y, size_t n, cudaStream_t stream);

/// SGD with momentum/Nesterov and L2 weight decay, torch.optim.SGD's formula.
cudaError_t sgd_step(float* p, const float* g, float* buf, size_t n, float lr, float momentum, float weight_decay,
                     bool nesterov, bool first, cudaStream_t stream);

/// Adam/AdamW fused: one read of p, g, m, v and one write of p, m, v.
/// `l2` adds weight decay to the gradient (Adam), `decay` shrinks p first (AdamW).
cudaError_t adam_step(float* p, const float* g, float* m, float* v, size_t n, float beta1, float beta2, float step_size,
                      float inv_sqrt_bc2, float eps, float l2, float decay, cudaStream_t stream);

/// Muon's momentum: buf = mu * buf + g; u = nesterov ? g + mu * buf : buf.
cudaError_t muon_momentum(float* buf, const float* g, float* u, size_t n, float mu, bool nesterov, cudaStream_t stream);
/// out = in / (sqrt(*sumsq) + 1e-7), transposed ([rows, cols] -> [cols, rows]) when `transpose`.
cudaError_t normalize(const float* in, float* out, int rows, int cols, const double* sumsq, bool transpose,
                      cudaStream_t stream);
/// out[rows, cols] = transpose of in[cols, rows].
cudaError_t transpose(const float* in, float* out, int rows, int cols, cudaStream_t stream);
/// p = p * decay - scale * u.
cudaError_t muon_apply(float* p, const float* u, size_t n, float decay, float scale, cudaStream_t stream);

}  // namespace cfmo::cuda::kernels
