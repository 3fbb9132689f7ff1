#pragma once
/// Inner optimizers over a flat parameter vector: SGD (momentum, Nesterov),
/// Adam, AdamW and Muon. The update rules follow PyTorch's torch.optim
/// (SGD, Adam, AdamW) and Keller Jordan's Muon, so results can be compared
/// value by value. State buffers share the parameters' flat layout.

#include "core/error.h"
#include "model/model.h"
#include "tensor/buffer.h"

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::optim {

enum class OptimizerKind { kSgd, kAdam, kAdamW, kMuon };

/// "sgd", "adam", "adamw" or "muon"; anything else is kUsage naming --optimizer.
Result<OptimizerKind> parse_optimizer_kind(std::string_view name);
std::string_view optimizer_kind_name(OptimizerKind kind);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double momentum = 0.9;  ///< SGD and Muon momentum
  bool nesterov = false;  ///< Nesterov momentum for SGD and Muon
  double beta1 = 0.9;     ///< Adam(W) first-moment decay (also Muon's AdamW part)
  double beta2 = 0.999;   ///< Adam(W) second-moment decay
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< L2 for sgd/adam, decoupled for adamw/muon
  int ns_steps = 5;           ///< Newton-Schulz iterations for Muon
};

/// A named state buffer, laid out like the parameters.
struct OptimizerState {
  std::string name;  ///< "exp_avg", "exp_avg_sq", "momentum_buffer"
  tensor::FloatBuffer* buffer;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string_view name() const = 0;

  /// One update of `params` from `grads` at learning rate `lr`.
  virtual void step(std::span<float> params, std::span<const float> grads, float lr) = 0;

  /// Multiplies the first-moment (momentum) state of [offset, offset + count)
  /// by `factor`: how the cfmo mode discounts stale momentum after a rebase.
  virtual void scale_first_moment(float factor, size_t offset, size_t count) = 0;
  void scale_first_moment(float factor) { scale_first_moment(factor, 0, SIZE_MAX); }

  /// The state buffers, for checkpoints; each has the parameters' size.
  virtual std::vector<OptimizerState> state() = 0;

  int64_t step_count() const { return steps_; }
  void set_step_count(int64_t steps) { steps_ = steps; }

 protected:
  int64_t steps_ = 0;
};

/// Adam's bias corrections for step `step` (1-based) at learning rate `lr`,
/// folded into the two scalars the update uses; the CPU and CUDA optimizers share them.
struct AdamCoefficients {
  float step_size;     ///< lr / (1 - beta1^step)
  float inv_sqrt_bc2;  ///< 1 / sqrt(1 - beta2^step)
};
AdamCoefficients adam_coefficients(const OptimizerConfig& config, int64_t step, float lr);

/// Builds the optimizer named in `config` for a model of this layout.
Result<std::unique_ptr<Optimizer>> make_optimizer(const OptimizerConfig& config,
                                                  const std::vector<model::ParamInfo>& layout, size_t size);

/// Scales `grads` so their global L2 norm is at most `max_norm` (0: no-op).
/// Returns the norm before clipping.
double clip_grad_norm(std::span<float> grads, double max_norm);
/// The same scaling for a gradient whose norm was measured elsewhere (a
/// gradient spread over processes: each holds part of it).
void clip_to_norm(std::span<float> grads, double max_norm, double norm);

/// Scratch space for newton_schulz, kept across steps: the buffers are
/// large enough that allocating them per call means mmap and page faults.
struct NewtonSchulzWorkspace {
  tensor::FloatBuffer x, x_next, gram, poly;
};

/// Orthogonalises the row-major matrix `g` [rows, cols] in place with
/// `steps` quintic Newton-Schulz iterations (Muon's zeropower_via_newtonschulz5).
void newton_schulz(std::span<float> g, int rows, int cols, int steps, NewtonSchulzWorkspace& workspace);
void newton_schulz(std::span<float> g, int rows, int cols, int steps);

}  // namespace cfmo::optim
