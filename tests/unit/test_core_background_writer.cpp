#include "core/background_writer.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace cfmo {
namespace {

/// A write that blocks until the test opens the gate, so the queue can be
/// filled while the writer is busy with the first item.
struct Gate {
  std::mutex mutex;
  std::condition_variable changed;
  bool open = false;
  int entered = 0;
  void wait() {
    std::unique_lock lock(mutex);
    ++entered;
    changed.notify_all();
    changed.wait(lock, [this] { return open; });
  }
  void wait_entered(int n) {
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return entered >= n; });
  }
  void release() {
    std::lock_guard lock(mutex);
    open = true;
    changed.notify_all();
  }
};

TEST(BackgroundWriterTest, WritesEveryItemInOrderAndCountsThem) {
  std::vector<int> seen;
  {
    BackgroundWriter<int> writer(4, BackgroundWriter<int>::WhenFull::kSkipNew, [&](int& item) -> Status {
      seen.push_back(item);
      return {};
    });
    for (int i = 0; i < 3; ++i) writer.submit(i);
    writer.close();
    EXPECT_EQ(writer.written(), 3);
    EXPECT_EQ(writer.skipped(), 0);
    EXPECT_TRUE(writer.status());
  }
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
}

TEST(BackgroundWriterTest, AFullQueueSkipsTheNewItemAndBuildsNothingForIt) {
  Gate gate;
  std::vector<int> seen;
  BackgroundWriter<int> writer(2, BackgroundWriter<int>::WhenFull::kSkipNew, [&](int& item) -> Status {
    gate.wait();
    seen.push_back(item);
    return {};
  });
  EXPECT_TRUE(writer.submit(0));
  gate.wait_entered(1);  // 0 is being written: the queue is empty again
  EXPECT_TRUE(writer.submit(1));
  EXPECT_TRUE(writer.submit(2));
  int built = 0;
  EXPECT_FALSE(writer.submit_with([&] {
    ++built;
    return 3;
  }));
  EXPECT_EQ(built, 0);
  gate.release();
  writer.close();
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(writer.written(), 3);
  EXPECT_EQ(writer.skipped(), 1);
}

TEST(BackgroundWriterTest, AFullQueueCanKeepOnlyTheNewest) {
  Gate gate;
  std::vector<int> seen;
  BackgroundWriter<int> writer(1, BackgroundWriter<int>::WhenFull::kReplaceWaiting, [&](int& item) -> Status {
    gate.wait();
    seen.push_back(item);
    return {};
  });
  EXPECT_TRUE(writer.submit(0));
  gate.wait_entered(1);
  EXPECT_TRUE(writer.submit(1));
  EXPECT_FALSE(writer.submit(2));  // takes 1's place
  gate.release();
  writer.close();
  EXPECT_EQ(seen, (std::vector<int>{0, 2}));
  EXPECT_EQ(writer.written(), 2);
  EXPECT_EQ(writer.skipped(), 1);
}

TEST(BackgroundWriterTest, TheFirstErrorIsKeptAndLaterItemsAreSkipped) {
  Gate gate;
  int calls = 0;
  BackgroundWriter<int> writer(4, BackgroundWriter<int>::WhenFull::kSkipNew, [&](int& item) -> Status {
    ++calls;
    if (item == 0) gate.wait();
    return make_error(ErrorKind::kInternal, "disk full writing item {}", item);
  });
  writer.submit(0);
  gate.wait_entered(1);
  writer.submit(1);  // queued before the failure: written, and fails too
  gate.release();
  while (writer.status()) std::this_thread::yield();
  writer.submit(2);  // after it: skipped, never written
  writer.close();
  ASSERT_FALSE(writer.status());
  EXPECT_EQ(writer.status().error().message, "disk full writing item 0");
  EXPECT_EQ(writer.status().error().kind, ErrorKind::kInternal);
  EXPECT_EQ(writer.written(), 0);
  EXPECT_EQ(writer.skipped(), 1);
  EXPECT_EQ(calls, 2);
}

TEST(BackgroundWriterTest, AfterCloseEverySubmissionIsSkipped) {
  BackgroundWriter<int> writer(2, BackgroundWriter<int>::WhenFull::kSkipNew, [](int&) -> Status { return {}; });
  writer.close();
  writer.close();  // twice is harmless
  EXPECT_FALSE(writer.submit(1));
  EXPECT_EQ(writer.skipped(), 1);
  EXPECT_EQ(writer.written(), 0);
}

}  // namespace
}  // namespace cfmo
