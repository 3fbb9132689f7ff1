#include "model/gpt.h"
#include "model/moe_mlp.h"

#include "core/rng.h"
#include "support/finite_differences.h"
#include "support/token_windows.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace cfmo::model {
namespace {

using testing::dot;

std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f) {
  return testing::random_vector(n, seed, scale, /*stream=*/7);
}

/// Central differences. Top-k and capacity are piecewise constant: the seeds
/// below keep every perturbation inside one piece (no routing decision flips).
using testing::expect_matches_finite_differences;
using testing::random_tokens;
using testing::windows;

constexpr int kDim = 6;
constexpr int kExperts = 4;
constexpr int kTopK = 2;
constexpr int kExpertDim = 5;
constexpr int kRows = 7;

/// One MoE layer's tensors as vectors, and views of them.
struct LayerFixture {
  std::vector<float> x = random_vector(kRows * kDim, 1);
  std::vector<float> residual = random_vector(kRows * kDim, 2);
  std::vector<float> router = random_vector(kDim * kExperts, 3, 0.8f);
  std::vector<std::vector<float>> tensors;  ///< per expert: fc_w, fc_b, proj_w, proj_b
  std::vector<std::vector<float>> grads;

  LayerFixture() {
    for (int e = 0; e < kExperts; ++e) {
      const auto seed = static_cast<uint64_t>(10 + 4 * e);
      tensors.push_back(random_vector(kDim * kExpertDim, seed, 0.5f));
      tensors.push_back(random_vector(kExpertDim, seed + 1, 0.5f));
      tensors.push_back(random_vector(kExpertDim * kDim, seed + 2, 0.5f));
      tensors.push_back(random_vector(kDim, seed + 3, 0.5f));
    }
    for (const auto& t : tensors) grads.emplace_back(t.size(), 0.0f);
  }
  std::vector<ExpertTensors> view(std::vector<std::vector<float>>& v) {
    std::vector<ExpertTensors> out;
    for (int e = 0; e < kExperts; ++e) {
      const auto i = static_cast<size_t>(4 * e);
      out.push_back({v[i].data(), v[i + 1].data(), v[i + 2].data(), v[i + 3].data()});
    }
    return out;
  }
};

void check_layer_gradients(const MoeOptions& options, bool expect_drops) {
  LayerFixture f;
  MoeMlp layer(kDim, kExperts, kTopK, kExpertDim, options);
  const auto r = random_vector(kRows * kDim, 4);
  // Large coefficients, so that a wrong auxiliary gradient shows.
  constexpr float kAux = 0.7f;
  constexpr float kZ = 0.3f;
  std::vector<float> y(r.size());
  auto loss = [&] {
    layer.forward(f.x.data(), f.residual.data(), kRows, f.router.data(), f.view(f.tensors), y.data());
    return dot(y, r) + kAux * layer.aux_loss() + kZ * layer.z_loss();
  };
  loss();
  if (expect_drops) {
    ASSERT_GT(layer.routing().dropped, 0);
  } else {
    ASSERT_EQ(layer.routing().dropped, 0);
  }
  std::vector<float> dx(f.x.size(), 0.0f), d_router(f.router.size(), 0.0f);
  layer.backward(r.data(), f.x.data(), f.router.data(), d_router.data(), f.view(f.tensors), f.view(f.grads), dx.data(),
                 kAux, kZ);
  expect_matches_finite_differences(f.x, dx, loss, "x", 1e-3f);
  expect_matches_finite_differences(f.router, d_router, loss, "router", 1e-3f);
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    expect_matches_finite_differences(f.tensors[i], f.grads[i], loss, fmt::format("expert tensor {}", i), 1e-2f);
  }
}

TEST(TestModelMoe, LayerGradientsMatchFiniteDifferencesDropless) {
  MoeOptions options;
  options.drop_policy = moe::DropPolicy::kDropless;
  check_layer_gradients(options, false);
}

TEST(TestModelMoe, LayerGradientsMatchFiniteDifferencesWithDrops) {
  MoeOptions options;
  options.capacity_factor = 0.5;  // 2 slots per expert for 14 assignments: some are dropped
  check_layer_gradients(options, true);
}

