#pragma once
/// The router of a Mixture-of-Experts layer: a real softmax router (hidden
/// states times router weights), top-k, capacity, and the generators that
/// give the routing a controlled skew.
///
/// Skews act on the router's logits: uniform adds nothing (random hidden
/// states and weights spread tokens about evenly), zipf:S adds -S ln(e+1) to
/// expert e's logit (expert popularity falls off as (e+1)^-S), hot:F raises
/// expert 0 into every top-k of a fraction F of the tokens, and balanced
/// assigns experts round-robin (exact equal loads, the gates still from the
/// softmax) for bandwidth measurements.

#include "core/error.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cfmo::moe {

enum class DropPolicy : uint8_t { kResidual, kDropless };

/// "residual" or "dropless"; kUsage naming --drop-policy otherwise.
Result<DropPolicy> parse_drop_policy(std::string_view text);

struct RoutingSkew {
  enum class Kind : uint8_t { kUniform, kBalanced, kZipf, kHot };
  Kind kind = Kind::kUniform;
  double value = 0;  ///< S for zipf, F for hot
};

/// "uniform", "balanced", "zipf:S" (S > 0) or "hot:F" (0 < F <= 1).
Result<RoutingSkew> parse_routing(std::string_view text);
std::string to_string(const RoutingSkew& skew);

/// Slots each expert has for the tokens of one source rank:
/// ceil(capacity_factor * top_k * tokens / experts), at least 1.
int64_t expert_capacity(int64_t tokens, int top_k, int experts, double capacity_factor);

/// One iteration's routing of one rank's tokens. Assignment a = t * top_k + j
/// is token t's j-th choice (choices in descending probability).
struct Routing {
  int64_t tokens = 0;
  int top_k = 0;
  int experts = 0;
  std::vector<int32_t> expert;  ///< [a]
  std::vector<float> gate;      ///< [a]: softmax probability renormalised over the token's top-k
  std::vector<uint8_t> kept;    ///< [a]: 0 when dropped by capacity
  std::vector<int64_t> load;    ///< [e]: assignments before capacity
  int64_t dropped = 0;
};

/// Drops assignments beyond `capacity` per expert (GShard's order: every
/// token's first choice in token order, then every second choice, ...).
/// capacity < 0 keeps everything (dropless).
void apply_capacity(Routing& routing, int64_t capacity);

/// Softmax of one token's logits [experts] into prob (exponents in float, summed in double).
void softmax_row(const float* logits, int experts, float* prob);
/// The `top_k` experts of one token's prob [experts] in descending
/// probability (ties to the lower expert) into expert[0, top_k), their
/// probabilities renormalised to sum 1 (Mixtral) into gate; returns the sum
/// of the chosen probabilities. `order` is scratch.
float top_k_row(const float* prob, int experts, int top_k, int32_t* expert, float* gate, std::vector<int32_t>& order);
/// gate[j] = prob[expert[j]] / sum over the token's chosen experts; returns that sum.
float renormalise_gates(const float* prob, const int32_t* expert, int top_k, float* gate);

class Router {
 public:
  /// Router weights [hidden, experts] drawn from `seed` (the same on every rank).
  Router(uint64_t seed, int hidden, int experts, int top_k, RoutingSkew skew);
  /// Given weights, row-major [hidden, experts] (for tests).
  Router(std::vector<float> weights, int hidden, int experts, int top_k, RoutingSkew skew, uint64_t seed = 0);

  /// Routes `tokens` rows of `x` [tokens, hidden]; `stream` seeds hot:F's
  /// per-token draws and `first_token` offsets balanced's round-robin.
  /// Capacity is not applied here.
  Routing route(const float* x, int64_t tokens, uint64_t stream, int64_t first_token = 0) const;

  int hidden() const { return hidden_; }
  int experts() const { return experts_; }

 private:
  std::vector<float> weights_;
  int hidden_;
  int experts_;
  int top_k_;
  RoutingSkew skew_;
  uint64_t seed_;
};

/// Max over experts of the load divided by the mean load (1 = perfectly even).
double load_imbalance(std::span<const int64_t> load);

}  // namespace cfmo::moe
