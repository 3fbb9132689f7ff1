#pragma once
/// The device seam: every dense kernel the model and optimizers use goes
/// through here. The CPU implementation calls OpenBLAS; a CUDA one will sit
/// beside it behind the same functions.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace cfmo::tensor::ops {

enum class Trans : uint8_t { kNo, kYes };

/// Row-major C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C.
void gemm(Trans trans_a, Trans trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc);

/// Sets the BLAS thread count (1 for reproducible runs and for one worker per core).
void set_num_threads(int threads);
int num_threads();

/// "OpenBLAS 0.3.21 SkylakeX": the library and the kernel it runs, for reports.
std::string blas_info();

/// OpenBLAS releases older than a CPU fall back to their slowest kernels
/// (Prescott: SSE3, about 4x below peak) on it. When that happened, returns the
/// core type whose kernels this CPU runs (SkylakeX for AVX-512, Haswell for
/// AVX2+FMA) for OPENBLAS_CORETYPE; empty when the detection was fine, when
/// OPENBLAS_CORETYPE is set already, or when CFMO_BLAS_CORETYPE=keep.
std::string better_blas_coretype();

/// Euclidean norm, accumulated in double for stability.
double norm2(std::span<const float> x);
/// Sum of squares, accumulated in double.
double sum_squares(std::span<const float> x);
/// Each row of z [rows, cols] += bias, then max(0, .) when `relu`.
void add_bias_rows(float* z, const float* bias, int rows, int cols, bool relu);
/// bias_grad[j] = sum over rows of dz[r, j].
void column_sums(const float* dz, int rows, int cols, float* bias_grad);
/// grad_z = grad_a where activation > 0, else 0 (ReLU backward).
void relu_backward(const float* activation, const float* grad_a, float* grad_z, size_t n);
/// x *= alpha.
void scale(std::span<float> x, float alpha);
/// y += alpha * x.
void axpy(float alpha, std::span<const float> x, std::span<float> y);

}  // namespace cfmo::tensor::ops
