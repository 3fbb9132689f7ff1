// CUDA kernels of the model and the optimizers. Each one mirrors a CPU kernel
// (tensor/ops.cpp, model/mlp.cpp, optim/optimizer.cpp) operation for
// operation; built with --fmad=false so no multiply-add is fused that the CPU
// path (-ffp-contract=off) does not fuse either.
#include "cuda/kernels.h"

#include <cfloat>
#include <climits>
#include <cstdint>

namespace cfmo::cuda::kernels {
namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;  // grid-stride loops cover the rest

unsigned blocks_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

__device__ size_t thread_index() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ size_t thread_stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__global__ void gather_rows_kernel(const uint8_t* pixels, const int32_t* labels, const int64_t* indices, int n,
                                   int features, float* out, int32_t* labels_out) {
  constexpr float kScale = 1.0f / 255.0f;
  const size_t total = static_cast<size_t>(n) * static_cast<size_t>(features);
  for (size_t i = thread_index(); i < total; i += thread_stride()) {
    const size_t r = i / static_cast<size_t>(features);
    const size_t c = i % static_cast<size_t>(features);
    const auto src = static_cast<size_t>(indices[r]);
    out[i] = static_cast<float>(pixels[src * static_cast<size_t>(features) + c]) * kScale;
    if (c == 0) labels_out[r] = labels[src];
  }
}

__global__ void add_bias_rows_kernel(float* z, const float* bias, size_t n, int cols, bool relu) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) {
    float v = z[i] + bias[i % static_cast<size_t>(cols)];
    if (relu) v = v > 0.0f ? v : 0.0f;
    z[i] = v;
  }
}

__global__ void relu_kernel(float* x, size_t n) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void relu_backward_kernel(const float* activation, const float* grad_a, float* grad_z, size_t n) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) grad_z[i] = activation[i] > 0.0f ? grad_a[i] : 0.0f;
}

__global__ void softmax_xent_kernel(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                                    float grad_scale, double* loss_sum, unsigned long long* correct) {
  const int row_index = static_cast<int>((static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row_index >= batch) return;
  const float* row = logits + static_cast<size_t>(row_index) * classes;
  // The first maximum, as the CPU's strict '>' scan finds it.
  float best = -FLT_MAX;
  int arg = INT_MAX;
  for (int j = lane; j < classes; j += 32) {
    const float v = row[j];
    if (v > best || (v == best && j < arg)) {
      best = v;
      arg = j;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(0xffffffffu, best, offset);
    const int other_arg = __shfl_down_sync(0xffffffffu, arg, offset);
    if (other > best || (other == best && other_arg < arg)) {
      best = other;
      arg = other_arg;
    }
  }
  best = __shfl_sync(0xffffffffu, best, 0);
  arg = __shfl_sync(0xffffffffu, arg, 0);
  double sum = 0;
  for (int j = lane; j < classes; j += 32) sum += exp(static_cast<double>(row[j] - best));
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  sum = __shfl_sync(0xffffffffu, sum, 0);
  const double log_sum = log(sum);
  const int label = labels[row_index];
  const bool valid = label >= 0 && label < classes;
  if (lane == 0) {
    if (valid && loss_sum != nullptr) atomicAdd(loss_sum, log_sum - static_cast<double>(row[label] - best));
    if (valid && correct != nullptr && arg == label) atomicAdd(correct, 1ull);
  }
  if (dlogits != nullptr) {
    float* drow = dlogits + static_cast<size_t>(row_index) * classes;
    for (int j = lane; j < classes; j += 32) {
      const double p = exp(static_cast<double>(row[j] - best) - log_sum);
      drow[j] = valid ? static_cast<float>(p - (j == label ? 1.0 : 0.0)) * grad_scale : 0.0f;
    }
  }
}

__global__ void sum_squares_kernel(const float* x, size_t n, double* out) {
  __shared__ double partial[kThreads / 32];
  double acc = 0;
  for (size_t i = thread_index(); i < n; i += thread_stride()) {
    const double v = x[i];
    acc += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (threadIdx.x == 0) atomicAdd(out, acc);
  }
}

__global__ void scale_kernel(float* x, size_t n, float factor) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) x[i] *= factor;
}

__global__ void clip_kernel(float* x, size_t n, const double* sumsq, float max_norm) {
  const double norm = sqrt(*sumsq);
  if (!(max_norm > 0.0f && norm > static_cast<double>(max_norm))) return;
  const auto factor = static_cast<float>(static_cast<double>(max_norm) / (norm + 1e-6));
  for (size_t i = thread_index(); i < n; i += thread_stride()) x[i] *= factor;
}

