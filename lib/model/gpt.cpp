#include "model/gpt.h"

#include "core/rng.h"
#include "core/simd.h"
#include "tensor/ops.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>

namespace cfmo::model {

using tensor::ops::Trans;

Result<GptSpec> GptSpec::parse(std::string_view text, int vocab) {
  constexpr std::string_view kPrefix = "gpt:";
  auto bad = [&](std::string_view why) {
    return make_error(ErrorKind::kUsage, "--model '{}': {} (expected e.g. gpt:layers=2,heads=4,dim=128,context=64)",
                      text, why);
  };
  if (!text.starts_with(kPrefix)) return bad("unknown model");
  GptSpec spec;
  spec.vocab = vocab;
  struct Field {
    std::string_view key;
    int* value;
    int max;
    bool required = true;
    bool seen = false;
  };
  Field fields[] = {{"layers", &spec.layers, 256},
                    {"heads", &spec.heads, 1024},
                    {"dim", &spec.dim, 65536},
                    {"context", &spec.context, 1 << 20},
                    {"experts", &spec.experts, 1024, false},
                    {"top_k", &spec.top_k, 1024, false},
                    {"expert_dim", &spec.expert_dim, 1 << 20, false},
                    {"moe_every", &spec.moe_every, 256, false}};
  std::string_view rest = text.substr(kPrefix.size());
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) return bad(fmt::format("'{}' is not KEY=VALUE", item));
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = item.substr(eq + 1);
    auto field = std::find_if(std::begin(fields), std::end(fields), [&](const Field& f) { return f.key == key; });
    if (field == std::end(fields)) return bad(fmt::format("unknown key '{}'", key));
    if (field->seen) return bad(fmt::format("'{}' given twice", key));
    int n = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (ec != std::errc() || end != value.data() + value.size() || n <= 0 || n > field->max) {
      return bad(fmt::format("{} must be an integer in 1..{}", key, field->max));
    }
    *field->value = n;
    field->seen = true;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) return bad("trailing comma");
  }
  for (const Field& f : fields) {
    if (f.required && !f.seen) return bad(fmt::format("'{}' is missing", f.key));
  }
  if (spec.dim % spec.heads != 0) return bad(fmt::format("dim {} is not a multiple of heads {}", spec.dim, spec.heads));
  if (spec.experts == 0) {
    for (const Field& f : fields) {
      if (!f.required && f.seen) return bad(fmt::format("'{}' needs experts=E", f.key));
    }
  } else {
    if (spec.top_k > spec.experts) {
      return bad(fmt::format("top_k {} is more than experts {}", spec.top_k, spec.experts));
    }
    if (spec.moe_every > spec.layers) {
      return bad(
          fmt::format("moe_every {} is more than layers {}: no block would have experts", spec.moe_every, spec.layers));
    }
    if (spec.expert_dim == 0) spec.expert_dim = 4 * spec.dim;
  }
  if (vocab <= 0) return bad("the data has no vocabulary");
  return spec;
}

std::string GptSpec::to_string() const {
  std::string text = fmt::format("gpt:layers={},heads={},dim={},context={}", layers, heads, dim, context);
  if (experts > 0) {
    text += fmt::format(",experts={},top_k={},expert_dim={},moe_every={}", experts, top_k, expert_dim, moe_every);
  }
  return text;
}

Gpt::Gpt(GptSpec spec, MoeOptions moe) : spec_(spec), moe_options_(moe) {
  const int64_t c = spec_.dim;
  const int64_t d = spec_.expert_dim;
  std::vector<ParamInfo> layout;
  LayoutBuilder b;
  // GPT-2 practice: weight decay on the matrices only.
  b.add(layout, "wte.weight", {spec_.vocab, c}, ParamKind::kEmbedding, false);
  b.add(layout, "wpe.weight", {spec_.context, c}, ParamKind::kEmbedding, false);
  const auto layers = static_cast<size_t>(spec_.layers);
  block_first_.resize(layers);
  expert_first_.assign(layers, -1);
  mlp_slot_.assign(layers, -1);
  moe_.resize(layers);
  int dense_mlps = 0;
  for (int l = 0; l < spec_.layers; ++l) {
    const std::string h = fmt::format("h.{}.", l);
    block_first_[static_cast<size_t>(l)] = static_cast<int>(layout.size());
    b.add(layout, h + "ln_1.weight", {c}, ParamKind::kNorm, false);
    b.add(layout, h + "ln_1.bias", {c}, ParamKind::kNorm, false);
    b.add(layout, h + "attn.c_attn.weight", {c, 3 * c}, ParamKind::kMatrix, true);
    b.add(layout, h + "attn.c_attn.bias", {3 * c}, ParamKind::kBias, false);
    b.add(layout, h + "attn.c_proj.weight", {c, c}, ParamKind::kMatrix, true);
    b.add(layout, h + "attn.c_proj.bias", {c}, ParamKind::kBias, false);
    b.add(layout, h + "ln_2.weight", {c}, ParamKind::kNorm, false);
    b.add(layout, h + "ln_2.bias", {c}, ParamKind::kNorm, false);
    if (spec_.is_moe_layer(l)) {
      b.add(layout, h + "mlp.router.weight", {c, spec_.experts}, ParamKind::kMatrix, true);
      moe_[static_cast<size_t>(l)] =
          std::make_unique<MoeMlp>(spec_.dim, spec_.experts, spec_.top_k, spec_.expert_dim, moe_options_);
      continue;
    }
    mlp_slot_[static_cast<size_t>(l)] = dense_mlps++;
    b.add(layout, h + "mlp.c_fc.weight", {c, 4 * c}, ParamKind::kMatrix, true);
    b.add(layout, h + "mlp.c_fc.bias", {4 * c}, ParamKind::kBias, false);
    b.add(layout, h + "mlp.c_proj.weight", {4 * c, c}, ParamKind::kMatrix, true);
    b.add(layout, h + "mlp.c_proj.bias", {c}, ParamKind::kBias, false);
  }
  ln_f_ = static_cast<int>(layout.size());
  b.add(layout, "ln_f.weight", {c}, ParamKind::kNorm, false);
  b.add(layout, "ln_f.bias", {c}, ParamKind::kNorm, false);
  dense_size_ = b.size();
  // The experts last, by block and expert: the prefix before them is what every rank replicates.
  for (int l = 0; l < spec_.layers; ++l) {
    if (!spec_.is_moe_layer(l)) continue;
    expert_first_[static_cast<size_t>(l)] = static_cast<int>(layout.size());
    for (int i = 0; i < local_experts(); ++i) {
      const int e = expert_placement().expert(moe_options_.expert_rank, i);
      const std::string x = fmt::format("h.{}.mlp.experts.{}.", l, e);
      b.add(layout, x + "c_fc.weight", {c, d}, ParamKind::kMatrix, true);
      b.add(layout, x + "c_fc.bias", {d}, ParamKind::kBias, false);
      b.add(layout, x + "c_proj.weight", {d, c}, ParamKind::kMatrix, true);
      b.add(layout, x + "c_proj.bias", {c}, ParamKind::kBias, false);
    }
  }
  set_layout(std::move(layout), b.size());
}

