#include "world.h"

#include "comm/world.h"

#include <cstdlib>

namespace cfmo::python {

Result<std::unique_ptr<comm::Communicator>> connect_world(const WorldOptions& options) {
  CFMO_ASSIGN_OR_RETURN(const auto world, comm::world_from_environment());
  if (!world || world->size == 1) return std::unique_ptr<comm::Communicator>();
  cfmo::comm::WorldOptions connect{options.rendezvous, options.peer_timeout_s,
                                   "set CFMO_RENDEZVOUS (or World(rendezvous=...))"};
  CFMO_ASSIGN_OR_RETURN(auto comm, cfmo::comm::connect_world(world, connect));
  // Consumed: a second World must not listen on a closed socket.
  if (world->launched && world->rank == 0) ::unsetenv("CFMO_RENDEZVOUS_FD");
  return comm;
}

}  // namespace cfmo::python
