#pragma once
// Starting `cfmo-pull fetch` as a detached process (pull --background):
// fork twice with setsid in between, so the fetcher has no controlling
// terminal, is not the caller's child (no zombie, no SIGHUP when the shell
// goes) and outlives the pull; its stdin is /dev/null and its stdout and
// stderr append to DIR/cfmo-pull.log. It is this program again, exec'ed
// fresh: nothing of the pull's state (threads, curl handles, locks) is
// inherited. Replacing processes is the tool's business, hence tools/.
#include "core/error.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace cfmo::pulltool {

/// Starts `argv` (argv[0] is only its name; /proc/self/exe runs) detached,
/// with its output appended to `log_path`; returns the fetcher's pid.
inline Result<int> start_detached(const std::vector<std::string>& argv, const std::string& log_path) {
  // Everything the children need is built before fork: after it only
  // async-signal-safe calls are allowed.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return make_error(ErrorKind::kInternal, "background log '{}': cannot open: {}", log_path, std::strerror(errno));
  }
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  int pid_pipe[2];
  if (null_fd < 0 || ::pipe2(pid_pipe, O_CLOEXEC) != 0) {
    ::close(log_fd);
    if (null_fd >= 0) ::close(null_fd);
    return make_error(ErrorKind::kInternal, "background fetch: {}", std::strerror(errno));
  }
  const pid_t child = ::fork();
  if (child < 0) {
    const int error = errno;
    ::close(log_fd);
    ::close(null_fd);
    ::close(pid_pipe[0]);
    ::close(pid_pipe[1]);
    return make_error(ErrorKind::kInternal, "background fetch: fork failed: {}", std::strerror(error));
  }
  if (child == 0) {
    ::setsid();
    const pid_t fetcher = ::fork();
    if (fetcher == 0) {
      ::dup2(null_fd, STDIN_FILENO);
      ::dup2(log_fd, STDOUT_FILENO);
      ::dup2(log_fd, STDERR_FILENO);
      [[maybe_unused]] const int cd = ::chdir("/");  // holds no directory busy; its paths are absolute
      ::execv("/proc/self/exe", args.data());
      _exit(127);
    }
    const int reported = static_cast<int>(fetcher);
    [[maybe_unused]] const ssize_t n = ::write(pid_pipe[1], &reported, sizeof reported);
    _exit(fetcher < 0 ? 1 : 0);
  }
  ::close(pid_pipe[1]);
  ::close(log_fd);
  ::close(null_fd);
  int fetcher = -1;
  const ssize_t n = ::read(pid_pipe[0], &fetcher, sizeof fetcher);
  ::close(pid_pipe[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (n != static_cast<ssize_t>(sizeof fetcher) || fetcher <= 0) {
    return make_error(ErrorKind::kInternal, "background fetch: the detached process did not start");
  }
  return fetcher;
}

}  // namespace cfmo::pulltool
