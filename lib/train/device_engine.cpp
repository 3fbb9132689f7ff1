#include "train/device_engine.h"

#include "cuda/devices.h"
#include "tensor/ops.h"

#if CFMO_HAVE_CUDA
#include "cuda/kernels.h"
#include "cuda/mlp.h"
#include "cuda/nccl.h"
#include "cuda/optimizer.h"
#include "cuda/runtime.h"
#endif

#include <algorithm>
#include <utility>

namespace cfmo::train {
namespace {

/// The model and optimizer in host memory, OpenBLAS for the GEMMs.
class CpuEngine final : public DeviceEngine {
 public:
  CpuEngine(model::Model& model, optim::Optimizer& optimizer, DataSource& data)
      : model_(model), optimizer_(optimizer), data_(data) {}

  std::string description() const override { return "cpu (" + tensor::ops::blas_info() + ")"; }
  bool host_resident() const override { return true; }

  Result<float> forward_backward(const BatchRequest& request) override {
    const float loss = model_.forward_backward(data_.train_batch(request));
    CFMO_TRY(model_.take_status());  // expert parallelism: a lost peer
    return loss;
  }
  Status zero_gradients() override {
    std::fill(model_.gradients().begin(), model_.gradients().end(), 0.0f);
    return {};
  }
  Result<std::span<float>> host_gradients() override { return model_.gradients(); }
  Status gradients_changed() override { return {}; }
  Status clip_gradients(double max_norm) override {
    optim::clip_grad_norm(model_.gradients(), max_norm);
    return {};
  }
  Status step(float lr) override {
    optimizer_.step(model_.parameters(), model_.gradients(), lr);
    return {};
  }
  Result<std::span<float>> host_parameters() override { return model_.parameters(); }
  Status parameters_changed() override { return {}; }
  optim::Optimizer& mode_optimizer() override { return optimizer_; }
  Result<optim::Optimizer*> host_optimizer() override { return &optimizer_; }
  Status optimizer_changed() override { return {}; }

  Result<model::EvalResult> evaluate() override {
    // Token windows are large (context x vocabulary logits each): a few at a time.
    const int chunk = model_.context() > 0 ? 8 : 1000;
    model::EvalResult total;
    data_.for_each_eval_batch(chunk, [&](const model::Examples& batch) { total.add(model_.evaluate(batch)); });
    CFMO_TRY(model_.take_status());
    return total;
  }

 private:
  model::Model& model_;
  optim::Optimizer& optimizer_;
  DataSource& data_;
};

#if CFMO_HAVE_CUDA

/// What the modes see of an optimizer whose state is on the device: the
/// momentum discount runs there; the state buffers are the host mirror's.
class DeviceOptimizerView final : public optim::Optimizer {
 public:
  DeviceOptimizerView(optim::Optimizer& host, cuda::CudaOptimizer& device) : host_(host), device_(device) {}
  std::string_view name() const override { return host_.name(); }
  void step(std::span<float>, std::span<const float>, float) override {}  // DeviceEngine::step updates on the device
  void scale_first_moment(float factor, size_t offset, size_t count) override {
    status_ = device_.scale_first_moment(factor, offset, count);
  }
  /// The host mirror brought up to date first, with the step count (sync's welcome to a joiner reads both).
  std::vector<optim::OptimizerState> state() override {
    status_ = device_.download_state(host_);
    set_step_count(host_.step_count());
    return host_.state();
  }
  /// scale_first_moment cannot return an error through Optimizer's interface: it is kept here.
  Status take_status() { return std::exchange(status_, Status{}); }

