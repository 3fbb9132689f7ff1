#pragma once
/// The seam between the trainer and what it trains. A Model keeps its
/// parameters and gradients in one flat buffer each, so optimizers,
/// checkpoints, modes and deltas treat every model as a vector; ParamInfo
/// names the tensors inside it (PyTorch style) and says what kind each is,
/// so an optimizer can tell the matrices it orthogonalises or decays from
/// biases, norms and embeddings.
///
/// Implementations: Mlp (model/mlp.h, features and labels) and Gpt
/// (model/gpt.h, token windows). make_model (model/factory.h) builds one from
/// its `--model` spec.

#include "core/error.h"
#include "tensor/buffer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cfmo::model {

/// What a tensor is, for the optimizers: Muon orthogonalises kMatrix tensors
/// and leaves the rest to AdamW; GPT-2 practice decays only matrices.
enum class ParamKind : uint8_t {
  kMatrix,     ///< a 2-D weight of a linear map inside the model
  kBias,       ///< an additive vector
  kNorm,       ///< a LayerNorm gain or shift
  kEmbedding,  ///< a lookup table (and, tied, the output head)
};

std::string_view to_string(ParamKind kind);

/// One named tensor inside a flat parameter buffer.
struct ParamInfo {
  std::string name;            ///< "layers.0.weight"
  std::vector<int64_t> shape;  ///< [out, in] for weights (nn.Linear layout), [out] for biases
  size_t offset = 0;           ///< in floats, into the flat buffer
  size_t size = 0;             ///< in floats
  ParamKind kind = ParamKind::kMatrix;
  bool decays = true;  ///< --weight-decay applies to it
  /// A 2-D weight of a linear map: what Muon orthogonalises.
  bool is_matrix() const { return kind == ParamKind::kMatrix && shape.size() == 2; }
};

/// Appends tensors to a layout, each starting on a 16-float (64-byte)
/// boundary so SIMD loops and BLAS see aligned rows; returns the offset.
class LayoutBuilder {
 public:
  size_t add(std::vector<ParamInfo>& layout, std::string name, std::vector<int64_t> shape, ParamKind kind, bool decays);
  /// The flat buffer's length so far.
  size_t size() const { return offset_; }

 private:
  size_t offset_ = 0;
};

struct EvalResult {
  double loss_sum = 0;
  int64_t correct = 0;
  int64_t count = 0;  ///< predictions scored (examples, or tokens for a language model)
  double loss() const { return count ? loss_sum / static_cast<double>(count) : 0; }
  double accuracy() const { return count ? static_cast<double>(correct) / static_cast<double>(count) : 0; }
  void add(const EvalResult& other) {
    loss_sum += other.loss_sum;
    correct += other.correct;
    count += other.count;
  }
};

/// A batch of examples as a model reads them. A feature model reads
/// `features` [count, inputs] and `labels` [count]; a language model reads
/// `tokens` [count, context + 1] (inputs the first context tokens of each
/// window, targets the last context).
struct Examples {
  int count = 0;
  const float* features = nullptr;
  const int32_t* labels = nullptr;
  const int32_t* tokens = nullptr;
};

/// What a model wants from the data.
enum class InputKind : uint8_t {
  kFeatures,  ///< float rows and class labels
  kTokens,    ///< windows of context + 1 token ids
};

class Model {
 public:
  virtual ~Model() = default;
  Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  /// The spec it was built from, canonical: "mlp:256,128", "gpt:layers=2,heads=4,dim=128,context=64".
  virtual std::string spec_string() const = 0;
  virtual InputKind input_kind() const = 0;
  /// Tokens per example for a language model (its context), 0 otherwise.
  virtual int context() const { return 0; }
  /// Predictions scored per example: 1, or the context for a language model.
  int predictions_per_example() const { return context() > 0 ? context() : 1; }

