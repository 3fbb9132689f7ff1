#include "world.h"

#include "comm/rendezvous.h"
#include "comm/ucx_communicator.h"
#include "train/launcher.h"

#include <algorithm>
#include <cstdlib>

namespace cfmo::python {

Result<std::unique_ptr<Communicator>> connect_world(const WorldOptions& options) {
  CFMO_ASSIGN_OR_RETURN(const auto world, world_from_environment());
  if (!world || world->size == 1) return std::unique_ptr<Communicator>();
  // Our own launcher's address wins: its rank 0 listens on the socket it inherited.
  const bool launched = std::getenv("CFMO_LAUNCHED") != nullptr;
  std::string address = launched ? "" : options.rendezvous;
  if (address.empty() && std::getenv("CFMO_RENDEZVOUS") != nullptr) address = std::getenv("CFMO_RENDEZVOUS");
  if (address.empty()) {
    return make_error(ErrorKind::kUsage, "{} says {} ranks: set CFMO_RENDEZVOUS (or World(rendezvous=...))",
                      world->source, world->size);
  }
  CFMO_ASSIGN_OR_RETURN(auto rendezvous, parse_rendezvous(address));
  if (const char* fd = std::getenv("CFMO_RENDEZVOUS_FD"); fd != nullptr && launched && world->rank == 0) {
    rendezvous.listen_fd = std::atoi(fd);
    ::unsetenv("CFMO_RENDEZVOUS_FD");  // consumed: a second World must not listen on a closed socket
  }
  rendezvous.timeout_s = std::max(60.0, options.peer_timeout_s);
  UcxOptions ucx;
  ucx.peer_timeout_s = options.peer_timeout_s;
  return connect_ucx(world->rank, world->size, rendezvous, ucx);
}

}  // namespace cfmo::python
