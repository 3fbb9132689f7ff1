#include "comm/solo_communicator.h"

#include <array>
#include <cstring>
#include <mutex>

namespace cfmo::comm {
namespace {

class SoloCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status all_reduce_sum(std::span<float>) override { return {}; }

  Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                      const std::vector<std::span<std::byte>>& recv) override {
    if (send.size() != 1 || recv.size() != 1 || send[0].size() != recv[0].size()) {
      return make_error(ErrorKind::kInternal, "all_to_all_v: one rank needs one buffer each way of the same size");
    }
    if (!send[0].empty()) std::memcpy(recv[0].data(), send[0].data(), send[0].size());
    return {};
  }

  Status barrier() override { return {}; }

  void post(int, Channel channel, std::vector<std::byte> payload) override {
    // Runs on the caller's thread: there is no progress thread to hand it to.
    std::lock_guard lock(mutex_);
    stats_.bytes_sent += payload.size();
    ++stats_.messages_sent;
    stats_.bytes_received += payload.size();
    ++stats_.messages_received;
    auto& handler = handlers_[channel.id];
    if (handler) handler(0, std::move(payload));
  }

  void on_message(Channel channel, Handler handler) override {
    if (!handler) {
      on_message_owned(channel, nullptr);
      return;
    }
    on_message_owned(channel,
                     [view = std::move(handler)](int from, std::vector<std::byte> payload) { view(from, payload); });
  }

  void on_message_owned(Channel channel, OwnedHandler handler) override {
    std::lock_guard lock(mutex_);
    handlers_[channel.id] = std::move(handler);
  }

  std::vector<int> lost_ranks() const override { return {}; }
  Status health() const override { return {}; }
  CommStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  mutable std::mutex mutex_;  ///< guards handlers_ and stats_; held while a handler runs
  std::array<OwnedHandler, 256> handlers_;
  CommStats stats_;
};

}  // namespace

std::unique_ptr<Communicator> make_solo_communicator() { return std::make_unique<SoloCommunicator>(); }

}  // namespace cfmo::comm
