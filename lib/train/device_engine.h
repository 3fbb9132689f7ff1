#pragma once
/// Where a worker's model lives and its arithmetic runs (`--device`). The CPU
/// engine works on the host Model and Optimizer in place, any model. The CUDA
/// engine (the MLP only, so far) keeps
/// parameters, gradients and optimizer state on the device, and copies them
/// to the host Model and Optimizer only when the host asks (a reconciliation, a
/// checkpoint, an evaluation's report), so the modes, the checkpoints and the
/// deltas are the same code on both.
///
/// The host views follow one rule: after host_parameters() (or
/// host_gradients()) the caller may read and write the span; if it wrote,
/// it calls parameters_changed() (gradients_changed()) before the next
/// engine call that computes. On the CPU both are no-ops.

#include "comm/communicator.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "tensor/device.h"
#include "train/data_source.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace cfmo::train {

class DeviceEngine {
 public:
  virtual ~DeviceEngine() = default;
  /// "cpu (OpenBLAS 0.3.21 SkylakeX)", "NVIDIA H200 (cuda:0, ...)".
  virtual std::string description() const = 0;
  /// True when the host views are the engine's own memory (the CPU): no copies, always current.
  virtual bool host_resident() const = 0;

  /// Forward and backward over the request's training examples; the
  /// gradients become d(mean loss)/d(params); returns the mean loss.
  virtual Result<float> forward_backward(const BatchRequest& request) = 0;
  virtual Status zero_gradients() = 0;
  virtual Result<std::span<float>> host_gradients() = 0;
  virtual Status gradients_changed() = 0;
  /// Scales the gradients to a global L2 norm of at most `max_norm` (0: no-op).
  virtual Status clip_gradients(double max_norm) = 0;
  /// One inner-optimizer update at `lr`.
  virtual Status step(float lr) = 0;

  virtual Result<std::span<float>> host_parameters() = 0;
  virtual Status parameters_changed() = 0;

  /// The optimizer as the modes see it: scale_first_moment acts where the
  /// state lives. Its step() is not for callers: use DeviceEngine::step.
  virtual optim::Optimizer& mode_optimizer() = 0;
  /// The host optimizer, its state current (for a checkpoint).
  virtual Result<optim::Optimizer*> host_optimizer() = 0;
  /// The host optimizer's state was loaded (a resume): the engine takes it.
  virtual Status optimizer_changed() = 0;

  /// Loss and accuracy over the evaluation data (the test set, the validation windows).
  virtual Result<model::EvalResult> evaluate() = 0;

  /// Sums `extras` (host floats) over ranks together with the gradients each
  /// weighted by extras[0] (this rank's example count), on the device, and
  /// leaves the gradients divided by the summed extras[0]: what the sync mode
  /// needs, without the gradients leaving the device. False when the engine
  /// has no device collective (the mode then uses the host communicator).
  virtual bool has_device_all_reduce() const { return false; }
  virtual Status device_all_reduce_gradients(std::span<float> /*extras*/) {
    return make_error(ErrorKind::kInternal, "this engine has no device all-reduce");
  }
};

struct DeviceEngineOptions {
  tensor::Device device;
  /// The host communicator; with `device_collectives`, a CUDA engine also
  /// connects NCCL over it (every rank calls make_device_engine together then).
  comm::Communicator* comm = nullptr;
  bool device_collectives = false;
  double peer_timeout_s = 10;
  int local_rank = -1;  ///< the rank's index on its host, for "cuda" (device_for_rank); -1: its rank
};

/// The engine for `options.device`, over `model` and `optimizer` (which it
/// keeps using as the host mirror) and the data (an image set is uploaded
/// once on CUDA). kUsage when the device does not run this model.
Result<std::unique_ptr<DeviceEngine>> make_device_engine(const DeviceEngineOptions& options, model::Model& model,
                                                         optim::Optimizer& optimizer,
                                                         const optim::OptimizerConfig& optimizer_config,
                                                         DataSource& data);

}  // namespace cfmo::train
