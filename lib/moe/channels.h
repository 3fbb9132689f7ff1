#pragma once
/// The MoE message streams over the transport seam (comm/communicator.h): cfmo-moe's and the model's.

#include "comm/communicator.h"

namespace cfmo::moe::channels {

inline constexpr comm::Channel kExperts{8};  ///< the async engine's tokens, results and end markers
/// cfmo-train --dispatch async: a MoE layer's rows, results and their gradients (model/expert_exchange.h)
inline constexpr comm::Channel kModelExperts{24};

}  // namespace cfmo::moe::channels
