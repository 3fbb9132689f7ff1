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
/// half, so the work it does is less than this count.

#include "core/error.h"
#include "model/model.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo {

struct GptSpec {
  int layers = 2;
  int heads = 4;
  int dim = 128;
  int context = 64;
  int vocab = 256;

  /// "gpt:layers=L,heads=H,dim=C,context=T"; the vocabulary comes from the data.
  static Result<GptSpec> parse(std::string_view text, int vocab);
  std::string to_string() const;
  int head_dim() const { return dim / heads; }
};

class Gpt final : public Model {
 public:
  explicit Gpt(GptSpec spec);

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
  double flops_per_example() const override;
  /// GPT2Config: the run directory then loads with GPT2LMHeadModel.from_pretrained.
  std::string hf_config_json() const override;
  std::string flops_formula() const override { return "T (6 (12 L C^2 + V C) + 12 L T C), attention as if unmasked"; }

  /// Forward only over `batch` windows of context + 1 tokens; leaves the
  /// logits [batch * context, vocab] in logits() and returns the summed loss.
  double forward(const int32_t* tokens, int batch, int64_t* correct = nullptr);
  const float* logits() const { return logits_.data(); }

  /// Logits [vocab] of the token after `tokens` (count in 1..context), for sampling.
  std::span<const float> next_token_logits(std::span<const int32_t> tokens);

 private:
  /// Indices into params_ of one block's tensors, in Hugging Face's order.
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
    kPerBlock
  };
  float* param(int index) { return parameters_.data() + params_[static_cast<size_t>(index)].offset; }
  float* grad(int index) { return gradients_.data() + params_[static_cast<size_t>(index)].offset; }
  static int block_tensor(int layer, Tensor t) { return 2 + layer * kPerBlock + t; }
  int ln_f() const { return 2 + spec_.layers * kPerBlock; }
  void ensure_workspace(int batch);
  /// Runs the model over `rows` = batch x `t` positions (t <= context) into logits_.
  void forward_rows(const int32_t* tokens, int batch, int t, int stride);

  GptSpec spec_;
  int workspace_batch_ = 0;
  // Activations, each [batch * context, width] unless noted; per layer where backward needs them.
  FloatBuffer residual_;   ///< [layers + 1] x the stream entering each block (and leaving the last)
  FloatBuffer residual2_;  ///< [layers] x the stream after attention
  FloatBuffer ln1_, ln1_stats_, ln2_, ln2_stats_;  ///< [layers] x normalised [.., C]; mean, rstd [.., 2]
  FloatBuffer qkv_;                                ///< [layers] x [.., 3C]
  FloatBuffer probs_;                              ///< [layers] x [batch, heads, T, T] attention weights
  FloatBuffer attn_;                               ///< [layers] x heads' outputs before c_proj [.., C]
  FloatBuffer fc_, gelu_;                          ///< [layers] x [.., 4C]
  FloatBuffer lnf_, lnf_stats_;
  FloatBuffer logits_;  ///< [.., V]; its gradient in place
  // Backward scratch, one layer's worth.
  FloatBuffer d_stream_, d_norm_, d_attn_, d_qkv_, d_wide_, d_scores_;
  std::vector<int32_t> targets_;
};

/// GPT-2's layers, exposed for their gradient checks. Rows are positions,
/// matrices Conv1D layout. Backward functions add into weight and input
/// gradients (`+=`), except where they say they overwrite.
namespace gpt {

/// y = (x - mean) * rstd * w + b over rows of `c`; stats [n, 2] receives mean and rstd.
void layernorm_forward(float* y, float* stats, const float* x, const float* w, const float* b, int n, int c);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* stats, int n, int c);
/// y = x W + bias for x [n, in], W [in, out] (bias may be null).
void linear_forward(float* y, const float* x, const float* w, const float* bias, int n, int in, int out);
/// dx (overwritten; may be null) = dy W^T, dW += x^T dy, dbias += column sums of dy.
void linear_backward(float* dx, float* dw, float* dbias, const float* dy, const float* x, const float* w, int n, int in,
                     int out);
/// GELU, tanh form (GPT-2's "gelu_new").
void gelu_forward(float* y, const float* x, size_t n);
/// dx = dy * gelu'(x) (overwritten).
void gelu_backward(float* dx, const float* dy, const float* x, size_t n);
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

}  // namespace cfmo
