#pragma once
/// The CUDA backend's handles: device checks, errors as values, device
/// memory, a stream and a cuBLAS handle, each owned by one RAII object.
/// Built only where the CUDA toolkit was found (CFMO_HAVE_CUDA).

#include "core/error.h"
#include "cuda/cublas_api.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace cfmo::cuda {

/// kUsage "no CUDA device" unless `ordinal` names a device this process can use.
/// `shown` is how the user named it ("cuda", "cuda:1"), for the message.
Status check_device(int ordinal, std::string_view flag, std::string_view shown);
std::string describe_device(int ordinal);
/// Devices this process can use (0 without a driver).
int device_count();

/// A failed CUDA call as an error naming what was being done.
Error cuda_error(cudaError_t code, std::string_view what);
Error cublas_error(cublasStatus_t code, std::string_view what);

#define CFMO_CUDA_TRY(call, what)                                                   \
  do {                                                                              \
    if (const cudaError_t cfmo_cuda_code_ = (call); cfmo_cuda_code_ != cudaSuccess) \
      return ::cfmo::cuda::cuda_error(cfmo_cuda_code_, what);                       \
  } while (0)

#define CFMO_CUBLAS_TRY(call, what)                                                                  \
  do {                                                                                               \
    if (const cublasStatus_t cfmo_cublas_code_ = (call); cfmo_cublas_code_ != CUBLAS_STATUS_SUCCESS) \
      return ::cfmo::cuda::cublas_error(cfmo_cublas_code_, what);                                    \
  } while (0)

/// An array in device memory (cudaMalloc; never managed memory), owned.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() { reset(); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }

  /// Allocates `count` elements (contents undefined); keeps a large-enough allocation.
  Status resize(size_t count, std::string_view what) {
    if (count <= capacity_) {
      size_ = count;
      return {};
    }
    reset();
    void* p = nullptr;
    CFMO_CUDA_TRY(cudaMalloc(&p, count * sizeof(T)), what);
    data_ = static_cast<T*>(p);
    size_ = capacity_ = count;
    return {};
  }
  Status zero(cudaStream_t stream, std::string_view what) {
    CFMO_CUDA_TRY(cudaMemsetAsync(data_, 0, size_ * sizeof(T), stream), what);
    return {};
  }
  Status upload(std::span<const T> host, cudaStream_t stream, std::string_view what) {
    CFMO_CUDA_TRY(
        cudaMemcpyAsync(data_, host.data(), std::min(host.size(), size_) * sizeof(T), cudaMemcpyHostToDevice, stream),
        what);
    return {};
  }
  Status download(std::span<T> host, cudaStream_t stream, std::string_view what) const {
    CFMO_CUDA_TRY(
        cudaMemcpyAsync(host.data(), data_, std::min(host.size(), size_) * sizeof(T), cudaMemcpyDeviceToHost, stream),
        what);
    return {};
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void reset() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    size_ = capacity_ = 0;
  }
  T* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

/// One device, one stream and one cuBLAS handle bound to it: everything a
/// worker's kernels run on, in order.
class Context {
 public:
  static Result<std::unique_ptr<Context>> create(int ordinal);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int ordinal() const { return ordinal_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  const CublasApi& cublas() const { return *api_; }
  /// Waits for the stream; the first error of an earlier asynchronous call surfaces here.
  Status synchronize(std::string_view what) const;

 private:
  Context() = default;
  int ordinal_ = 0;
  cudaStream_t stream_ = nullptr;
  const CublasApi* api_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

enum class Trans { kNo, kYes };

/// Row-major C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C on the
/// context's stream: the same contract as ops::gemm, so CPU and CUDA code
/// read alike (cuBLAS is column-major; the operands are swapped inside).
Status gemm(const Context& ctx, Trans trans_a, Trans trans_b, int m, int n, int k, float alpha, const float* a, int lda,
            const float* b, int ldb, float beta, float* c, int ldc);

}  // namespace cfmo::cuda
