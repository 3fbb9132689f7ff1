#include "comm/silence_clock.h"

#include <algorithm>

namespace cfmo::comm {

SilenceClock::SilenceClock(int size, Clock::duration slack, Clock::time_point now)
    : slack_(slack), last_look_(now), heard_(static_cast<size_t>(size), now) {}

void SilenceClock::grow(int size, Clock::time_point now) {
  if (static_cast<size_t>(size) > heard_.size()) heard_.resize(static_cast<size_t>(size), now);
}

void SilenceClock::reset(Clock::time_point now) {
  std::fill(heard_.begin(), heard_.end(), now);
  last_look_ = now;
}

void SilenceClock::heard(int peer, Clock::time_point now) {
  if (peer >= 0 && static_cast<size_t>(peer) < heard_.size()) heard_[static_cast<size_t>(peer)] = now;
}

void SilenceClock::listened(Clock::time_point now) {
  const Clock::duration gap = now - last_look_;
  if (gap > slack_) {
    // Moving each "heard" on by the time not listened keeps the silence
    // heard before the stall and the silence since.
    const Clock::duration deaf = gap - slack_;
    stalled_ += deaf;
    for (auto& t : heard_) t = std::min(t + deaf, now);
  }
  last_look_ = std::max(last_look_, now);
}

double SilenceClock::silent_s(int peer) const {
  return std::max(0.0, std::chrono::duration<double>(last_look_ - heard_[static_cast<size_t>(peer)]).count());
}

}  // namespace cfmo::comm
