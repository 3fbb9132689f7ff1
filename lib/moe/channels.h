#pragma once
/// cfmo-moe's message stream over the transport seam (comm/communicator.h).

#include "comm/communicator.h"

namespace cfmo::moe::channels {

inline constexpr comm::Channel kExperts{8};  ///< the async engine's tokens, results and end markers

}  // namespace cfmo::moe::channels