moe::ExpertPlacement Gpt::expert_placement() const {
  return moe::ExpertPlacement{spec_.experts, moe_options_.expert_ranks, /*strided=*/true};
}

int Gpt::local_experts() const { return expert_placement().count(moe_options_.expert_rank); }

void Gpt::set_expert_parallel(comm::Communicator* comm) {
  exchange_.reset();
  if (comm != nullptr && moe_options_.async_dispatch && moe_options_.expert_ranks > 1) {
    std::vector<int> moe_layers;
    for (int l = 0; l < spec_.layers; ++l) {
      if (spec_.is_moe_layer(l)) moe_layers.push_back(l);
    }
    exchange_ = std::make_unique<ExpertExchange>(
        *comm, expert_placement(), spec_.layers, std::move(moe_layers), spec_.dim, spec_.expert_dim,
        moe_options_.dispatch_deadline_s, moe_options_.serve_slowdown,
        [this](int layer, bool grads) { return expert_tensors(layer, grads); });
  }
  for (int l = 0; l < spec_.layers; ++l) {
    if (auto& layer = moe_[static_cast<size_t>(l)]) layer->set_expert_parallel(comm, exchange_.get(), l);
  }
}

Status Gpt::finish_exchanges() { return exchange_ ? exchange_->finish() : Status{}; }

std::vector<int> Gpt::experts_held_by(int rank) const {
  std::vector<int> out;
  if (moe_options_.expert_ranks <= 1) return out;
  const moe::ExpertPlacement placement = expert_placement();
  for (int e = 0; e < spec_.experts; ++e) {
    if (placement.owner(e) == rank) out.push_back(e);
  }
  return out;
}

