#include "tensor/ops.h"

#include "core/simd.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <string_view>

namespace cfmo::tensor::ops {
namespace {
CBLAS_TRANSPOSE to_cblas(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }
}  // namespace

void gemm(Trans trans_a, Trans trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, to_cblas(trans_a), to_cblas(trans_b), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

std::string blas_info() {
  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21"
  std::string_view config = openblas_get_config();
  const auto second_space = config.find(' ', config.find(' ') + 1);
  return fmt::format("{} {}", config.substr(0, second_space), openblas_get_corename());
}

std::string better_blas_coretype() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return "";
  if (const char* mode = std::getenv("CFMO_BLAS_CORETYPE"); mode != nullptr && std::string_view(mode) == "keep") {
    return "";
  }
  if (std::string_view(openblas_get_corename()) != "Prescott") return "";
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return "";
}

void set_num_threads(int threads) { openblas_set_num_threads(threads); }
int num_threads() { return openblas_get_num_threads(); }

CFMO_SIMD_CLONES
double sum_squares(std::span<const float> x) {
  // Four double accumulators keep the loop vectorisable and the sum accurate.
  double acc[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= x.size(); i += 4) {
    for (size_t j = 0; j < 4; ++j) acc[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (; i < x.size(); ++i) acc[0] += static_cast<double>(x[i]) * x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

double norm2(std::span<const float> x) { return __builtin_sqrt(sum_squares(x)); }

CFMO_SIMD_CLONES
void add_bias_rows(float* z, const float* bias, int rows, int cols, bool relu) {
  for (int r = 0; r < rows; ++r) {
    float* __restrict row = z + static_cast<size_t>(r) * static_cast<size_t>(cols);
    if (relu) {
      for (int j = 0; j < cols; ++j) row[j] = std::max(row[j] + bias[j], 0.0f);
    } else {
      for (int j = 0; j < cols; ++j) row[j] += bias[j];
    }
  }
}

CFMO_SIMD_CLONES
void column_sums(const float* dz, int rows, int cols, float* bias_grad) {
  std::fill(bias_grad, bias_grad + cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* __restrict row = dz + static_cast<size_t>(r) * static_cast<size_t>(cols);
    for (int j = 0; j < cols; ++j) bias_grad[j] += row[j];
  }
}

CFMO_SIMD_CLONES
void relu_backward(const float* activation, const float* grad_a, float* grad_z, size_t n) {
  for (size_t i = 0; i < n; ++i) grad_z[i] = activation[i] > 0.0f ? grad_a[i] : 0.0f;
}

CFMO_SIMD_CLONES
void scale(std::span<float> x, float alpha) {
  for (float& v : x) v *= alpha;
}

CFMO_SIMD_CLONES
void axpy(float alpha, std::span<const float> x, std::span<float> y) {
  assert(x.size() == y.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] += alpha * x[i];
}

}  // namespace cfmo::tensor::ops
