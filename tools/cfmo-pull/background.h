#pragma once
// Starting `cfmo-pull fetch` as a detached process (pull --background):
// fork twice with setsid in between, so the fetcher has no controlling
// terminal, is not the caller's child (no zombie, no SIGHUP when the shell
// goes) and outlives the pull; its stdin is /dev/null and its stdout and
// stderr append to DIR/cfmo-pull.log. It is this program again, exec'ed
// fresh: nothing of the pull's state (threads, curl handles, locks) is
// inherited. The lazy mount's daemon (serve_detached) is a forked child
// instead: it serves the mount prepared here. Replacing processes is the
// tool's business, hence tools/.
#include "core/error.h"
#include "oci/lazy_mount.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cfmo::pull_tool {

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

/// Mounts `mount` in a child that stays, detached, with its output in the
/// mount's log, and serves it; the child says through a pipe whether the
/// mount itself worked, so that its error is told here. Returns its pid.
inline Result<int> serve_detached(oci::LazyMount& mount) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return make_error(ErrorKind::kInternal, "mount: pipe failed");
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) return make_error(ErrorKind::kInternal, "mount: fork failed");
  if (pid == 0) {
    ::close(pipe_fds[0]);
    ::setsid();
    const int null = ::open("/dev/null", O_RDWR);
    const int log = ::open(mount.report().log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(null, STDIN_FILENO);
    ::dup2(log >= 0 ? log : null, STDOUT_FILENO);
    ::dup2(log >= 0 ? log : null, STDERR_FILENO);
    auto mounted = mount.mount();
    const std::string answer =
        mounted ? std::string("ok")
                : fmt::format("{} {}", static_cast<int>(mounted.error().kind), mounted.error().message);
    (void)!::write(pipe_fds[1], answer.data(), answer.size());
    ::close(pipe_fds[1]);
    if (!mounted) std::_Exit(static_cast<int>(mounted.error().kind));
    const auto served = mount.serve();
    std::_Exit(served ? 0 : static_cast<int>(served.error().kind));
  }
  ::close(pipe_fds[1]);
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) answer.append(buffer, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  if (answer != "ok") {
    ::waitpid(pid, nullptr, 0);
    const auto space = answer.find(' ');
    if (space == std::string::npos) return make_error(ErrorKind::kInternal, "mount: the mount's process ended");
    return Error{static_cast<ErrorKind>(std::stoi(answer.substr(0, space))), answer.substr(space + 1)};
  }
  return static_cast<int>(pid);
}

}  // namespace cfmo::pull_tool
