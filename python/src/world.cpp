#include "world.h"

#include "comm/world.h"

#include <cstdlib>

namespace cfmo::python {

Result<std::unique_ptr<Communicator>> connect_world(const WorldOptions& options) {
  CFMO_ASSIGN_OR_RETURN(const auto world, world_from_environment());
  if (!world || world->size == 1) return std::unique_ptr<Communicator>();
  cfmo::WorldOptions connect{options.rendezvous, options.peer_timeout_s,
                             "set CFMO_RENDEZVOUS (or World(rendezvous=...))"};
  CFMO_ASSIGN_OR_RETURN(auto comm, cfmo::connect_world(world, connect));
  // Consumed: a second World must not listen on a closed socket.
  if (world->launched && world->rank == 0) ::unsetenv("CFMO_RENDEZVOUS_FD");
  return comm;
}

}  // namespace cfmo::python
