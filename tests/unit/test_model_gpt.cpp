#include "model/gpt.h"

#include "core/rng.h"
#include "optim/optimizer.h"
#include "support/finite_differences.h"
#include "support/token_windows.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace cfmo::model {
namespace {

using testing::dot;
using testing::expect_matches_finite_differences;
using testing::random_tokens;
using testing::random_vector;
using testing::windows;

TEST(TestModelGpt, LayerNormGradientsMatchFiniteDifferences) {
  constexpr int kRows = 3;
  constexpr int kCols = 6;
  auto x = random_vector(kRows * kCols, 1);
  auto w = random_vector(kCols, 2, 0.5f);
  for (float& v : w) v += 1.0f;
  auto b = random_vector(kCols, 3, 0.5f);
  const auto r = random_vector(kRows * kCols, 4);
  std::vector<float> y(x.size()), stats(2 * kRows);
  auto loss = [&] {
    gpt::layernorm_forward(y.data(), stats.data(), x.data(), w.data(), b.data(), kRows, kCols);
    return dot(y, r);
  };
  loss();
  std::vector<float> dx(x.size(), 0.0f), dw(w.size(), 0.0f), db(b.size(), 0.0f);
  gpt::layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), stats.data(), kRows, kCols);
  expect_matches_finite_differences(x, dx, loss, "x");
  expect_matches_finite_differences(w, dw, loss, "weight");
  expect_matches_finite_differences(b, db, loss, "bias");
}

TEST(TestModelGpt, LayerNormNormalisesWithEpsilon) {
  // A constant row has variance 0: the output is the bias (eps keeps rstd finite).
  std::vector<float> x = {2, 2, 2, 2, 1, 2, 3, 4};
  std::vector<float> w(4, 1.0f), b = {0.5f, 0.5f, 0.5f, 0.5f}, y(8), stats(4);
  gpt::layernorm_forward(y.data(), stats.data(), x.data(), w.data(), b.data(), 2, 4);
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(y[static_cast<size_t>(j)], 0.5f);
  EXPECT_FLOAT_EQ(stats[1], 1.0f / std::sqrt(1e-5f));
  // Row 2: mean 2.5, biased variance 1.25.
  EXPECT_NEAR(y[4], (1 - 2.5) / std::sqrt(1.25 + 1e-5) + 0.5, 1e-6);
}

TEST(TestModelGpt, LinearGradientsMatchFiniteDifferences) {
  constexpr int kRows = 4;
  constexpr int kIn = 5;
  constexpr int kOut = 3;
  auto x = random_vector(kRows * kIn, 5);
  auto w = random_vector(kIn * kOut, 6);
  auto bias = random_vector(kOut, 7);
  const auto r = random_vector(kRows * kOut, 8);
  std::vector<float> y(kRows * kOut);
  auto loss = [&] {
    gpt::linear_forward(y.data(), x.data(), w.data(), bias.data(), kRows, kIn, kOut);
    return dot(y, r);
  };
  loss();
  // Conv1D layout: y[r, o] = sum_i x[r, i] w[i, o] + b[o].
  EXPECT_NEAR(y[1], x[0] * w[1] + x[1] * w[4] + x[2] * w[7] + x[3] * w[10] + x[4] * w[13] + bias[1], 1e-5);
  std::vector<float> dx(x.size()), dw(w.size(), 0.0f), db(bias.size(), 0.0f);
  gpt::linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), kRows, kIn, kOut);
  expect_matches_finite_differences(x, dx, loss, "x");
  expect_matches_finite_differences(w, dw, loss, "weight");
  expect_matches_finite_differences(bias, db, loss, "bias");
}

TEST(TestModelGpt, GeluIsTheTanhFormAndItsGradientMatches) {
  auto x = random_vector(40, 9, 2.0f);
  const auto r = random_vector(40, 10);
  std::vector<float> y(x.size());
  auto loss = [&] {
    gpt::gelu_forward(y.data(), x.data(), x.size());
    return dot(y, r);
  };
  loss();
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double expected = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(y[i], expected, 1e-6);
  }
  std::vector<float> dx(x.size());
  gpt::gelu_backward(dx.data(), r.data(), x.data(), x.size());
  expect_matches_finite_differences(x, dx, loss, "x", 1e-3f);
}