__global__ void axpy_kernel(float alpha, const float* x, float* y, size_t n) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) y[i] += alpha * x[i];
}

__global__ void sgd_kernel(float* p, const float* g, float* buf, size_t n, float lr, float momentum, float weight_decay,
                           bool nesterov, bool first) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) {
    float d = g[i] + weight_decay * p[i];
    if (momentum != 0.0f) {
      const float b = first ? d : momentum * buf[i] + d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

struct AdamArgs {
  float beta1, beta2, step_size, inv_sqrt_bc2, eps, l2, decay;
};

__device__ __forceinline__ void adam_one(float& p, float g, float& m, float& v, const AdamArgs& a) {
  const float pi = p * a.decay;
  const float gi = g + a.l2 * pi;
  const float mi = a.beta1 * m + (1.0f - a.beta1) * gi;
  const float vi = a.beta2 * v + (1.0f - a.beta2) * gi * gi;
  m = mi;
  v = vi;
  p = pi - a.step_size * mi / (sqrtf(vi) * a.inv_sqrt_bc2 + a.eps);
}

// The update is memory-bound (28 bytes a parameter): 16-byte loads and stores.
__global__ void adam_kernel4(float4* p, const float4* g, float4* m, float4* v, size_t n4, AdamArgs a) {
  for (size_t i = thread_index(); i < n4; i += thread_stride()) {
    float4 P = p[i];
    const float4 G = g[i];
    float4 M = m[i];
    float4 V = v[i];
    adam_one(P.x, G.x, M.x, V.x, a);
    adam_one(P.y, G.y, M.y, V.y, a);
    adam_one(P.z, G.z, M.z, V.z, a);
    adam_one(P.w, G.w, M.w, V.w, a);
    p[i] = P;
    m[i] = M;
    v[i] = V;
  }
}

__global__ void adam_kernel(float* p, const float* g, float* m, float* v, size_t n, AdamArgs a) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) adam_one(p[i], g[i], m[i], v[i], a);
}

__global__ void muon_momentum_kernel(float* buf, const float* g, float* u, size_t n, float mu, bool nesterov) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) {
    const float b = mu * buf[i] + g[i];
    buf[i] = b;
    u[i] = nesterov ? g[i] + mu * b : b;
  }
}

constexpr int kTile = 32;

// out[c, r] = in[r, c] * factor, through a shared tile so reads and writes are both coalesced.
__global__ void transpose_kernel(const float* in, float* out, int rows, int cols, const double* sumsq) {
  __shared__ float tile[kTile][kTile + 1];
  const float factor = sumsq != nullptr ? 1.0f / (static_cast<float>(sqrt(*sumsq)) + 1e-7f) : 1.0f;
  const int c0 = static_cast<int>(blockIdx.x) * kTile;
  const int r0 = static_cast<int>(blockIdx.y) * kTile;
  for (int dy = static_cast<int>(threadIdx.y); dy < kTile; dy += static_cast<int>(blockDim.y)) {
    const int r = r0 + dy;
    const int c = c0 + static_cast<int>(threadIdx.x);
    if (r < rows && c < cols) tile[dy][threadIdx.x] = in[static_cast<size_t>(r) * cols + c] * factor;
  }
  __syncthreads();
  for (int dy = static_cast<int>(threadIdx.y); dy < kTile; dy += static_cast<int>(blockDim.y)) {
    const int c = c0 + dy;
    const int r = r0 + static_cast<int>(threadIdx.x);
    if (r < rows && c < cols) out[static_cast<size_t>(c) * rows + r] = tile[threadIdx.x][dy];
  }
}

__global__ void normalize_kernel(const float* in, float* out, size_t n, const double* sumsq) {
  const float factor = 1.0f / (static_cast<float>(sqrt(*sumsq)) + 1e-7f);
  for (size_t i = thread_index(); i < n; i += thread_stride()) out[i] = in[i] * factor;
}

__global__ void muon_apply_kernel(float* p, const float* u, size_t n, float decay, float scale) {
  for (size_t i = thread_index(); i < n; i += thread_stride()) p[i] = p[i] * decay - scale * u[i];
}

cudaError_t launched() { return cudaGetLastError(); }

cudaError_t launch_transpose(const float* in, float* out, int rows, int cols, const double* sumsq,
                             cudaStream_t stream) {
  const dim3 block(kTile, 8);
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  transpose_kernel<<<grid, block, 0, stream>>>(in, out, rows, cols, sumsq);
  return launched();
}

}  // namespace

