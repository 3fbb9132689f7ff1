#include "diverge/watch.h"

#include "core/atomic_file.h"
#include "unit/diverge_fixtures.h"

#include <gtest/gtest.h>

#include <chrono>

namespace cfmo::diverge {
namespace {

namespace fs = std::filesystem;
using WatchTest = testing::TempDirTest;

TEST_F(WatchTest, EachDeltaIsReturnedOnceInRoundThenRankOrder) {
  const fs::path run = dir_ / "run";
  fs::create_directories(run);
  auto watcher = RunWatcher::open(run);
  ASSERT_TRUE(watcher) << watcher.error().message;
  auto first = watcher->poll();
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(first->empty());  // no deltas/ yet: nothing, not an error

  testing::write_run_delta(run, 1, 1, testing::scaled_delta(0.01f));
  testing::write_run_delta(run, 0, 1, testing::scaled_delta(0.01f));
  auto second = watcher->poll();
  ASSERT_TRUE(second);
  ASSERT_EQ(second->size(), 2u);
  EXPECT_EQ((*second)[0].rank, 0);
  EXPECT_EQ((*second)[1].rank, 1);
  EXPECT_TRUE(watcher->poll()->empty());

  testing::write_run_delta(run, 0, 2, testing::scaled_delta(0.01f));
  ASSERT_TRUE(write_file_atomic(run / "deltas" / "rank-1" / "round-000002.cfd.tmp.99", "being written"));
  auto third = watcher->poll();
  ASSERT_TRUE(third);
  ASSERT_EQ(third->size(), 1u);
  EXPECT_EQ((*third)[0].round, 2);
}

TEST_F(WatchTest, FinishedOnceTheModelIsWrittenAfterTheLastDelta) {
  const fs::path run = dir_ / "run";
  testing::write_run_delta(run, 0, 1, testing::scaled_delta(0.01f));
  auto watcher = RunWatcher::open(run);
  ASSERT_TRUE(watcher);
  ASSERT_EQ(watcher->poll()->size(), 1u);
  EXPECT_FALSE(watcher->finished());
  ASSERT_TRUE(write_file_atomic(run / "model.safetensors", "final"));
  // Explicit times: no test depends on the clock's resolution.
  const auto delta_time = fs::last_write_time(ckpt::delta_path(run, 0, 1));
  fs::last_write_time(run / "model.safetensors", delta_time + std::chrono::seconds(1));
  EXPECT_TRUE(watcher->finished());
  // A newer delta (a resumed run) means it is running again.
  testing::write_run_delta(run, 0, 2, testing::scaled_delta(0.01f));
  fs::last_write_time(ckpt::delta_path(run, 0, 2), delta_time + std::chrono::seconds(2));
  ASSERT_EQ(watcher->poll()->size(), 1u);
  EXPECT_FALSE(watcher->finished());
}

TEST_F(WatchTest, TheRunDirectoryMustExist) {
  auto watcher = RunWatcher::open(dir_ / "nowhere");
  ASSERT_FALSE(watcher);
  EXPECT_EQ(watcher.error().kind, ErrorKind::kInput);
}

}  // namespace
}  // namespace cfmo::diverge