std::vector<int> Gpt::lost_experts() const {
  std::vector<int> out;
  if (!exchange_) return out;
  for (const int r : exchange_->lost_ranks()) {
    const auto held = experts_held_by(r);
    out.insert(out.end(), held.begin(), held.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Gpt::add_exchange_figures(nlohmann::ordered_json& j) const {
  if (!exchange_ || !j.is_object() || !j.contains("dispatch")) return;
  auto& d = j["dispatch"];
  d["deadline_us"] = exchange_->deadline_s() == ExpertExchange::kNoDeadline
                         ? nlohmann::ordered_json(nullptr)
                         : nlohmann::ordered_json(exchange_->deadline_s() * 1e6);
  d["skipped_chunks"] = exchange_->skipped_chunks();
  d["skipped_grads"] = exchange_->skipped_grads();
  d["lost_experts"] = lost_experts();
}

Status Gpt::take_status() {
  Status first;
  for (auto& layer : moe_) {
    if (!layer) continue;
    Status s = layer->take_status();
    if (first && !s) first = std::move(s);
  }
  return first;
}

std::vector<ExpertTensors> Gpt::expert_tensors(int layer, bool grads) {
  std::vector<ExpertTensors> out(static_cast<size_t>(local_experts()));
  const int first = expert_first_[static_cast<size_t>(layer)];
  for (int e = 0; e < local_experts(); ++e) {
    auto at = [&](int i) { return grads ? grad(first + 4 * e + i) : param(first + 4 * e + i); };
    out[static_cast<size_t>(e)] = {at(0), at(1), at(2), at(3)};
  }
  return out;
}

void Gpt::init(uint64_t seed) {
  Rng rng(seed, /*stream=*/0x6e7);
  std::fill(parameters_.begin(), parameters_.end(), 0.0f);
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(spec_.layers));
  for (const ParamInfo& p : params_) {
    if (p.offset >= dense_size_) break;  // the experts below, in every rank's order
    float* w = parameters_.data() + p.offset;
    if (p.kind == ParamKind::kNorm) {
      if (p.name.ends_with(".weight")) std::fill(w, w + p.size, 1.0f);
      continue;
    }
    if (p.kind == ParamKind::kBias) continue;
    const float std = p.name.ends_with("c_proj.weight") ? proj_std : 0.02f;
    for (size_t i = 0; i < p.size; ++i) w[i] = std * rng.normal();
  }
  // The experts in the order of the model that holds them all (by block, then
  // expert), drawing those held elsewhere too: an expert's initial weights are
  // the same whichever rank holds it.
  const moe::ExpertPlacement placement = expert_placement();
  const auto c = static_cast<size_t>(spec_.dim);
  const auto d = static_cast<size_t>(spec_.expert_dim);
  for (int l = 0; l < spec_.layers; ++l) {
    if (!spec_.is_moe_layer(l)) continue;
    const int first = expert_first_[static_cast<size_t>(l)];
    for (int e = 0; e < spec_.experts; ++e) {
      const bool here = placement.owner(e) == moe_options_.expert_rank;
      const int i = placement.local_index(e);
      float* fc = here ? param(first + 4 * i) : nullptr;
      float* proj = here ? param(first + 4 * i + 2) : nullptr;
      for (size_t k = 0; k < c * d; ++k) {
        const float v = 0.02f * rng.normal();
        if (here) fc[k] = v;
      }
      for (size_t k = 0; k < d * c; ++k) {
        const float v = proj_std * rng.normal();
        if (here) proj[k] = v;
      }
    }
  }
}

double Gpt::flops_per_example() const {
  const double c = spec_.dim;
  const double l = spec_.layers;
  const double t = spec_.context;
  const double moe = spec_.moe_layers();
  const double mlp = (l - moe) * 8.0 * c * c +
                     moe * (c * spec_.experts + 2.0 * spec_.top_k * c * static_cast<double>(spec_.expert_dim));
  const double matmul_weights = 4.0 * l * c * c + mlp + static_cast<double>(spec_.vocab) * c;
  return t * (6.0 * matmul_weights + 12.0 * l * t * c);
}

std::string Gpt::flops_formula() const {
  if (!spec_.is_moe()) return "T (6 (12 L C^2 + V C) + 12 L T C), attention as if unmasked";
  return "T (6 (4 L C^2 + 8 L_dense C^2 + L_moe (C E + 2 K C D) + V C) + 12 L T C), active weights, attention as if "
         "unmasked";
}

nlohmann::ordered_json Gpt::take_metrics() {
  nlohmann::ordered_json j = window_stats_.to_json();
  window_stats_ = MoeStats{};
  add_exchange_figures(j);
  return j;
}

nlohmann::ordered_json Gpt::run_metrics() const {
  nlohmann::ordered_json j = run_stats_.to_json();
  add_exchange_figures(j);
  return j;
}

std::string Gpt::hf_config_json() const {
  if (spec_.is_moe()) return {};  // GPT2LMHeadModel has no experts
  // Dropout 0: the model trained without it. GPT-2's <|endoftext|> is its last token.
  const nlohmann::ordered_json config = {{"model_type", "gpt2"},
                                         {"architectures", {"GPT2LMHeadModel"}},
                                         {"n_layer", spec_.layers},
                                         {"n_head", spec_.heads},
                                         {"n_embd", spec_.dim},
                                         {"n_positions", spec_.context},
                                         {"n_ctx", spec_.context},
                                         {"vocab_size", spec_.vocab},
                                         {"layer_norm_epsilon", 1e-5},
                                         {"activation_function", "gelu_new"},
                                         {"tie_word_embeddings", true},
                                         {"resid_pdrop", 0.0},
                                         {"embd_pdrop", 0.0},
                                         {"attn_pdrop", 0.0},
                                         {"bos_token_id", spec_.vocab - 1},
                                         {"eos_token_id", spec_.vocab - 1},
                                         {"torch_dtype", "float32"}};
  return config.dump(2) + "\n";
}

size_t Gpt::workspace_floats(int batch) const {
  // What ensure_workspace allocates, buffer by buffer, and the MoE layers' own.
  const auto n = static_cast<size_t>(batch) * static_cast<size_t>(spec_.context);
  const auto c = static_cast<size_t>(spec_.dim);
  const auto layers = static_cast<size_t>(spec_.layers);
  const auto dense = layers - static_cast<size_t>(spec_.moe_layers());
  const auto t = static_cast<size_t>(spec_.context);
  const size_t per_layer = n * c * 8 + n * 4 + static_cast<size_t>(batch) * static_cast<size_t>(spec_.heads) * t * t;
  size_t moe = 0;
  for (const auto& layer : moe_) {
    if (layer) moe += layer->workspace_floats(static_cast<int>(n));
  }
  return layers * per_layer + dense * n * c * 8 + n * c * 11 + n * 3 + n * static_cast<size_t>(spec_.vocab) +
         static_cast<size_t>(gpt::kAttentionBlock) * t + moe;
}

void Gpt::prepare(int batch) {
  ensure_workspace(batch);  // zero-filled: touched
  size_t rows_per_peer = 0;
  for (const auto& layer : moe_) {
    if (!layer) continue;
    layer->prepare(batch * spec_.context);
    rows_per_peer = std::max(rows_per_peer, layer->rows_to(local_experts(), batch * spec_.context));
  }
  if (exchange_) exchange_->prepare(rows_per_peer);
}

void Gpt::ensure_workspace(int batch) {
  if (batch <= workspace_batch_) return;
  workspace_batch_ = batch;
  const auto n = static_cast<size_t>(batch) * static_cast<size_t>(spec_.context);
  const auto c = static_cast<size_t>(spec_.dim);
  const auto layers = static_cast<size_t>(spec_.layers);
  const auto dense = layers - static_cast<size_t>(spec_.moe_layers());
  const auto t = static_cast<size_t>(spec_.context);
  residual_.resize((layers + 1) * n * c);
  residual2_.resize(layers * n * c);
  ln1_.resize(layers * n * c);
  ln2_.resize(layers * n * c);
  ln1_stats_.resize(layers * n * 2);
  ln2_stats_.resize(layers * n * 2);
  qkv_.resize(layers * n * 3 * c);
  probs_.resize(layers * static_cast<size_t>(batch) * static_cast<size_t>(spec_.heads) * t * t);
  attn_.resize(layers * n * c);
  fc_.resize(dense * n * 4 * c);
  gelu_.resize(dense * n * 4 * c);
  lnf_.resize(n * c);
  lnf_stats_.resize(n * 2);
  logits_.resize(n * static_cast<size_t>(spec_.vocab));
  d_stream_.resize(n * c);
  d_norm_.resize(n * c);
  d_attn_.resize(n * c);
  d_qkv_.resize(n * 3 * c);
  d_wide_.resize(n * 4 * c);
  d_scores_.resize(static_cast<size_t>(gpt::kAttentionBlock) * t);
  targets_.resize(n);
}

void Gpt::forward_rows(const int32_t* tokens, int batch, int t, int stride) {
  ensure_workspace(batch);
  const int c = spec_.dim;
  const int rows = batch * t;
  const auto n = static_cast<size_t>(workspace_batch_) * static_cast<size_t>(spec_.context);  // a layer's slot
  const auto uc = static_cast<size_t>(c);
  const float* wte = param(0);
  const float* wpe = param(1);
  float* x = residual_.data();
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < t; ++i) {
      const int32_t token = tokens[static_cast<size_t>(b) * static_cast<size_t>(stride) + static_cast<size_t>(i)];
      const float* te = wte + static_cast<size_t>(token) * uc;
      const float* pe = wpe + static_cast<size_t>(i) * uc;
      float* out = x + (static_cast<size_t>(b) * static_cast<size_t>(t) + static_cast<size_t>(i)) * uc;
      for (int j = 0; j < c; ++j) out[j] = te[j] + pe[j];
    }
  }
  const size_t probs_slot = static_cast<size_t>(workspace_batch_) * static_cast<size_t>(spec_.heads) *
                            static_cast<size_t>(spec_.context) * static_cast<size_t>(spec_.context);
  for (int l = 0; l < spec_.layers; ++l) {
    const auto ul = static_cast<size_t>(l);
    const float* in = residual_.data() + ul * n * uc;
    float* ln1 = ln1_.data() + ul * n * uc;
    float* qkv = qkv_.data() + ul * n * 3 * uc;
    float* attn = attn_.data() + ul * n * uc;
    float* mid = residual2_.data() + ul * n * uc;
    float* ln2 = ln2_.data() + ul * n * uc;
    float* out = residual_.data() + (ul + 1) * n * uc;
    gpt::layernorm_forward(ln1, ln1_stats_.data() + ul * n * 2, in, param(block_tensor(l, kLn1W)),
                           param(block_tensor(l, kLn1B)), rows, c);
    gpt::linear_forward(qkv, ln1, param(block_tensor(l, kAttnW)), param(block_tensor(l, kAttnB)), rows, c, 3 * c);
    gpt::attention_forward(attn, probs_.data() + ul * probs_slot, qkv, batch, t, c, spec_.heads);
    // mid = (in + b) + attn c_proj: the residual and bias in one pass, the product added by a GEMM with beta 1.
    gpt::add_rows(mid, in, param(block_tensor(l, kAttnProjB)), rows, c);
    tensor::ops::gemm(Trans::kNo, Trans::kNo, rows, c, c, 1.0f, attn, c, param(block_tensor(l, kAttnProjW)), c, 1.0f,
                      mid, c);
    gpt::layernorm_forward(ln2, ln2_stats_.data() + ul * n * 2, mid, param(block_tensor(l, kLn2W)),
                           param(block_tensor(l, kLn2B)), rows, c);
    if (MoeMlp* moe = moe_[ul].get()) {
      moe->forward(ln2, mid, rows, param(block_tensor(l, kRouter)), expert_tensors(l, false), out);
      continue;
    }
    const auto slot = static_cast<size_t>(mlp_slot_[ul]);
    float* fc = fc_.data() + slot * n * 4 * uc;
    float* gelu = gelu_.data() + slot * n * 4 * uc;
    gpt::linear_forward(fc, ln2, param(block_tensor(l, kFcW)), param(block_tensor(l, kFcB)), rows, c, 4 * c);
    gpt::gelu_forward(gelu, fc, static_cast<size_t>(rows) * 4 * uc);
    gpt::add_rows(out, mid, param(block_tensor(l, kFcProjB)), rows, c);
    tensor::ops::gemm(Trans::kNo, Trans::kNo, rows, c, 4 * c, 1.0f, gelu, 4 * c, param(block_tensor(l, kFcProjW)), c,
                      1.0f, out, c);
  }
  const float* last = residual_.data() + static_cast<size_t>(spec_.layers) * n * uc;
  gpt::layernorm_forward(lnf_.data(), lnf_stats_.data(), last, param(ln_f()), param(ln_f() + 1), rows, c);
  // Tied head: logits = ln_f(x) wte^T.
  tensor::ops::gemm(Trans::kNo, Trans::kYes, rows, spec_.vocab, c, 1.0f, lnf_.data(), c, wte, c, 0.0f, logits_.data(),
                    spec_.vocab);
}