 private:
  optim::Optimizer& host_;
  cuda::CudaOptimizer& device_;
  Status status_;
};

/// Parameters, gradients and optimizer state on one CUDA device; the data
/// set uploaded once; NCCL for the lockstep modes' collectives.
class CudaEngine final : public DeviceEngine {
 public:
  static Result<std::unique_ptr<DeviceEngine>> create(const DeviceEngineOptions& options, model::Model& host,
                                                      optim::Optimizer& optimizer,
                                                      const optim::OptimizerConfig& optimizer_config,
                                                      DataSource& source) {
    // The device model is the MLP's; any other is refused before the device is touched.
    auto* mlp = dynamic_cast<model::Mlp*>(&host);
    if (mlp == nullptr || source.images() == nullptr) {
      return make_error(ErrorKind::kUsage, "--device {}: the CUDA engine does not run this model yet ({})",
                        options.device.to_string(), host.spec_string());
    }
    model::Mlp& model = *mlp;
    const data::DataSplit& data = *source.images();
    std::unique_ptr<CudaEngine> e(new CudaEngine(model, optimizer));
    const int rank = options.comm != nullptr ? options.comm->rank() : 0;
    const tensor::Device device =
        cuda::device_for_rank(options.device, options.local_rank >= 0 ? options.local_rank : rank);
    CFMO_ASSIGN_OR_RETURN(e->ctx_, cuda::Context::create(device.index));
    CFMO_ASSIGN_OR_RETURN(e->model_, cuda::CudaMlp::create(*e->ctx_, model));
    CFMO_ASSIGN_OR_RETURN(e->optimizer_,
                          cuda::CudaOptimizer::create(*e->ctx_, optimizer_config, model.params(), model.num_params()));
    CFMO_ASSIGN_OR_RETURN(auto train, cuda::DeviceDataset::upload(*e->ctx_, data.train, "the training set"));
    CFMO_ASSIGN_OR_RETURN(auto test, cuda::DeviceDataset::upload(*e->ctx_, data.test, "the test set"));
    e->train_ = std::make_unique<cuda::DeviceDataset>(std::move(train));
    e->test_ = std::make_unique<cuda::DeviceDataset>(std::move(test));
    e->view_ = std::make_unique<DeviceOptimizerView>(optimizer, *e->optimizer_);
    e->description_ = cuda::device_description(device);
    if (options.device_collectives && options.comm != nullptr && options.comm->size() > 1) {
      // NCCL refuses two ranks on one GPU: such ranks reduce over UCX, through host memory.
      CFMO_ASSIGN_OR_RETURN(const bool distinct, cuda::NcclComm::one_gpu_per_rank(*e->ctx_, *options.comm));
      if (distinct) {
        CFMO_ASSIGN_OR_RETURN(e->nccl_, cuda::NcclComm::create(*e->ctx_, *options.comm, options.peer_timeout_s));
        e->description_ += ", " + cuda::NcclComm::version();
      } else {
        e->description_ += ", ranks share a GPU: collectives over UCX";
      }
    }
    return std::unique_ptr<DeviceEngine>(std::move(e));
  }

  std::string description() const override { return description_; }
  bool host_resident() const override { return false; }

  Result<float> forward_backward(const BatchRequest& request) override {
    host_params_current_ = false;
    return model_->forward_backward(*train_, request.indices);
  }
  Status zero_gradients() override { return model_->zero_gradients(); }
  Result<std::span<float>> host_gradients() override {
    CFMO_TRY(model_->download_gradients(host_.gradients()));
    return host_.gradients();
  }
  Status gradients_changed() override { return model_->upload_gradients(host_.gradients()); }
  Status clip_gradients(double max_norm) override {
    return cuda::clip_grad_norm(*ctx_, model_->gradients(), model_->num_params(), max_norm, norm_scratch_);
  }
  Status step(float lr) override {
    host_params_current_ = false;
    CFMO_TRY(view_->take_status());
    return optimizer_->step(model_->parameters(), model_->gradients(), lr);
  }
  Result<std::span<float>> host_parameters() override {
    if (!host_params_current_) {
      CFMO_TRY(model_->download_parameters(host_.parameters()));
      host_params_current_ = true;
    }
    return host_.parameters();
  }
  Status parameters_changed() override {
    CFMO_TRY(view_->take_status());
    return model_->upload_parameters(host_.parameters());
  }
  optim::Optimizer& mode_optimizer() override { return *view_; }
  Result<optim::Optimizer*> host_optimizer() override {
    CFMO_TRY(view_->take_status());
    CFMO_TRY(optimizer_->download_state(host_optimizer_));
    return &host_optimizer_;
  }
  Status optimizer_changed() override { return optimizer_->upload_state(host_optimizer_); }

