#pragma once
/// The inner optimizers of optim/optimizer.h on a CUDA device: SGD
/// (momentum, Nesterov), Adam, AdamW as one fused kernel each, and Muon with
/// its Newton-Schulz iterations through cuBLAS. The state has the CPU
/// optimizer's names and layout, so checkpoints go through a host
/// `Optimizer` (download_state / upload_state) and read the same everywhere.

#include "core/error.h"
#include "cuda/runtime.h"
#include "model/mlp.h"
#include "optim/optimizer.h"

#include <memory>
#include <string>
#include <vector>

namespace cfmo::cuda {

class CudaOptimizer {
 public:
  static Result<std::unique_ptr<CudaOptimizer>> create(Context& ctx, const optim::OptimizerConfig& config,
                                                       const std::vector<model::ParamInfo>& layout, size_t size);

  /// One update of the device `params` from the device `grads`.
  Status step(float* params, const float* grads, float lr);
  /// The cfmo mode's momentum discount over [offset, offset + count).
  Status scale_first_moment(float factor, size_t offset, size_t count);

  /// Copies the state into `host` (an optimizer of the same name and size), with the step count.
  Status download_state(optim::Optimizer& host);
  /// Copies `host`'s state and step count to the device (a resumed run).
  Status upload_state(optim::Optimizer& host);

  int64_t step_count() const { return steps_; }

 private:
  CudaOptimizer(Context& ctx, optim::OptimizerConfig config, std::vector<model::ParamInfo> layout)
      : ctx_(ctx), config_(std::move(config)), layout_(std::move(layout)) {}
  struct Named {
    std::string name;
    DeviceArray<float> buffer;
  };
  DeviceArray<float>* find(const std::string& name);
  Status muon_matrix(float* p, const float* g, const model::ParamInfo& info, float lr);

  Context& ctx_;
  optim::OptimizerConfig config_;
  std::vector<model::ParamInfo> layout_;
  int64_t steps_ = 0;
  std::vector<Named> state_;  ///< "momentum_buffer", "exp_avg", "exp_avg_sq" as the optimizer has them
  // Muon's scratch, sized for the largest matrix.
  DeviceArray<float> update_, x_, x_next_, gram_, poly_;
  DeviceArray<double> sumsq_;
};

/// Scales device `grads` so their global L2 norm is at most `max_norm`
/// (torch's clip_grad_norm_), deciding on the device: nothing waits.
Status clip_grad_norm(Context& ctx, float* grads, size_t n, double max_norm, DeviceArray<double>& scratch);

}  // namespace cfmo::cuda