cudaError_t gather_rows(const uint8_t* pixels, const int32_t* labels, const int64_t* indices, int n, int features,
                        float* out, int32_t* labels_out, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n) * static_cast<size_t>(features);
  gather_rows_kernel<<<blocks_for(total), kThreads, 0, stream>>>(pixels, labels, indices, n, features, out, labels_out);
  return launched();
}

cudaError_t add_bias_rows(float* z, const float* bias, int rows, int cols, bool relu, cudaStream_t stream) {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  add_bias_rows_kernel<<<blocks_for(n), kThreads, 0, stream>>>(z, bias, n, cols, relu);
  return launched();
}

cudaError_t relu(float* x, size_t n, cudaStream_t stream) {
  relu_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n);
  return launched();
}

cudaError_t relu_backward(const float* activation, const float* grad_a, float* grad_z, size_t n, cudaStream_t stream) {
  relu_backward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(activation, grad_a, grad_z, n);
  return launched();
}

cudaError_t softmax_cross_entropy(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                                  float grad_scale, double* loss_sum, unsigned long long* correct,
                                  cudaStream_t stream) {
  const size_t threads = static_cast<size_t>(batch) * 32;
  const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  softmax_xent_kernel<<<blocks, kThreads, 0, stream>>>(logits, labels, batch, classes, dlogits, grad_scale, loss_sum,
                                                       correct);
  return launched();
}

cudaError_t sum_squares(const float* x, size_t n, double* out, cudaStream_t stream) {
  sum_squares_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, out);
  return launched();
}

cudaError_t scale(float* x, size_t n, float factor, cudaStream_t stream) {
  scale_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, factor);
  return launched();
}

cudaError_t clip_by_norm(float* x, size_t n, const double* sumsq, float max_norm, cudaStream_t stream) {
  clip_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, sumsq, max_norm);
  return launched();
}

cudaError_t axpy(float alpha, const float* x, float* y, size_t n, cudaStream_t stream) {
  axpy_kernel<<<blocks_for(n), kThreads, 0, stream>>>(alpha, x, y, n);
  return launched();
}

cudaError_t sgd_step(float* p, const float* g, float* buf, size_t n, float lr, float momentum, float weight_decay,
                     bool nesterov, bool first, cudaStream_t stream) {
  sgd_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p, g, buf, n, lr, momentum, weight_decay, nesterov, first);
  return launched();
}

cudaError_t adam_step(float* p, const float* g, float* m, float* v, size_t n, float beta1, float beta2, float step_size,
                      float inv_sqrt_bc2, float eps, float l2, float decay, cudaStream_t stream) {
  const AdamArgs args{beta1, beta2, step_size, inv_sqrt_bc2, eps, l2, decay};
  size_t done = 0;
  if (aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    const size_t n4 = n / 4;
    if (n4 > 0) {
      adam_kernel4<<<blocks_for(n4), kThreads, 0, stream>>>(
          reinterpret_cast<float4*>(p), reinterpret_cast<const float4*>(g), reinterpret_cast<float4*>(m),
          reinterpret_cast<float4*>(v), n4, args);
      if (const cudaError_t e = launched(); e != cudaSuccess) return e;
    }
    done = n4 * 4;
  }
  if (done < n) {
    adam_kernel<<<blocks_for(n - done), kThreads, 0, stream>>>(p + done, g + done, m + done, v + done, n - done, args);
  }
  return launched();
}

cudaError_t muon_momentum(float* buf, const float* g, float* u, size_t n, float mu, bool nesterov,
                          cudaStream_t stream) {
  muon_momentum_kernel<<<blocks_for(n), kThreads, 0, stream>>>(buf, g, u, n, mu, nesterov);
  return launched();
}

cudaError_t normalize(const float* in, float* out, int rows, int cols, const double* sumsq, bool transpose_it,
                      cudaStream_t stream) {
  if (transpose_it) return launch_transpose(in, out, rows, cols, sumsq, stream);
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  normalize_kernel<<<blocks_for(n), kThreads, 0, stream>>>(in, out, n, sumsq);
  return launched();
}

cudaError_t transpose(const float* in, float* out, int rows, int cols, cudaStream_t stream) {
  // `in` is [cols, rows]; the kernel's rows/cols are those of its input.
  return launch_transpose(in, out, cols, rows, nullptr, stream);
}

cudaError_t muon_apply(float* p, const float* u, size_t n, float decay, float scale, cudaStream_t stream) {
  muon_apply_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p, u, n, decay, scale);
  return launched();
}

}  // namespace cfmo::cuda::kernels
