#pragma once
/// How long each peer has been silent, counted only while this rank was
/// listening. A rank that is not running cannot hear its peers, and when
/// the whole host stalls (every process descheduled at once: a loaded CI
/// machine, a throttled container, a paused VM) its peers could not speak
/// either; on waking, the first look at the clock would find every peer
/// silent for the stall's length and take live ranks for lost. So a gap
/// between two looks longer than `slack` (the listener's own stall) does
/// not count against the peers: silence is listening time without a word.
/// A peer stopped or dead while this rank listens is still silent after
/// the peer timeout of listening. Not thread-safe: one thread listens.

#include <chrono>
#include <vector>

namespace cfmo::comm {

class SilenceClock {
 public:
  using Clock = std::chrono::steady_clock;

  /// `size` peers (this rank's own entry unused), all heard at `now`.
  SilenceClock(int size, Clock::duration slack, Clock::time_point now);

  /// Every peer was heard at `now` (the connection's start).
  void reset(Clock::time_point now);
  /// The world grew to `size` peers: the new ones heard at `now` (their join).
  void grow(int size, Clock::time_point now);
  /// A message from `peer` arrived at `now`.
  void heard(int peer, Clock::time_point now);
  /// This rank looks at `now`: a gap since its last look longer than the
  /// slack was not listening, and is taken off every peer's silence.
  void listened(Clock::time_point now);
  /// How long `peer` has been silent while this rank listened, as of its last look.
  double silent_s(int peer) const;
  /// The listening time given back so far: how long this rank itself did not listen.
  double stalled_s() const { return std::chrono::duration<double>(stalled_).count(); }

 private:
  Clock::duration slack_;
  Clock::time_point last_look_;
  std::vector<Clock::time_point> heard_;  ///< per peer, moved on by the listener's stalls
  Clock::duration stalled_{};
};

}  // namespace cfmo::comm
