#pragma once
/// What a transport knows about its peers' health, kept alike by every
/// transport (UCX, loopback): who is lost and why, who left on purpose (a
/// goodbye), and the root cause of a failure, passed on in goodbyes so that
/// a rank that cannot go on without a failed peer fails with that peer's
/// kind and message rather than with "rank K left the run". Thread-safe.

#include "core/error.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::comm {

class PeerHealth {
 public:
  PeerHealth(int rank, int size);

  /// `peer` is lost for `why` (the first reason stays). Ignored once this
  /// rank is stopping (peers leave at shutdown) and for a peer that said goodbye.
  void mark_lost(int peer, std::string why);
  bool is_lost(int peer) const;
  bool departed(int peer) const;  ///< said goodbye: its disconnect is expected
  void set_stopping() { stopping_ = true; }
  bool stopping() const { return stopping_.load(); }

  std::vector<int> lost_ranks() const;
  /// The world grew to `size` ranks (a join with no rank lost): the new
  /// ones start alive. Called before the transport's size says so, so that
  /// a rank below size() is always known here.
  void grow(int size);
  /// A new process took the place of `peer` (a join): it is live again, and
  /// its join is recorded (joined_ranks).
  void rejoined(int peer);
  /// The ranks that joined the run while this rank was in it, one entry per join, in order.
  std::vector<int> joined_ranks() const;
  /// How many times `peer` is in joined_ranks() (no copy).
  size_t joins_of(int peer) const;
  /// Why the process the `join`-th join (an index into joined_ranks()) took
  /// the place of was lost; empty for a new rank (the world grew).
  std::string replaced_loss(size_t join) const;
  /// When this rank took the `join`-th join in (an index into joined_ranks()).
  std::chrono::steady_clock::time_point joined_at(size_t join) const;
  /// The root cause another rank reported, else a kPeer error naming the first lost rank; ok if none.
  Status health() const;
  std::string lost_reason(int peer) const;
  /// Why waiting on `peer` cannot succeed (`what` failed), with the root
  /// cause's kind and message when another rank reported one.
  Error failure_of(std::string_view what, int peer) const;

  /// This rank is about to leave because of its own failure (Communicator::leave_with).
  void leave_with(const Error& error);
  /// Whether this rank saw any failure (its own, a peer's, a root cause).
  bool saw_failure() const { return !own_failure().message.empty(); }

  /// The payload of this rank's goodbye: [u8 kind | kFailedLeaving][message],
  /// or nothing when this rank saw no failure.
  std::vector<std::byte> goodbye() const;
  /// `peer` said goodbye with `payload`.
  void on_goodbye(int peer, std::span<const std::byte> payload);

 private:
  /// The failure this rank saw first, to pass on in its goodbye: a root
  /// cause another rank reported, else its own (leave_with), else a lost
  /// peer. An empty message: none.
  Error own_failure() const;
  Status first_lost_locked() const;

  const int rank_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::vector<std::string> lost_;                    ///< per rank: why it is lost, empty while alive
  std::vector<bool> departed_;                       ///< per rank: said goodbye
  std::vector<int> joined_;                          ///< see joined_ranks()
  std::vector<std::string> replaced_;                ///< per join: see replaced_loss()
  std::string first_failure_;                        ///< the first failure any rank reported, e.g. "rank 2 lost: .."
  ErrorKind first_failure_kind_ = ErrorKind::kPeer;  ///< and its kind: the status the run ends with
  Error left_with_{ErrorKind::kPeer, {}};            ///< this rank's own failure (leave_with)
  /// Per join: see joined_at().
  std::vector<std::chrono::steady_clock::time_point> joined_at_;
};

}  // namespace cfmo::comm
