#pragma once
/// The transport seam: what the training modes and cfmo-moe need from the
/// network, whatever carries the bytes (UCX here; NCCL later on GPUs).
///
/// Threads: every method may be called from the training thread. Message
/// handlers registered with on_message() run one at a time on the
/// communicator's own progress thread or, while a blocking collective is
/// under way, on the thread that called it; they may call post(), never a
/// collective, and the caller of a collective holds no lock a handler takes.

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace cfmo::comm {

/// An independent message stream between ranks: a message is handled by the
/// handler registered for its channel. The transport knows no channel by
/// name; each client declares its own (lib/train/channels.h,
/// lib/moe/channels.h) with ids from 1 to kLastClientChannel, distinct among
/// the clients that share a communicator. The ids above are the transports'
/// own (heartbeats, goodbyes), as is 0 (collectives).
struct Channel {
  uint8_t id = 0;
  friend constexpr bool operator==(Channel, Channel) = default;
};
inline constexpr uint8_t kLastClientChannel = 0xEF;

struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
  double collective_wait_s = 0;  ///< time the caller spent blocked in collectives
};

class Communicator {
 public:
  using Handler = std::function<void(int from, std::span<const std::byte> payload)>;
  /// A handler that takes the payload's buffer itself (no copy).
  using OwnedHandler = std::function<void(int from, std::vector<std::byte> payload)>;

  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// Blocking: afterwards every rank's `data` holds the element-wise sum over
  /// ranks. Fails (kPeer) naming a rank that is lost or too slow to answer.
  virtual Status all_reduce_sum(std::span<float> data) = 0;

  /// Blocking all-to-all-v: `send[p]` goes to rank p, `recv[p]` is filled
  /// from rank p (sized by the caller: counts are known beforehand).
  virtual Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                              const std::vector<std::span<std::byte>>& recv) = 0;

  /// Blocking: returns once every rank has entered the barrier.
  virtual Status barrier() = 0;

  /// Non-blocking send; the payload is owned by the communicator until sent.
  /// A message to a lost rank is dropped (and counted by the caller's logic).
  virtual void post(int peer, Channel channel, std::vector<std::byte> payload) = 0;

  /// Registers the handler for a channel; call before messages can arrive
  /// (right after construction, before the first post by any rank). A null
  /// handler unregisters; it returns once no handler is running, so the
  /// handler's owner may then be destroyed. Never call it from a handler.
  virtual void on_message(Channel channel, Handler handler) = 0;

  /// As on_message, but the handler receives the message's own buffer, so a
  /// large payload can be kept (queued, computed on) without a copy. The
  /// default copies; a transport that receives into owned buffers moves.
  virtual void on_message_owned(Channel channel, OwnedHandler handler) {
    if (!handler) {
      on_message(channel, nullptr);
      return;
    }
    on_message(channel, [owned = std::move(handler)](int from, std::span<const std::byte> payload) {
      owned(from, std::vector<std::byte>(payload.begin(), payload.end()));
    });
  }

  /// Ranks found lost so far (connection error or silence past the peer timeout).
  virtual std::vector<int> lost_ranks() const = 0;
  /// kPeer error naming the first lost rank, if any.
  virtual Status health() const = 0;
  /// Why `rank` is lost ("no message for 10.0s"); empty while it is not.
  virtual std::string lost_reason(int /*rank*/) const { return {}; }
  /// Whether `rank` said goodbye: its process is leaving the run (finished,
  /// or failed: then it is lost too, its failure the reason), does not go
  /// on, and answers nothing from now on.
  virtual bool said_goodbye(int /*rank*/) const { return false; }

  /// The ranks that joined the run while this rank was in it (a new process
  /// in the place of a lost rank: `cfmo-train --join`, a restarted rank), one
  /// entry per join, in order; such a rank is no longer in lost_ranks().
  virtual std::vector<int> joined_ranks() const { return {}; }
  /// Whether `rank` is in lost_ranks(), and how many times it is in
  /// joined_ranks(), without copying them (what a wait asks at every turn).
  virtual bool is_lost_rank(int rank) const {
    const auto lost = lost_ranks();
    return std::find(lost.begin(), lost.end(), rank) != lost.end();
  }
  virtual size_t joins_of(int rank) const {
    const auto joined = joined_ranks();
    return static_cast<size_t>(std::count(joined.begin(), joined.end(), rank));
  }
  /// Why the process that the `join`-th join (an index into joined_ranks())
  /// took the place of was lost: a rank may be lost and taken back between
  /// two looks at lost_ranks(), and its loss is still news. Empty for a new
  /// rank (the world grew).
  virtual std::string replaced_loss(size_t /*join*/) const { return {}; }
  /// When this rank took the `join`-th join in: every rank takes a join in
  /// within the leader's admission (which waits for their answers), where
  /// each notices it only at its next look, which a long step delays.
  virtual std::chrono::steady_clock::time_point joined_at(size_t /*join*/) const {
    return std::chrono::steady_clock::now();
  }
  /// This rank joined a run already under way: the others are past their
  /// start, so it may take part in no collective (their sequence is theirs),
  /// only in messages.
  virtual bool joined() const { return false; }
  /// Where this rank serves joins (`host:port`), empty while it does not:
  /// rank 0 at the rendezvous address; after rank 0's loss, the lowest live
  /// rank, there if it can listen there, else at that port of its own host.
  virtual std::string join_address() const { return {}; }
  /// The run is ending (this rank's mode took its last round, and takes
  /// nobody in now): a process that asks to join from now on is refused
  /// with "the run ends" (rendezvous.h), not taken in to wait for nothing.
  virtual void close_joins() {}

  /// This rank is about to leave because of its own failure (not the
  /// network's): the goodbye it sends on leaving carries `error`, so that a
  /// peer that cannot go on without it fails with this root cause, its kind
  /// and its message, rather than with "rank K left the run".
  virtual void leave_with(const Error& /*error*/) {}

  virtual CommStats stats() const = 0;
};

}  // namespace cfmo::comm
