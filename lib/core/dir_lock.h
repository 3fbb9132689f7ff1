#pragma once
/// An exclusive lock on a directory, for the processes that write into it
/// (cfmo-pull on a layout, cfmo-train on a run directory): flock on a file
/// in it, which the kernel drops however the holder ends, so a killed
/// process never leaves a stale lock. The file names the holder's pid.

#include "core/error.h"
#include "core/fd.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string_view>

namespace cfmo {

class DirLock {
 public:
  /// Locks DIR/NAME (created if absent). When another process holds it,
  /// `on_wait` is called once with that process's pid (0 when unknown) and
  /// the wait ends with kPeer at `deadline` (nullopt: never; now: at once);
  /// the error says "another WHO (pid N)". The wait also ends, with kPeer,
  /// when `stop` is set (a signal asked the caller to stop).
  static Result<DirLock> acquire(const std::filesystem::path& dir, std::string_view name, std::string_view who,
                                 std::optional<std::chrono::steady_clock::time_point> deadline,
                                 const std::function<void(int pid)>& on_wait = nullptr,
                                 const std::atomic<bool>* stop = nullptr);
  /// Lets it go before destruction (a process about to hand over to another):
  /// closing the descriptor drops the flock.
  void release() { fd_.reset(); }

 private:
  explicit DirLock(int fd) : fd_(fd) {}
  Fd fd_;
};

/// True when `pid` names a live process (not a zombie).
bool process_alive(int pid);

}  // namespace cfmo
