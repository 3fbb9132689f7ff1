#pragma once
/// Elapsed time on the monotonic clock, in seconds: what every wait,
/// deadline and report in cfmo measures with.
///
/// The seam of a virtual clock: code that a simulation runs unchanged (the
/// training modes, lib/sim) reads SeamClock and waits with seam_sleep_for /
/// seam_yield. On a thread that installed no TimeSource (every real run)
/// they are steady_clock, std::this_thread::sleep_for and yield; the
/// simulator installs one on its thread, which answers with virtual time
/// and turns a wait into an event of its scheduler.

#include <chrono>
#include <thread>

namespace cfmo {

class TimeSource {
 public:
  virtual ~TimeSource() = default;
  virtual std::chrono::steady_clock::time_point now() = 0;
  /// Waits `d` (zero: lets others run, as a yield).
  virtual void sleep_for(std::chrono::steady_clock::duration d) = 0;
};

/// This thread's time source; null: the real clock.
inline TimeSource*& this_thread_time_source() {
  static thread_local TimeSource* source = nullptr;
  return source;
}

/// steady_clock, or the time source this thread installed.
struct SeamClock {
  using rep = std::chrono::steady_clock::rep;
  using period = std::chrono::steady_clock::period;
  using duration = std::chrono::steady_clock::duration;
  using time_point = std::chrono::steady_clock::time_point;
  static constexpr bool is_steady = true;
  static time_point now() {
    TimeSource* source = this_thread_time_source();
    return source != nullptr ? source->now() : std::chrono::steady_clock::now();
  }
};

inline void seam_sleep_for(std::chrono::steady_clock::duration d) {
  if (TimeSource* source = this_thread_time_source()) {
    source->sleep_for(d);
  } else {
    std::this_thread::sleep_for(d);
  }
}

inline void seam_yield() {
  if (TimeSource* source = this_thread_time_source()) {
    source->sleep_for(std::chrono::steady_clock::duration::zero());
  } else {
    std::this_thread::yield();
  }
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(SeamClock::now() - start).count();
}

}  // namespace cfmo
