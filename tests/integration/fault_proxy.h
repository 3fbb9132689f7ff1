#pragma once
// A real TCP proxy between cfmo-pull and a registry, for the faults a flaky
// link or a busy registry gives: it drops the connection after N bytes of a
// body, answers 429 (with Retry-After) or 503 instead of forwarding, flips a
// byte of a body, or stalls a body until released. Each rule applies to the
// requests whose target contains a string, from the k-th such request on,
// for a number of them. Every request is logged (method, target, Range,
// status, the fault applied) so tests can check what the puller asked for.
//
// One connection serves one request: the proxy sends "Connection: close"
// both ways, so keep-alive never hides a request from the rules.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace cfmo::pulltest {

class FaultProxy {
 public:
  enum class Action { kDropAfter, kStatus, kCorrupt, kStallAfter };

  struct Rule {
    std::string path_contains;  ///< "" matches every request
    Action action = Action::kStatus;
    int64_t offset = 0;  ///< body bytes before the drop or stall, or the byte corrupted
    int status = 503;
    std::string headers;  ///< extra response headers for kStatus, each ending in \r\n
    int first = 1;        ///< the first matching request it applies to (1-based)
    int times = 1;        ///< how many from there; 0: every one
    int seen = 0;         ///< matching requests so far
  };

  static Rule drop_after(std::string path, int64_t bytes, int first = 1, int times = 1) {
    return {std::move(path), Action::kDropAfter, bytes, 0, "", first, times};
  }
  static Rule status(std::string path, int code, std::string headers = "", int first = 1, int times = 1) {
    return {std::move(path), Action::kStatus, 0, code, std::move(headers), first, times};
  }
  static Rule corrupt(std::string path, int64_t offset, int first = 1, int times = 0) {
    return {std::move(path), Action::kCorrupt, offset, 0, "", first, times};
  }
  static Rule stall_after(std::string path, int64_t bytes, int first = 1, int times = 1) {
    return {std::move(path), Action::kStallAfter, bytes, 0, "", first, times};
  }

  struct Seen {
    std::string method;
    std::string target;
    long range_start = -1;  ///< the N of "Range: bytes=N-", or -1
    int status = 0;         ///< what the client got (0: the proxy could not reach upstream)
    std::string fault;      ///< "", "drop", "status", "corrupt", "stall"
    std::chrono::steady_clock::time_point at;
  };

  /// Proxies to `upstream` ("127.0.0.1:PORT"); `upstream` may be a port where
  /// nothing listens (the client then sees the connection closed).
  explicit FaultProxy(const std::string& upstream) {
    const auto colon = upstream.rfind(':');
    upstream_port_ = std::stoi(upstream.substr(colon + 1));
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t length = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &length);
    port_ = ntohs(addr.sin_port);
    ::listen(listen_fd_, 64);
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~FaultProxy() {
    stop_ = true;
    release();
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    {
      std::lock_guard lock(mutex_);
      for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : connections_) t.join();
  }

  FaultProxy(const FaultProxy&) = delete;
  FaultProxy& operator=(const FaultProxy&) = delete;

  std::string host() const { return "127.0.0.1:" + std::to_string(port_); }

  void add(Rule rule) {
    std::lock_guard lock(mutex_);
    rules_.push_back(std::move(rule));
  }

  /// Drops every rule: what comes next is proxied as it is.
  void clear() {
    std::lock_guard lock(mutex_);
    rules_.clear();
  }

  /// Ends every stall: the stalled connections are closed.
  void release() {
    {
      std::lock_guard lock(mutex_);
      released_ = true;
    }
    released_cv_.notify_all();
  }

  std::vector<Seen> requests() const {
    std::lock_guard lock(mutex_);
    return seen_;
  }

  /// Requests whose target contains `path`.
  std::vector<Seen> requests(const std::string& path) const {
    std::vector<Seen> out;
    for (const auto& s : requests()) {
      if (s.target.find(path) != std::string::npos) out.push_back(s);
    }
    return out;
  }

  /// True once a stalled connection is waiting (for tests that act mid-body).
  bool stalled() const { return stalled_.load() > 0; }

 private:
  static bool send_all(int fd, const char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
      if (n <= 0) return false;
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }

