#include "model/mlp.h"

#include "core/rng.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace cfmo::model {
namespace {

constexpr int kBatch = 6;

MlpSpec small_spec(std::vector<int> hidden = {5, 4}) {
  MlpSpec spec;
  spec.inputs = 7;
  spec.hidden = std::move(hidden);
  spec.classes = 3;
  return spec;
}

struct Batch {
  std::vector<float> inputs;
  std::vector<int32_t> labels;
};

Batch random_batch(const MlpSpec& spec, int batch, uint64_t seed) {
  Rng rng(seed, /*stream=*/7);
  Batch b;
  b.inputs.resize(static_cast<size_t>(batch) * static_cast<size_t>(spec.inputs));
  for (float& x : b.inputs) x = rng.normal();
  b.labels.resize(static_cast<size_t>(batch));
  for (int32_t& y : b.labels) y = static_cast<int32_t>(rng.below(static_cast<uint64_t>(spec.classes)));
  return b;
}

/// The forward pass written out in double from the PyTorch layout alone
/// (y = x W^T + b, W stored [out, in] row-major), independent of the BLAS calls.
EvalResult manual_evaluate(const Mlp& mlp, const Batch& b, int batch) {
  const auto& spec = mlp.spec();
  const auto params = mlp.parameters();
  const auto& infos = mlp.params();
  const size_t layers = infos.size() / 2;
  EvalResult result;
  for (int r = 0; r < batch; ++r) {
    std::vector<double> a(b.inputs.begin() + r * spec.inputs, b.inputs.begin() + (r + 1) * spec.inputs);
    for (size_t l = 0; l < layers; ++l) {
      const ParamInfo& w = infos[2 * l];
      const ParamInfo& bias = infos[2 * l + 1];
      const auto out = static_cast<size_t>(w.shape[0]);
      const auto in = static_cast<size_t>(w.shape[1]);
      std::vector<double> z(out);
      for (size_t o = 0; o < out; ++o) {
        double sum = params[bias.offset + o];
        for (size_t i = 0; i < in; ++i) sum += static_cast<double>(params[w.offset + o * in + i]) * a[i];
        z[o] = l + 1 < layers ? std::max(sum, 0.0) : sum;
      }
      a = std::move(z);
    }
    const int label = b.labels[static_cast<size_t>(r)];
    double log_sum = 0;
    for (double logit : a) log_sum += std::exp(logit);
    log_sum = std::log(log_sum);
    result.loss_sum += log_sum - a[static_cast<size_t>(label)];
    if (std::max_element(a.begin(), a.end()) - a.begin() == label) ++result.correct;
    ++result.count;
  }
  return result;
}

/// Checks d(mean loss)/d(param) from forward_backward against central finite
/// differences of the loss, for every weight and bias of every layer.
void expect_gradients_match_finite_differences(const MlpSpec& spec, uint64_t seed) {
  Mlp mlp(spec);
  mlp.init(seed);
  const Batch b = random_batch(spec, kBatch, seed + 1);
  mlp.forward_backward(b.inputs.data(), b.labels.data(), kBatch);
  const std::vector<float> analytic(mlp.gradients().begin(), mlp.gradients().end());
  // evaluate() sums the loss in double, so the difference quotient is not
  // swamped by rounding the mean loss to float.
  auto loss = [&] { return mlp.evaluate(b.inputs.data(), b.labels.data(), kBatch).loss(); };
  // Small enough that no ReLU input of this fixed batch crosses zero within
  // +-h, large enough that float rounding in the logits (~1e-7) stays below
  // the tolerance once divided by 2h.
  constexpr float kStep = 1e-3f;
  for (const ParamInfo& info : mlp.params()) {
    int nonzero = 0;
    for (size_t i = 0; i < info.size; ++i) {
      float& p = mlp.parameters()[info.offset + i];
      const float saved = p;
      p = saved + kStep;
      const double up = p;
      const double loss_up = loss();
      p = saved - kStep;
      const double down = p;
      const double loss_down = loss();
      p = saved;
      // Divide by the step actually taken: saved +- h is rounded to float.
      const double numeric = (loss_up - loss_down) / (up - down);
      const double got = analytic[info.offset + i];
      EXPECT_NEAR(got, numeric, 5e-5 + 1e-3 * std::abs(numeric)) << info.name << "[" << i << "]";
      if (got != 0.0) ++nonzero;
    }
    // A gradient of all zeros would pass the check above for a dead layer.
    EXPECT_GT(nonzero, 0) << info.name;
  }
}

TEST(TestModelMlp, GradientsMatchFiniteDifferences) { expect_gradients_match_finite_differences(small_spec(), 11); }

TEST(TestModelMlp, LinearModelGradientsMatchFiniteDifferences) {
  expect_gradients_match_finite_differences(small_spec({}), 23);
}

TEST(TestModelMlp, SoftmaxCrossEntropyGradientMatchesFiniteDifferences) {
  constexpr int kRows = 4;
  constexpr int kClasses = 5;
  constexpr float kScale = 1.0f / kRows;
  Rng rng(5);
  std::vector<float> logits(kRows * kClasses);
  for (float& x : logits) x = 2.0f * rng.normal();
  const std::vector<int32_t> labels = {0, 3, 4, 3};
  std::vector<float> dlogits(logits.size());
  softmax_cross_entropy(logits.data(), labels.data(), kRows, kClasses, dlogits.data(), kScale, nullptr);
  // row - max is rounded to float before the double exp, so the loss carries
  // float-sized noise (~5e-7); a step of 1e-2 keeps both that noise over 2h
  // and the O(h^2) truncation error near 5e-6.
  constexpr float kStep = 1e-2f;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float saved = logits[i];
    logits[i] = saved + kStep;
    const double up = logits[i];
    const double loss_up = softmax_cross_entropy(logits.data(), labels.data(), kRows, kClasses, nullptr, 0, nullptr);
    logits[i] = saved - kStep;
    const double down = logits[i];
    const double loss_down = softmax_cross_entropy(logits.data(), labels.data(), kRows, kClasses, nullptr, 0, nullptr);
    logits[i] = saved;
    const double numeric = kScale * (loss_up - loss_down) / (up - down);
    EXPECT_NEAR(dlogits[i], numeric, 5e-6) << "logit " << i;
  }
  // Softmax minus one-hot: every row of the gradient sums to zero.
  for (int r = 0; r < kRows; ++r) {
    double sum = 0;
    for (int j = 0; j < kClasses; ++j) sum += dlogits[static_cast<size_t>(r * kClasses + j)];
    EXPECT_NEAR(sum, 0.0, 1e-7) << "row " << r;
  }
}

