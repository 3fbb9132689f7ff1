#pragma once
/// Elapsed time on the monotonic clock, in seconds: what every wait,
/// deadline and report in cfmo measures with.

#include <chrono>

namespace cfmo {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace cfmo
