// SilenceClock: a peer's silence counts only the time this rank listened.
#include "comm/silence_clock.h"

#include <gtest/gtest.h>

namespace cfmo::comm {
namespace {

using Clock = SilenceClock::Clock;
using std::chrono::milliseconds;

TEST(SilenceClock, CountsSilenceWhileTheRankLooksOften) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  SilenceClock clock(3, milliseconds(500), t0);
  auto t = t0;
  for (int i = 0; i < 1000; ++i) {  // a look every 5 ms, for 5 s; rank 1 heard throughout
    t += milliseconds(5);
    clock.heard(1, t);
    clock.listened(t);
  }
  EXPECT_NEAR(clock.silent_s(2), 5.0, 1e-9);
  EXPECT_NEAR(clock.silent_s(1), 0.0, 1e-9);
  EXPECT_EQ(clock.stalled_s(), 0.0);
}

TEST(SilenceClock, ALookAfterAStallOfItsOwnDoesNotCountTheStall) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  SilenceClock clock(2, milliseconds(500), t0);
  clock.listened(t0 + milliseconds(300));                             // 0.3 s of silence heard
  clock.listened(t0 + milliseconds(300) + std::chrono::seconds(10));  // then 10 s not running
  // The slack (0.5 s) of the gap counts, the rest does not.
  EXPECT_NEAR(clock.silent_s(1), 0.8, 1e-9);
  EXPECT_NEAR(clock.stalled_s(), 9.5, 1e-9);
  // Listening again, the silence grows as before.
  clock.listened(t0 + milliseconds(300) + std::chrono::seconds(10) + milliseconds(5));
  EXPECT_NEAR(clock.silent_s(1), 0.805, 1e-9);
}

TEST(SilenceClock, HeardAfterTheLastLookIsNoSilence) {
  const auto t0 = Clock::time_point{} + std::chrono::hours(1);
  SilenceClock clock(2, milliseconds(500), t0);
  clock.heard(1, t0 + milliseconds(7));
  EXPECT_EQ(clock.silent_s(1), 0.0);
  clock.reset(t0 + std::chrono::seconds(3));
  clock.listened(t0 + std::chrono::seconds(3) + milliseconds(400));
  EXPECT_NEAR(clock.silent_s(0), 0.4, 1e-9);
}

}  // namespace
}  // namespace cfmo::comm