TEST(TestModelMlp, SoftmaxCrossEntropyKnownValuesAndStability) {
  const std::vector<float> logits = {0, 0, 0, 1000, 0, -1000, 1000, 0, -1000};
  const std::vector<int32_t> labels = {1, 0, 2};
  std::vector<float> dlogits(logits.size());
  int64_t correct = 5;  // accumulates onto what the caller already counted
  const double loss = softmax_cross_entropy(logits.data(), labels.data(), 3, 3, dlogits.data(), 1.0f, &correct);
  // log 3 for the uniform row, 0 and 2000 for the saturated ones: no overflow.
  EXPECT_NEAR(loss, std::log(3.0) + 0.0 + 2000.0, 1e-9);
  // Ties go to the first class, so the uniform row (label 1) is wrong.
  EXPECT_EQ(correct, 6);
  EXPECT_FLOAT_EQ(dlogits[0], 1.0f / 3);
  EXPECT_FLOAT_EQ(dlogits[1], -2.0f / 3);
  EXPECT_FLOAT_EQ(dlogits[2], 1.0f / 3);
  EXPECT_FLOAT_EQ(dlogits[3], 0.0f);
  EXPECT_FLOAT_EQ(dlogits[6], 1.0f);
  EXPECT_FLOAT_EQ(dlogits[8], -1.0f);
  for (float d : dlogits) EXPECT_TRUE(std::isfinite(d));
}

TEST(TestModelMlp, ParametersUsePyTorchLinearLayout) {
  Mlp mlp(small_spec());
  const auto& params = mlp.params();
  struct Expected {
    const char* name;
    std::vector<int64_t> shape;
  };
  const std::vector<Expected> expected = {
      {"layers.0.weight", {5, 7}}, {"layers.0.bias", {5}},      {"layers.1.weight", {4, 5}},
      {"layers.1.bias", {4}},      {"layers.2.weight", {3, 4}}, {"layers.2.bias", {3}},
  };
  ASSERT_EQ(params.size(), expected.size());
  size_t end = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].name, expected[i].name);
    EXPECT_EQ(params[i].shape, expected[i].shape) << params[i].name;
    EXPECT_EQ(params[i].is_matrix(), expected[i].shape.size() == 2) << params[i].name;
    size_t size = 1;
    for (int64_t d : params[i].shape) size *= static_cast<size_t>(d);
    EXPECT_EQ(params[i].size, size) << params[i].name;
    // In flat order and not overlapping: optimizers and checkpoints slice by offset.
    EXPECT_GE(params[i].offset, end) << params[i].name;
    end = params[i].offset + params[i].size;
  }
  EXPECT_LE(end, mlp.num_params());
  EXPECT_EQ(mlp.parameters().size(), mlp.num_params());
  EXPECT_EQ(mlp.gradients().size(), mlp.num_params());
}

