#include "comm/rendezvous.h"

#include "core/fd.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <thread>

namespace cfmo::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x4346'4D4F;  // "CFMO"
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxAddress = 1 << 20;

/// A socket, closed when it goes out of scope.
using Socket = Fd;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

Error peer_error(std::string_view what) { return make_error(ErrorKind::kPeer, "rendezvous: {}", what); }

Status wait_for(int fd, short events, Clock::time_point deadline, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return {};
    if (rc < 0 && errno != EINTR) return peer_error(fmt::format("{}: {}", what, std::strerror(errno)));
    if (Clock::now() >= deadline) return peer_error(fmt::format("timed out {}", what));
  }
}

Status send_all(int fd, const void* data, size_t size, Clock::time_point deadline, std::string_view what) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    CFMO_TRY(wait_for(fd, POLLOUT, deadline, what));
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return peer_error(fmt::format("{}: {}", what, std::strerror(errno)));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return {};
}

Status recv_all(int fd, void* data, size_t size, Clock::time_point deadline, std::string_view what) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    CFMO_TRY(wait_for(fd, POLLIN, deadline, what));
    const ssize_t n = ::recv(fd, p, size, 0);
    if (n == 0) return peer_error(fmt::format("{}: connection closed", what));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return peer_error(fmt::format("{}: {}", what, std::strerror(errno)));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return {};
}

Status send_u32s(int fd, std::initializer_list<uint32_t> values, Clock::time_point deadline, std::string_view what) {
  for (uint32_t v : values) {
    const uint32_t be = htonl(v);
    CFMO_TRY(send_all(fd, &be, 4, deadline, what));
  }
  return {};
}

Result<uint32_t> recv_u32(int fd, Clock::time_point deadline, std::string_view what) {
  uint32_t be = 0;
  CFMO_TRY(recv_all(fd, &be, 4, deadline, what));
  return ntohl(be);
}

Result<addrinfo*> resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) return make_error(ErrorKind::kUsage, "rendezvous host '{}': {}", host, ::gai_strerror(rc));
  return result;
}

Result<Socket> connect_with_retry(const RendezvousConfig& config, Clock::time_point deadline) {
  const std::string where = fmt::format("{}:{}", config.host, config.port);
  std::string last_error = "no address";
  while (Clock::now() < deadline) {
    CFMO_ASSIGN_OR_RETURN(addrinfo * list, resolve(config.host, config.port, false));
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
      if (s.get() < 0) continue;
      if (::connect(s.get(), ai->ai_addr, ai->ai_addrlen) == 0) {
        ::freeaddrinfo(list);
        const int one = 1;
        ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        return s;
      }
      last_error = std::strerror(errno);
    }
    ::freeaddrinfo(list);
    // Rank 0 may simply not be listening yet.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return peer_error(fmt::format("no answer from rank 0 at {} within {:.0f}s: {}", where, config.timeout_s, last_error));
}

}  // namespace

Result<RendezvousConfig> parse_rendezvous(const std::string& text) {
  RendezvousConfig config;
  std::string_view host = text;
  std::string_view port;
  if (text.starts_with('[')) {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return make_error(ErrorKind::kUsage, "rendezvous '{}': expected host:port", text);
    }
    host = std::string_view(text).substr(1, close - 1);
    port = std::string_view(text).substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return make_error(ErrorKind::kUsage, "rendezvous '{}': expected host:port", text);
    host = std::string_view(text).substr(0, colon);
    port = std::string_view(text).substr(colon + 1);
  }
  unsigned value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size() || value == 0 || value > 65535 || host.empty()) {
    return make_error(ErrorKind::kUsage, "rendezvous '{}': expected host:port with a port in 1..65535", text);
  }
  config.host = std::string(host);
  config.port = static_cast<uint16_t>(value);
  return config;
}

Result<std::pair<int, uint16_t>> listen_tcp(const std::string& host, uint16_t port) {
  CFMO_ASSIGN_OR_RETURN(addrinfo * list, resolve(host, port, true));
  std::string last_error = "no address";
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (s.get() < 0) continue;
    const int one = 1;
    ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.get(), 1024) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    const uint16_t actual = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                        : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    ::freeaddrinfo(list);
    return std::pair<int, uint16_t>{s.release(), actual};
  }
  ::freeaddrinfo(list);
  return make_error(ErrorKind::kUsage, "rendezvous: cannot listen on {}:{}: {}", host, port, last_error);
}

