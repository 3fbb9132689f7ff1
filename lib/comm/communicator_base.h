#pragma once
/// What the transports with a progress thread (UCX, loopback) keep alike:
/// the channels' handlers (HandlerTable), the peers' health
/// (comm/peer_health.h) and the stats, behind the Communicator methods that
/// only read or change them (CommunicatorBase).

#include "comm/communicator.h"
#include "comm/peer_health.h"

#include <array>
#include <atomic>
#include <mutex>

namespace cfmo::comm {

/// Registration waits for a running handler, so an owner that unregisters
/// (with nullptr) before it is destroyed is never called afterwards, and
/// handlers run one at a time.
class HandlerTable {
 public:
  void set(Channel channel, Communicator::Handler handler) { replace(channel, {std::move(handler), nullptr}); }
  void set_owned(Channel channel, Communicator::OwnedHandler handler) {
    replace(channel, {nullptr, std::move(handler)});
  }

  /// Hands a received payload to its channel's handler, if any (an owned
  /// handler takes the buffer); false when the channel has none.
  bool deliver(int from, uint8_t channel, std::vector<std::byte>& payload) {
    std::lock_guard dispatch(dispatch_mutex_);
    Entry handler;
    {
      std::lock_guard lock(mutex_);
      handler = handlers_[channel];
    }
    if (handler.owned) {
      handler.owned(from, std::move(payload));
    } else if (handler.view) {
      handler.view(from, payload);
    } else {
      return false;
    }
    return true;
  }

  bool has(uint8_t channel) const {
    std::lock_guard lock(mutex_);
    return static_cast<bool>(handlers_[channel]);
  }
  /// Bumped by every change: a transport that caches which channels have handlers rebuilds it then.
  uint64_t generation() const { return generation_.load(); }

 private:
  struct Entry {
    Communicator::Handler view;
    Communicator::OwnedHandler owned;
    explicit operator bool() const { return view || owned; }
  };

  void replace(Channel channel, Entry entry) {
    std::lock_guard dispatch(dispatch_mutex_);
    std::lock_guard lock(mutex_);
    handlers_[channel.id] = std::move(entry);
    ++generation_;
  }

  std::mutex dispatch_mutex_;  ///< held while a handler runs or is replaced
  mutable std::mutex mutex_;   ///< guards handlers_
  std::array<Entry, 256> handlers_;
  std::atomic<uint64_t> generation_{1};
};

class CommunicatorBase : public Communicator {
 public:
  CommunicatorBase(int rank, int size) : peers_(rank, size) {}

  void on_message(Channel channel, Handler handler) override { handlers_.set(channel, std::move(handler)); }
  void on_message_owned(Channel channel, OwnedHandler handler) override {
    handlers_.set_owned(channel, std::move(handler));
  }

  std::vector<int> lost_ranks() const override { return peers_.lost_ranks(); }
  Status health() const override { return peers_.health(); }
  std::string lost_reason(int rank) const override { return peers_.lost_reason(rank); }
  bool said_goodbye(int rank) const override { return rank >= 0 && rank < size() && peers_.departed(rank); }
  std::vector<int> joined_ranks() const override { return peers_.joined_ranks(); }
  bool is_lost_rank(int rank) const override { return rank >= 0 && rank < size() && peers_.is_lost(rank); }
  size_t joins_of(int rank) const override { return peers_.joins_of(rank); }
  std::string replaced_loss(size_t join) const override { return peers_.replaced_loss(join); }
  std::chrono::steady_clock::time_point joined_at(size_t join) const override { return peers_.joined_at(join); }
  void leave_with(const Error& error) override { peers_.leave_with(error); }

  CommStats stats() const override {
    CommStats s;
    s.bytes_sent = stats_bytes_sent_.load();
    s.bytes_received = stats_bytes_received_.load();
    s.messages_sent = stats_messages_sent_.load();
    s.messages_received = stats_messages_received_.load();
    s.collective_wait_s = collective_wait_s_.load();
    return s;
  }

 protected:
  /// The caller of a collective (one at a time) spent `seconds` in it.
  void add_collective_wait(double seconds) { collective_wait_s_ = collective_wait_s_.load() + seconds; }

  HandlerTable handlers_;
  PeerHealth peers_;
  std::atomic<uint64_t> stats_bytes_sent_{0};
  std::atomic<uint64_t> stats_bytes_received_{0};
  std::atomic<uint64_t> stats_messages_sent_{0};
  std::atomic<uint64_t> stats_messages_received_{0};

 private:
  std::atomic<double> collective_wait_s_{0};
};

}  // namespace cfmo::comm