double Gpt::forward(const int32_t* tokens, int batch, int64_t* correct) {
  const int t = spec_.context;
  if (exchange_) exchange_->begin_pass(/*training=*/false);
  forward_rows(tokens, batch, t, t + 1);
  if (exchange_) exchange_->end_pass();
  for (int b = 0; b < batch; ++b) {
    const int32_t* window = tokens + static_cast<size_t>(b) * static_cast<size_t>(t + 1);
    std::copy(window + 1, window + 1 + t, targets_.begin() + static_cast<ptrdiff_t>(b) * t);
  }
  return softmax_cross_entropy(logits_.data(), targets_.data(), batch * t, spec_.vocab, nullptr, 0.0f, correct);
}

EvalResult Gpt::evaluate(const Examples& batch) {
  EvalResult r;
  r.loss_sum = forward(batch.tokens, batch.count, &r.correct);
  r.count = static_cast<int64_t>(batch.count) * spec_.context;
  return r;
}

std::span<const float> Gpt::next_token_logits(std::span<const int32_t> tokens) {
  const int t = static_cast<int>(tokens.size());
  forward_rows(tokens.data(), 1, t, t);
  return {logits_.data() + static_cast<size_t>(t - 1) * static_cast<size_t>(spec_.vocab),
          static_cast<size_t>(spec_.vocab)};
}