Result<std::vector<std::vector<std::byte>>> exchange_addresses(const RendezvousConfig& config, int rank, int size,
                                                               const std::vector<std::byte>& own_address) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(config.timeout_s * 1000));
  std::vector<std::vector<std::byte>> table(static_cast<size_t>(size));
  if (rank != 0) {
    CFMO_ASSIGN_OR_RETURN(Socket s, connect_with_retry(config, deadline));
    const std::string what = fmt::format("talking to rank 0 at {}:{}", config.host, config.port);
    CFMO_TRY(send_u32s(s.get(),
                       {kMagic, kVersion, static_cast<uint32_t>(rank), static_cast<uint32_t>(size),
                        static_cast<uint32_t>(own_address.size())},
                       deadline, what));
    CFMO_TRY(send_all(s.get(), own_address.data(), own_address.size(), deadline, what));
    CFMO_ASSIGN_OR_RETURN(uint32_t count, recv_u32(s.get(), deadline, what));
    if (count != static_cast<uint32_t>(size)) {
      return peer_error(fmt::format("rank 0 runs {} ranks, this rank was started for {}", count, size));
    }
    for (auto& address : table) {
      CFMO_ASSIGN_OR_RETURN(uint32_t length, recv_u32(s.get(), deadline, what));
      if (length > kMaxAddress) return peer_error("rank 0 sent an oversized address");
      address.resize(length);
      CFMO_TRY(recv_all(s.get(), address.data(), length, deadline, what));
    }
    return table;
  }

  Socket listener;
  if (config.listen_fd >= 0) {
    listener = Socket(config.listen_fd);
  } else {
    CFMO_ASSIGN_OR_RETURN(auto bound, listen_tcp(config.host, config.port));
    listener = Socket(bound.first);
  }
  table[0] = own_address;
  std::vector<Socket> peers(static_cast<size_t>(size));
  int joined = 1;
  while (joined < size) {
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 1; r < size; ++r) {
        if (peers[static_cast<size_t>(r)].get() < 0) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      }
      return peer_error(fmt::format("rank(s) {} did not arrive within {:.0f}s", missing, config.timeout_s));
    }
    pollfd p{listener.get(), POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) continue;
    Socket s(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s.get() < 0) continue;
    // A stranger (a port scan, a wrong client) is dropped, not fatal.
    const auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    auto magic = recv_u32(s.get(), hello_deadline, "reading a hello");
    if (!magic || *magic != kMagic) continue;
    auto version = recv_u32(s.get(), hello_deadline, "reading a hello");
    auto peer_rank = recv_u32(s.get(), hello_deadline, "reading a hello");
    auto peer_size = recv_u32(s.get(), hello_deadline, "reading a hello");
    auto length = recv_u32(s.get(), hello_deadline, "reading a hello");
    if (!version || !peer_rank || !peer_size || !length || *version != kVersion || *length > kMaxAddress) continue;
    if (*peer_size != static_cast<uint32_t>(size)) {
      return peer_error(fmt::format("rank {} was started for {} ranks, rank 0 for {}", *peer_rank, *peer_size, size));
    }
    if (*peer_rank == 0 || *peer_rank >= static_cast<uint32_t>(size) || peers[*peer_rank].get() >= 0) {
      return peer_error(fmt::format("two processes claim rank {}", *peer_rank));
    }
    std::vector<std::byte> address(*length);
    if (!recv_all(s.get(), address.data(), address.size(), hello_deadline, "reading an address")) continue;
    table[*peer_rank] = std::move(address);
    peers[*peer_rank] = std::move(s);
    ++joined;
  }
  for (int r = 1; r < size; ++r) {
    const int fd = peers[static_cast<size_t>(r)].get();
    const std::string what = fmt::format("answering rank {}", r);
    CFMO_TRY(send_u32s(fd, {static_cast<uint32_t>(size)}, deadline, what));
    for (const auto& address : table) {
      CFMO_TRY(send_u32s(fd, {static_cast<uint32_t>(address.size())}, deadline, what));
      CFMO_TRY(send_all(fd, address.data(), address.size(), deadline, what));
    }
  }
  return table;
}

}  // namespace cfmo::comm
