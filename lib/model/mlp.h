#pragma once
/// A multi-layer perceptron with ReLU between layers and a softmax
/// cross-entropy head: the Model that trains on features and labels.

#include "core/error.h"
#include "model/model.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::model {

struct MlpSpec {
  int inputs = 784;
  std::vector<int> hidden = {256, 128};
  int classes = 10;

  /// "mlp:256,128" (or "mlp:" for a linear model) with the data's input and class counts.
  static Result<MlpSpec> parse(std::string_view text, int inputs, int classes);
  std::string to_string() const;
};

class Mlp final : public Model {
 public:
  explicit Mlp(MlpSpec spec);

  const MlpSpec& spec() const { return spec_; }
  std::string spec_string() const override { return spec_.to_string(); }
  InputKind input_kind() const override { return InputKind::kFeatures; }

  /// PyTorch's nn.Linear initialisation, U(-1/sqrt(in), 1/sqrt(in)), from `seed`.
  void init(uint64_t seed) override;

  float forward_backward(const Examples& batch) override;
  EvalResult evaluate(const Examples& batch) override;
  size_t workspace_floats(int batch) const override;
  double flops_per_example() const override;
  std::string flops_formula() const override { return "sum over layers of 6 in out (4 in out for the first)"; }

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

  int workspace_batch_ = 0;
  std::vector<tensor::FloatBuffer> activations_;  ///< [layer] -> [batch, widths_[layer]] for layer >= 1
  tensor::FloatBuffer logits_;
  tensor::FloatBuffer grad_a_;  ///< scratch for dL/dA of the layer below
  tensor::FloatBuffer grad_z_;  ///< scratch for dL/dZ of the current layer
};

}  // namespace cfmo::model