float Gpt::forward_backward(const Examples& batch) {
  const int t = spec_.context;
  const int c = spec_.dim;
  const int rows = batch.count * t;
  const auto uc = static_cast<size_t>(c);
  const auto urows = static_cast<size_t>(rows);
  if (exchange_) exchange_->begin_pass(/*training=*/true);
  forward_rows(batch.tokens, batch.count, t, t + 1);
  for (int b = 0; b < batch.count; ++b) {
    const int32_t* window = batch.tokens + static_cast<size_t>(b) * static_cast<size_t>(t + 1);
    std::copy(window + 1, window + 1 + t, targets_.begin() + static_cast<ptrdiff_t>(b) * t);
  }
  const double loss =
      gpt::cross_entropy_backward(logits_.data(), targets_.data(), rows, spec_.vocab, 1.0f / static_cast<float>(rows));
  // The auxiliary losses: each the mean over the MoE layers, times its coefficient.
  const int moe_layers = spec_.moe_layers();
  const float aux_weight = moe_layers > 0 ? static_cast<float>(moe_options_.aux_loss / moe_layers) : 0.0f;
  const float z_weight = moe_layers > 0 ? static_cast<float>(moe_options_.z_loss / moe_layers) : 0.0f;
  double aux = 0;
  if (moe_layers > 0) {
    std::vector<const MoeMlp*> layers;
    std::vector<int> index;
    for (int l = 0; l < spec_.layers; ++l) {
      if (const MoeMlp* moe = moe_[static_cast<size_t>(l)].get()) {
        aux += aux_weight * moe->aux_loss() + z_weight * moe->z_loss();
        layers.push_back(moe);
        index.push_back(l);
      }
    }
    window_stats_.add(layers, index);
    run_stats_.add(layers, index);
  }
  std::fill(gradients_.begin(), gradients_.end(), 0.0f);
  const auto n = static_cast<size_t>(workspace_batch_) * static_cast<size_t>(spec_.context);
  const size_t probs_slot = static_cast<size_t>(workspace_batch_) * static_cast<size_t>(spec_.heads) *
                            static_cast<size_t>(t) * static_cast<size_t>(t);
  const float* dlogits = logits_.data();
  // Head: d ln_f = dlogits wte; d wte += dlogits^T ln_f.
  tensor::ops::gemm(Trans::kNo, Trans::kNo, rows, c, spec_.vocab, 1.0f, dlogits, spec_.vocab, param(0), c, 0.0f,
                    d_norm_.data(), c);
  tensor::ops::gemm(Trans::kYes, Trans::kNo, spec_.vocab, c, rows, 1.0f, dlogits, spec_.vocab, lnf_.data(), c, 1.0f,
                    grad(0), c);
  float* dx = d_stream_.data();  // d loss / d the residual stream, walking down
  std::fill(dx, dx + urows * uc, 0.0f);
  // The bias gradient of the dense MLP's c_proj whose output is the stream
  // below a LayerNorm: its backward sums dx's columns in the same pass.
  auto mlp_proj_bias_grad = [&](int layer) {
    return layer >= 0 && mlp_slot_[static_cast<size_t>(layer)] >= 0 ? grad(block_tensor(layer, kFcProjB)) : nullptr;
  };
  gpt::layernorm_backward(dx, grad(ln_f()), grad(ln_f() + 1), d_norm_.data(),
                          residual_.data() + static_cast<size_t>(spec_.layers) * n * uc, param(ln_f()),
                          lnf_stats_.data(), rows, c, mlp_proj_bias_grad(spec_.layers - 1));
  for (int l = spec_.layers - 1; l >= 0; --l) {
    const auto ul = static_cast<size_t>(l);
    const float* in = residual_.data() + ul * n * uc;
    const float* ln1 = ln1_.data() + ul * n * uc;
    const float* qkv = qkv_.data() + ul * n * 3 * uc;
    const float* attn = attn_.data() + ul * n * uc;
    const float* mid = residual2_.data() + ul * n * uc;
    const float* ln2 = ln2_.data() + ul * n * uc;
    // MLP: out = mid + gelu(ln2(mid) W_fc + b) W_proj + b; dx is d out and becomes d mid.
    if (MoeMlp* moe = moe_[ul].get()) {
      std::fill(d_norm_.begin(), d_norm_.begin() + static_cast<ptrdiff_t>(urows * uc), 0.0f);
      moe->backward(dx, ln2, param(block_tensor(l, kRouter)), grad(block_tensor(l, kRouter)), expert_tensors(l, false),
                    expert_tensors(l, true), d_norm_.data(), aux_weight, z_weight);
    } else {
      const auto slot = static_cast<size_t>(mlp_slot_[ul]);
      const float* fc = fc_.data() + slot * n * 4 * uc;
      const float* gelu = gelu_.data() + slot * n * 4 * uc;
      // c_proj's bias gradient came with the LayerNorm backward above; c_fc's comes with GELU's.
      gpt::linear_backward(d_wide_.data(), grad(block_tensor(l, kFcProjW)), nullptr, dx, gelu,
                           param(block_tensor(l, kFcProjW)), rows, 4 * c, c);
      gpt::gelu_backward(d_wide_.data(), grad(block_tensor(l, kFcB)), d_wide_.data(), fc, rows, 4 * c);
      gpt::linear_backward(d_norm_.data(), grad(block_tensor(l, kFcW)), nullptr, d_wide_.data(), ln2,
                           param(block_tensor(l, kFcW)), rows, c, 4 * c);
    }
    gpt::layernorm_backward(dx, grad(block_tensor(l, kLn2W)), grad(block_tensor(l, kLn2B)), d_norm_.data(), mid,
                            param(block_tensor(l, kLn2W)), ln2_stats_.data() + ul * n * 2, rows, c,
                            grad(block_tensor(l, kAttnProjB)));
    // Attention: mid = in + attn(ln1(in)) W_proj + b; dx becomes d in (d mid's column sums are b's gradient).
    gpt::linear_backward(d_attn_.data(), grad(block_tensor(l, kAttnProjW)), nullptr, dx, attn,
                         param(block_tensor(l, kAttnProjW)), rows, c, c);
    gpt::attention_backward(d_qkv_.data(), d_scores_.data(), d_attn_.data(), qkv, probs_.data() + ul * probs_slot,
                            batch.count, t, c, spec_.heads);
    gpt::linear_backward(d_norm_.data(), grad(block_tensor(l, kAttnW)), grad(block_tensor(l, kAttnB)), d_qkv_.data(),
                         ln1, param(block_tensor(l, kAttnW)), rows, c, 3 * c);
    gpt::layernorm_backward(dx, grad(block_tensor(l, kLn1W)), grad(block_tensor(l, kLn1B)), d_norm_.data(), in,
                            param(block_tensor(l, kLn1W)), ln1_stats_.data() + ul * n * 2, rows, c,
                            mlp_proj_bias_grad(l - 1));
  }
  // Embeddings: each position's gradient to its token's row and its position's row.
  float* dwte = grad(0);
  float* dwpe = grad(1);
  for (int b = 0; b < batch.count; ++b) {
    for (int i = 0; i < t; ++i) {
      const int32_t token = batch.tokens[static_cast<size_t>(b) * static_cast<size_t>(t + 1) + static_cast<size_t>(i)];
      const float* d = dx + (static_cast<size_t>(b) * static_cast<size_t>(t) + static_cast<size_t>(i)) * uc;
      float* te = dwte + static_cast<size_t>(token) * uc;
      float* pe = dwpe + static_cast<size_t>(i) * uc;
      for (int j = 0; j < c; ++j) {
        te[j] += d[j];
        pe[j] += d[j];
      }
    }
  }
  // Async dispatch: the gradients of the rows this rank served, added now.
  if (exchange_) exchange_->end_pass();
  if (moe_layers > 0) {
    std::vector<const MoeMlp*> layers;
    for (const auto& layer : moe_) {
      if (layer) layers.push_back(layer.get());
    }
    window_stats_.add_timing(layers);
    run_stats_.add_timing(layers);
  }
  if (moe_options_.expert_ranks > 1) {
    // An expert's gradient holds every rank's tokens, each rank's scaled to
    // the mean over its own batch: over W ranks' batches of equal size the
    // mean is 1/W of that sum (what one process training on all of them,
    // holding every expert, computes).
    const float scale = 1.0f / static_cast<float>(moe_options_.expert_ranks);
    for (size_t i = dense_size_; i < gradients_.size(); ++i) gradients_[i] *= scale;
  }
  return static_cast<float>(loss / rows + aux);
}

