#pragma once
// Runs a real binary with arguments and captures its exit status, stdout and
// stderr; kills it after a timeout so a hang fails the test instead of CI.

#include "support/temp_dir.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace cfmo::testing {

struct RunResult {
  int status = -1;  ///< exit status, or 128 + signal
  std::string out;
  std::string err;
  bool timed_out = false;
};

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

/// Starts `args[0]` with `args`; `extra_env` entries are "NAME=value".
/// `while_running` is called every 50 ms with the child's pid (for signals).
inline RunResult run(const std::vector<std::string>& args, double timeout_s = 120,
                     const std::vector<std::string>& extra_env = {},
                     const std::function<void(pid_t, double)>& while_running = nullptr) {
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& e : extra_env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (rc != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    throw std::runtime_error("posix_spawn " + args[0] + ": " + std::to_string(rc));
  }
  RunResult result;
  const auto start = std::chrono::steady_clock::now();
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_s && !result.timed_out) {
      result.timed_out = true;
      kill(pid, SIGKILL);
    }
    if (while_running) while_running(pid, elapsed);
    if (poll(fds, 2, 50) < 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || (fds[i].revents & (POLLIN | POLLHUP)) == 0) continue;
      char buffer[65536];
      const ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  result.status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  return result;
}

/// A process started in the background, its output going to files.
struct Background {
  pid_t pid = -1;
  int status = -1;  ///< once reaped: exit status, or 128 + signal

  /// Waits up to `timeout_s`; true when it ended (then `status` is set).
  bool wait(double timeout_s) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int wstatus = 0;
      const pid_t done = waitpid(pid, &wstatus, WNOHANG);
      if (done == pid) {
        status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
        return true;
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s) return false;
      usleep(20000);
    }
  }
  /// Kills it if it is still running (tests never leave processes behind).
  void reap() {
    if (status >= 0 || pid < 0) return;
    kill(pid, SIGKILL);
    wait(10);
  }
};

inline Background spawn(const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
                        const std::string& stdout_path, const std::string& stderr_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& e : extra_env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  Background b;
  if (posix_spawn(&b.pid, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) b.pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return b;
}

/// Waits until `file` is not empty (a run's first metrics line: it is under
/// way); false at once when one of `processes` ends first, or after `timeout_s`.
inline bool wait_for_output(std::vector<Background>& processes, const std::filesystem::path& file, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < timeout_s) {
    std::error_code ec;
    if (std::filesystem::file_size(file, ec) > 0 && !ec) return true;
    for (auto& p : processes) {
      if (p.status < 0 && p.wait(0)) return false;
    }
    usleep(20000);
  }
  return false;
}

/// A file's bytes; empty when it cannot be read.
inline std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// `text` cut at newlines (a last line without one counts too).
inline std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

/// A free TCP port on 127.0.0.1 (bound, read, released: good enough for tests).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t length = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  close(fd);
  return ntohs(addr.sin_port);
}

/// A fresh directory removed at the end of the test.
class TempDir : public ScratchDir {
 public:
  TempDir() : ScratchDir("cfmo-test") {}
};

}  // namespace cfmo::testing
