#pragma once
/// How the Mixture-of-Experts layers of a model train (model/moe_mlp.h):
/// flags, not the model's shape. A header of its own so that configuration
/// code does not pull in the layer and its dispatch.

#include "moe/router.h"

namespace cfmo::model {

struct MoeOptions {
  double aux_loss = 0.01;  ///< coefficient of the load-balancing loss
  double z_loss = 0.001;   ///< coefficient of the router z-loss
  double capacity_factor = 1.25;
  moe::DropPolicy drop_policy = moe::DropPolicy::kResidual;
  /// --expert-parallel: this process holds only the experts e with
  /// e mod expert_ranks == expert_rank (its parameters, gradients and so its
  /// optimizer state); 1 rank holds them all.
  int expert_rank = 0;
  int expert_ranks = 1;
  /// --dispatch async: the exchanges without collectives, up to a deadline
  /// (model/expert_exchange.h); --dispatch-deadline in seconds: < 0
  /// adaptive, infinity none.
  bool async_dispatch = false;
  double dispatch_deadline_s = -1;
  /// --slowdown's FACTOR for this rank: async dispatch serves its peers on a
  /// thread of its own, which the step loop's sleep does not stretch, so the
  /// exchange stretches each chunk it serves by it: a slow rank serves slowly.
  double serve_slowdown = 1;
};

}  // namespace cfmo::model