namespace gpt {

namespace {
constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

/// e^x for x <= 0 in float without a library call or a float comparison,
/// so that the GELU and softmax loops vectorise on every ISA (libm's tanhf
/// was a quarter of a step): the clamp at -87 is an integer min on the bits
/// (a negative float's magnitude grows with its bits), then Cody-Waite
/// reduction by ln 2 and a degree-6 Taylor polynomial on |r| <= ln(2)/2,
/// within about 2 ulp.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kLowest = std::bit_cast<uint32_t>(-87.0f);
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  x = std::bit_cast<float>(bits < kLowest ? bits : kLowest);
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693145751953125f;  // ln 2, high bits
  r -= n * 1.428606765330187e-06f;       // ln 2, the rest
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

/// tanh(u) = sign(u) (1 - e) / (1 + e), e = e^(-2|u|): absolute error below 1e-7, what GELU needs.
inline float tanh_inline(float u) {
  const float e = exp_nonpositive(-2.0f * std::fabs(u));
  return std::copysign((1.0f - e) / (1.0f + e), u);
}

// Row reductions in kLanes partial results, so that they vectorise under
// -ffp-contract=off without -ffast-math (a single float accumulator is a
// chain of dependent scalar adds: the LayerNorms' and softmaxes' reductions
// were scalar loops). Inlined into each SIMD clone of their callers.
constexpr int kLanes = 8;

inline float combine(const float (&acc)[kLanes]) {
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/// sum of x[j] over j < n.
inline float row_sum(const float* __restrict x, int n) {
  float acc[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] += x[j + k];
  }
  for (; j < n; ++j) acc[0] += x[j];
  return combine(acc);
}

/// sum of (x[j] - mean)^2 over j < n.
inline float row_sum_squares(const float* __restrict x, int n, float mean) {
  float acc[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float d = x[j + k] - mean;
      acc[k] += d * d;
    }
  }
  for (; j < n; ++j) {
    const float d = x[j] - mean;
    acc[0] += d * d;
  }
  return combine(acc);
}

/// sum of a[j] * b[j] over j < n.
inline float row_dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] += a[j + k] * b[j + k];
  }
  for (; j < n; ++j) acc[0] += a[j] * b[j];
  return combine(acc);
}

/// max of x[j] over j < n (n >= 1).
inline float row_max(const float* __restrict x, int n) {
  float acc[kLanes];
  for (float& a : acc) a = x[0];
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] = acc[k] < x[j + k] ? x[j + k] : acc[k];
  }
  for (; j < n; ++j) acc[0] = acc[0] < x[j] ? x[j] : acc[0];
  float m = acc[0];
  for (int k = 1; k < kLanes; ++k) m = m < acc[k] ? acc[k] : m;
  return m;
}

/// x[j] = e^(x[j] - max) for j < n; returns their sum.
inline float exp_shifted(float* __restrict x, int n, float max) {
  for (int j = 0; j < n; ++j) x[j] = exp_nonpositive(x[j] - max);
  return row_sum(x, n);
}

CFMO_SIMD_CLONES
void layernorm_forward_kernel(float* __restrict y, float* __restrict stats, const float* __restrict x,
                              const float* __restrict w, const float* __restrict b, int n, int c) {
  for (int r = 0; r < n; ++r) {
    const float* xr = x + static_cast<size_t>(r) * static_cast<size_t>(c);
    float* yr = y + static_cast<size_t>(r) * static_cast<size_t>(c);
    const float mean = row_sum(xr, c) / static_cast<float>(c);
    const float var = row_sum_squares(xr, c, mean);
    const float rstd = 1.0f / std::sqrt(var / static_cast<float>(c) + kLayerNormEps);
    for (int j = 0; j < c; ++j) yr[j] = (xr[j] - mean) * rstd * w[j] + b[j];
    stats[2 * r] = mean;
    stats[2 * r + 1] = rstd;
  }
}

