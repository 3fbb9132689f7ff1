#pragma once
/// The point-to-point seam under the collectives (comm/collectives.h): what a
/// transport must offer so that the ring all-reduce, the barrier and the
/// all-to-all-v are written once. UCX (comm/ucx_communicator.cpp) and the
/// in-process loopback (comm/loopback.h) implement it.
///
/// A collective is a sequence of exchanges. Each exchange is a batch of
/// tagged sends and receives that the transport starts together and waits
/// for together: a receive of `peer` and `tag` is matched by the send of
/// that peer with that tag (exactly; sizes agree, as the collectives know
/// every count beforehand). Every rank calls the same collectives in the same
/// order, so the tags, which the collectives number, agree too. Messages of
/// different tags may overtake each other; a transport must keep them apart.
///
/// Threads: one exchange at a time, on the thread that called the
/// collective. While it waits, the transport may go on serving its message
/// handlers (UCX does, on that thread).

#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace cfmo::comm {

struct SendTo {
  int peer = -1;
  std::span<const std::byte> bytes;
};

struct ReceiveFrom {
  int peer = -1;
  std::span<std::byte> into;  ///< filled with exactly into.size() bytes
};

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// Starts every send and receive with `tag`, then waits until all are done.
  /// Fails (kPeer, naming `what` and the peer) once a peer with a transfer
  /// still in flight is lost or has left; then, when it returns, no transfer
  /// reads or writes the buffers any more. Counts the bytes in its stats.
  virtual Status exchange(uint32_t tag, std::span<const SendTo> sends, std::span<const ReceiveFrom> receives,
                          std::string_view what) = 0;
};

/// The seam a communicator's collectives run over: the communicator's own
/// exchange among the ranks of the world as it started. The world may grow
/// (a rank that joins later takes part in no collective), and every member
/// must agree on the ranks a collective spans, so this size never changes.
/// The owner names it a friend to lend it its private exchange.
template <typename Owner>
class StartingWorld final : public PointToPoint {
 public:
  StartingWorld(Owner& owner, int rank, int size) : owner_(owner), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status exchange(uint32_t tag, std::span<const SendTo> sends, std::span<const ReceiveFrom> receives,
                  std::string_view what) override {
    return owner_.exchange(tag, sends, receives, what);
  }

 private:
  Owner& owner_;
  const int rank_;
  const int size_;
};

}  // namespace cfmo::comm
