#pragma once
/// GPT-2 (Radford et al. 2019, as Hugging Face's GPT2LMHeadModel runs it):
/// token and learned position embeddings, pre-LayerNorm blocks of causal
/// self-attention and a GELU MLP with residuals, a final LayerNorm, logits
/// by the tied token embedding.
///
/// The tensors carry Hugging Face's names and Conv1D layout ([in, out],
/// inputs first), so the flat buffer written as safetensors loads with
/// GPT2LMHeadModel.from_pretrained as it is.
///
/// FLOPs of one training example (context T), the count nanoGPT and PaLM use:
///   T * (6 * N + 12 * L * T * C),  N = 12 * L * C^2 + V * C
/// N the weights of the matrix products (the tied head once), 6 = forward 2
/// plus backward 4 per multiply-add, 12 L T C the attention scores and their
/// weighted sum as if unmasked. The causal kernel skips most of the masked
/// half, so the work it does is less than this count. With experts N counts
/// the active weights: a MoE block's MLP is its router C E and k experts of
/// 2 C D each, instead of 8 C^2.
///
/// With `experts=E` every `moe_every`-th block (blocks M-1, 2M-1, ...) has a
/// Mixture-of-Experts MLP (model/moe_mlp.h). Its router is
/// h.{i}.mlp.router.weight [C, E]; its experts h.{i}.mlp.experts.{e}.c_fc.*
/// and .c_proj.* in the Conv1D layout. The expert tensors come after every
/// other tensor in the flat buffer (dense_size() floats precede them), so an
/// expert-parallel mode can tell the replicated prefix from the experts.

#include "core/error.h"
#include "model/expert_exchange.h"
#include "model/model.h"
#include "model/moe_mlp.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::model {

struct GptSpec {
  int layers = 2;
  int heads = 4;
  int dim = 128;
  int context = 64;
  int vocab = 256;
  int experts = 0;     ///< 0: a dense GPT
  int top_k = 2;       ///< experts per token
  int expert_dim = 0;  ///< D of each expert's MLP (parse sets 4 C when not given)
  int moe_every = 1;   ///< every M-th block's MLP is a MoE

  /// "gpt:layers=L,heads=H,dim=C,context=T[,experts=E,top_k=K,expert_dim=D,moe_every=M]";
  /// the vocabulary comes from the data.
  static Result<GptSpec> parse(std::string_view text, int vocab);
  std::string to_string() const;
  int head_dim() const { return dim / heads; }
  bool is_moe() const { return experts > 0; }
  bool is_moe_layer(int layer) const { return experts > 0 && layer % moe_every == moe_every - 1; }
  int moe_layers() const { return experts > 0 ? layers / moe_every : 0; }
};

class Gpt final : public Model {
 public:
  explicit Gpt(GptSpec spec, MoeOptions moe = {});

  const GptSpec& spec() const { return spec_; }
  std::string spec_string() const override { return spec_.to_string(); }
  InputKind input_kind() const override { return InputKind::kTokens; }
  int context() const override { return spec_.context; }

  /// GPT-2's: normal(0, 0.02), the blocks' two output projections normal(0,
  /// 0.02 / sqrt(2 L)), biases 0, LayerNorm gains 1.
  void init(uint64_t seed) override;

  /// `batch.tokens` [count, context + 1]; the loss is the mean over count x context predictions.
  float forward_backward(const Examples& batch) override;
  EvalResult evaluate(const Examples& batch) override;
  size_t workspace_floats(int batch) const override;
  void prepare(int batch) override;
  double flops_per_example() const override;
  /// GPT2Config: the run directory then loads with GPT2LMHeadModel.from_pretrained.
  std::string hf_config_json() const override;
  std::string flops_formula() const override;
  nlohmann::ordered_json take_metrics() override;
  nlohmann::ordered_json run_metrics() const override;

