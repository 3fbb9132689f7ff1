#include "moe/router.h"

#include "core/rng.h"
#include "tensor/ops.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>

namespace cfmo::moe {

Result<RoutingSkew> parse_routing(std::string_view text) {
  auto bad = [&] {
    return make_error(ErrorKind::kUsage,
                      "--routing '{}': expected uniform, balanced, zipf:S (S > 0) or hot:F (0 < F <= 1)", text);
  };
  if (text == "uniform") return RoutingSkew{RoutingSkew::Kind::kUniform, 0};
  if (text == "balanced") return RoutingSkew{RoutingSkew::Kind::kBalanced, 0};
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return bad();
  const std::string_view name = text.substr(0, colon);
  const std::string_view number = text.substr(colon + 1);
  double value = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || end != number.data() + number.size() || !std::isfinite(value)) return bad();
  if (name == "zipf" && value > 0 && value <= 100) return RoutingSkew{RoutingSkew::Kind::kZipf, value};
  if (name == "hot" && value > 0 && value <= 1) return RoutingSkew{RoutingSkew::Kind::kHot, value};
  return bad();
}

Result<DropPolicy> parse_drop_policy(std::string_view text) {
  if (text == "residual") return DropPolicy::kResidual;
  if (text == "dropless") return DropPolicy::kDropless;
  return make_error(ErrorKind::kUsage, "--drop-policy '{}': expected residual or dropless", text);
}

std::string to_string(const RoutingSkew& skew) {
  switch (skew.kind) {
    case RoutingSkew::Kind::kUniform:
      return "uniform";
    case RoutingSkew::Kind::kBalanced:
      return "balanced";
    case RoutingSkew::Kind::kZipf:
      return fmt::format("zipf:{}", skew.value);
    case RoutingSkew::Kind::kHot:
      return fmt::format("hot:{}", skew.value);
  }
  return "?";
}

int64_t expert_capacity(int64_t tokens, int top_k, int experts, double capacity_factor) {
  // Computed in long double so that exact products (1.25 * 2 * 10 / 4 = 6.25)
  // do not pick up a binary rounding that ceil would turn into one more slot.
  const long double slots = static_cast<long double>(capacity_factor) * top_k * static_cast<long double>(tokens) /
                            static_cast<long double>(experts);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(slots - 1e-9L)));
}

void apply_capacity(Routing& r, int64_t capacity) {
  r.kept.assign(r.expert.size(), 1);
  r.dropped = 0;
  if (capacity < 0) return;
  std::vector<int64_t> used(static_cast<size_t>(r.experts), 0);
  for (int j = 0; j < r.top_k; ++j) {
    for (int64_t t = 0; t < r.tokens; ++t) {
      const size_t a = static_cast<size_t>(t * r.top_k + j);
      auto& n = used[static_cast<size_t>(r.expert[a])];
      if (n < capacity) {
        ++n;
      } else {
        r.kept[a] = 0;
        ++r.dropped;
      }
    }
  }
}

void softmax_row(const float* logits, int experts, float* prob) {
  const float top = *std::max_element(logits, logits + experts);
  double sum = 0;
  for (int e = 0; e < experts; ++e) {
    prob[e] = std::exp(logits[e] - top);
    sum += prob[e];
  }
  for (int e = 0; e < experts; ++e) prob[e] = static_cast<float>(prob[e] / sum);
}

float renormalise_gates(const float* prob, const int32_t* expert, int top_k, float* gate) {
  float chosen = 0;
  for (int j = 0; j < top_k; ++j) chosen += prob[expert[j]];
  for (int j = 0; j < top_k; ++j) gate[j] = prob[expert[j]] / chosen;
  return chosen;
}

float top_k_row(const float* prob, int experts, int top_k, int32_t* expert, float* gate, std::vector<int32_t>& order) {
  order.resize(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  // Descending probability; ties to the lower expert, so the choice is deterministic.
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); });
  std::copy(order.begin(), order.begin() + top_k, expert);
  return renormalise_gates(prob, expert, top_k, gate);
}

