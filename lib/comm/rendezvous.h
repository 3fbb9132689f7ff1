#pragma once
/// Rendezvous: rank 0 listens on a TCP address, every rank (rank 0 too) sends
/// it its transport address, and rank 0 answers each with the table of all
/// of them. After that ranks talk directly; the socket is closed.

#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cfmo::comm {

struct RendezvousConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  int listen_fd = -1;     ///< rank 0: an already listening socket (the local launcher passes one)
  double timeout_s = 60;  ///< how long to wait for every rank
};

/// "host:port" (IPv4, a name, or [IPv6]:port).
Result<RendezvousConfig> parse_rendezvous(const std::string& text);

/// Returns every rank's address, indexed by rank.
Result<std::vector<std::vector<std::byte>>> exchange_addresses(const RendezvousConfig& config, int rank, int size,
                                                               const std::vector<std::byte>& own_address);

/// A listening TCP socket on host, port 0 = any free port. Returns the fd and the port.
Result<std::pair<int, uint16_t>> listen_tcp(const std::string& host, uint16_t port);

}  // namespace cfmo::comm
