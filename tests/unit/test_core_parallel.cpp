#include "core/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

namespace cfmo {
namespace {

TEST(ParallelTest, EveryTaskRunsOnceWhateverTheThreadCount) {
  for (int threads : {0, 1, 2, 7, 64}) {
    for (size_t count : {0u, 1u, 5u, 1000u}) {
      std::vector<std::atomic<int>> runs(count);
      parallel_for(count, threads, "test", [&](size_t i) { runs[i].fetch_add(1); });
      for (size_t i = 0; i < count; ++i) EXPECT_EQ(runs[i].load(), 1) << threads << " threads, task " << i;
    }
  }
}

TEST(ParallelTest, AnExceptionReachesTheCallerAfterTheHelpersAreJoined) {
  std::atomic<int> ran{0};
  EXPECT_THROW(parallel_for(100, 4, "test",
                            [&](size_t i) {
                              ran.fetch_add(1);
                              if (i == 10) throw std::runtime_error("task 10");
                            }),
               std::runtime_error);
  EXPECT_GE(ran.load(), 11);
}

TEST(ParallelTest, ResolveThreads) {
  EXPECT_EQ(resolve_threads(3), 3);
  EXPECT_GE(resolve_threads(0), 1);
}

}  // namespace
}  // namespace cfmo