TEST(TestModelMoe, RoutesToTheTopKWithRenormalisedGatesAndDroppedTokensTakeTheResidual) {
  LayerFixture f;
  MoeOptions options;
  options.capacity_factor = 0.25;  // one slot per expert
  MoeMlp layer(kDim, kExperts, kTopK, kExpertDim, options);
  std::vector<float> y(f.residual.size());
  layer.forward(f.x.data(), f.residual.data(), kRows, f.router.data(), f.view(f.tensors), y.data());
  const moe::Routing& routing = layer.routing();
  EXPECT_EQ(layer.capacity(kRows), 1);
  int64_t kept = 0;
  for (int t = 0; t < kRows; ++t) {
    // The gates of a token sum to 1, and its choices are its two most probable experts.
    std::vector<double> logits(kExperts, 0.0);
    for (int e = 0; e < kExperts; ++e) {
      for (int i = 0; i < kDim; ++i) logits[e] += f.x[t * kDim + i] * f.router[i * kExperts + e];
    }
    const auto a = static_cast<size_t>(t * kTopK);
    EXPECT_NEAR(routing.gate[a] + routing.gate[a + 1], 1.0, 1e-6);
    EXPECT_GE(logits[routing.expert[a]], logits[routing.expert[a + 1]]);
    for (int e = 0; e < kExperts; ++e) {
      if (e != routing.expert[a] && e != routing.expert[a + 1]) {
        EXPECT_LE(logits[e], logits[routing.expert[a + 1]]);
      }
    }
    // A token whose both assignments were dropped is its residual, exactly.
    if (routing.kept[a] == 0 && routing.kept[a + 1] == 0) {
      for (int i = 0; i < kDim; ++i) EXPECT_EQ(y[t * kDim + i], f.residual[t * kDim + i]);
    }
    kept += routing.kept[a] + routing.kept[a + 1];
  }
  EXPECT_EQ(kept, kExperts);  // one slot each, and 14 assignments compete for them
  EXPECT_EQ(routing.dropped, kRows * kTopK - kExperts);
}

TEST(TestModelMoe, AuxiliaryLossesFollowTheirDefinitions) {
  LayerFixture f;
  MoeOptions options;
  options.drop_policy = moe::DropPolicy::kDropless;
  MoeMlp layer(kDim, kExperts, kTopK, kExpertDim, options);
  std::vector<float> y(f.residual.size());
  layer.forward(f.x.data(), f.residual.data(), kRows, f.router.data(), f.view(f.tensors), y.data());
  std::vector<double> f_share(kExperts, 0.0), p_mean(kExperts, 0.0);
  double z = 0;
  for (int t = 0; t < kRows; ++t) {
    std::vector<double> logits(kExperts, 0.0);
    for (int e = 0; e < kExperts; ++e) {
      for (int i = 0; i < kDim; ++i) logits[e] += f.x[t * kDim + i] * f.router[i * kExperts + e];
    }
    double sum = 0;
    for (double l : logits) sum += std::exp(l);
    for (int e = 0; e < kExperts; ++e) p_mean[e] += std::exp(logits[e]) / sum / kRows;
    z += std::log(sum) * std::log(sum) / kRows;
    for (int j = 0; j < kTopK; ++j) f_share[layer.routing().expert[t * kTopK + j]] += 1.0 / (kRows * kTopK);
  }
  double aux = 0;
  for (int e = 0; e < kExperts; ++e) aux += f_share[e] * p_mean[e];
  EXPECT_NEAR(layer.aux_loss(), kExperts * aux, 1e-5);
  EXPECT_NEAR(layer.z_loss(), z, 1e-4);
}

TEST(TestModelMoe, BalancedUniformRoutingHasAnAuxLossOfOne) {
  // A zero router: every probability 1/E; ties go to the lower experts, so
  // experts 0 and 1 take everything: f = (1/2, 1/2, 0, 0), P = 1/4 each.
  LayerFixture f;
  std::fill(f.router.begin(), f.router.end(), 0.0f);
  MoeOptions options;
  options.drop_policy = moe::DropPolicy::kDropless;
  MoeMlp layer(kDim, kExperts, kTopK, kExpertDim, options);
  std::vector<float> y(f.residual.size());
  layer.forward(f.x.data(), f.residual.data(), kRows, f.router.data(), f.view(f.tensors), y.data());
  EXPECT_NEAR(layer.aux_loss(), 1.0, 1e-6);
  EXPECT_NEAR(layer.z_loss(), std::log(4.0) * std::log(4.0), 1e-5);
}