/// Causal attention written out in double from its definition.
std::vector<double> naive_attention(const std::vector<float>& qkv, int batch, int t, int c, int heads) {
  const int hs = c / heads;
  std::vector<double> out(static_cast<size_t>(batch * t * c), 0.0);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < t; ++i) {
        auto at = [&](int row, int part, int d) {
          return static_cast<double>(qkv[static_cast<size_t>((b * t + row) * 3 * c + part * c + h * hs + d)]);
        };
        std::vector<double> s(static_cast<size_t>(i + 1));
        double max = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dp = 0;
          for (int d = 0; d < hs; ++d) dp += at(i, 0, d) * at(j, 1, d);
          s[static_cast<size_t>(j)] = dp / std::sqrt(static_cast<double>(hs));
          max = std::max(max, s[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (double& v : s) sum += (v = std::exp(v - max));
        for (int d = 0; d < hs; ++d) {
          double o = 0;
          for (int j = 0; j <= i; ++j) o += s[static_cast<size_t>(j)] / sum * at(j, 2, d);
          out[static_cast<size_t>((b * t + i) * c + h * hs + d)] = o;
        }
      }
    }
  }
  return out;
}

// 37 positions: two blocks of queries, the second one partial.
constexpr int kAttnBatch = 2;
constexpr int kAttnT = gpt::kAttentionBlock + 5;
constexpr int kAttnC = 6;
constexpr int kAttnHeads = 2;

TEST(TestModelGpt, AttentionMatchesItsDefinition) {
  const auto qkv = random_vector(kAttnBatch * kAttnT * 3 * kAttnC, 11);
  std::vector<float> out(kAttnBatch * kAttnT * kAttnC), probs(kAttnBatch * kAttnHeads * kAttnT * kAttnT);
  gpt::attention_forward(out.data(), probs.data(), qkv.data(), kAttnBatch, kAttnT, kAttnC, kAttnHeads);
  const auto expected = naive_attention(qkv, kAttnBatch, kAttnT, kAttnC, kAttnHeads);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], expected[i], 1e-5) << i;
}

TEST(TestModelGpt, AttentionGradientsMatchFiniteDifferences) {
  auto qkv = random_vector(kAttnBatch * kAttnT * 3 * kAttnC, 12);
  const auto r = random_vector(kAttnBatch * kAttnT * kAttnC, 13);
  std::vector<float> out(r.size()), probs(kAttnBatch * kAttnHeads * kAttnT * kAttnT);
  auto loss = [&] {
    gpt::attention_forward(out.data(), probs.data(), qkv.data(), kAttnBatch, kAttnT, kAttnC, kAttnHeads);
    return dot(out, r);
  };
  loss();
  std::vector<float> dqkv(qkv.size()), scratch(static_cast<size_t>(gpt::kAttentionBlock) * kAttnT);
  gpt::attention_backward(dqkv.data(), scratch.data(), r.data(), qkv.data(), probs.data(), kAttnBatch, kAttnT, kAttnC,
                          kAttnHeads);
  // Tight enough to catch a 1% error in one of the four products.
  expect_matches_finite_differences(qkv, dqkv, loss, "qkv", 1e-2f, 3, 3e-3);
}

GptSpec make_spec(int layers, int heads, int dim, int context, int vocab) {
  GptSpec spec;
  spec.layers = layers;
  spec.heads = heads;
  spec.dim = dim;
  spec.context = context;
  spec.vocab = vocab;
  return spec;
}

GptSpec tiny_spec() { return make_spec(2, 2, 8, 5, 11); }

TEST(TestModelGpt, WholeModelGradientsMatchFiniteDifferencesForEveryTensor) {
  const GptSpec spec = tiny_spec();
  Gpt model(spec);
  model.init(21);
  // Larger than GPT-2's initialisation, so that every path carries gradient worth measuring.
  Rng rng(22, 1);
  for (float& p : model.parameters()) p += 0.3f * rng.normal();
  constexpr int kBatch = 3;
  const auto tokens = random_tokens(spec, kBatch, 23);
  model.forward_backward(windows(tokens, kBatch));
  const std::vector<float> analytic(model.gradients().begin(), model.gradients().end());
  testing::expect_model_gradients_match(model, analytic,
                                        [&] { return model.evaluate(windows(tokens, kBatch)).loss(); });
}