  static std::string read_head(int fd, std::string& rest) {
    std::string data;
    char buffer[8192];
    while (data.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n <= 0) return "";
      data.append(buffer, static_cast<size_t>(n));
    }
    const auto end = data.find("\r\n\r\n") + 4;
    rest = data.substr(end);
    return data.substr(0, end);
  }

  /// The head with every Connection header replaced by "Connection: close".
  static std::string close_connection(const std::string& head) {
    std::string out;
    size_t pos = 0;
    while (pos < head.size()) {
      const auto eol = head.find("\r\n", pos);
      const std::string line = head.substr(pos, eol - pos);
      pos = eol + 2;
      if (line.empty()) break;
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      if (lower.rfind("connection:", 0) == 0 || lower.rfind("keep-alive:", 0) == 0) continue;
      out += line + "\r\n";
    }
    return out + "Connection: close\r\n\r\n";
  }

  void accept_loop() {
    while (!stop_) {
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        if (stop_) return;
        continue;
      }
      std::lock_guard lock(mutex_);
      open_fds_.push_back(client);
      connections_.emplace_back([this, client] { serve(client); });
    }
  }

  void forget(int fd) {
    std::lock_guard lock(mutex_);
    open_fds_.erase(std::remove(open_fds_.begin(), open_fds_.end(), fd), open_fds_.end());
    ::close(fd);
  }

  void serve(int client) {
    std::string body_start;
    const std::string head = read_head(client, body_start);
    if (head.empty()) return forget(client);
    Seen seen;
    seen.at = std::chrono::steady_clock::now();
    const auto first_space = head.find(' ');
    const auto second_space = head.find(' ', first_space + 1);
    seen.method = head.substr(0, first_space);
    seen.target = head.substr(first_space + 1, second_space - first_space - 1);
    if (const auto at = head.find("Range: bytes="); at != std::string::npos) {
      seen.range_start = std::stol(head.substr(at + 13));
    }
    std::optional<Rule> rule;
    {
      std::lock_guard lock(mutex_);
      for (auto& r : rules_) {
        if (seen.target.find(r.path_contains) == std::string::npos) continue;
        const int n = ++r.seen;
        if (!rule && n >= r.first && (r.times == 0 || n < r.first + r.times)) rule = r;
      }
    }
    if (rule && rule->action == Action::kStatus) {
      const std::string body = "{\"errors\":[{\"code\":\"FAULT\",\"message\":\"injected\"}]}";
      const std::string reply =
          "HTTP/1.1 " + std::to_string(rule->status) +
          " Fault\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
          "\r\nConnection: close\r\n" + rule->headers + "\r\n" + body;
      send_all(client, reply.data(), reply.size());
      seen.status = rule->status;
      seen.fault = "status";
      record(seen);
      return forget(client);
    }
    const int upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
    if (::connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(upstream);
      record(seen);
      return forget(client);
    }
    {
      std::lock_guard lock(mutex_);
      open_fds_.push_back(upstream);
    }
    const std::string request = close_connection(head);
    std::string response_rest;
    std::string response_head;
    if (send_all(upstream, request.data(), request.size()) &&
        (body_start.empty() || send_all(upstream, body_start.data(), body_start.size()))) {
      response_head = read_head(upstream, response_rest);
    }
    if (response_head.empty()) {
      record(seen);
      forget(upstream);
      return forget(client);
    }
    seen.status = std::atoi(response_head.c_str() + response_head.find(' ') + 1);
    const std::string out_head = close_connection(response_head);
    send_all(client, out_head.data(), out_head.size());
    if (rule) {
      seen.fault = rule->action == Action::kDropAfter ? "drop" : rule->action == Action::kCorrupt ? "corrupt" : "stall";
    }
    // The body, byte-counted so a rule lands at its offset.
    int64_t sent = 0;
    std::string chunk = std::move(response_rest);
    char buffer[65536];
    bool open = true;
    while (open) {
      if (chunk.empty()) {
        const ssize_t n = ::recv(upstream, buffer, sizeof buffer, 0);
        if (n <= 0) break;
        chunk.assign(buffer, static_cast<size_t>(n));
      }
      if (rule && rule->action == Action::kCorrupt && rule->offset >= sent &&
          rule->offset < sent + static_cast<int64_t>(chunk.size())) {
        chunk[static_cast<size_t>(rule->offset - sent)] ^= 0x01;
      }
      if (rule && (rule->action == Action::kDropAfter || rule->action == Action::kStallAfter) &&
          sent + static_cast<int64_t>(chunk.size()) >= rule->offset) {
        const auto keep = static_cast<size_t>(rule->offset - sent);
        send_all(client, chunk.data(), keep);
        if (rule->action == Action::kStallAfter) stall(client);
        open = false;
        break;
      }
      open = send_all(client, chunk.data(), chunk.size());
      sent += static_cast<int64_t>(chunk.size());
      chunk.clear();
    }
    record(seen);
    forget(upstream);
    forget(client);
  }

  /// Holds the connection, sending nothing, until released, stopped, or the client goes.
  void stall(int client) {
    ++stalled_;
    std::unique_lock lock(mutex_);
    while (!released_ && !stop_) {
      released_cv_.wait_for(lock, std::chrono::milliseconds(50));
      lock.unlock();
      pollfd p{client, POLLIN | POLLRDHUP, 0};
      const bool gone = ::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
      lock.lock();
      if (gone) break;
    }
    --stalled_;
  }

  void record(const Seen& seen) {
    std::lock_guard lock(mutex_);
    seen_.push_back(seen);
  }

  int listen_fd_ = -1;
  int port_ = 0;
  int upstream_port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> stalled_{0};
  std::thread acceptor_;
  mutable std::mutex mutex_;  ///< guards rules_, seen_, open_fds_, connections_, released_
  std::condition_variable released_cv_;
  bool released_ = false;
  std::vector<Rule> rules_;
  std::vector<Seen> seen_;
  std::vector<int> open_fds_;
  std::vector<std::thread> connections_;
};

}  // namespace cfmo::pulltest
