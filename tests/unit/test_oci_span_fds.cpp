// The lazy mount's open span files: at most `capacity` held, least recently
// used out first, and a descriptor dropped while a read holds it still
// reads (its file unlinked meanwhile) and is closed when that read ends.
#include "oci/span_fds.h"

#include "support/temp_dir.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <utility>

namespace cfmo::oci {
namespace {

using Key = std::pair<size_t, size_t>;
using Fds = SpanFds<Key>;

/// A span file holding its own name, opened.
Fds::Handle open_span(const std::filesystem::path& dir, size_t k) {
  const auto path = dir / std::to_string(k);
  std::ofstream(path) << "span " << k;
  return std::make_shared<const Fd>(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
}

std::string read_all(int fd) {
  char buffer[64] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(SpanFds, HoldsAtMostItsCapacityLeastRecentlyUsedFirstOut) {
  testing::ScratchDir dir("cfmo-span-fds");
  Fds fds(4);
  std::vector<int> numbers;
  for (size_t k = 0; k < 100; ++k) {
    auto handle = open_span(dir.path(), k);
    numbers.push_back(handle->get());
    fds.put({0, k}, std::move(handle));
    EXPECT_LE(fds.size(), 4u);
  }
  EXPECT_EQ(fds.size(), 4u);
  for (size_t k = 96; k < 100; ++k) {
    const auto held = fds.find({0, k});
    ASSERT_TRUE(held) << k;
    EXPECT_EQ(read_all(held->get()), "span " + std::to_string(k));
  }
  EXPECT_FALSE(fds.find({0, 95}));
  EXPECT_FALSE(fds.find({0, 0}));
  EXPECT_FALSE(is_open(numbers[0])) << "a dropped descriptor no read holds is closed";
}

TEST(SpanFds, ATouchedSpanOutlivesNewerOnes) {
  testing::ScratchDir dir("cfmo-span-fds");
  Fds fds(3);
  for (size_t k = 0; k < 3; ++k) fds.put({1, k}, open_span(dir.path(), k));
  ASSERT_TRUE(fds.find({1, 0}));  // now the most recently used
  fds.put({1, 3}, open_span(dir.path(), 3));
  EXPECT_TRUE(fds.find({1, 0}));
  EXPECT_FALSE(fds.find({1, 1})) << "the least recently used went";
  EXPECT_TRUE(fds.find({1, 2}));
  EXPECT_TRUE(fds.find({1, 3}));
}

TEST(SpanFds, ADroppedDescriptorStillReadsUntilItsLastHolderLetsGo) {
  testing::ScratchDir dir("cfmo-span-fds");
  Fds fds(2);
  fds.put({0, 7}, open_span(dir.path(), 7));
  Fds::Handle reading = fds.find({0, 7});
  ASSERT_TRUE(reading);
  const int number = reading->get();
  // The span is evicted from the cache: its descriptor dropped, its file unlinked.
  fds.drop({0, 7});
  std::filesystem::remove(dir.path() / "7");
  EXPECT_FALSE(fds.find({0, 7}));
  EXPECT_EQ(fds.size(), 0u);
  EXPECT_EQ(read_all(reading->get()), "span 7") << "a read under way still gets the span's bytes";
  reading.reset();
  EXPECT_FALSE(is_open(number));
  // Made again later: a new file, a new descriptor.
  fds.put({0, 7}, open_span(dir.path(), 7));
  EXPECT_EQ(read_all(fds.find({0, 7})->get()), "span 7");
}

TEST(SpanFds, PuttingAKeyAgainReplacesItsDescriptor) {
  testing::ScratchDir dir("cfmo-span-fds");
  Fds fds(2);
  auto first = open_span(dir.path(), 1);
  const int old_number = first->get();
  fds.put({0, 1}, std::move(first));
  fds.put({0, 1}, open_span(dir.path(), 1));
  EXPECT_EQ(fds.size(), 1u);
  EXPECT_FALSE(is_open(old_number));
  EXPECT_EQ(Fds(0).capacity(), 1u) << "at least one";
}

}  // namespace
}  // namespace cfmo::oci
