// The simulator's scheduler: events in time order, fibers that sleep,
// suspend and wake on the virtual clock, the clock seam the modes read, and
// a deadlock named rather than hung.
#include "core/clock.h"
#include "sim/ring.h"
#include "sim/scheduler.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace cfmo::sim {
namespace {

TEST(SimScheduler, EventsRunInTimeOrderAndTiesInTheOrderTheyWereScheduled) {
  Scheduler s;
  std::vector<std::string> log;
  s.at(2.0, [&] { log.push_back("b@" + std::to_string(s.time())); });
  s.at(1.0, [&] { log.push_back("a"); });
  s.at(2.0, [&] { log.push_back("c"); });
  s.at(1.5, [&] {
    log.push_back("nested");
    s.at(1.0, [&] { log.push_back("past is now"); });  // never before now
  });
  ASSERT_TRUE(s.run());
  EXPECT_EQ(log, (std::vector<std::string>{"a", "nested", "past is now", "b@2.000000", "c"}));
  EXPECT_DOUBLE_EQ(s.time(), 2.0);
}

// Events due now skip the heap (a FIFO of their own); one the heap holds for
// the same time with an earlier place (at_order) still runs before them.
TEST(SimScheduler, EventsDueNowKeepTheirPlaceAmongThoseScheduledEarlierForNow) {
  Scheduler s;
  std::vector<std::string> log;
  struct Logger final : EventTarget {
    std::vector<std::string>* log;
    void fire(uint64_t arg) override { log->push_back("ordered " + std::to_string(arg)); }
  } logger;
  logger.log = &log;
  s.at(1.0, [&] {
    const uint64_t early = s.take_order();
    s.at(1.0, [&] { log.push_back("now 1"); });
    s.at_order(1.0, early, &logger, 0);  // its place taken before "now 1"
    s.at(1.0, [&] {
      log.push_back("now 2");
      s.at(1.0, [&] { log.push_back("now 3"); });
    });
    s.at_order(1.0, s.take_order(), &logger, 1);  // after "now 2"
    s.at(1.5, [&] { log.push_back("later"); });
  });
  ASSERT_TRUE(s.run());
  EXPECT_EQ(log, (std::vector<std::string>{"ordered 0", "now 1", "now 2", "ordered 1", "now 3", "later"}));
}

TEST(SimRing, AFifoThatGrowsAndTakesInsertsOnEitherSide) {
  Ring<int> r;
  std::vector<int> want;
  // Around the ring's end several times, growing past 16 on the way.
  for (int i = 0; i < 100; ++i) {
    r.push_back(i);
    want.push_back(i);
    if (i % 3 == 0) {
      EXPECT_EQ(r.front(), want.front());
      r.pop_front();
      want.erase(want.begin());
    }
  }
  r.insert(1, -1);  // near the front: the front moves
  want.insert(want.begin() + 1, -1);
  r.insert(r.size() - 1, -2);  // near the back: the back moves
  want.insert(want.end() - 1, -2);
  r.insert(0, -3);
  want.insert(want.begin(), -3);
  ASSERT_EQ(r.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(r[i], want[i]) << i;
  EXPECT_EQ(r.back(), want.back());
  while (!r.empty()) r.pop_front();
  EXPECT_EQ(r.size(), 0u);
}

TEST(SimScheduler, FibersSleepOnTheVirtualClockAndInterleave) {
  Scheduler s;
  std::vector<std::pair<int, double>> log;
  for (int f = 0; f < 3; ++f) {
    s.spawn([&, f] {
      for (int i = 0; i < 3; ++i) {
        s.sleep(1.0 + f);
        log.emplace_back(f, s.time());
      }
    });
  }
  ASSERT_TRUE(s.run());
  EXPECT_DOUBLE_EQ(s.time(), 9.0);
  ASSERT_EQ(log.size(), 9u);
  for (size_t i = 1; i < log.size(); ++i) EXPECT_LE(log[i - 1].second, log[i].second);
  EXPECT_EQ(log[0], std::make_pair(0, 1.0));
  EXPECT_EQ(log.back(), std::make_pair(2, 9.0));
}

TEST(SimScheduler, ASuspendedFiberResumesWhenWokenAndADeadlockIsNamed) {
  Scheduler s;
  double woke_at = -1;
  const int sleeper = s.spawn([&] {
    s.suspend();
    woke_at = s.time();
  });
  s.at(3.0, [&] { s.wake(sleeper, 4.0); });
  ASSERT_TRUE(s.run());
  EXPECT_DOUBLE_EQ(woke_at, 4.0);

  Scheduler stuck;
  stuck.spawn([&] { stuck.suspend(); });
  const Status ran = stuck.run();
  ASSERT_FALSE(ran);
  EXPECT_EQ(ran.error().kind, ErrorKind::kInternal);
  EXPECT_NE(ran.error().message.find("worker 0 waits"), std::string::npos) << ran.error().message;
}

TEST(SimScheduler, TheClockSeamReadsVirtualTimeInsideAndTheRealClockOutside) {
  Scheduler s;
  double seam_elapsed = -1;
  double virtual_elapsed = -1;
  s.spawn([&] {
    const auto start = SeamClock::now();
    const double t0 = s.time();
    seam_sleep_for(std::chrono::milliseconds(250));  // the modes' polling wait
    seam_yield();                                    // a busy wait: one quantum
    seam_elapsed = seconds_since(start);
    virtual_elapsed = s.time() - t0;
  });
  const auto real_start = std::chrono::steady_clock::now();
  ASSERT_TRUE(s.run());
  EXPECT_NEAR(seam_elapsed, 0.25 + Scheduler::kQuantum, 1e-9);
  EXPECT_NEAR(virtual_elapsed, 0.25 + Scheduler::kQuantum, 1e-9);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - real_start).count(), 0.25);
  EXPECT_EQ(this_thread_time_source(), nullptr);  // a real run's thread is left as it was
}

TEST(SimScheduler, ThousandsOfFibersCostTheirUsedStackOnly) {
  Scheduler s;
  int done = 0;
  for (int f = 0; f < 4096; ++f) {
    s.spawn([&, f] {
      s.sleep(0.001 * (f % 7));
      ++done;
    });
  }
  ASSERT_TRUE(s.run());
  EXPECT_EQ(done, 4096);
}

TEST(SimScheduler, WithAPollCapASeamWaitEndsAtAPokeOrAfterTheCap) {
  Scheduler s;
  s.set_poll_cap(5.0);
  std::vector<double> woke;
  const int poller = s.spawn([&] {
    seam_yield();  // poked at 2
    woke.push_back(s.time());
    seam_sleep_for(std::chrono::milliseconds(1));  // nobody pokes: the cap
    woke.push_back(s.time());
  });
  s.at(2.0, [&] { s.poke(poller); });
  s.at(2.5, [&] { s.poke(poller); });  // the second wait
  ASSERT_TRUE(s.run());
  EXPECT_EQ(woke, (std::vector<double>{2.0, 2.5}));

  Scheduler quiet;
  quiet.set_poll_cap(5.0);
  double at = -1;
  const int alone = quiet.spawn([&] {
    seam_sleep_for(std::chrono::milliseconds(1));
    at = quiet.time();
  });
  quiet.poke(alone);  // not started, so not waiting: nothing
  ASSERT_TRUE(quiet.run());
  EXPECT_DOUBLE_EQ(at, 5.0);
}

}  // namespace
}  // namespace cfmo::sim