GptSpec moe_spec() {
  auto spec = GptSpec::parse("gpt:layers=2,heads=2,dim=8,context=5,experts=3,top_k=2,expert_dim=6", 11);
  EXPECT_TRUE(spec.has_value());
  return *spec;
}

TEST(TestModelMoe, WholeModelGradientsMatchFiniteDifferencesForEveryTensor) {
  const GptSpec spec = moe_spec();
  MoeOptions options;
  options.aux_loss = 0.5;  // large, so that the auxiliary losses' gradients show
  options.z_loss = 0.2;
  options.drop_policy = moe::DropPolicy::kDropless;
  Gpt model(spec, options);
  model.init(31);
  Rng rng(32, 1);
  for (float& p : model.parameters()) p += 0.3f * rng.normal();
  constexpr int kBatch = 2;
  const auto tokens = random_tokens(spec, kBatch, 33);
  const Examples batch = windows(tokens, kBatch);
  model.forward_backward(batch);
  const std::vector<float> analytic(model.gradients().begin(), model.gradients().end());
  // The training loss (cross-entropy and the weighted auxiliary losses) is what forward_backward returns.
  testing::expect_model_gradients_match(model, analytic,
                                        [&] { return static_cast<double>(model.forward_backward(batch)); });
}

TEST(TestModelMoe, APreparedModelComputesTheSameLossAndGradients) {
  // prepare() only allocates and touches the workspaces before the first
  // step: with and without it, with drops and dropless, the passes agree bit for bit.
  const GptSpec spec = moe_spec();
  for (const auto policy : {moe::DropPolicy::kDropless, moe::DropPolicy::kResidual}) {
    MoeOptions options;
    options.drop_policy = policy;
    options.capacity_factor = 1.0;
    Gpt plain(spec, options);
    Gpt prepared(spec, options);
    plain.init(51);
    prepared.init(51);
    constexpr int kBatch = 3;
    prepared.prepare(kBatch);
    for (uint64_t seed : {52, 53}) {
      // A smaller batch than prepared for, then the full one.
      const int n = seed == 52 ? kBatch - 1 : kBatch;
      const auto tokens = random_tokens(spec, n, seed);
      const Examples batch = windows(tokens, n);
      EXPECT_EQ(plain.forward_backward(batch), prepared.forward_backward(batch));
      EXPECT_TRUE(std::equal(plain.gradients().begin(), plain.gradients().end(), prepared.gradients().begin()));
    }
  }
}