TEST(TestModelGpt, TensorsCarryHuggingFaceNamesAndConv1DShapes) {
  GptSpec spec = tiny_spec();
  Gpt model(spec);
  const auto& p = model.params();
  ASSERT_EQ(p.size(), 2u + 12u * 2u + 2u);
  auto shape_of = [&](const std::string& name) {
    for (const auto& info : p) {
      if (info.name == name) return info.shape;
    }
    return std::vector<int64_t>{};
  };
  EXPECT_EQ(shape_of("wte.weight"), (std::vector<int64_t>{11, 8}));
  EXPECT_EQ(shape_of("wpe.weight"), (std::vector<int64_t>{5, 8}));
  EXPECT_EQ(shape_of("h.1.ln_1.weight"), (std::vector<int64_t>{8}));
  EXPECT_EQ(shape_of("h.1.attn.c_attn.weight"), (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(shape_of("h.1.attn.c_attn.bias"), (std::vector<int64_t>{24}));
  EXPECT_EQ(shape_of("h.1.attn.c_proj.weight"), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(shape_of("h.0.mlp.c_fc.weight"), (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(shape_of("h.0.mlp.c_proj.weight"), (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(shape_of("h.0.mlp.c_proj.bias"), (std::vector<int64_t>{8}));
  EXPECT_EQ(shape_of("ln_f.bias"), (std::vector<int64_t>{8}));
  // Matrices decay and go to Muon; embeddings, biases and norms do neither.
  for (const auto& info : p) {
    const bool matrix = info.name.ends_with("c_attn.weight") || info.name.ends_with("c_proj.weight") ||
                        info.name.ends_with("c_fc.weight");
    EXPECT_EQ(info.is_matrix(), matrix) << info.name;
    EXPECT_EQ(info.decays, matrix) << info.name;
    EXPECT_EQ(info.offset % 16, 0u) << info.name;
  }
  EXPECT_EQ(model.num_trainable(), 11u * 8 + 5 * 8 + 2 * (12 * 64 + 13 * 8) + 2 * 8);
}

TEST(TestModelGpt, InitFollowsGpt2) {
  const GptSpec spec = make_spec(4, 4, 64, 32, 256);
  Gpt model(spec);
  model.init(5);
  for (const auto& info : model.params()) {
    const auto v = model.parameters().subspan(info.offset, info.size);
    double sum = 0;
    double sq = 0;
    for (float x : v) {
      sum += x;
      sq += static_cast<double>(x) * x;
    }
    const double mean = sum / static_cast<double>(v.size());
    const double std = std::sqrt(sq / static_cast<double>(v.size()) - mean * mean);
    if (info.kind == ParamKind::kBias || info.name.ends_with("ln_1.bias") || info.name.ends_with("ln_2.bias") ||
        info.name == "ln_f.bias") {
      EXPECT_EQ(sq, 0.0) << info.name;
    } else if (info.kind == ParamKind::kNorm) {
      EXPECT_EQ(mean, 1.0) << info.name;
      EXPECT_EQ(std, 0.0) << info.name;
    } else {
      const double expected = info.name.ends_with("c_proj.weight") ? 0.02 / std::sqrt(8.0) : 0.02;
      EXPECT_NEAR(std, expected, 0.1 * expected) << info.name;
      EXPECT_NEAR(mean, 0.0, 0.1 * expected) << info.name;
    }
  }
}

TEST(TestModelGpt, InitialLossIsNearUniformAndEvaluateAgrees) {
  GptSpec spec = tiny_spec();
  spec.vocab = 50;
  Gpt model(spec);
  model.init(3);
  const auto tokens = random_tokens(spec, 4, 4);
  const float loss = model.forward_backward(windows(tokens, 4));
  EXPECT_NEAR(loss, std::log(50.0), 0.05);
  const EvalResult r = model.evaluate(windows(tokens, 4));
  EXPECT_EQ(r.count, 4 * spec.context);
  EXPECT_NEAR(r.loss(), loss, 1e-6);
}

TEST(TestModelGpt, LaterTokensDoNotChangeEarlierLogits) {
  GptSpec spec = tiny_spec();
  Gpt model(spec);
  model.init(8);
  auto tokens = random_tokens(spec, 1, 9);
  model.forward(tokens.data(), 1);
  const std::vector<float> before(model.logits(), model.logits() + spec.context * spec.vocab);
  tokens[3] = (tokens[3] + 1) % spec.vocab;  // input position 3
  model.forward(tokens.data(), 1);
  for (int i = 0; i < spec.context * spec.vocab; ++i) {
    if (i < 3 * spec.vocab) {
      EXPECT_EQ(model.logits()[i], before[static_cast<size_t>(i)]) << i;
    }
  }
  EXPECT_NE(model.logits()[3 * spec.vocab], before[static_cast<size_t>(3 * spec.vocab)]);
  // next_token_logits over a prefix equals the full forward's row.
  model.forward(tokens.data(), 1);
  const std::vector<float> full(model.logits(), model.logits() + spec.context * spec.vocab);
  const auto next = model.next_token_logits(std::span<const int32_t>(tokens.data(), 3));
  for (int j = 0; j < spec.vocab; ++j)
    EXPECT_NEAR(next[static_cast<size_t>(j)], full[static_cast<size_t>(2 * spec.vocab + j)], 1e-5);
}

TEST(TestModelGpt, TrainingIsDeterministicAndResumesExactly) {
  const GptSpec spec = tiny_spec();
  optim::OptimizerConfig oc;
  oc.kind = optim::OptimizerKind::kAdamW;
  oc.weight_decay = 0.1;
  auto run = [&](Gpt& model, optim::Optimizer& opt, int first, int last) {
    for (int s = first; s < last; ++s) {
      const auto tokens = random_tokens(spec, 2, 100 + static_cast<uint64_t>(s));
      model.forward_backward(windows(tokens, 2));
      opt.step(model.parameters(), model.gradients(), 1e-2f);
    }
  };
  Gpt a(spec);
  a.init(1);
  auto opt_a = optim::make_optimizer(oc, a.params(), a.num_params());
  ASSERT_TRUE(opt_a.has_value());
  run(a, **opt_a, 0, 6);
  // The same six steps split at step 3, the state carried over as a checkpoint would.
  Gpt b(spec);
  b.init(1);
  auto opt_b = optim::make_optimizer(oc, b.params(), b.num_params());
  ASSERT_TRUE(opt_b.has_value());
  run(b, **opt_b, 0, 3);
  Gpt c(spec);
  std::copy(b.parameters().begin(), b.parameters().end(), c.parameters().begin());
  auto opt_c = optim::make_optimizer(oc, c.params(), c.num_params());
  ASSERT_TRUE(opt_c.has_value());
  auto from = (*opt_b)->state();
  auto to = (*opt_c)->state();
  for (size_t i = 0; i < from.size(); ++i) *to[i].buffer = *from[i].buffer;
  (*opt_c)->set_step_count((*opt_b)->step_count());
  run(c, **opt_c, 3, 6);
  for (size_t i = 0; i < a.num_params(); ++i) ASSERT_EQ(a.parameters()[i], c.parameters()[i]) << i;
}

TEST(TestModelGpt, LearnsAPeriodicSequence) {
  // Windows of a sequence of period 7 over 11 tokens: predictable from the previous token alone.
  GptSpec spec = tiny_spec();
  spec.dim = 16;
  Gpt model(spec);
  model.init(4);
  optim::OptimizerConfig oc;
  oc.kind = optim::OptimizerKind::kAdamW;
  auto opt = optim::make_optimizer(oc, model.params(), model.num_params());
  ASSERT_TRUE(opt.has_value());
  constexpr int kBatch = 4;
  std::vector<int32_t> tokens(static_cast<size_t>(kBatch) * static_cast<size_t>(spec.context + 1));
  float first = 0;
  float last = 0;
  for (int step = 0; step < 150; ++step) {
    for (int b = 0; b < kBatch; ++b) {
      for (int i = 0; i <= spec.context; ++i) {
        tokens[static_cast<size_t>(b * (spec.context + 1) + i)] =
            static_cast<int32_t>(((step + 3 * b + i) % 7) * 3 % 11);
      }
    }
    last = model.forward_backward(windows(tokens, kBatch));
    if (step == 0) first = last;
    (*opt)->step(model.parameters(), model.gradients(), 1e-2f);
  }
  EXPECT_NEAR(first, std::log(11.0), 0.1);
  EXPECT_LT(last, 0.2f);
}

TEST(TestModelGpt, FlopsFollowTheDocumentedFormula) {
  const GptSpec spec = make_spec(6, 6, 384, 256, 256);
  Gpt model(spec);
  const double n = 12.0 * 6 * 384 * 384 + 256.0 * 384;
  EXPECT_DOUBLE_EQ(model.flops_per_example(), 256.0 * (6 * n + 12.0 * 6 * 256 * 384));
}

TEST(TestModelGpt, SpecParseAcceptsTheFourKeysInAnyOrder) {
  auto spec = GptSpec::parse("gpt:layers=6,heads=6,dim=384,context=256", 256);
  ASSERT_TRUE(spec.has_value()) << spec.error().message;
  EXPECT_EQ(spec->layers, 6);
  EXPECT_EQ(spec->heads, 6);
  EXPECT_EQ(spec->dim, 384);
  EXPECT_EQ(spec->context, 256);
  EXPECT_EQ(spec->vocab, 256);
  EXPECT_EQ(spec->to_string(), "gpt:layers=6,heads=6,dim=384,context=256");
  auto reordered = GptSpec::parse("gpt:context=8,dim=16,heads=2,layers=1", 50257);
  ASSERT_TRUE(reordered.has_value());
  EXPECT_EQ(reordered->to_string(), "gpt:layers=1,heads=2,dim=16,context=8");
}

TEST(TestModelGpt, SpecParseRejectsMalformedText) {
  for (const char* text :
       {"gpt:", "gpt:layers=2,heads=4,dim=128", "gpt:layers=2,heads=4,dim=130,context=8",
        "gpt:layers=0,heads=4,dim=128,context=8", "gpt:layers=x,heads=4,dim=128,context=8",
        "gpt:layers=2,heads=4,dim=128,context=8,", "gpt:layers=2,layers=2,heads=4,dim=128,context=8",
        "gpt:layers=2,heads=4,dim=128,context=8,depth=3", "gpt:layers2,heads=4,dim=128,context=8", "mlp:256"}) {
    auto spec = GptSpec::parse(text, 256);
    ASSERT_FALSE(spec.has_value()) << text;
    EXPECT_EQ(spec.error().kind, ErrorKind::kUsage) << text;
    EXPECT_NE(spec.error().message.find(text), std::string::npos) << spec.error().message;
    EXPECT_EQ(spec.error().message.find('\n'), std::string::npos) << spec.error().message;
  }
}

// tests/reference/gpt_golden.txt: the loss and gradient norm of a fixed tiny
// GPT on fixed tokens, computed in float64 by bench/pytorch_gpt.py --golden
// (the model and tokens are defined by formula there).
TEST(TestModelGpt, GoldenLossMatchesPyTorch) {
  const GptSpec spec = make_spec(2, 2, 8, 4, 16);
  Gpt model(spec);
  ASSERT_EQ(model.num_trainable(), 1920u);
  size_t k = 0;
  for (const ParamInfo& p : model.params()) {
    const bool gain = p.kind == ParamKind::kNorm && p.name.ends_with(".weight");
    for (size_t i = 0; i < p.size; ++i, ++k) {
      const double wave = std::sin(0.37 * static_cast<double>(k) + 0.1);
      model.parameters()[p.offset + i] = static_cast<float>(gain ? 1.0 + 0.1 * wave : 0.2 * wave);
    }
  }
  std::vector<int32_t> tokens(10);
  for (int j = 0; j < 10; ++j) tokens[static_cast<size_t>(j)] = (5 * j * j + 3 * j + 1) % 16;
  ASSERT_EQ(tokens, (std::vector<int32_t>{1, 9, 11, 7, 13, 13, 7, 11, 9, 1}));
  const float loss = model.forward_backward(windows(tokens, 2));
  EXPECT_NEAR(loss, 2.27501192, 2e-6);
  double sq = 0;
  for (float g : model.gradients()) sq += static_cast<double>(g) * g;
  EXPECT_NEAR(std::sqrt(sq), 5.17280052, 5e-6 * 5.17280052);
}

}  // namespace
}  // namespace cfmo::model
