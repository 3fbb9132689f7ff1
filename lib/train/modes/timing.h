#pragma once
/// The clock the modes measure their waits and deadlines with.

#include "core/clock.h"

#include <chrono>

namespace cfmo::modes {

using Clock = std::chrono::steady_clock;

using cfmo::seconds_since;

inline Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace cfmo::modes
