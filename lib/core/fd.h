#pragma once
/// A file descriptor owned by one object: closed when it goes, moved but
/// never copied. Every descriptor the library opens is held by one of these
/// (or a type built on it), so an early return cannot leak one.

#include <fcntl.h>
#include <unistd.h>

#include <utility>

namespace cfmo {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  /// Closes the one held (its error ignored: nothing was written through it
  /// that a caller checks, see close()) and holds `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  /// Hands the descriptor over; this object holds none afterwards.
  int release() { return std::exchange(fd_, -1); }
  /// Closes it now and returns close(2)'s result (0, or -1 with errno set),
  /// for a writer that must know its data reached the file.
  int close() { return fd_ >= 0 ? ::close(std::exchange(fd_, -1)) : 0; }

 private:
  int fd_ = -1;
};

/// Both ends of a pipe, each closed when it goes.
struct Pipe {
  Fd read;
  Fd write;
  /// Makes the pipe, close-on-exec; false (errno set) when it cannot be made.
  bool open() {
    int ends[2];
    if (::pipe2(ends, O_CLOEXEC) != 0) return false;
    read.reset(ends[0]);
    write.reset(ends[1]);
    return true;
  }
};

}  // namespace cfmo
