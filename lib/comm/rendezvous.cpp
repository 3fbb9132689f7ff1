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
#include <span>
#include <thread>

namespace cfmo::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x4346'4D4F;  // "CFMO"
// 2: joins; 3: an offer says the run's first size (the world may grow); 4: a refusal may say the run ends.
constexpr uint32_t kVersion = 4;
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

/// A connection to rank 0 (or whoever serves joins there), tried until the
/// deadline; `joining`: a process that joins (or rejoins) a run under way.
Result<Socket> connect_with_retry(const RendezvousConfig& config, Clock::time_point deadline, bool joining) {
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
  if (joining) {
    // Nobody listens: a run that ended looks the same as one not started yet.
    return peer_error(
        fmt::format("nobody answered at {} within {:.0f}s ({}): no run listens there (it ended, or "
                    "has not started); this process trained nothing",
                    where, config.timeout_s, last_error));
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

namespace {

/// listen_tcp, and whether it failed because the address is in use (`in_use`).
Result<std::pair<int, uint16_t>> listen_tcp_at(const std::string& host, uint16_t port, bool& in_use) {
  in_use = false;
  CFMO_ASSIGN_OR_RETURN(addrinfo * list, resolve(host, port, true));
  std::string last_error = "no address";
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (s.get() < 0) continue;
    const int one = 1;
    ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.get(), 1024) != 0) {
      in_use = in_use || errno == EADDRINUSE;
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

}  // namespace

Result<std::pair<int, uint16_t>> listen_tcp(const std::string& host, uint16_t port) {
  bool in_use = false;
  return listen_tcp_at(host, port, in_use);
}

namespace {

constexpr uint32_t kAnswerTable = 0;
constexpr uint32_t kAnswerOffer = 1;
constexpr uint32_t kAnswerRefusal = 2;
constexpr uint32_t kAny = ~uint32_t{0};

Status send_bytes(int fd, std::span<const std::byte> bytes, Clock::time_point deadline, std::string_view what) {
  CFMO_TRY(send_u32s(fd, {static_cast<uint32_t>(bytes.size())}, deadline, what));
  return send_all(fd, bytes.data(), bytes.size(), deadline, what);
}

Result<std::vector<std::byte>> recv_bytes(int fd, Clock::time_point deadline, std::string_view what) {
  CFMO_ASSIGN_OR_RETURN(uint32_t length, recv_u32(fd, deadline, what));
  if (length > kMaxAddress) return peer_error(fmt::format("{}: an oversized field", what));
  std::vector<std::byte> out(length);
  CFMO_TRY(recv_all(fd, out.data(), length, deadline, what));
  return out;
}

Status send_table(int fd, const std::vector<std::vector<std::byte>>& table, Clock::time_point deadline,
                  std::string_view what) {
  CFMO_TRY(send_u32s(fd, {static_cast<uint32_t>(table.size())}, deadline, what));
  for (const auto& address : table) CFMO_TRY(send_bytes(fd, address, deadline, what));
  return {};
}

Result<std::vector<std::vector<std::byte>>> recv_table(int fd, uint32_t size, Clock::time_point deadline,
                                                       std::string_view what) {
  CFMO_ASSIGN_OR_RETURN(uint32_t count, recv_u32(fd, deadline, what));
  if (count != size) return peer_error(fmt::format("rank 0 runs {} ranks, this rank was started for {}", count, size));
  std::vector<std::vector<std::byte>> table(count);
  for (auto& address : table) {
    CFMO_ASSIGN_OR_RETURN(address, recv_bytes(fd, deadline, what));
  }
  return table;
}

/// A refusal's second word.
constexpr uint32_t kRefusedFinal = 0;
constexpr uint32_t kRefusedRetry = 1;
constexpr uint32_t kRefusedRunEnds = 2;

Status send_refusal(int fd, uint32_t why, std::string_view reason, std::string_view description,
                    Clock::time_point deadline) {
  CFMO_TRY(send_u32s(fd, {kAnswerRefusal, why}, deadline, "refusing a join"));
  CFMO_TRY(send_bytes(fd, std::as_bytes(std::span(reason.data(), reason.size())), deadline, "refusing a join"));
  return send_bytes(fd, std::as_bytes(std::span(description.data(), description.size())), deadline, "refusing a join");
}

/// A joiner's look at the run's description (none while the run starts).
Status check_description(const RendezvousConfig& config, const std::vector<std::byte>& description) {
  if (!config.check || description.empty()) return {};
  return config.check(std::string_view(reinterpret_cast<const char*>(description.data()), description.size()));
}

/// A process other than rank 0: its hello, then the table (the start) or a
/// join (the run is under way); a refusal that may pass is retried until the deadline.
Result<Rendezvous> ask_rank_zero(const RendezvousConfig& config, int rank, int size,
                                 const std::vector<std::byte>& own_address, Clock::time_point deadline) {
  const std::string where = fmt::format("{}:{}", config.host, config.port);
  const std::string what = fmt::format("talking to rank 0 at {}", where);
  std::string refused;
  for (;;) {
    if (!refused.empty() && Clock::now() >= deadline) {
      return peer_error(fmt::format("no place in the run at {} within {:.0f}s: {}", where, config.timeout_s, refused));
    }
    CFMO_ASSIGN_OR_RETURN(Socket s, connect_with_retry(config, deadline, rank == kAnyRank || !refused.empty()));
    CFMO_TRY(send_u32s(
        s.get(), {kMagic, kVersion, rank == kAnyRank ? kAny : static_cast<uint32_t>(rank), static_cast<uint32_t>(size)},
        deadline, what));
    CFMO_TRY(send_bytes(s.get(), own_address, deadline, what));
    auto answer = recv_u32(s.get(), deadline, what);
    if (!answer) {
      // A rank of the start fails as it always did; a joiner dropped while
      // the run was starting (or by a rank 0 busy with another) asks again.
      if (rank != kAnyRank) return answer.error();
      refused = answer.error().message;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    if (*answer == kAnswerTable) {
      if (rank == kAnyRank) return peer_error("rank 0 answered a join with the table of a starting run");
      Rendezvous out;
      out.rank = rank;
      out.size = size;
      out.first_size = size;
      CFMO_ASSIGN_OR_RETURN(out.addresses, recv_table(s.get(), static_cast<uint32_t>(size), deadline, what));
      return out;
    }
    if (*answer == kAnswerRefusal) {
      CFMO_ASSIGN_OR_RETURN(uint32_t why, recv_u32(s.get(), deadline, what));
      CFMO_ASSIGN_OR_RETURN(auto reason, recv_bytes(s.get(), deadline, what));
      CFMO_ASSIGN_OR_RETURN(auto description, recv_bytes(s.get(), deadline, what));
      refused.assign(reinterpret_cast<const char*>(reason.data()), reason.size());
      // A process that does not fit the run learns it now, not after waiting for a free rank.
      CFMO_TRY(check_description(config, description));
      if (why == kRefusedRunEnds) {
        Rendezvous out;
        out.run_ended = true;
        return out;
      }
      if (why != kRefusedRetry) return make_error(ErrorKind::kUsage, "joining the run at {}: {}", where, refused);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    if (*answer != kAnswerOffer) return peer_error(fmt::format("{}: unknown answer {}", what, *answer));
    // A place is offered: the wait for one (the timeout) is over, and the
    // admission, for which the leader waits on every live rank, has its own time.
    const auto admission = std::max(deadline, Clock::now() + std::chrono::seconds(60));
    Rendezvous out;
    out.joined = true;
    CFMO_ASSIGN_OR_RETURN(uint32_t offered, recv_u32(s.get(), admission, what));
    CFMO_ASSIGN_OR_RETURN(uint32_t world, recv_u32(s.get(), admission, what));
    CFMO_ASSIGN_OR_RETURN(uint32_t first, recv_u32(s.get(), admission, what));
    CFMO_ASSIGN_OR_RETURN(auto description, recv_bytes(s.get(), admission, what));
    if (world < 2 || offered >= world || first < 1 || first > world)
      return peer_error(fmt::format("{}: rank 0 offered rank {} of {}", what, offered, world));
    if (const Status fits = check_description(config, description); !fits) {
      // Declined: rank 0 takes nobody in, the run goes on as it was.
      [[maybe_unused]] auto declined = send_u32s(s.get(), {0u}, admission, what);
      return fits.error();
    }
    CFMO_TRY(send_u32s(s.get(), {1u}, admission, what));
    out.rank = static_cast<int>(offered);
    out.size = static_cast<int>(world);
    out.first_size = static_cast<int>(first);
    CFMO_ASSIGN_OR_RETURN(out.addresses, recv_table(s.get(), world, admission, what));
    out.lost.resize(world);
    for (uint32_t r = 0; r < world; ++r) {
      CFMO_ASSIGN_OR_RETURN(uint32_t lost, recv_u32(s.get(), admission, what));
      out.lost[r] = lost != 0;
    }
    return out;
  }
}

struct Hello {
  uint32_t rank = 0;
  uint32_t size = 0;
  std::vector<std::byte> address;
};

/// A hello on a just accepted connection; an error for a stranger's bytes.
Result<Hello> read_hello(int fd, Clock::time_point deadline) {
  CFMO_ASSIGN_OR_RETURN(uint32_t magic, recv_u32(fd, deadline, "reading a hello"));
  CFMO_ASSIGN_OR_RETURN(uint32_t version, recv_u32(fd, deadline, "reading a hello"));
  if (magic != kMagic || version != kVersion) return peer_error("a hello of another program or version");
  Hello h;
  CFMO_ASSIGN_OR_RETURN(h.rank, recv_u32(fd, deadline, "reading a hello"));
  CFMO_ASSIGN_OR_RETURN(h.size, recv_u32(fd, deadline, "reading a hello"));
  CFMO_ASSIGN_OR_RETURN(h.address, recv_bytes(fd, deadline, "reading an address"));
  return h;
}

}  // namespace

Status serve_join(int socket, int size, int first_size, const std::string& description, const JoinHooks& hooks,
                  double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  CFMO_ASSIGN_OR_RETURN(Hello hello, read_hello(socket, std::min(deadline, Clock::now() + std::chrono::seconds(5))));
  const int asked = hello.rank == kAny ? kAnyRank : static_cast<int>(std::min<uint32_t>(hello.rank, 1u << 30));
  const JoinHooks::Decision decision = hooks.decide(asked, static_cast<int>(std::min<uint32_t>(hello.size, 1u << 30)));
  if (decision.rank < 0) {
    const uint32_t why = decision.ended ? kRefusedRunEnds : decision.retry ? kRefusedRetry : kRefusedFinal;
    return send_refusal(socket, why, decision.refusal, description, deadline);
  }
  const std::string what = fmt::format("offering rank {} to a joining process", decision.rank);
  const int world = std::max(size, decision.world);
  CFMO_TRY(send_u32s(socket,
                     {kAnswerOffer, static_cast<uint32_t>(decision.rank), static_cast<uint32_t>(world),
                      static_cast<uint32_t>(first_size)},
                     deadline, what));
  CFMO_TRY(send_bytes(socket, std::as_bytes(std::span(description.data(), description.size())), deadline, what));
  CFMO_ASSIGN_OR_RETURN(uint32_t accepted, recv_u32(socket, deadline, what));
  if (accepted == 0) return {};  // it did not fit (its flags): nothing changes
  CFMO_ASSIGN_OR_RETURN(auto admitted, hooks.admit(decision.rank, hello.address));
  CFMO_TRY(send_table(socket, admitted.first, deadline, what));
  for (const bool lost : admitted.second) CFMO_TRY(send_u32s(socket, {lost ? 1u : 0u}, deadline, what));
  return {};
}

Result<Rendezvous> exchange_addresses(const RendezvousConfig& config, int rank, int size,
                                      const std::vector<std::byte>& own_address) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(config.timeout_s * 1000));
  if (rank != 0) return ask_rank_zero(config, rank, size, own_address, deadline);

  Rendezvous out;
  out.rank = 0;
  out.size = size;
  out.first_size = size;
  if (config.listen_fd >= 0) {
    out.listener = Socket(config.listen_fd);
  } else {
    bool in_use = false;
    auto bound = listen_tcp_at(config.host, config.port, in_use);
    if (!bound && in_use && config.grow) {
      // Rank 0 restarted with its command while its run goes on (another
      // rank serves joins at the address now): it joins, at the rank it is given.
      auto joined = ask_rank_zero(config, 0, size, own_address, deadline);
      if (joined && (joined->joined || joined->run_ended)) return joined;
      return make_error(bound.error().kind, "{}; nor did a run there take this process in: {}", bound.error().message,
                        joined ? "it is starting" : joined.error().message);
    }
    if (!bound) return bound.error();
    out.listener = Socket(bound->first);
  }
  auto& table = out.addresses;
  table.assign(static_cast<size_t>(size), {});
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
    pollfd p{out.listener.get(), POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) continue;
    Socket s(::accept4(out.listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s.get() < 0) continue;
    // A stranger (a port scan, a wrong client) is dropped, not fatal.
    const auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    auto hello = read_hello(s.get(), hello_deadline);
    if (!hello) continue;
    if (hello->rank == kAny) {
      // A join while the run starts: it asks again once the run is under way.
      [[maybe_unused]] auto refused =
          send_refusal(s.get(), kRefusedRetry, "the run is still starting", {}, hello_deadline);
      continue;
    }
    if (hello->size != static_cast<uint32_t>(size)) {
      return peer_error(fmt::format("rank {} was started for {} ranks, rank 0 for {}", hello->rank, hello->size, size));
    }
    if (hello->rank == 0 || hello->rank >= static_cast<uint32_t>(size) || peers[hello->rank].get() >= 0) {
      return peer_error(fmt::format("two processes claim rank {}", hello->rank));
    }
    table[hello->rank] = std::move(hello->address);
    peers[hello->rank] = std::move(s);
    ++joined;
  }
  for (int r = 1; r < size; ++r) {
    const int fd = peers[static_cast<size_t>(r)].get();
    const std::string what = fmt::format("answering rank {}", r);
    CFMO_TRY(send_u32s(fd, {kAnswerTable}, deadline, what));
    CFMO_TRY(send_table(fd, table, deadline, what));
  }
  return out;
}

}  // namespace cfmo::comm
