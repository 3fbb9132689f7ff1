#include "train/launcher.h"

#include "comm/rendezvous.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

namespace cfmo {
namespace {

std::optional<int> env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  int out = -1;
  std::string_view text(value);
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec != std::errc() || end != text.data() + text.size()) return -1;
  return out;
}

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
}

struct Child {
  pid_t pid = -1;
  int rank = 0;
  int out = -1;  ///< read end of its stdout
  int err = -1;  ///< read end of its stderr
  std::string out_partial;
  std::string err_partial;
  int status = -1;
  bool killed = false;  ///< ended by a signal rather than an exit
  bool reaped = false;
  int wstatus = 0;
};

}  // namespace

Result<std::optional<WorldInfo>> world_from_environment() {
  struct Pair {
    const char* rank;
    const char* size;
  };
  for (const Pair& p : {Pair{"RANK", "WORLD_SIZE"}, Pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                        Pair{"SLURM_PROCID", "SLURM_NTASKS"}}) {
    const auto rank = env_int(p.rank);
    const auto size = env_int(p.size);
    if (!rank && !size) continue;
    if (!rank || !size || *size < 1 || *rank < 0 || *rank >= *size) {
      return make_error(ErrorKind::kUsage, "{}={} and {}={} do not describe a rank in a world", p.rank,
                        std::getenv(p.rank) ? std::getenv(p.rank) : "(unset)", p.size,
                        std::getenv(p.size) ? std::getenv(p.size) : "(unset)");
    }
    return std::optional<WorldInfo>(WorldInfo{*rank, *size, fmt::format("{}/{}", p.rank, p.size)});
  }
  return std::optional<WorldInfo>();
}

Result<int> launch_local(int workers, char** argv, const std::atomic<bool>* interrupt, int out_fd, int err_fd) {
  CFMO_ASSIGN_OR_RETURN(auto listener, listen_tcp("127.0.0.1", 0));
  const std::string rendezvous = fmt::format("127.0.0.1:{}", listener.second);
  std::vector<Child> children(static_cast<size_t>(workers));
  for (int rank = 0; rank < workers; ++rank) {
    int out_pipe[2];
    int err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) {
      return make_error(ErrorKind::kInternal, "cannot create pipes for rank {}: {}", rank, std::strerror(errno));
    }
    const pid_t pid = ::fork();
    if (pid < 0) return make_error(ErrorKind::kInternal, "cannot start rank {}: {}", rank, std::strerror(errno));
    if (pid == 0) {
      // Its own process group: a terminal's Ctrl-C reaches the launcher only,
      // which passes exactly one SIGINT on. It dies with the launcher.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      const std::string rank_text = std::to_string(rank);
      const std::string size_text = std::to_string(workers);
      ::setenv("RANK", rank_text.c_str(), 1);
      ::setenv("WORLD_SIZE", size_text.c_str(), 1);
      ::setenv("CFMO_RENDEZVOUS", rendezvous.c_str(), 1);
      ::setenv("CFMO_LAUNCHED", "1", 1);
      ::setenv("UCX_LOG_LEVEL", "error", 0);  // UCX logs to stdout, which carries --json
      if (rank == 0) {
        const int fd = ::dup(listener.first);  // without O_CLOEXEC: it survives exec
        ::setenv("CFMO_RENDEZVOUS_FD", std::to_string(fd).c_str(), 1);
      }
      ::execv("/proc/self/exe", argv);
      _exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    children[static_cast<size_t>(rank)] = Child{pid, rank, out_pipe[0], err_pipe[0], {}, {}, -1};
  }
  ::close(listener.first);

  bool forwarded = false;
  auto flush_lines = [&](Child& c, std::string& partial, bool is_err, bool final) {
    if (final && !partial.empty() && partial.back() != '\n') partial.push_back('\n');
    size_t start = 0;
    for (;;) {
      const size_t end = partial.find('\n', start);
      if (end == std::string::npos) break;
      const std::string_view line(partial.data() + start, end - start + 1);
      if (!is_err && c.rank == 0) {
        write_all(out_fd, line);
      } else {
        write_all(err_fd, fmt::format("[rank {}] {}", c.rank, line));
      }
      start = end + 1;
    }
    partial.erase(0, start);
  };

  for (;;) {
    if (interrupt != nullptr && interrupt->load() && !forwarded) {
      forwarded = true;
      for (auto& c : children) {
        if (c.status < 0) ::kill(c.pid, SIGINT);
      }
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, bool>> owners;
    for (auto& c : children) {
      if (c.out >= 0) {
        fds.push_back({c.out, POLLIN, 0});
        owners.emplace_back(&c, false);
      }
      if (c.err >= 0) {
        fds.push_back({c.err, POLLIN, 0});
        owners.emplace_back(&c, true);
      }
    }
    if (fds.empty()) break;
    // Reap a rank as soon as it is gone: until then it is a zombie, which
    // the others' transport (UCX's keepalive between ranks of one host)
    // takes for a live process, so they would wait for the peer timeout.
    for (auto& c : children) {
      if (!c.reaped && c.out < 0 && c.err < 0) c.reaped = ::waitpid(c.pid, &c.wstatus, WNOHANG) == c.pid;
    }
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      auto [child, is_err] = owners[i];
      char buffer[65536];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      std::string& partial = is_err ? child->err_partial : child->out_partial;
      if (n > 0) {
        partial.append(buffer, static_cast<size_t>(n));
        flush_lines(*child, partial, is_err, false);
      } else if (n == 0 || errno != EINTR) {
        flush_lines(*child, partial, is_err, true);
        ::close(fds[i].fd);
        (is_err ? child->err : child->out) = -1;
      }
    }
  }

  int result = 0;
  for (auto& c : children) {
    int wstatus = c.wstatus;
    while (!c.reaped && ::waitpid(c.pid, &wstatus, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(wstatus)) {
      c.status = WEXITSTATUS(wstatus);
    } else {
      c.status = 128 + WTERMSIG(wstatus);
      c.killed = true;
      write_all(err_fd, fmt::format("[launcher] rank {} was killed by signal {} ({})\n", c.rank, WTERMSIG(wstatus),
                                    ::strsignal(WTERMSIG(wstatus))));
    }
  }
  // The run's status: an interrupted run reports 130; otherwise the first
  // rank that failed decides, and a rank killed by a signal counts as a
  // peer failure (4) for the run.
  for (const auto& c : children) {
    if (c.status == 130 && forwarded) return 130;
  }
  for (const auto& c : children) {
    if (c.status == 0) continue;
    result = c.killed ? static_cast<int>(ErrorKind::kPeer) : c.status;
    break;
  }
  return result;
}

Result<std::pair<int, std::string>> run_self(const std::vector<std::string>& args) {
  int out_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    return make_error(ErrorKind::kInternal, "cannot create a pipe: {}", std::strerror(errno));
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return make_error(ErrorKind::kInternal, "cannot start a run: {}", std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  ::close(out_pipe[1]);
  std::string out;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(out_pipe[0], buffer, sizeof buffer);
    if (n > 0) {
      out.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(out_pipe[0]);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  const int status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return std::pair<int, std::string>{status, std::move(out)};
}

}  // namespace cfmo
