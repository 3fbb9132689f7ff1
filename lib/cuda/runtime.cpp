#include "cuda/runtime.h"

namespace cfmo::cuda {

Error cuda_error(cudaError_t code, std::string_view what) {
  return make_error(ErrorKind::kInternal, "CUDA: {}: {} ({})", what, cudaGetErrorString(code), cudaGetErrorName(code));
}

Error cublas_error(cublasStatus_t code, std::string_view what) {
  // The status text needs the library; a code reaches here only after a call through it succeeded in loading.
  const Result<const CublasApi*> api = cublas_api();
  return make_error(ErrorKind::kInternal, "cuBLAS: {}: {}", what,
                    api ? (*api)->status_string(code) : std::to_string(static_cast<int>(code)));
}

Status check_device(int ordinal, std::string_view flag, std::string_view shown) {
  int count = 0;
  // No driver, a driver older than the runtime, or no GPU: all the same to a user.
  if (const cudaError_t code = cudaGetDeviceCount(&count); code != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls are not confused
    return make_error(ErrorKind::kUsage, "{} {}: no CUDA device ({})", flag, shown, cudaGetErrorString(code));
  }
  if (count == 0) return make_error(ErrorKind::kUsage, "{} {}: no CUDA device", flag, shown);
  if (ordinal >= count) {
    return make_error(ErrorKind::kUsage, "{} {}: no CUDA device of that number ({} present: cuda:0..cuda:{})", flag,
                      shown, count, count - 1);
  }
  return {};
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string describe_device(int ordinal) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) return fmt::format("cuda:{}", ordinal);
  return fmt::format("{} (cuda:{}, compute {}.{}, {:.0f} GiB)", prop.name, ordinal, prop.major, prop.minor,
                     static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

Result<std::unique_ptr<Context>> Context::create(int ordinal) {
  CFMO_TRY(check_device(ordinal, "--device", fmt::format("cuda:{}", ordinal)));
  std::unique_ptr<Context> ctx(new Context());
  ctx->ordinal_ = ordinal;
  CFMO_CUDA_TRY(cudaSetDevice(ordinal), fmt::format("selecting cuda:{}", ordinal));
  CFMO_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->stream_, cudaStreamNonBlocking), "creating a stream");
  CFMO_ASSIGN_OR_RETURN(ctx->api_, cublas_api());
  CFMO_CUBLAS_TRY(ctx->api_->create(&ctx->blas_), "creating a handle");
  CFMO_CUBLAS_TRY(ctx->api_->set_stream(ctx->blas_, ctx->stream_), "binding the handle to the stream");
  // FP32 GEMMs stay FP32 (no TF32 tensor-core rounding): training on the GPU
  // must match the CPU path within float tolerance.
  CFMO_CUBLAS_TRY(ctx->api_->set_math_mode(ctx->blas_, CUBLAS_DEFAULT_MATH), "setting the math mode");
  return ctx;
}

Context::~Context() {
  if (blas_ != nullptr) api_->destroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status Context::synchronize(std::string_view what) const {
  CFMO_CUDA_TRY(cudaStreamSynchronize(stream_), what);
  return {};
}

Status gemm(const Context& ctx, Trans trans_a, Trans trans_b, int m, int n, int k, float alpha, const float* a, int lda,
            const float* b, int ldb, float beta, float* c, int ldc) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
  // row-major buffer read column-major is its transpose: so B goes first,
  // each with its own transpose flag, and m and n trade places.
  const cublasOperation_t op_a = trans_a == Trans::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b == Trans::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
  CFMO_CUBLAS_TRY(ctx.cublas().sgemm(ctx.blas(), op_b, op_a, n, m, k, &alpha, b, ldb, a, lda, &beta, c, ldc),
                  fmt::format("sgemm {}x{}x{}", m, n, k));
  return {};
}

}  // namespace cfmo::cuda
