#include "core/fd.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace cfmo {
namespace {

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

TEST(FdTest, ClosesWhatItHoldsWhenItGoes) {
  int raw = -1;
  {
    const Fd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd);
    raw = fd.get();
    EXPECT_TRUE(is_open(raw));
  }
  EXPECT_FALSE(is_open(raw));
}

TEST(FdTest, AMoveHandsItOverAndAssignmentClosesTheOldOne) {
  Fd a(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int first = a.get();
  Fd b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from holds nothing
  EXPECT_EQ(b.get(), first);
  Fd c(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int second = c.get();
  c = std::move(b);
  EXPECT_FALSE(is_open(second));
  EXPECT_EQ(c.get(), first);
  EXPECT_TRUE(is_open(first));
}

TEST(FdTest, ReleaseHandsTheDescriptorToTheCaller) {
  Fd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int raw = fd.release();
  EXPECT_FALSE(fd);
  EXPECT_TRUE(is_open(raw));
  ::close(raw);
}

TEST(FdTest, CloseReportsAndLeavesNothingHeld) {
  Fd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  EXPECT_EQ(fd.close(), 0);
  EXPECT_FALSE(fd);
  EXPECT_EQ(fd.close(), 0);  // nothing held: nothing to close
}

TEST(FdTest, APipeCarriesBytesAndItsReadEndSeesTheWriteEndGo) {
  Pipe pipe;
  ASSERT_TRUE(pipe.open());
  ASSERT_EQ(::write(pipe.write.get(), "x", 1), 1);
  pipe.write.reset();
  char c = 0;
  EXPECT_EQ(::read(pipe.read.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  EXPECT_EQ(::read(pipe.read.get(), &c, 1), 0);  // end of file: no writer left
  EXPECT_NE(::fcntl(pipe.read.get(), F_GETFD) & FD_CLOEXEC, 0);
}

}  // namespace
}  // namespace cfmo
