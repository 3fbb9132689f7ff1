#pragma once
/// The simulated transport: W Communicators in one process whose messages
/// are events of the scheduler (sim/scheduler.h), delivered when the
/// network model (sim/network.h) says, and whose collectives block the
/// calling fiber until every rank has called them, then end when the
/// modelled ring says. A sibling of comm/loopback for virtual time: the
/// modes run on it unchanged.
///
/// Handlers run as events (between fibers), one at a time, in the order of
/// arrival; messages between two ranks keep their order. Nobody is ever
/// lost. The bytes a message costs on the network are the sizer's answer
/// (by default its payload): a simulation without parameters charges each
/// message for the floats a real model would put in it.

#include "comm/communicator.h"
#include "sim/network.h"
#include "sim/ring.h"
#include "sim/scheduler.h"

#include <array>
#include <functional>
#include <memory>
#include <vector>

namespace cfmo::sim {

/// The collectives' channel id for the sizer (the transports' own, 0).
inline constexpr comm::Channel kCollective{0};

/// Bytes on the network of a message of `payload` bytes (collectives: the
/// buffer each rank puts in) from `from` to `to`.
using Sizer = std::function<uint64_t(comm::Channel channel, int from, int to, uint64_t payload)>;

class SimWorld final : private EventTarget {
 public:
  SimWorld(Scheduler& scheduler, Network& network, int size, Sizer sizer = nullptr);
  ~SimWorld();
  SimWorld(const SimWorld&) = delete;
  SimWorld& operator=(const SimWorld&) = delete;

  comm::Communicator& rank(int r);
  int size() const { return static_cast<int>(ranks_.size()); }
  /// Messages handed to the network so far.
  uint64_t messages() const { return messages_; }
  /// Rank `rank` runs on fiber `fiber`: each message delivered to it pokes
  /// that fiber (Scheduler::poke), ending a seam wait it polls in.
  void bind_fiber(int rank, int fiber) { fiber_of_[static_cast<size_t>(rank)] = fiber; }

 private:
  class Rank;
  /// The payload bytes a message holds in itself.
  static constexpr size_t kInline = 40;
  /// A message on its way, in its destination's queue: one cache line. Most
  /// payloads (a reply, a progress report, a gradient or delta shard of the
  /// stand-in model) fit in it, so the mode's buffer goes back to the
  /// allocator at once, still in cache; a longer one waits in boxes_.
  /// (Hundreds of thousands of messages are on their way at 4096 workers:
  /// a buffer of each, cold when delivered, was a cache miss a message.)
  struct alignas(64) Message {
    double t = 0;        ///< arrival
    uint64_t order = 0;  ///< its place among events of the same time (Scheduler::take_order)
    int from = -1;
    uint8_t channel = 0;
    bool boxed = false;  ///< its payload is boxes_[box], not bytes
    uint16_t size = 0;   ///< the bytes in `bytes`
    union {
      std::array<std::byte, kInline> bytes;
      uint32_t box;
    };
  };
  /// The scheduler's event for a destination's first message: its order and the rank.
  static constexpr int kRankBits = 21;  // --workers is at most 2^20
  void arm(int to);
  struct Collective {
    size_t floats = 0;
    int arrived = 0;
    std::vector<std::span<float>> buffers;
    std::vector<int> fibers;
  };

  void fire(uint64_t slot) override;
  void post(int from, int to, comm::Channel channel, std::vector<std::byte> payload);
  Status meet(int rank, const std::function<double(double)>& finish, double& waited);
  Status all_reduce(int rank, std::span<float> data, double& waited);
  Status barrier(int rank, double& waited);

  Scheduler& scheduler_;
  Network& network_;
  Sizer sizer_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<int> fiber_of_;  ///< -1: none bound
  /// Each destination's messages in order of arrival: the scheduler holds an
  /// event for the first only, so its queue holds about one event per rank,
  /// however many messages are on their way (a heap of millions of messages
  /// was most of a large simulation's time, in cache misses). The order of
  /// delivery is the same: each event keeps the place taken when it was sent.
  std::vector<Ring<Message>> inbound_;
  std::vector<std::vector<std::byte>> boxes_;  ///< the payloads too long for a Message
  std::vector<uint32_t> free_boxes_;           ///< boxes_'s unused slots
  Collective collective_;
  uint64_t messages_ = 0;
};

}  // namespace cfmo::sim