  /// Floats of the flat buffer before the first expert tensor (all of it for a dense GPT).
  size_t dense_size() const { return dense_size_; }
  /// Where the experts live: strided over MoeOptions::expert_ranks (one rank: all here).
  moe::ExpertPlacement expert_placement() const;
  /// Experts of each MoE block this process holds (after the dense prefix,
  /// by block, then expert: rank, rank + W, ...).
  int local_experts() const;
  /// --expert-parallel: the MoE layers exchange rows with the other ranks
  /// of `comm` (of MoeOptions::expert_ranks ranks, this one expert_rank):
  /// by collectives, or with MoeOptions::async_dispatch through an
  /// ExpertExchange (model/expert_exchange.h).
  void set_expert_parallel(comm::Communicator* comm);
  Status take_status() override;
  Status finish_exchanges() override;
  /// Async dispatch: the experts of the ranks found lost (their tokens take the residual).
  std::vector<int> lost_experts() const;
  std::vector<int> experts_held_by(int rank) const override;
  double exchange_wait_s() const override { return run_stats_.wait_s(); }
  size_t replicated_size() const override { return moe_options_.expert_ranks > 1 ? dense_size_ : num_params(); }
  /// The Mixture-of-Experts MLP of block `layer`, or null for a dense block.
  const MoeMlp* moe_layer(int layer) const { return moe_[static_cast<size_t>(layer)].get(); }

  /// Forward only over `batch` windows of context + 1 tokens; leaves the
  /// logits [batch * context, vocab] in logits() and returns the summed loss.
  double forward(const int32_t* tokens, int batch, int64_t* correct = nullptr);
  const float* logits() const { return logits_.data(); }

  /// Logits [vocab] of the token after `tokens` (count in 1..context), for sampling.
  std::span<const float> next_token_logits(std::span<const int32_t> tokens);

 private:
  /// Indices into params_ of one block's tensors, in Hugging Face's order
  /// (a MoE block: the first eight, then its router in kFcW's place).
  enum Tensor : int {
    kLn1W,
    kLn1B,
    kAttnW,
    kAttnB,
    kAttnProjW,
    kAttnProjB,
    kLn2W,
    kLn2B,
    kFcW,
    kFcB,
    kFcProjW,
    kFcProjB,
    kPerBlock,
    kRouter = kFcW
  };
  float* param(int index) { return parameters_.data() + params_[static_cast<size_t>(index)].offset; }
  float* grad(int index) { return gradients_.data() + params_[static_cast<size_t>(index)].offset; }
  int block_tensor(int layer, Tensor t) const { return block_first_[static_cast<size_t>(layer)] + t; }
  int ln_f() const { return ln_f_; }
  /// A MoE block's experts' tensors in the parameters (or, `grads`, the gradients).
  std::vector<ExpertTensors> expert_tensors(int layer, bool grads);
  void ensure_workspace(int batch);
  /// Runs the model over `rows` = batch x `t` positions (t <= context) into logits_.
  void forward_rows(const int32_t* tokens, int batch, int t, int stride);
  /// Async dispatch's figures beside the layers' (the deadline, skipped work, lost experts).
  void add_exchange_figures(nlohmann::ordered_json& j) const;

