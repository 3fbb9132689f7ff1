#include "core/dir_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

namespace cfmo {
namespace fs = std::filesystem;

Result<DirLock> DirLock::acquire(const fs::path& dir, std::string_view name, std::string_view who,
                                 std::optional<std::chrono::steady_clock::time_point> deadline,
                                 const std::function<void(int pid)>& on_wait, const std::atomic<bool>* stop) {
  const fs::path path = dir / name;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return make_error(ErrorKind::kInternal, "'{}': cannot open: {}", path.string(), std::strerror(errno));
  }
  DirLock lock(fd);
  bool told = false;
  int holder = 0;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      return make_error(ErrorKind::kInternal, "'{}': cannot lock: {}", path.string(), std::strerror(errno));
    }
    if (!told) {
      char buffer[32] = {0};
      const ssize_t n = ::pread(fd, buffer, sizeof buffer - 1, 0);
      holder = n > 0 ? std::atoi(buffer) : 0;
      if (on_wait) on_wait(holder);
      told = true;
    }
    if (deadline && std::chrono::steady_clock::now() >= *deadline) {
      return make_error(ErrorKind::kPeer, "'{}': another {}{} still holds it", dir.string(), who,
                        holder > 0 ? fmt::format(" (pid {})", holder) : "");
    }
    if (stop != nullptr && stop->load()) {
      return make_error(ErrorKind::kPeer, "'{}': interrupted while another {} held it", dir.string(), who);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The holder's pid, for whoever waits next (informational: the lock is the flock).
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] const ssize_t n = ::pwrite(fd, pid.data(), pid.size(), 0);
  }
  return lock;
}

bool process_alive(int pid) {
  if (pid <= 0 || (::kill(pid, 0) != 0 && errno != EPERM)) return false;
  // A zombie (a killed process whose parent has not reaped it yet) is gone too.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return true;
  return text[paren + 2] != 'Z' && text[paren + 2] != 'X';
}

}  // namespace cfmo