  Result<model::EvalResult> evaluate() override { return model_->evaluate(*test_); }

  bool has_device_all_reduce() const override { return nccl_ != nullptr; }
  Status device_all_reduce_gradients(std::span<float> extras) override {
    // [gradients * count..., extras...] in one NCCL all-reduce, then / total count.
    const size_t n = model_->num_params();
    CFMO_TRY(reduce_.resize(n + extras.size(), "the all-reduce buffer"));
    CFMO_CUDA_TRY(cudaMemcpyAsync(reduce_.data(), model_->gradients(), n * sizeof(float), cudaMemcpyDeviceToDevice,
                                  ctx_->stream()),
                  "the all-reduce buffer");
    CFMO_CUDA_TRY(cuda::kernels::scale(reduce_.data(), n, extras[0], ctx_->stream()), "weighting the gradients");
    CFMO_CUDA_TRY(cudaMemcpyAsync(reduce_.data() + n, extras.data(), extras.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, ctx_->stream()),
                  "the all-reduce buffer");
    CFMO_TRY(nccl_->all_reduce_sum(reduce_.data(), reduce_.size()));
    CFMO_CUDA_TRY(cudaMemcpyAsync(extras.data(), reduce_.data() + n, extras.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, ctx_->stream()),
                  "the all-reduce buffer");
    CFMO_TRY(ctx_->synchronize("the all-reduce"));
    const float total = extras[0];
    CFMO_CUDA_TRY(cudaMemcpyAsync(model_->gradients(), reduce_.data(), n * sizeof(float), cudaMemcpyDeviceToDevice,
                                  ctx_->stream()),
                  "the all-reduce buffer");
    CFMO_CUDA_TRY(cuda::kernels::scale(model_->gradients(), n, total > 0 ? 1.0f / total : 0.0f, ctx_->stream()),
                  "averaging the gradients");
    return {};
  }

 private:
  CudaEngine(model::Mlp& host, optim::Optimizer& host_optimizer) : host_(host), host_optimizer_(host_optimizer) {}

  model::Mlp& host_;
  optim::Optimizer& host_optimizer_;
  std::unique_ptr<cuda::Context> ctx_;
  std::unique_ptr<cuda::CudaMlp> model_;
  std::unique_ptr<cuda::CudaOptimizer> optimizer_;
  std::unique_ptr<cuda::DeviceDataset> train_;
  std::unique_ptr<cuda::DeviceDataset> test_;
  std::unique_ptr<DeviceOptimizerView> view_;
  std::unique_ptr<cuda::NcclComm> nccl_;
  cuda::DeviceArray<double> norm_scratch_;
  cuda::DeviceArray<float> reduce_;
  std::string description_;
  bool host_params_current_ = true;  ///< the host Mlp's parameters equal the device's
};

#endif

}  // namespace

Result<std::unique_ptr<DeviceEngine>> make_device_engine(const DeviceEngineOptions& options, model::Model& model,
                                                         optim::Optimizer& optimizer,
                                                         const optim::OptimizerConfig& optimizer_config,
                                                         DataSource& data) {
  if (options.device.is_cuda() && model.input_kind() != model::InputKind::kFeatures) {
    return make_error(ErrorKind::kUsage, "--device {}: the CUDA engine does not run this model yet ({})",
                      options.device.to_string(), model.spec_string());
  }
  CFMO_TRY(cuda::check_device(options.device));
  if (!options.device.is_cuda())
    return std::unique_ptr<DeviceEngine>(std::make_unique<CpuEngine>(model, optimizer, data));
#if CFMO_HAVE_CUDA
  return CudaEngine::create(options, model, optimizer, optimizer_config, data);
#else
  (void)optimizer_config;
  return make_error(ErrorKind::kInternal, "no CUDA backend in this build");
#endif
}

}  // namespace cfmo::train