Router::Router(uint64_t seed, int hidden, int experts, int top_k, RoutingSkew skew)
    : hidden_(hidden), experts_(experts), top_k_(top_k), skew_(skew), seed_(seed) {
  Rng rng(seed, 0x524F55544552ULL);  // "ROUTER"
  weights_.resize(static_cast<size_t>(hidden) * static_cast<size_t>(experts));
  // Unit variance: with unit-variance hidden states and the 1/sqrt(hidden)
  // below, each logit is about N(0, 1).
  for (float& w : weights_) w = rng.uniform(-1.7320508f, 1.7320508f);
}

Router::Router(std::vector<float> weights, int hidden, int experts, int top_k, RoutingSkew skew, uint64_t seed)
    : weights_(std::move(weights)), hidden_(hidden), experts_(experts), top_k_(top_k), skew_(skew), seed_(seed) {}

Routing Router::route(const float* x, int64_t tokens, uint64_t stream, int64_t first_token) const {
  Routing r;
  r.tokens = tokens;
  r.top_k = top_k_;
  r.experts = experts_;
  const auto e_count = static_cast<size_t>(experts_);
  const auto assignments = static_cast<size_t>(tokens) * static_cast<size_t>(top_k_);
  r.expert.resize(assignments);
  r.gate.resize(assignments);
  r.load.assign(e_count, 0);
  std::vector<float> logits(static_cast<size_t>(tokens) * e_count);
  if (tokens > 0) {
    tensor::ops::gemm(tensor::ops::Trans::kNo, tensor::ops::Trans::kNo, static_cast<int>(tokens), experts_, hidden_,
                      1.0f / std::sqrt(static_cast<float>(hidden_)), x, hidden_, weights_.data(), experts_, 0.0f,
                      logits.data(), experts_);
  }
  std::vector<float> bias(e_count, 0.0f);
  if (skew_.kind == RoutingSkew::Kind::kZipf) {
    for (size_t e = 0; e < e_count; ++e) bias[e] = static_cast<float>(-skew_.value * std::log(double(e) + 1.0));
  }
  Rng hot_rng(seed_ ^ 0x484F54ULL, stream);
  std::vector<float> prob(e_count);
  std::vector<int32_t> order;
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = logits.data() + static_cast<size_t>(t) * e_count;
    for (size_t e = 0; e < e_count; ++e) row[e] += bias[e];
    if (skew_.kind == RoutingSkew::Kind::kHot && hot_rng.uniform() < skew_.value) {
      row[0] = *std::max_element(row, row + e_count) + 8.0f;  // first choice, by a wide margin
    }
    softmax_row(row, experts_, prob.data());
    int32_t* chosen = r.expert.data() + static_cast<size_t>(t) * static_cast<size_t>(top_k_);
    float* gates = r.gate.data() + static_cast<size_t>(t) * static_cast<size_t>(top_k_);
    if (skew_.kind == RoutingSkew::Kind::kBalanced) {
      // Round-robin over the experts, k distinct ones per token.
      for (int j = 0; j < top_k_; ++j) {
        chosen[j] = static_cast<int32_t>(((first_token + t) * top_k_ + j) % static_cast<int64_t>(e_count));
      }
      renormalise_gates(prob.data(), chosen, top_k_, gates);
    } else {
      top_k_row(prob.data(), experts_, top_k_, chosen, gates, order);
    }
    for (int j = 0; j < top_k_; ++j) ++r.load[static_cast<size_t>(chosen[j])];
  }
  r.kept.assign(assignments, 1);
  return r;
}

double load_imbalance(std::span<const int64_t> load) {
  if (load.empty()) return 1.0;
  const double total = static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0}));
  if (total <= 0) return 1.0;
  const double mean = total / static_cast<double>(load.size());
  return static_cast<double>(*std::max_element(load.begin(), load.end())) / mean;
}

}  // namespace cfmo::moe
