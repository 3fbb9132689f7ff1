#include "comm/world.h"

#include "comm/rendezvous.h"
#include "comm/solo_communicator.h"
#include "comm/ucx_communicator.h"
#include "core/fd.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>
#include <vector>

namespace cfmo::comm {
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
  Fd out;  ///< read end of its stdout
  Fd err;  ///< read end of its stderr
  std::string out_partial;
  std::string err_partial;
  int status = -1;
  bool killed = false;      ///< ended by a signal rather than an exit
  bool ended_here = false;  ///< the launcher ended it: it outlived the others
  bool sigkilled = false;
  std::chrono::steady_clock::time_point ended_at{};
  bool stopped = false;  ///< as last looked at
  bool reaped = false;
  int wstatus = 0;
};

/// The run's status from its ranks': an interrupted run reports 130;
/// otherwise the root cause decides, the first rank's failure that is not
/// a peer failure. A rank killed by a signal or ended by the launcher counts
/// as a peer failure (4), and so does the status of the ranks that saw it go.
int run_status(const std::vector<Child>& children, bool interrupted) {
  for (const auto& c : children) {
    if (c.status == 130 && interrupted) return 130;
  }
  constexpr int kPeer = static_cast<int>(ErrorKind::kPeer);
  int result = 0;
  for (const auto& c : children) {
    if (c.status == 0) continue;
    const int status = c.killed || c.ended_here ? kPeer : c.status;
    if (result == 0 || (result == kPeer && status != kPeer)) result = status;
  }
  return result;
}

/// True when the process is stopped (state T in /proc/PID/stat).
bool is_stopped(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(in, stat);
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T';
}

/// A directory of this run's own under /dev/shm (empty when it cannot be
/// made: then UCX uses /dev/shm as usual), removed with what it holds.
struct ShmDir {
  std::string path;
  ShmDir() {
    std::string pattern = fmt::format("/dev/shm/cfmo-ucx-{}-XXXXXX", ::getpid());
    if (::mkdtemp(pattern.data()) != nullptr) path = pattern;
  }
  ~ShmDir() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove_all(path, ignored);
  }
  ShmDir(const ShmDir&) = delete;
  ShmDir& operator=(const ShmDir&) = delete;
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
    WorldInfo world{*rank, *size, fmt::format("{}/{}", p.rank, p.size), std::getenv("CFMO_LAUNCHED") != nullptr, *rank};
    for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
      if (const auto local = env_int(name); local && *local >= 0) {
        world.local_rank = *local;
        break;
      }
    }
    return std::optional<WorldInfo>(std::move(world));
  }
  return std::optional<WorldInfo>();
}

