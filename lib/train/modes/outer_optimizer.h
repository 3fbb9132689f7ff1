#pragma once
/// The outer step of localsgd and cfmo on (a range of) the global parameters.

#include "tensor/buffer.h"
#include "train/modes.h"

#include <algorithm>
#include <cstddef>
#include <span>

namespace cfmo::train {

/// The outer step on (a range of) the global parameters, fed with weighted
/// deltas. localsgd feeds it once per round with the sum of the W deltas
/// weighted 1/W (`contributions_per_round` 1); a cfmo owner feeds it each
/// contribution to its shard as it arrives, weighted beta^s / W (W_live after losses)
/// (`contributions_per_round` W), so that a round of W fresh contributions
/// moves the shard exactly as localsgd's step on their mean.
///
///   avg       global += lr * weight * delta
///   nesterov  global += lr * weight * delta at once, and, once per round,
///             m = mu * m + (the round's weighted deltas); global += lr * mu * m.
///             Per round: DiLoCo's Nesterov step on the mean delta. For cfmo this
///             is the delayed Nesterov update of Async Local-SGD (arXiv
///             2401.09135, without momentum between the updates); a momentum
///             step per contribution would amplify the mean by ~W / (1 - mu).
///
/// Warm-up (nesterov, --outer-warmup R): round r < R (set_round) is taken with
/// lr_r = 1 + (lr - 1) r / R and mu_r = mu r / R, plain averaging at the first
/// round. A momentum of 0.8 takes about 1 / (1 - mu) = 5 rounds to build up
/// and then moves the parameters by lr / (1 - mu) = 2.5 times a round's mean
/// delta; on a run of few rounds that gain comes too late and overshoots (a
/// 3-worker run of 8 rounds a rank ended 1 point below plain averaging in
/// localsgd and 1.5 in cfmo, whose workers train on between a send and its
/// reply: bench/RESULTS.md), while runs of tens of rounds gain from it.
class OuterOptimizer {
 public:
  OuterOptimizer(const ModeSettings& settings, size_t size, int contributions_per_round);
  /// The round the next contributions belong to, 0 the first (rounds
  /// completed before it); sets the warm-up's lr and momentum. The callers
  /// derive it from what every replica of the state agrees on: localsgd from
  /// the step, a cfmo owner and its backup from the shard's version.
  void set_round(int64_t round);
  void apply(std::span<float> global, std::span<const float> delta, float weight);
  /// m, in the deltas' sign (empty for avg): what a checkpoint keeps, and
  /// where a resumed run puts it back.
  std::span<float> momentum() { return momentum_; }
  std::span<const float> momentum() const { return momentum_; }
  /// A round in progress (nesterov with owners): its contributions so far and
  /// their weighted sum. With the momentum, what a backup replica must hold.
  int in_round() const { return in_round_; }
  std::span<const float> round_sum() const { return round_sum_; }
  /// Takes up a state sent by another owner (a shard moving to its backup);
  /// buffers of the wrong size are left as they are.
  void restore(int in_round, std::span<const float> momentum, std::span<const float> round_sum);
  /// A cfmo owner after a loss: a round is now W_live contributions. A round
  /// already past the new count completes at its next contribution.
  void set_contributions_per_round(int contributions) { per_round_ = std::max(1, contributions); }

 private:
  bool nesterov_;
  float base_lr_;  ///< --outer-lr
  float base_mu_;  ///< --outer-momentum
  int warmup_;     ///< --outer-warmup (0 with avg)
  float lr_;       ///< this round's
  float mu_;       ///< this round's
  int per_round_;
  int in_round_ = 0;
  tensor::FloatBuffer momentum_;
  tensor::FloatBuffer round_sum_;
};

}  // namespace cfmo::train
