#pragma once
/// The UCX implementation of the transport seam: one UCP context and worker
/// per process, endpoints to every peer with peer error handling, and one
/// progress thread that drives the worker. Other threads hand their sends
/// to it through a queue; only the caller of a blocking collective takes
/// the worker over for the collective's duration (no hand-off, no wake-ups
/// on the collective's path) while the progress thread waits.

#include "comm/communicator.h"
#include "comm/rendezvous.h"

#include <memory>

namespace cfmo::comm {

struct UcxOptions {
  double peer_timeout_s = 10;  ///< a peer silent this long is lost
  double heartbeat_s = 0.5;    ///< how often each rank says it is alive
  /// The run ends at its first lost rank: UCX's shared-memory FIFOs may
  /// carry the small messages between ranks of one host (several times
  /// faster than TCP loopback), although a sender killed mid-write leaves
  /// the receiver deaf to every local sender (ucx_communicator.cpp,
  /// choose_transports): here that only delays the end by a peer timeout.
  bool fifos = false;
};

/// Creates the UCP context and worker, exchanges addresses through the
/// rendezvous and connects to every peer. UCX_TLS, UCX_NET_DEVICES and the
/// other UCX_* variables are honoured (read by ucp_config_read). `first_size`,
/// if given, gets the world's size when the run started (a joiner learns it
/// from the leader: the world may have grown since). `run_ended`, if given,
/// is set when this process (a joiner, a rank restarted into its run) came as
/// the run ended (Rendezvous::run_ended): then no communicator (null) is
/// returned; without it that is an error (kPeer).
Result<std::unique_ptr<Communicator>> connect_ucx(int rank, int size, const RendezvousConfig& rendezvous,
                                                  const UcxOptions& options = {}, int* first_size = nullptr,
                                                  bool* run_ended = nullptr);

}  // namespace cfmo::comm