TEST(TestModelMoe, TensorsAreNamedAndTheExpertsComeLast) {
  auto spec = GptSpec::parse("gpt:layers=4,heads=2,dim=8,context=5,experts=3,top_k=1,moe_every=2", 11);
  ASSERT_TRUE(spec.has_value());
  EXPECT_EQ(spec->expert_dim, 32);  // 4 C by default
  Gpt model(*spec);
  std::map<std::string, std::vector<int64_t>> shapes;
  size_t first_expert = SIZE_MAX;
  for (const ParamInfo& p : model.params()) {
    shapes[p.name] = p.shape;
    if (p.name.find(".experts.") != std::string::npos) {
      first_expert = std::min(first_expert, p.offset);
    } else {
      EXPECT_LT(p.offset, model.dense_size()) << p.name;
    }
  }
  EXPECT_EQ(first_expert, model.dense_size());
  // Blocks 1 and 3 have experts; 0 and 2 the dense MLP.
  EXPECT_EQ(shapes.count("h.0.mlp.c_fc.weight"), 1u);
  EXPECT_EQ(shapes.count("h.1.mlp.c_fc.weight"), 0u);
  EXPECT_EQ(shapes["h.1.mlp.router.weight"], (std::vector<int64_t>{8, 3}));
  EXPECT_EQ(shapes["h.3.mlp.experts.2.c_fc.weight"], (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(shapes["h.3.mlp.experts.2.c_fc.bias"], (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes["h.3.mlp.experts.2.c_proj.weight"], (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(shapes["h.3.mlp.experts.2.c_proj.bias"], (std::vector<int64_t>{8}));
  EXPECT_EQ(shapes.count("h.2.mlp.router.weight"), 0u);
  EXPECT_TRUE(model.hf_config_json().empty());
  EXPECT_EQ(model.spec_string(), "gpt:layers=4,heads=2,dim=8,context=5,experts=3,top_k=1,expert_dim=32,moe_every=2");
  EXPECT_EQ(GptSpec::parse(model.spec_string(), 11)->to_string(), model.spec_string());
}

TEST(TestModelMoe, SpecParseRejectsBadMoeSpecsInOneLine) {
  for (const char* text :
       {"gpt:layers=2,heads=2,dim=8,context=5,experts=2,top_k=3",
        "gpt:layers=2,heads=2,dim=8,context=5,experts=2,expert_dim=0", "gpt:layers=2,heads=2,dim=8,context=5,top_k=2",
        "gpt:layers=2,heads=2,dim=8,context=5,experts=0", "gpt:layers=2,heads=2,dim=8,context=5,experts=4,moe_every=3",
        "gpt:layers=2,heads=2,dim=8,context=5,experts=4,experts=4"}) {
    auto spec = GptSpec::parse(text, 11);
    ASSERT_FALSE(spec.has_value()) << text;
    EXPECT_EQ(spec.error().kind, ErrorKind::kUsage) << text;
    EXPECT_EQ(spec.error().message.find('\n'), std::string::npos) << spec.error().message;
  }
  auto spec = GptSpec::parse("gpt:layers=2,heads=2,dim=8,context=5,experts=2,top_k=3", 11);
  EXPECT_NE(spec.error().message.find("top_k 3 is more than experts 2"), std::string::npos) << spec.error().message;
}

TEST(TestModelMoe, MetricsReportLoadPerLayerAndStartAFreshWindow) {
  const GptSpec spec = moe_spec();
  Gpt model(spec);
  model.init(41);
  EXPECT_TRUE(model.take_metrics().is_null());
  constexpr int kBatch = 3;
  const auto tokens = random_tokens(spec, kBatch, 42);
  const Examples batch = windows(tokens, kBatch);
  model.forward_backward(batch);
  model.forward_backward(batch);
  const auto m = model.take_metrics();
  ASSERT_TRUE(m.is_object());
  EXPECT_EQ(m["passes"], 2);
  ASSERT_EQ(m["layers"].size(), 2u);
  const auto& layer = m["layers"][1];
  EXPECT_EQ(layer["layer"], 1);
  // Assignments per expert and pass: rows x top_k over the experts on average.
  EXPECT_NEAR(layer["load_mean"].get<double>(), kBatch * spec.context * 2.0 / 3.0, 1e-9);
  EXPECT_LE(layer["load_min"].get<double>(), layer["load_mean"].get<double>());
  EXPECT_GE(layer["load_max"].get<double>(), layer["load_mean"].get<double>());
  EXPECT_GE(layer["load_cv"].get<double>(), 0.0);
  EXPECT_GE(m["aux_loss"].get<double>(), 1.0 - 1e-9);  // the balanced minimum
  EXPECT_GT(m["z_loss"].get<double>(), 0.0);
  EXPECT_TRUE(model.take_metrics().is_null());
  EXPECT_EQ(model.run_metrics()["passes"], 2);
  // evaluate() is no training pass.
  model.evaluate(batch);
  EXPECT_TRUE(model.take_metrics().is_null());
}

TEST(TestModelMoe, FlopsCountTheActiveWeights) {
  const GptSpec spec = moe_spec();
  Gpt model(spec);
  const double c = 8, t = 5, l = 2, v = 11;
  const double n = 4 * l * c * c + l * (c * 3 + 2 * 2 * c * 6) + v * c;
  EXPECT_DOUBLE_EQ(model.flops_per_example(), t * (6 * n + 12 * l * t * c));
}

}  // namespace
}  // namespace cfmo::model