  GptSpec spec_;
  MoeOptions moe_options_;
  std::vector<int> block_first_;   ///< [layer]: index of its ln_1.weight
  std::vector<int> expert_first_;  ///< [layer]: index of its expert 0's c_fc.weight (-1: dense block)
  std::vector<int> mlp_slot_;      ///< [layer]: its slot in fc_ and gelu_ (-1: a MoE block)
  int ln_f_ = 0;
  size_t dense_size_ = 0;
  std::vector<std::unique_ptr<MoeMlp>> moe_;  ///< [layer]; null for a dense block
  std::unique_ptr<ExpertExchange> exchange_;  ///< --dispatch async
  MoeStats window_stats_, run_stats_;
  int workspace_batch_ = 0;
  // Activations, each [batch * context, width] unless noted; per layer where backward needs them.
  tensor::FloatBuffer residual_;   ///< [layers + 1] x the stream entering each block (and leaving the last)
  tensor::FloatBuffer residual2_;  ///< [layers] x the stream after attention
  tensor::FloatBuffer ln1_, ln1_stats_, ln2_, ln2_stats_;  ///< [layers] x normalised [.., C]; mean, rstd [.., 2]
  tensor::FloatBuffer qkv_;                                ///< [layers] x [.., 3C]
  tensor::FloatBuffer probs_;                              ///< [layers] x [batch, heads, T, T] attention weights
  tensor::FloatBuffer attn_;                               ///< [layers] x heads' outputs before c_proj [.., C]
  tensor::FloatBuffer fc_, gelu_;                          ///< [dense layers] x [.., 4C]
  tensor::FloatBuffer lnf_, lnf_stats_;
  tensor::FloatBuffer logits_;  ///< [.., V]; its gradient in place
  // Backward scratch, one layer's worth.
  tensor::FloatBuffer d_stream_, d_norm_, d_attn_, d_qkv_, d_wide_, d_scores_;
  std::vector<int32_t> targets_;
};

/// GPT-2's layers, exposed for their gradient checks. Rows are positions,
/// matrices Conv1D layout. Backward functions add into weight and input
/// gradients (`+=`), except where they say they overwrite.
namespace gpt {

/// y = (x - mean) * rstd * w + b over rows of `c`; stats [n, 2] receives mean and rstd.
void layernorm_forward(float* y, float* stats, const float* x, const float* w, const float* b, int n, int c);
/// `dx_sums` (may be null) += the column sums of dx after the update: the
/// bias gradient of the projection that wrote x's residual, in the same pass.
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* stats, int n, int c, float* dx_sums = nullptr);
/// y = x + bias over rows of `c` (x null: y = bias), for a product then added with beta 1.
void add_rows(float* y, const float* x, const float* bias, int n, int c);
/// y = x W + bias for x [n, in], W [in, out] (bias may be null).
void linear_forward(float* y, const float* x, const float* w, const float* bias, int n, int in, int out);
/// dx (overwritten; may be null) = dy W^T, dW += x^T dy, dbias += column sums of dy.
void linear_backward(float* dx, float* dw, float* dbias, const float* dy, const float* x, const float* w, int n, int in,
                     int out);
/// GELU, tanh form (GPT-2's "gelu_new").
void gelu_forward(float* y, const float* x, size_t n);
/// dx = dy * gelu'(x) (overwritten).
void gelu_backward(float* dx, const float* dy, const float* x, size_t n);
/// The same over n rows of `c`, each row's dx also added to `dbias` (the bias gradient of x's linear).
void gelu_backward(float* dx, float* dbias, const float* dy, const float* x, int n, int c);
/// Cross-entropy of `logits` [rows, vocab] against `targets`, in float with a
/// vectorised exp (the training step's; evaluation keeps the double-precision
/// softmax_cross_entropy): returns the summed loss, leaves d(loss * scale) / d
/// logits in place of the logits.
double cross_entropy_backward(float* logits, const int32_t* targets, int rows, int vocab, float scale);
/// Causal self-attention of qkv [batch * t, 3C] (q, k, v side by side, heads
/// of C/H within each) into out [batch * t, C]; probs [batch, heads, t, t]
/// keeps the weights (the masked upper triangle is left unwritten).
void attention_forward(float* out, float* probs, const float* qkv, int batch, int t, int c, int heads);
/// dqkv (overwritten) from dout; `scratch` holds kAttentionBlock x t floats.
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* probs, int batch,
                        int t, int c, int heads);
/// Query rows per blocked step of attention: a block's scores stay in cache
/// between the softmax and the product with V, and keys after its last row are skipped.
inline constexpr int kAttentionBlock = 32;

}  // namespace gpt

}  // namespace cfmo::model
