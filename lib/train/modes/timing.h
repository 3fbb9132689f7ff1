#pragma once
/// The clock the modes measure their waits and deadlines with: steady_clock
/// in a real run, the simulator's virtual clock under lib/sim (core/clock.h).

#include "core/clock.h"

#include <chrono>

namespace cfmo::train::modes {

using Clock = cfmo::SeamClock;

using cfmo::seam_sleep_for;
using cfmo::seam_yield;

using cfmo::seconds_since;

inline Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace cfmo::train::modes