// The gradient check cannot tell a transposed weight layout from the right one
// (forward and backward would agree with each other); an independent forward
// pass that reads W as [out, in] can.
TEST(TestModelMlp, ForwardMatchesManualPyTorchLayoutForward) {
  Mlp mlp(small_spec());
  mlp.init(3);
  const Batch b = random_batch(mlp.spec(), kBatch, 4);
  const EvalResult got = mlp.evaluate(b.inputs.data(), b.labels.data(), kBatch);
  const EvalResult want = manual_evaluate(mlp, b, kBatch);
  EXPECT_EQ(got.count, kBatch);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * want.loss_sum);
}

TEST(TestModelMlp, InitIsDeterministicPerSeed) {
  Mlp a(small_spec());
  Mlp b(small_spec());
  Mlp c(small_spec());
  a.init(42);
  b.init(42);
  c.init(43);
  const std::vector<float> pa(a.parameters().begin(), a.parameters().end());
  const std::vector<float> pb(b.parameters().begin(), b.parameters().end());
  const std::vector<float> pc(c.parameters().begin(), c.parameters().end());
  EXPECT_EQ(pa, pb);
  EXPECT_NE(pa, pc);
  // Re-initialising overwrites whatever training did.
  for (float& p : a.parameters()) p += 1.0f;
  a.init(42);
  EXPECT_EQ(std::vector<float>(a.parameters().begin(), a.parameters().end()), pb);
}

// nn.Linear draws weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
TEST(TestModelMlp, InitStaysWithinPyTorchBound) {
  MlpSpec spec;
  spec.inputs = 100;
  spec.hidden = {64};
  spec.classes = 10;
  Mlp mlp(spec);
  mlp.init(7);
  const auto params = mlp.parameters();
  std::vector<bool> inside_tensor(params.size(), false);
  const auto& infos = mlp.params();
  for (size_t t = 0; t < infos.size(); ++t) {
    const ParamInfo& info = infos[t];
    // Tensors come in (weight, bias) pairs; both use the weight's fan-in.
    const int64_t fan_in = infos[t / 2 * 2].shape[1];
    // The relative slack covers the bound itself being rounded to float.
    const double bound = (1.0 + 1e-6) / std::sqrt(static_cast<double>(fan_in));
    float lo = 0;
    float hi = 0;
    for (size_t i = info.offset; i < info.offset + info.size; ++i) {
      inside_tensor[i] = true;
      EXPECT_LE(std::abs(params[i]), bound) << info.name << "[" << i - info.offset << "]";
      lo = std::min(lo, params[i]);
      hi = std::max(hi, params[i]);
    }
    // The draws fill the range rather than sitting near zero; a tensor of 50
    // uniform values misses the outer half on one side with odds of 0.75^50.
    if (info.size >= 50) {
      EXPECT_LT(lo, -0.5 * bound) << info.name;
      EXPECT_GT(hi, 0.5 * bound) << info.name;
    }
  }
  // Alignment padding between tensors is not a parameter and stays zero.
  for (size_t i = 0; i < params.size(); ++i) {
    if (!inside_tensor[i]) {
      EXPECT_EQ(params[i], 0.0f) << "padding at " << i;
    }
  }
}

TEST(TestModelMlp, EvaluateCountsCorrectPredictions) {
  MlpSpec spec;
  spec.inputs = 2;
  spec.hidden = {};
  spec.classes = 2;
  Mlp mlp(spec);
  // W = [[1, 2], [0, 1]] as [out, in], b = [0, 0.5]: logits (x0 + 2 x1, x1 + 0.5).
  const auto& w = mlp.params()[0];
  const auto& bias = mlp.params()[1];
  auto p = mlp.parameters();
  p[w.offset + 0] = 1;
  p[w.offset + 1] = 2;
  p[w.offset + 2] = 0;
  p[w.offset + 3] = 1;
  p[bias.offset + 0] = 0;
  p[bias.offset + 1] = 0.5f;
  const std::vector<float> inputs = {2, 0, -1, 1, 1, -1, -3, 1, 0.5f, 0};
  // Logits by hand: (2, 0.5), (1, 1.5), (-1, -0.5), (-1, 1.5), (0.5, 0.5).
  const std::vector<int32_t> labels = {0, 1, 0, 0, 0};
  const EvalResult r = mlp.evaluate(inputs.data(), labels.data(), 5);
  EXPECT_EQ(r.count, 5);
  EXPECT_EQ(r.correct, 3);  // rows 0, 1 and the tie in row 4 (first class wins)
  EXPECT_DOUBLE_EQ(r.accuracy(), 0.6);
  // Two-class cross-entropy: log(1 + exp(other - label)).
  const double want = std::log1p(std::exp(-1.5)) + std::log1p(std::exp(-0.5)) + std::log1p(std::exp(0.5)) +
                      std::log1p(std::exp(2.5)) + std::log(2.0);
  EXPECT_NEAR(r.loss_sum, want, 1e-6);
  EXPECT_NEAR(r.loss(), want / 5, 1e-6);
  // Chunking is only a memory bound: it must not change the result.
  const EvalResult chunked = mlp.evaluate(inputs.data(), labels.data(), 5, /*chunk=*/2);
  EXPECT_EQ(chunked.count, 5);
  EXPECT_EQ(chunked.correct, 3);
  EXPECT_NEAR(chunked.loss_sum, r.loss_sum, 1e-12);
  const EvalResult empty = mlp.evaluate(inputs.data(), labels.data(), 0);
  EXPECT_EQ(empty.count, 0);
  EXPECT_EQ(empty.loss(), 0.0);
  EXPECT_EQ(empty.accuracy(), 0.0);
}

