// cfmo-moe's experts' GEMMs on a CUDA device (--device cuda): cuBLAS on
// weights uploaded once, rows staged through pinned host buffers. A build
// without CUDA answers "no CUDA device", like every other --device cuda.
#include "cuda/moe_experts.h"

#include "cuda/devices.h"

#if CFMO_HAVE_CUDA
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#endif

#include <memory>

namespace cfmo::cuda {

#if CFMO_HAVE_CUDA
namespace {

/// Pinned host memory: copies to and from it are true DMA, at full bus speed.
class PinnedFloats {
 public:
  ~PinnedFloats() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  Status reserve(size_t n) {
    if (n <= size_) return {};
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
    void* p = nullptr;
    CFMO_CUDA_TRY(cudaMallocHost(&p, n * sizeof(float)), "pinned staging memory");
    data_ = static_cast<float*>(p);
    size_ = n;
    return {};
  }
  float* data() { return data_; }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

/// What the experts of one rank share: the device, its stream and the staging buffers.
struct DeviceShared {
  std::unique_ptr<Context> ctx;
  cuda::DeviceArray<float> x, inner, out;
  PinnedFloats staged_in, staged_out;
};

class CudaExpert final : public moe::ExpertDevice {
 public:
  CudaExpert(std::shared_ptr<DeviceShared> shared, int hidden, int ffn)
      : shared_(std::move(shared)), hidden_(hidden), ffn_(ffn) {}

  Status upload(const tensor::FloatBuffer& w1, const tensor::FloatBuffer& w2) {
    const cudaStream_t stream = shared_->ctx->stream();
    CFMO_TRY(w1_.resize(w1.size(), "expert weights"));
    CFMO_TRY(w2_.resize(w2.size(), "expert weights"));
    CFMO_TRY(w1_.upload(w1, stream, "expert weights"));
    CFMO_TRY(w2_.upload(w2, stream, "expert weights"));
    return shared_->ctx->synchronize("uploading expert weights");
  }

  Status forward(const float* x, int64_t rows, float* out) override {
    DeviceShared& s = *shared_;
    const cuda::Context& ctx = *s.ctx;
    const size_t n_in = static_cast<size_t>(rows) * static_cast<size_t>(hidden_);
    const size_t n_inner = static_cast<size_t>(rows) * static_cast<size_t>(ffn_);
    CFMO_TRY(s.x.resize(std::max(s.x.size(), n_in), "expert rows"));
    CFMO_TRY(s.out.resize(std::max(s.out.size(), n_in), "expert rows"));
    CFMO_TRY(s.inner.resize(std::max(s.inner.size(), n_inner), "expert rows"));
    CFMO_TRY(s.staged_in.reserve(n_in));
    CFMO_TRY(s.staged_out.reserve(n_in));
    std::copy(x, x + n_in, s.staged_in.data());
    CFMO_CUDA_TRY(
        cudaMemcpyAsync(s.x.data(), s.staged_in.data(), n_in * sizeof(float), cudaMemcpyHostToDevice, ctx.stream()),
        "expert rows to the device");
    const int m = static_cast<int>(rows);
    CFMO_TRY(cuda::gemm(ctx, cuda::Trans::kNo, cuda::Trans::kNo, m, ffn_, hidden_, 1.0f, s.x.data(), hidden_,
                        w1_.data(), ffn_, 0.0f, s.inner.data(), ffn_));
    CFMO_CUDA_TRY(cuda::kernels::relu(s.inner.data(), n_inner, ctx.stream()), "expert ReLU");
    CFMO_TRY(cuda::gemm(ctx, cuda::Trans::kNo, cuda::Trans::kNo, m, hidden_, ffn_, 1.0f, s.inner.data(), ffn_,
                        w2_.data(), hidden_, 0.0f, s.out.data(), hidden_));
    CFMO_CUDA_TRY(
        cudaMemcpyAsync(s.staged_out.data(), s.out.data(), n_in * sizeof(float), cudaMemcpyDeviceToHost, ctx.stream()),
        "expert results to the host");
    CFMO_TRY(ctx.synchronize("an expert block"));
    std::copy(s.staged_out.data(), s.staged_out.data() + n_in, out);
    return {};
  }

 private:
  std::shared_ptr<DeviceShared> shared_;
  int hidden_;
  int ffn_;
  cuda::DeviceArray<float> w1_, w2_;
};

/// Moves every expert's GEMMs to device `ordinal`, the weights uploaded once.
Status attach_experts(std::vector<moe::ExpertFfn>& experts, int ordinal) {
  auto shared = std::make_shared<DeviceShared>();
  CFMO_ASSIGN_OR_RETURN(shared->ctx, Context::create(ordinal));
  for (moe::ExpertFfn& e : experts) {
    if (e.ffn() == 0) continue;  // the identity has nothing to compute
    auto device = std::make_unique<CudaExpert>(shared, e.hidden(), e.ffn());
    CFMO_TRY(device->upload(e.w1(), e.w2()));
    e.attach(std::move(device));
  }
  return {};
}

}  // namespace

#endif

Result<std::string> place_experts(std::vector<moe::ExpertFfn>& experts, const tensor::Device& device, int local_rank) {
  if (!device.is_cuda()) return std::string("cpu");
  const tensor::Device mine = device_for_rank(device, local_rank);
#if CFMO_HAVE_CUDA
  CFMO_TRY(attach_experts(experts, mine.index));
#else
  (void)experts;
  CFMO_TRY(check_device(mine));
#endif
  return device_description(mine);
}

}  // namespace cfmo::cuda
