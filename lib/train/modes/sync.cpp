// Mode sync: every step, gradients weighted by their example counts, summed
// by a ring all-reduce, divided by the total: the same update as one worker
// with the union of the batches. With --elastic the sum goes through an
// ElasticGroup instead: a lost worker leaves the group, the sum in flight is
// redone without it, and the others go on with the batches they have (the
// global batch shrinks, or the trainer raises each share).
#include "train/modes/elastic_group.h"
#include "train/modes/lockstep.h"
#include "train/modes/timing.h"

#include <algorithm>
#include <memory>

namespace cfmo::train::modes {
namespace {

class SyncMode final : public LockstepMode {
 public:
  SyncMode(comm::Communicator& comm, const ModeSettings& settings) : comm_(comm) {
    if (settings.elastic) group_ = std::make_unique<ElasticGroup>(comm, channels::kElastic, settings.peer_timeout_s);
  }
  std::string_view name() const override { return "sync"; }

  bool needs_params(const TrainPosition&) const override { return false; }
  bool uses_gradients() const override { return true; }
  // An elastic group sums on the host: its members change, a device communicator's do not.
  void use_device_reduce(DeviceReduce reduce) override {
    if (!group_) device_reduce_ = std::move(reduce);
  }
  bool survives_losses() const override { return group_ != nullptr; }
  int keeper() const override { return group_ ? first_live(comm_, group_->members()) : 0; }
  std::vector<int> members() const override { return group_ ? group_->members() : std::vector<int>(); }

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
    Status status = group_ ? group_->all_reduce_sum(buffer_) : comm_.all_reduce_sum(buffer_);
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
  comm::Communicator& comm_;
  tensor::FloatBuffer buffer_;
  ModeStats stats_;
  DeviceReduce device_reduce_;
  std::unique_ptr<ElasticGroup> group_;  ///< with --elastic
};

}  // namespace

Result<std::unique_ptr<Mode>> make_sync(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<SyncMode>(c.comm, c.settings));
}

}  // namespace cfmo::train::modes
