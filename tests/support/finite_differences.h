#pragma once
// Gradient checks by central differences, shared by the models' tests.

#include "core/rng.h"
#include "model/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace cfmo::testing {

inline std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f, uint64_t stream = 3) {
  Rng rng(seed, stream);
  std::vector<float> v(n);
  for (float& x : v) x = scale * rng.normal();
  return v;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

/// Central differences of `loss` with respect to `x` at every `stride`-th
/// entry, against `analytic`. The losses are float computations summed in
/// double, so eps is large enough that rounding stays far below the gradient.
inline void expect_matches_finite_differences(std::vector<float>& x, const std::vector<float>& analytic,
                                              const std::function<double()>& loss, const std::string& what,
                                              float eps = 1e-2f, size_t stride = 1, double relative = 2e-2) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  for (size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2.0 * eps);
    EXPECT_NEAR(analytic[i], numeric, 2e-4 + relative * std::abs(numeric)) << what << "[" << i << "]";
  }
}

/// Every tensor of `model` against central differences of `loss` (which
/// reads the model's parameters); `analytic` the gradients at the current
/// parameters. Tensors over 64 floats are sampled every 7th entry.
inline void expect_model_gradients_match(model::Model& model, const std::vector<float>& analytic,
                                         const std::function<double()>& loss) {
  const std::vector<float> params(model.parameters().begin(), model.parameters().end());
  for (const model::ParamInfo& p : model.params()) {
    const auto first = static_cast<ptrdiff_t>(p.offset);
    const auto last = static_cast<ptrdiff_t>(p.offset + p.size);
    std::vector<float> x(params.begin() + first, params.begin() + last);
    const std::vector<float> g(analytic.begin() + first, analytic.begin() + last);
    auto tensor_loss = [&] {
      std::copy(x.begin(), x.end(), model.parameters().begin() + first);
      return loss();
    };
    expect_matches_finite_differences(x, g, tensor_loss, p.name, 1e-2f, p.size > 64 ? 7 : 1);
    std::copy(params.begin() + first, params.begin() + last, model.parameters().begin() + first);
  }
}

}  // namespace cfmo::testing
