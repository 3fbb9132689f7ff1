#pragma once
/// A multi-layer perceptron with ReLU between layers and a softmax
/// cross-entropy head. Parameters and gradients live in one flat buffer each,
/// so optimizers, checkpoints and (later) delta exchange treat the model as a
/// vector; ParamInfo names the tensors inside it, PyTorch style.

#include "core/error.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo {

/// One named tensor inside a flat parameter buffer.
struct ParamInfo {
  std::string name;            ///< "layers.0.weight"
  std::vector<int64_t> shape;  ///< [out, in] for weights (nn.Linear layout), [out] for biases
  size_t offset = 0;           ///< in floats, into the flat buffer
  size_t size = 0;             ///< in floats
  bool is_matrix() const { return shape.size() == 2; }
};

struct MlpSpec {
  int inputs = 784;
  std::vector<int> hidden = {256, 128};
  int classes = 10;

  /// "mlp:256,128" (or "mlp:" for a linear model) with the data's input and class counts.
  static Result<MlpSpec> parse(std::string_view text, int inputs, int classes);
  std::string to_string() const;
};

struct EvalResult {
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t count = 0;
  double loss() const { return count ? loss_sum / static_cast<double>(count) : 0; }
  double accuracy() const { return count ? static_cast<double>(correct) / static_cast<double>(count) : 0; }
};

class Mlp {
 public:
  explicit Mlp(MlpSpec spec);

  const MlpSpec& spec() const { return spec_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  /// Length of the flat buffers (tensors start 64-byte aligned, so a few floats of padding).
  size_t num_params() const { return parameters_.size(); }
  /// Trainable parameters: the sum of the tensors' sizes, without padding.
  size_t num_trainable() const;
  std::span<float> parameters() { return parameters_; }
  std::span<const float> parameters() const { return parameters_; }
  std::span<float> gradients() { return gradients_; }
  std::span<const float> gradients() const { return gradients_; }

  /// PyTorch's nn.Linear initialisation, U(-1/sqrt(in), 1/sqrt(in)), from `seed`.
  void init(uint64_t seed);

  /// Forward and backward over a batch of row-major inputs [batch, inputs];
  /// overwrites gradients() with d(mean loss)/d(params) and returns the mean loss.
  float forward_backward(const float* inputs, const int32_t* labels, int batch);

  /// Forward only; accumulates loss and correct predictions.
  EvalResult evaluate(const float* inputs, const int32_t* labels, int64_t count, int chunk = 1000);

 private:
  int layers() const { return static_cast<int>(widths_.size()) - 1; }
  const float* weight(int layer) const { return parameters_.data() + params_[2 * layer].offset; }
  const float* bias(int layer) const { return parameters_.data() + params_[2 * layer + 1].offset; }
  void ensure_workspace(int batch);
  /// Runs the layers; leaves post-ReLU activations in activations_ and logits in logits_.
  void forward(const float* inputs, int batch);

  MlpSpec spec_;
  std::vector<int> widths_;  ///< inputs, hidden..., classes
  std::vector<ParamInfo> params_;
  FloatBuffer parameters_;
  FloatBuffer gradients_;

  int workspace_batch_ = 0;
  std::vector<FloatBuffer> activations_;  ///< [layer] -> [batch, widths_[layer]] for layer >= 1
  FloatBuffer logits_;
  FloatBuffer grad_a_;  ///< scratch for dL/dA of the layer below
  FloatBuffer grad_z_;  ///< scratch for dL/dZ of the current layer
};

/// Softmax cross-entropy over rows of `logits` [batch, classes]. Returns the
/// summed loss; when `dlogits` is given, writes (softmax - onehot) * grad_scale.
/// `correct`, when given, is increased by the rows whose argmax is the label.
double softmax_cross_entropy(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, int64_t* correct);

}  // namespace cfmo
