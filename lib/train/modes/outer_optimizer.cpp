#include "train/modes/outer_optimizer.h"

#include <algorithm>

namespace cfmo::train {

OuterOptimizer::OuterOptimizer(const ModeSettings& settings, size_t size, int contributions_per_round)
    : nesterov_(settings.outer_optimizer == OuterKind::kNesterov),
      base_lr_(static_cast<float>(settings.outer_lr)),
      base_mu_(static_cast<float>(settings.outer_momentum)),
      warmup_(nesterov_ ? std::max(0, settings.outer_warmup) : 0),
      lr_(base_lr_),
      mu_(base_mu_),
      per_round_(std::max(1, contributions_per_round)),
      momentum_(nesterov_ ? size : 0, 0.0f),
      round_sum_(nesterov_ && per_round_ > 1 ? size : 0, 0.0f) {
  set_round(0);
}

void OuterOptimizer::set_round(int64_t round) {
  if (warmup_ == 0) return;
  const float ramp =
      round >= warmup_ ? 1.0f : static_cast<float>(std::max<int64_t>(0, round)) / static_cast<float>(warmup_);
  lr_ = 1.0f + (base_lr_ - 1.0f) * ramp;
  mu_ = base_mu_ * ramp;
}

void OuterOptimizer::apply(std::span<float> global, std::span<const float> delta, float weight) {
  const size_t n = global.size();
  for (size_t i = 0; i < n; ++i) global[i] += lr_ * weight * delta[i];
  if (!nesterov_) return;
  // Rounds of several contributions since the start (a round shrunk to one by
  // losses still completes here: the sum of one is its contribution).
  if (!round_sum_.empty()) {
    for (size_t i = 0; i < n; ++i) round_sum_[i] += weight * delta[i];
    if (++in_round_ < per_round_) return;
    in_round_ = 0;
    for (size_t i = 0; i < n; ++i) {
      momentum_[i] = mu_ * momentum_[i] + round_sum_[i];
      round_sum_[i] = 0;
      global[i] += lr_ * mu_ * momentum_[i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    momentum_[i] = mu_ * momentum_[i] + weight * delta[i];
    global[i] += lr_ * mu_ * momentum_[i];
  }
}

void OuterOptimizer::restore(int in_round, std::span<const float> momentum, std::span<const float> round_sum) {
  if (momentum.size() == momentum_.size()) std::copy(momentum.begin(), momentum.end(), momentum_.begin());
  if (round_sum.size() == round_sum_.size()) {
    std::copy(round_sum.begin(), round_sum.end(), round_sum_.begin());
    in_round_ = std::clamp(in_round, 0, per_round_ - 1);
  }
}

}  // namespace cfmo::train