Result<int> launch_local(int workers, char** argv, const std::atomic<bool>* interrupt, int out_fd, int err_fd,
                         double grace_s) {
  CFMO_ASSIGN_OR_RETURN(auto listening, listen_tcp("127.0.0.1", 0));
  Fd listener(listening.first);
  const std::string rendezvous = fmt::format("127.0.0.1:{}", listening.second);
  // UCX's POSIX shared memory normally lives in /dev/shm itself, each file
  // unlinked once made; a rank killed or aborting in between leaves its file
  // (2-4 MB) there for good. In a directory of the run's own, the launcher
  // removes whatever is left when the ranks are gone.
  const ShmDir shm_dir;
  std::vector<Child> children(static_cast<size_t>(workers));
  for (int rank = 0; rank < workers; ++rank) {
    Pipe out_pipe;
    Pipe err_pipe;
    if (!out_pipe.open() || !err_pipe.open()) {
      return make_error(ErrorKind::kInternal, "cannot create pipes for rank {}: {}", rank, std::strerror(errno));
    }
    const pid_t pid = ::fork();
    if (pid < 0) return make_error(ErrorKind::kInternal, "cannot start rank {}: {}", rank, std::strerror(errno));
    if (pid == 0) {
      // Its own process group: a terminal's Ctrl-C reaches the launcher only,
      // which passes exactly one SIGINT on. It dies with the launcher.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      ::dup2(out_pipe.write.get(), STDOUT_FILENO);
      ::dup2(err_pipe.write.get(), STDERR_FILENO);
      const std::string rank_text = std::to_string(rank);
      const std::string size_text = std::to_string(workers);
      ::setenv("RANK", rank_text.c_str(), 1);
      ::setenv("WORLD_SIZE", size_text.c_str(), 1);
      ::setenv("CFMO_RENDEZVOUS", rendezvous.c_str(), 1);
      ::setenv("CFMO_LAUNCHED", "1", 1);
      ::setenv("UCX_LOG_LEVEL", "error", 0);  // UCX logs to stdout, which carries --json
      if (!shm_dir.path.empty()) ::setenv("UCX_POSIX_DIR", shm_dir.path.c_str(), 0);  // the user's choice wins
      if (rank == 0) {
        const int fd = ::dup(listener.get());  // without O_CLOEXEC: it survives exec
        ::setenv("CFMO_RENDEZVOUS_FD", std::to_string(fd).c_str(), 1);
      }
      ::execv("/proc/self/exe", argv);
      _exit(127);
    }
    Child& c = children[static_cast<size_t>(rank)];
    c.pid = pid;
    c.rank = rank;
    c.out = std::move(out_pipe.read);  // the write ends close here: the rank holds its own
    c.err = std::move(err_pipe.read);
  }
  listener.reset();

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

  // A rank that outlives all the others is silent when it is stopped
  // (SIGSTOP, a terminal's Ctrl-Z) for grace_s, or, running, for much longer:
  // one still at work (the final evaluation, a checkpoint) or waiting for
  // peers that are gone ends by itself within a few of its peer timeouts.
  // A silent rank is ended, in two steps.
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> others_ended;
  constexpr auto kKillGrace = std::chrono::seconds(5);
  const double running_grace_s = std::max(60.0, 10 * grace_s);
  auto end_silent = [&] {
    int alive = 0;
    int stopped = 0;
    for (auto& c : children) {
      c.stopped = !c.reaped && is_stopped(c.pid);
      alive += c.reaped ? 0 : 1;
      stopped += c.stopped ? 1 : 0;
    }
    // The clock starts once some rank ended and the rest is one rank, or only stopped ones.
    if (!others_ended && (alive == workers || alive == 0 || (alive > 1 && stopped < alive))) return;
    const auto now = Clock::now();
    if (!others_ended) others_ended = now;
    const double outlived = std::chrono::duration<double>(now - *others_ended).count();
    for (auto& c : children) {
      if (c.reaped) continue;
      if (!c.ended_here) {
        if (outlived < (c.stopped ? grace_s : running_grace_s)) continue;
        c.ended_here = true;
        c.ended_at = now;
        write_all(err_fd, fmt::format("[launcher] rank {} was {} {:.1f} s after the other ranks ended: ending it\n",
                                      c.rank, c.stopped ? "stopped" : "still running", outlived));
        ::kill(c.pid, SIGTERM);
        ::kill(c.pid, SIGCONT);  // a stopped process acts on the SIGTERM only once continued
      } else if (!c.sigkilled && now - c.ended_at >= kKillGrace) {
        c.sigkilled = true;
        ::kill(c.pid, SIGKILL);
      }
    }
  };

  for (;;) {
    if (interrupt != nullptr && interrupt->load() && !forwarded) {
      forwarded = true;
      for (auto& c : children) {
        if (c.status < 0) ::kill(c.pid, SIGINT);
      }
    }
    // Reap a rank as soon as it is gone: until then it is a zombie, which
    // the others' transport (UCX's keepalive between ranks of one host)
    // takes for a live process, so they would wait for the peer timeout.
    // One whose output is still open is looked at too: a process it started
    // may hold its pipes.
    for (auto& c : children) {
      if (!c.reaped) c.reaped = ::waitpid(c.pid, &c.wstatus, WNOHANG) == c.pid;
    }
    end_silent();
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, bool>> owners;
    for (auto& c : children) {
      if (c.out) {
        fds.push_back({c.out.get(), POLLIN, 0});
        owners.emplace_back(&c, false);
      }
      if (c.err) {
        fds.push_back({c.err.get(), POLLIN, 0});
        owners.emplace_back(&c, true);
      }
    }
    if (fds.empty()) break;
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
        (is_err ? child->err : child->out).reset();
      }
    }
  }

  for (auto& c : children) {
    while (!c.reaped && ::waitpid(c.pid, &c.wstatus, 0) < 0 && errno == EINTR) {
    }
    c.reaped = true;
    if (WIFEXITED(c.wstatus)) {
      c.status = WEXITSTATUS(c.wstatus);
    } else {
      c.status = 128 + WTERMSIG(c.wstatus);
      c.killed = true;
      if (!c.ended_here) {
        write_all(err_fd, fmt::format("[launcher] rank {} was killed by signal {} ({})\n", c.rank, WTERMSIG(c.wstatus),
                                      ::strsignal(WTERMSIG(c.wstatus))));
      }
    }
  }
  return run_status(children, forwarded);
}

