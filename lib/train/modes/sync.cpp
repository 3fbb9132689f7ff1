// Mode sync: every step, gradients weighted by their example counts, summed
// by a ring all-reduce, divided by the total: the same update as one worker
// with the union of the batches.
#include "train/modes/lockstep.h"
#include "train/modes/timing.h"

#include <memory>

namespace cfmo::modes {
namespace {

class SyncMode final : public LockstepMode {
 public:
  explicit SyncMode(Communicator& comm) : comm_(comm) {}
  std::string_view name() const override { return "sync"; }

  bool needs_params(const TrainPosition&) const override { return false; }
  bool uses_gradients() const override { return true; }
  void use_device_reduce(DeviceReduce reduce) override { device_reduce_ = std::move(reduce); }

  Status on_gradients(std::span<float> grads, int count, float) override {
    if (device_reduce_) {
      // The gradients stay on the device: only the count and the votes are the host's.
      float extras[3] = {static_cast<float>(count), 0, 0};
      vote_.write(extras + 1);
      const auto start = Clock::now();
      Status status = device_reduce_(extras);
      stats_.wait_s += seconds_since(start);
      CFMO_TRY(status);
      vote_.read(extras + 1);
      ++stats_.rounds;
      return {};
    }
    // [weighted gradients..., example count, stop votes (time limit, interrupt)]
    buffer_.resize(grads.size() + 3);
    const auto n = static_cast<float>(count);
    for (size_t i = 0; i < grads.size(); ++i) buffer_[i] = grads[i] * n;
    buffer_[grads.size()] = n;
    vote_.write(buffer_.data() + grads.size() + 1);
    const auto start = Clock::now();
    Status status = comm_.all_reduce_sum(buffer_);
    stats_.wait_s += seconds_since(start);
    CFMO_TRY(status);
    vote_.read(buffer_.data() + grads.size() + 1);
    const float total = buffer_[grads.size()];
    const float inverse = total > 0 ? 1.0f / total : 0.0f;
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = buffer_[i] * inverse;
    ++stats_.rounds;
    return {};
  }
  ModeStats stats() const override { return stats_; }

 private:
  Communicator& comm_;
  FloatBuffer buffer_;
  ModeStats stats_;
  DeviceReduce device_reduce_;
};

}  // namespace

Result<std::unique_ptr<Mode>> make_sync(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<SyncMode>(c.comm));
}

}  // namespace cfmo::modes