CFMO_SIMD_CLONES
void layernorm_backward_kernel(float* __restrict dx, float* __restrict dw, float* __restrict db,
                               const float* __restrict dy, const float* __restrict x, const float* __restrict w,
                               const float* __restrict stats, int n, int c, float* __restrict dx_sums) {
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int r = 0; r < n; ++r) {
    const float* xr = x + static_cast<size_t>(r) * static_cast<size_t>(c);
    const float* dyr = dy + static_cast<size_t>(r) * static_cast<size_t>(c);
    float* dxr = dx + static_cast<size_t>(r) * static_cast<size_t>(c);
    const float mean = stats[2 * r];
    const float rstd = stats[2 * r + 1];
    // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w.
    float acc_d[kLanes] = {};
    float acc_dx[kLanes] = {};
    int j = 0;
    for (; j + kLanes <= c; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float xhat = (xr[j + k] - mean) * rstd;
        const float d = dyr[j + k] * w[j + k];
        acc_d[k] += d;
        acc_dx[k] += d * xhat;
      }
    }
    for (; j < c; ++j) {
      const float xhat = (xr[j] - mean) * rstd;
      const float d = dyr[j] * w[j];
      acc_d[0] += d;
      acc_dx[0] += d * xhat;
    }
    for (j = 0; j < c; ++j) {
      const float xhat = (xr[j] - mean) * rstd;
      dw[j] += dyr[j] * xhat;
      db[j] += dyr[j];
    }
    const float mean_d = combine(acc_d) * inv_c;
    const float mean_dx = combine(acc_dx) * inv_c;
    for (j = 0; j < c; ++j) {
      const float xhat = (xr[j] - mean) * rstd;
      dxr[j] += rstd * (dyr[j] * w[j] - mean_d - xhat * mean_dx);
    }
    if (dx_sums != nullptr) {
      for (j = 0; j < c; ++j) dx_sums[j] += dxr[j];
    }
  }
}

CFMO_SIMD_CLONES
void fill_rows_kernel(float* __restrict y, const float* __restrict x, const float* __restrict bias, int n, int c) {
  for (int r = 0; r < n; ++r) {
    float* yr = y + static_cast<size_t>(r) * static_cast<size_t>(c);
    if (x == nullptr) {
      for (int j = 0; j < c; ++j) yr[j] = bias[j];
    } else {
      const float* xr = x + static_cast<size_t>(r) * static_cast<size_t>(c);
      for (int j = 0; j < c; ++j) yr[j] = xr[j] + bias[j];
    }
  }
}

CFMO_SIMD_CLONES
void gelu_forward_kernel(float* __restrict y, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanh_inline(kGeluScale * (v + kGeluCubic * v * v * v)));
  }
}

inline void gelu_backward_span(float* dx, const float* dy, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float th = tanh_inline(kGeluScale * (v + kGeluCubic * v * v * v));
    const float dth = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v) * (1.0f - th * th);
    dx[i] = dy[i] * (0.5f * (1.0f + th) + 0.5f * v * dth);
  }
}

CFMO_SIMD_CLONES
void gelu_backward_kernel(float* dx, const float* dy, const float* x, size_t n) { gelu_backward_span(dx, dy, x, n); }

/// gelu_backward over rows of `c`, each row's dx added to `sums` while in cache (the bias gradient).
CFMO_SIMD_CLONES
void gelu_backward_sums_kernel(float* dx, float* __restrict sums, const float* dy, const float* x, int n, int c) {
  const auto uc = static_cast<size_t>(c);
  for (int r = 0; r < n; ++r) {
    const size_t at = static_cast<size_t>(r) * uc;
    gelu_backward_span(dx + at, dy + at, x + at, uc);
    const float* __restrict row = dx + at;
    for (size_t j = 0; j < uc; ++j) sums[j] += row[j];
  }
}

CFMO_SIMD_CLONES
void column_sums_add_kernel(float* __restrict sums, const float* __restrict x, int n, int c) {
  for (int r = 0; r < n; ++r) {
    const float* xr = x + static_cast<size_t>(r) * static_cast<size_t>(c);
    for (int j = 0; j < c; ++j) sums[j] += xr[j];
  }
}

/// Softmax of rows [0, rb) of the block of scores `s` (row stride `ld`) whose
/// row r sees keys 0..i0 + r, the rest up to i1 set to 0.
CFMO_SIMD_CLONES
void causal_softmax_kernel(float* s, size_t ld, int rb, int i0, int i1) {
  for (int r = 0; r < rb; ++r) {
    float* __restrict row = s + static_cast<size_t>(r) * ld;
    const int visible = i0 + r + 1;
    const float inv = 1.0f / exp_shifted(row, visible, row_max(row, visible));
    for (int j = 0; j < visible; ++j) row[j] *= inv;
    for (int j = visible; j < i1; ++j) row[j] = 0.0f;
  }
}

/// dS = P * (dP - sum_j P dP) in place of dP over the block's visible keys, 0 after them.
CFMO_SIMD_CLONES
void causal_softmax_backward_kernel(float* ds, const float* p, size_t ld, int rb, int i0, int i1) {
  for (int r = 0; r < rb; ++r) {
    const float* __restrict prow = p + static_cast<size_t>(r) * ld;
    float* __restrict row = ds + static_cast<size_t>(r) * ld;
    const int visible = i0 + r + 1;
    const float dot = row_dot(prow, row, visible);
    for (int j = 0; j < visible; ++j) row[j] = prow[j] * (row[j] - dot);
    for (int j = visible; j < i1; ++j) row[j] = 0.0f;
  }
}

CFMO_SIMD_CLONES
double cross_entropy_kernel(float* logits, const int32_t* targets, int rows, int vocab, float scale) {
  double total = 0;
  for (int r = 0; r < rows; ++r) {
    float* __restrict row = logits + static_cast<size_t>(r) * static_cast<size_t>(vocab);
    const int32_t label = targets[r];
    const float max = row_max(row, vocab);
    const float target = row[label] - max;
    const float sum = exp_shifted(row, vocab, max);
    total += std::log(static_cast<double>(sum)) - static_cast<double>(target);
    const float k = scale / sum;
    for (int j = 0; j < vocab; ++j) row[j] *= k;
    row[label] -= scale;
  }
  return total;
}
}  // namespace