  const std::vector<ParamInfo>& params() const { return params_; }
  /// Length of the flat buffers (tensors start 64-byte aligned, so a few floats of padding).
  size_t num_params() const { return parameters_.size(); }
  /// Trainable parameters: the sum of the tensors' sizes, without padding.
  size_t num_trainable() const;
  std::span<float> parameters() { return parameters_; }
  std::span<const float> parameters() const { return parameters_; }
  std::span<float> gradients() { return gradients_; }
  std::span<const float> gradients() const { return gradients_; }

  /// The model's own initialisation from `seed` (the same on every rank).
  virtual void init(uint64_t seed) = 0;

  /// Forward and backward over a batch; overwrites gradients() with
  /// d(mean loss)/d(params) and returns the mean loss per prediction.
  virtual float forward_backward(const Examples& batch) = 0;

  /// Forward only over a batch; adds its summed loss, correct predictions and count to the result.
  virtual EvalResult evaluate(const Examples& batch) = 0;

  /// The floats of the workspaces a forward and backward pass over `batch`
  /// examples allocates (activations kept for the backward pass, scratch).
  virtual size_t workspace_floats(int batch) const = 0;

  /// Allocates and touches the workspaces of batches of up to `batch`
  /// examples now, before the training loop: a process's first step would
  /// otherwise fault them in page by page (bench/RESULTS.md).
  virtual void prepare(int /*batch*/) {}

  /// Floating-point operations of one forward and backward pass over one
  /// example (multiply-adds count two), for GFLOP/s reports.
  virtual double flops_per_example() const = 0;
  /// How flops_per_example counts, for reports.
  virtual std::string flops_formula() const = 0;
  /// A Hugging Face config.json for the saved tensors, or empty when the
  /// model has no Hugging Face counterpart (then none is written).
  virtual std::string hf_config_json() const { return {}; }

  /// Figures of the training passes (forward_backward) since the last call,
  /// beyond the loss: a Mixture of Experts' auxiliary losses and expert load
  /// (model/moe_mlp.h). A JSON object, then a new window starts; null for a
  /// model without any. What metrics.jsonl's step lines carry as "moe".
  virtual nlohmann::ordered_json take_metrics() { return nullptr; }
  /// The same over every training pass of this process (the summary's).
  virtual nlohmann::ordered_json run_metrics() const { return nullptr; }
  /// The first failure since the last call of what a pass exchanges with
  /// other processes (expert parallelism: a lost peer), kPeer; a model that
  /// exchanges nothing never fails.
  virtual Status take_status() { return {}; }
  /// After this process's last pass: what its passes exchange with other
  /// processes is served until every other process has finished its own
  /// (async expert dispatch); nothing for a model that exchanges nothing.
  virtual Status finish_exchanges() { return {}; }
  /// The experts (by number) that only process `rank` holds (expert
  /// parallelism); none for a model that is not spread.
  virtual std::vector<int> experts_held_by(int /*rank*/) const { return {}; }
  /// Floats at the start of the flat buffer that every rank holds and the
  /// modes reconcile; the rest (expert parallelism: this rank's experts) is
  /// this rank's alone. All of it for a model that is not spread.
  virtual size_t replicated_size() const { return num_params(); }
  /// Seconds the training passes of this process have spent so far
  /// waiting in exchanges with other processes (expert dispatch); 0 for a
  /// model that exchanges nothing.
  virtual double exchange_wait_s() const { return 0; }

 protected:
  /// Allocates the flat buffers for `layout` of `size` floats, zeroed.
  void set_layout(std::vector<ParamInfo> layout, size_t size);

  std::vector<ParamInfo> params_;
  tensor::FloatBuffer parameters_;
  tensor::FloatBuffer gradients_;
};

/// Softmax cross-entropy over rows of `logits` [batch, classes]. Returns the
/// summed loss; when `dlogits` is given, writes (softmax - onehot) * grad_scale.
/// `correct`, when given, is increased by the rows whose argmax is the label.
/// `dlogits` may be `logits` (overwritten in place).
double softmax_cross_entropy(const float* logits, const int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, int64_t* correct);

}  // namespace cfmo::model
