#pragma once
/// The Python module's world: this process's rank among the workers, found
/// as cfmo-train's workers find it (RANK/WORLD_SIZE, Open MPI's, Slurm's,
/// the rendezvous in CFMO_RENDEZVOUS, and on rank 0 of cfmo's own launcher
/// the listening socket in CFMO_RENDEZVOUS_FD); one process is a world of one.

#include "comm/communicator.h"
#include "core/error.h"

#include <memory>
#include <string>

namespace cfmo::python {

struct WorldOptions {
  std::string rendezvous;  ///< host:port; empty: CFMO_RENDEZVOUS
  double peer_timeout_s = 10;
};

/// Connects this process to its world (lib/comm's connect_world); null for
/// a world of one. The one place the module builds a communicator.
Result<std::unique_ptr<comm::Communicator>> connect_world(const WorldOptions& options);

/// A connected world, shared by the objects that use it. One Reconciler at
/// a time owns the modes' channels.
struct World {
  std::unique_ptr<comm::Communicator> comm;  ///< null: a world of one, or closed
  WorldOptions options;
  bool in_use = false;
  bool closed = false;
  int rank_ = 0;
  int size_ = 1;

  int rank() const { return rank_; }
  int size() const { return size_; }
};

}  // namespace cfmo::python
