#pragma once
/// An in-process transport: N Communicators in one process, for tests of the
/// protocols built on the seam (the training modes, cfmo-moe's engines) and
/// for simulations, without processes, sockets or UCX.
///
///   auto world = make_loopback_world(3, {.peer_timeout_s = 0.2});
///   // world.ranks[r] is rank r's Communicator: use each from its own thread
///   // (a blocking collective waits for the other ranks' calls), or drive
///   // non-blocking protocols from one thread and world.network->drain().
///
/// It keeps the Communicator contract as UCX does: each rank has its own
/// progress thread that runs its message handlers, one at a time, in the
/// order the messages arrived; messages between two ranks keep their order;
/// a post to oneself goes through the progress thread too; the collectives
/// are the same code (comm/collectives.h) over a point-to-point seam of
/// copies; stats count as UCX's (collectives count bytes, not messages; a
/// post to oneself counts nothing); health, lost_ranks, leave_with and the
/// goodbye a destroyed rank sends behave as UCX's (comm/peer_health.h).
///
/// What a test controls, through world.network (any thread, any time):
///   set_delay(from, to, s)  messages on that link (-1: every link) arrive s
///                           seconds after they were sent, still in order
///   hold(from, to) /        messages on the link wait, in order, until
///   release(from, to)       released: staleness made deterministic
///   silence(rank)           the rank goes quiet as a hung or cut-off host:
///                           nothing it sends arrives, nothing reaches it, its
///                           handlers run no more; after peer_timeout_s every
///                           other rank finds it lost ("no message for 0.2s")
///                           and it finds every other rank lost
///   kill(rank)              as silence, but found at once, as UCX finds a
///                           peer whose process died ("connection error: ...")
///   drain(timeout)          waits until every message sent so far that is
///                           not held has been handled (delays included): a
///                           single-threaded test's point of quiet
///   join(rank)              a new Communicator in the place of a lost rank
///                           whose own is gone, as a process that joined the
///                           run under way (`cfmo-train --join`): its joined()
///                           is true, and every other rank finds the rank live
///                           again at once, the join recorded (joined_ranks),
///                           as UCX's ranks do before the joiner gets its table;
///                           join(W) in a world of W: a new rank W, the world
///                           grows by one (a join with no rank lost), every
///                           rank's size() says W + 1 and its joined_ranks()
///                           records W, as UCX's; the collectives stay among
///                           the ranks a communicator started with, and the
///                           new rank's links start without delay or hold;
///                           refused (kPeer, "the run ends") once the lowest
///                           live rank closed joins (close_joins), as the
///                           rendezvous refuses, and with no rank live
///   join(rank, true)        taken in all the same: a process the rendezvous
///                           admitted just before the close, whose request
///                           for the run's state comes after the modes' end
/// Collectives' messages take the links' delays and holds too; a rank that
/// waits in a collective on a lost peer fails with kPeer naming it, as UCX.
///
/// Destroying a rank's Communicator is its leaving (the goodbye); the world's
/// state lives until the last Communicator and the network handle are gone.

#include "comm/communicator.h"

#include <memory>
#include <vector>

namespace cfmo::comm {

struct LoopbackOptions {
  double peer_timeout_s = 10;  ///< a silenced peer is found lost this long after it went quiet
};

struct LoopbackState;

class LoopbackNetwork {
 public:
  explicit LoopbackNetwork(std::shared_ptr<LoopbackState> state) : state_(std::move(state)) {}
  void set_delay(int from, int to, double seconds);
  void hold(int from, int to);
  void release(int from, int to);
  void silence(int rank);
  void kill(int rank);
  /// True once quiet; false if `timeout_s` passed first.
  bool drain(double timeout_s = 30);
  /// A process joining in `rank`'s place; kUsage unless the rank was
  /// killed or silenced and its Communicator destroyed, or is the world's
  /// size (a new rank: the world grows).
  Result<std::unique_ptr<Communicator>> join(int rank, bool past_close = false);

 private:
  std::shared_ptr<LoopbackState> state_;
};

struct LoopbackWorld {
  std::vector<std::unique_ptr<Communicator>> ranks;  ///< [r]: rank r
  std::unique_ptr<LoopbackNetwork> network;
};

/// `size` ranks (at least 1), connected, their progress threads running.
LoopbackWorld make_loopback_world(int size, const LoopbackOptions& options = {});

}  // namespace cfmo::comm
