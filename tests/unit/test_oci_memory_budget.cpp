#include "oci/memory_budget.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace cfmo::oci {
namespace {

TEST(OciMemoryBudget, LeasesNeverExceedTheTotal) {
  MemoryBudget budget(1000);
  auto a = budget.acquire(600);
  EXPECT_EQ(a.bytes(), 600u);
  EXPECT_EQ(budget.try_acquire(500).bytes(), 0u);  // would exceed the total
  {
    auto b = budget.try_acquire(400);
    EXPECT_EQ(b.bytes(), 400u);
    EXPECT_EQ(budget.in_use(), 1000u);
  }
  EXPECT_EQ(budget.in_use(), 600u);
  a.release();
  EXPECT_EQ(budget.in_use(), 0u);
  EXPECT_EQ(budget.peak(), 1000u);
  // A request above the total is clipped to it.
  EXPECT_EQ(budget.acquire(5000).bytes(), 1000u);
}

TEST(OciMemoryBudget, ManyThreadsShareIt) {
  MemoryBudget budget(4096);
  std::atomic<size_t> worst{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto lease = budget.acquire(1024);
        size_t now = budget.in_use();
        size_t seen = worst.load();
        while (now > seen && !worst.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::yield();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(worst.load(), 4096u);
  EXPECT_LE(budget.peak(), 4096u);
  EXPECT_EQ(budget.in_use(), 0u);
}

TEST(OciMemoryBudget, SharesAreClampedAndMoved) {
  MemoryBudget budget(16 << 20);
  EXPECT_EQ(budget.share(4, 64 << 10, 4 << 20), 4u << 20);
  EXPECT_EQ(budget.share(64, 64 << 10, 4 << 20), 256u << 10);
  EXPECT_EQ(budget.share(1, 64 << 10, 4 << 20), 4u << 20);
  MemoryBudget small(100 << 10);
  EXPECT_EQ(small.share(8, 64 << 10, 4 << 20), 64u << 10);
  auto lease = budget.acquire(10);
  MemoryBudget::Lease moved = std::move(lease);
  EXPECT_EQ(lease.bytes(), 0u);  // NOLINT(bugprone-use-after-move): a moved-from lease holds nothing
  EXPECT_EQ(moved.bytes(), 10u);
  EXPECT_EQ(budget.in_use(), 10u);
}

TEST(OciMemoryBudget, PeakRssIsMeasured) {
  const int64_t before = peak_rss_bytes();
  EXPECT_GT(before, 0);
  std::vector<char> touched(64 << 20, 1);
  EXPECT_GE(peak_rss_bytes(), before);
  EXPECT_GE(peak_rss_bytes(), int64_t{60} << 20) << "64 MiB touched";
  EXPECT_EQ(touched[12345], 1);
}

}  // namespace
}  // namespace cfmo::oci