TEST(TestModelMlp, EvaluateMatchesForwardBackwardLoss) {
  Mlp mlp(small_spec());
  mlp.init(9);
  const Batch b = random_batch(mlp.spec(), kBatch, 10);
  const float loss = mlp.forward_backward(b.inputs.data(), b.labels.data(), kBatch);
  const std::vector<float> grads(mlp.gradients().begin(), mlp.gradients().end());
  const EvalResult r = mlp.evaluate(b.inputs.data(), b.labels.data(), kBatch);
  EXPECT_NEAR(loss, r.loss(), 1e-6 * r.loss());
  EXPECT_GT(loss, 0.0f);
  // Evaluation must leave the gradients of the last training step alone.
  EXPECT_EQ(std::vector<float>(mlp.gradients().begin(), mlp.gradients().end()), grads);
}

// Gradients are overwritten, not accumulated, and a smaller batch after a
// larger one reuses the workspace without reading stale rows.
TEST(TestModelMlp, ForwardBackwardOverwritesGradients) {
  Mlp mlp(small_spec());
  mlp.init(1);
  Mlp fresh(small_spec());
  fresh.init(1);
  const Batch big = random_batch(mlp.spec(), 9, 2);
  const Batch small = random_batch(mlp.spec(), 3, 3);
  mlp.forward_backward(big.inputs.data(), big.labels.data(), 9);
  const float loss = mlp.forward_backward(small.inputs.data(), small.labels.data(), 3);
  const float fresh_loss = fresh.forward_backward(small.inputs.data(), small.labels.data(), 3);
  EXPECT_EQ(loss, fresh_loss);
  EXPECT_EQ(std::vector<float>(mlp.gradients().begin(), mlp.gradients().end()),
            std::vector<float>(fresh.gradients().begin(), fresh.gradients().end()));
}

TEST(TestModelMlp, SpecParseAcceptsHiddenLists) {
  auto two = MlpSpec::parse("mlp:256,128", 784, 10);
  ASSERT_TRUE(two) << two.error().message;
  EXPECT_EQ(two->inputs, 784);
  EXPECT_EQ(two->classes, 10);
  EXPECT_EQ(two->hidden, (std::vector<int>{256, 128}));
  EXPECT_EQ(two->to_string(), "mlp:256,128");
  auto one = MlpSpec::parse("mlp:65536", 3, 2);
  ASSERT_TRUE(one) << one.error().message;
  EXPECT_EQ(one->hidden, (std::vector<int>{65536}));
  // "mlp:" is a linear model: no hidden layers.
  auto linear = MlpSpec::parse("mlp:", 20, 4);
  ASSERT_TRUE(linear) << linear.error().message;
  EXPECT_TRUE(linear->hidden.empty());
  EXPECT_EQ(linear->to_string(), "mlp:");
  EXPECT_EQ(Mlp(*linear).params().size(), 2u);
}

TEST(TestModelMlp, SpecParseRejectsMalformedText) {
  for (const std::string text : {"", "mlp", "MLP:5", "cnn:5", "mlp:256,", "mlp:,5", "mlp:1,,2", "mlp:a", "mlp:12x",
                                 "mlp: 5", "mlp:0", "mlp:-4", "mlp:65537", "mlp:99999999999", "mlp:2.5"}) {
    auto spec = MlpSpec::parse(text, 784, 10);
    ASSERT_FALSE(spec) << "'" << text << "' was accepted";
    EXPECT_EQ(spec.error().kind, ErrorKind::kUsage) << text;
    EXPECT_NE(spec.error().message.find("'" + text + "'"), std::string::npos) << spec.error().message;
  }
}

}  // namespace
}  // namespace cfmo::model