Result<std::pair<int, std::string>> run_self(const std::vector<std::string>& args) {
  Pipe out_pipe;
  if (!out_pipe.open()) {
    return make_error(ErrorKind::kInternal, "cannot create a pipe: {}", std::strerror(errno));
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return make_error(ErrorKind::kInternal, "cannot start a run: {}", std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    ::dup2(out_pipe.write.get(), STDOUT_FILENO);
    ::execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  out_pipe.write.reset();  // the run holds its own: the read ends when it does
  std::string out;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(out_pipe.read.get(), buffer, sizeof buffer);
    if (n > 0) {
      out.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  out_pipe.read.reset();
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  const int status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return std::pair<int, std::string>{status, std::move(out)};
}

Result<std::unique_ptr<Communicator>> connect_world(const std::optional<WorldInfo>& world,
                                                    const WorldOptions& options) {
  UcxOptions ucx;
  ucx.peer_timeout_s = options.peer_timeout_s;
  ucx.fifos = options.fifos;
  if (!options.join.empty()) {
    CFMO_ASSIGN_OR_RETURN(RendezvousConfig rendezvous, parse_rendezvous(options.join));
    rendezvous.timeout_s = options.join_timeout_s;
    rendezvous.check = options.check;
    rendezvous.description = options.description;  // a joiner may come to lead, and serve joins
    rendezvous.grow = options.grow;
    return connect_ucx(kAnyRank, 0, rendezvous, ucx, options.first_size, options.run_ended);
  }
  if (!world || world->size <= 1) return make_solo_communicator();
  // Our own launcher's address wins: its rank 0 listens on the socket it inherited.
  std::string address = world->launched ? "" : options.rendezvous;
  if (address.empty() && std::getenv("CFMO_RENDEZVOUS") != nullptr) address = std::getenv("CFMO_RENDEZVOUS");
  if (address.empty()) {
    return make_error(ErrorKind::kUsage, "{} says {} ranks: {}", world->source, world->size, options.rendezvous_hint);
  }
  CFMO_ASSIGN_OR_RETURN(RendezvousConfig rendezvous, parse_rendezvous(address));
  if (const char* fd = std::getenv("CFMO_RENDEZVOUS_FD"); fd != nullptr && world->launched && world->rank == 0) {
    rendezvous.listen_fd = std::atoi(fd);
  }
  rendezvous.timeout_s = std::max(60.0, options.peer_timeout_s);
  rendezvous.description = options.description;
  rendezvous.check = options.check;
  rendezvous.grow = options.grow;
  return connect_ucx(world->rank, world->size, rendezvous, ucx, options.first_size, options.run_ended);
}

}  // namespace cfmo::comm