void layernorm_forward(float* y, float* stats, const float* x, const float* w, const float* b, int n, int c) {
  layernorm_forward_kernel(y, stats, x, w, b, n, c);
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* stats, int n, int c, float* dx_sums) {
  layernorm_backward_kernel(dx, dw, db, dy, x, w, stats, n, c, dx_sums);
}

void add_rows(float* y, const float* x, const float* bias, int n, int c) { fill_rows_kernel(y, x, bias, n, c); }

void linear_forward(float* y, const float* x, const float* w, const float* bias, int n, int in, int out) {
  // The bias first and the product added to it (beta 1): OpenBLAS's beta 0
  // is a pass zeroing y, and a bias added after would be a second one.
  if (bias != nullptr) fill_rows_kernel(y, nullptr, bias, n, out);
  tensor::ops::gemm(Trans::kNo, Trans::kNo, n, out, in, 1.0f, x, in, w, out, bias != nullptr ? 1.0f : 0.0f, y, out);
}

void linear_backward(float* dx, float* dw, float* dbias, const float* dy, const float* x, const float* w, int n, int in,
                     int out) {
  if (dx != nullptr) tensor::ops::gemm(Trans::kNo, Trans::kYes, n, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  tensor::ops::gemm(Trans::kYes, Trans::kNo, in, out, n, 1.0f, x, in, dy, out, 1.0f, dw, out);
  if (dbias != nullptr) column_sums_add_kernel(dbias, dy, n, out);
}

void gelu_forward(float* y, const float* x, size_t n) { gelu_forward_kernel(y, x, n); }
void gelu_backward(float* dx, const float* dy, const float* x, size_t n) { gelu_backward_kernel(dx, dy, x, n); }
void gelu_backward(float* dx, float* dbias, const float* dy, const float* x, int n, int c) {
  gelu_backward_sums_kernel(dx, dbias, dy, x, n, c);
}

double cross_entropy_backward(float* logits, const int32_t* targets, int rows, int vocab, float scale) {
  return cross_entropy_kernel(logits, targets, rows, vocab, scale);
}

void attention_forward(float* out, float* probs, const float* qkv, int batch, int t, int c, int heads) {
  const int hs = c / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int ld = 3 * c;
  const auto ut = static_cast<size_t>(t);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const float* q = qkv + static_cast<size_t>(b) * ut * static_cast<size_t>(ld) + static_cast<size_t>(h * hs);
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* p = probs + (static_cast<size_t>(b) * static_cast<size_t>(heads) + static_cast<size_t>(h)) * ut * ut;
      float* o = out + static_cast<size_t>(b) * ut * static_cast<size_t>(c) + static_cast<size_t>(h * hs);
      for (int i0 = 0; i0 < t; i0 += kAttentionBlock) {
        const int i1 = std::min(t, i0 + kAttentionBlock);
        const int rb = i1 - i0;
        float* s = p + static_cast<size_t>(i0) * ut;
        // Scores of the block's queries against the keys up to its last row only.
        tensor::ops::gemm(Trans::kNo, Trans::kYes, rb, i1, hs, scale,
                          q + static_cast<size_t>(i0) * static_cast<size_t>(ld), ld, k, ld, 0.0f, s, t);
        causal_softmax_kernel(s, ut, rb, i0, i1);
        tensor::ops::gemm(Trans::kNo, Trans::kNo, rb, hs, i1, 1.0f, s, t, v, ld, 0.0f,
                          o + static_cast<size_t>(i0) * static_cast<size_t>(c), c);
      }
    }
  }
}

void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* probs, int batch,
                        int t, int c, int heads) {
  const int hs = c / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int ld = 3 * c;
  const auto ut = static_cast<size_t>(t);
  const int last_block = (t - 1) / kAttentionBlock * kAttentionBlock;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const size_t base = static_cast<size_t>(b) * ut * static_cast<size_t>(ld) + static_cast<size_t>(h * hs);
      const float* q = qkv + base;
      const float* k = q + c;
      const float* v = q + 2 * c;
      float* dq = dqkv + base;
      float* dk = dq + c;
      float* dv = dq + 2 * c;
      const float* p = probs + (static_cast<size_t>(b) * static_cast<size_t>(heads) + static_cast<size_t>(h)) * ut * ut;
      const float* d_o = dout + static_cast<size_t>(b) * ut * static_cast<size_t>(c) + static_cast<size_t>(h * hs);
      // The last block first: it sees every key, so its dK and dV products
      // overwrite (beta 0) and the earlier blocks' add, with no zeroing pass.
      for (int i0 = last_block; i0 >= 0; i0 -= kAttentionBlock) {
        const int i1 = std::min(t, i0 + kAttentionBlock);
        const int rb = i1 - i0;
        const float beta = i0 == last_block ? 0.0f : 1.0f;
        const float* pb = p + static_cast<size_t>(i0) * ut;
        const float* dob = d_o + static_cast<size_t>(i0) * static_cast<size_t>(c);
        float* ds = scratch;
        // dP = dO V^T; dV += P^T dO (keys up to the block's last row).
        tensor::ops::gemm(Trans::kNo, Trans::kYes, rb, i1, hs, 1.0f, dob, c, v, ld, 0.0f, ds, t);
        tensor::ops::gemm(Trans::kYes, Trans::kNo, i1, hs, rb, 1.0f, pb, t, dob, c, beta, dv, ld);
        causal_softmax_backward_kernel(ds, pb, ut, rb, i0, i1);
        // dQ = scale dS K; dK += scale dS^T Q.
        tensor::ops::gemm(Trans::kNo, Trans::kNo, rb, hs, i1, scale, ds, t, k, ld, 0.0f,
                          dq + static_cast<size_t>(i0) * static_cast<size_t>(ld), ld);
        tensor::ops::gemm(Trans::kYes, Trans::kNo, i1, hs, rb, scale, ds, t,
                          q + static_cast<size_t>(i0) * static_cast<size_t>(ld), ld, beta, dk, ld);
      }
    }
  }
}

}  // namespace gpt

}  // namespace cfmo::model
