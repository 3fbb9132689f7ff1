// Mode sync: every step, gradients weighted by their example counts, summed
// by a ring all-reduce, divided by the total: the same update as one worker
// with the union of the batches. With --elastic the sum goes through an
// ElasticGroup instead: a lost worker leaves the group, the sum in flight is
// redone without it, and the others go on with the batches they have (the
// global batch shrinks, or the trainer raises each share). A process that
// joins the run (a lost worker restarted, --join) is taken in by the group's
// leader at the end of a sum; once the leader has stepped with it, it sends
// the joiner what makes it a replica like the others (the position, the
// parameters and the inner optimizer's state), and the joiner's first
// gradient is in the next sum.
//
// The welcome's state: [position][f32 x2: the sum's stop votes][u64 n][n floats:
// parameters][u32 buffers][per buffer: u64 n][n floats][i64 optimizer steps]
#include "train/modes/elastic_group.h"
#include "train/modes/lockstep.h"
#include "train/modes/timing.h"
#include "train/modes/wire.h"

#include <algorithm>
#include <array>
#include <memory>

namespace cfmo::train::modes {
namespace {

class SyncMode final : public LockstepMode {
 public:
  SyncMode(comm::Communicator& comm, const ModeSettings& settings)
      : comm_(comm), peer_timeout_s_(settings.peer_timeout_s) {
    if (settings.elastic) {
      group_ = std::make_unique<ElasticGroup>(comm, channels::kElastic, settings.peer_timeout_s);
      group_->welcome_later();  // the parameters a joiner needs are those after the step
    }
  }
  std::string_view name() const override { return "sync"; }

  bool needs_params(const TrainPosition&) const override { return group_ && !group_->welcome_due().empty(); }
  Status after_step(const TrainPosition& position, std::span<float> params, optim::Optimizer& optimizer) override {
    if (!group_ || group_->welcome_due().empty()) return {};
    // The leader took joiners in at this step's sum: they start from where it is now.
    std::vector<std::byte> out;
    put_position(out, position);
    put_floats(out, votes_);
    put_vector(out, params);
    const auto state = optimizer.state();  // first: a device optimizer's step count comes with it
    put(out, static_cast<uint32_t>(state.size()));
    for (const auto& s : state) put_vector(out, *s.buffer);
    put(out, optimizer.step_count());
    group_->send_welcome(out);
    return {};
  }
  Result<Joined> join(std::span<float> params, optim::Optimizer& optimizer, TrainPosition& position) override {
    if (!group_) return make_error(ErrorKind::kUsage, "--join: sync takes joining workers only with --elastic");
    // The leader takes a joiner in at the end of a sum: the next step's.
    CFMO_ASSIGN_OR_RETURN(auto welcome, group_->join(std::max(60.0, 4 * peer_timeout_s_)));
    if (!welcome) return Joined::kRunEnded;
    std::span<const std::byte> in = welcome->state;
    std::array<float, 2> votes{};
    std::vector<float> values;
    uint32_t buffers = 0;
    int64_t steps = 0;
    auto malformed = [&] {
      return make_error(ErrorKind::kPeer, "rank {} joined, but the leader's welcome is malformed", comm_.rank());
    };
    if (!take_position(in, position) || !take(in, votes[0]) || !take(in, votes[1]) || !take_vector(in, values) ||
        values.size() != params.size() || !take(in, buffers)) {
      return malformed();
    }
    std::copy(values.begin(), values.end(), params.begin());
    auto state = optimizer.state();
    if (buffers != state.size()) return malformed();
    for (auto& s : state) {
      if (!take_vector(in, values) || values.size() != s.buffer->size()) return malformed();
      std::copy(values.begin(), values.end(), s.buffer->begin());
    }
    if (!take(in, steps)) return malformed();
    optimizer.set_step_count(steps);
    vote_.read(votes.data());  // the others stop after that step: so does the joiner
    return Joined::kTakenIn;
  }
  bool uses_gradients() const override { return true; }
  Status finish(std::span<float>, optim::Optimizer&) override {
    // No sum comes after the last step's: a joiner not taken in by now comes too late.
    if (group_) group_->close();
    return {};
  }
  // An elastic group sums on the host: its members change, a device communicator's do not.
  void use_device_reduce(DeviceReduce reduce) override {
    if (!group_) device_reduce_ = std::move(reduce);
  }
  bool survives_losses() const override { return group_ != nullptr; }
  int keeper() const override { return group_ ? first_live(comm_, group_->members()) : 0; }
  std::vector<int> members() const override { return group_ ? group_->members() : std::vector<int>(); }
  int64_t reconciled_samples(int rank) const override { return group_ ? group_->reconciled_samples(rank) : 0; }
  int64_t retired_samples(int rank) const override { return group_ ? group_->retired_samples(rank) : 0; }

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
    samples_ += count;
    for (size_t i = 0; i < grads.size(); ++i) buffer_[i] = grads[i] * n;
    buffer_[grads.size()] = n;
    vote_.write(buffer_.data() + grads.size() + 1);
    const auto start = Clock::now();
    Status status = group_ ? group_->all_reduce_sum(buffer_, samples_) : comm_.all_reduce_sum(buffer_);
    stats_.wait_s += seconds_since(start);
    CFMO_TRY(status);
    vote_.read(buffer_.data() + grads.size() + 1);
    std::copy_n(buffer_.data() + grads.size() + 1, votes_.size(), votes_.begin());
    const float total = buffer_[grads.size()];
    const float inverse = total > 0 ? 1.0f / total : 0.0f;
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = buffer_[i] * inverse;
    ++stats_.rounds;
    return {};
  }
  ModeStats stats() const override { return stats_; }

 private:
  comm::Communicator& comm_;
  const double peer_timeout_s_;
  tensor::FloatBuffer buffer_;
  std::array<float, 2> votes_{};  ///< the last sum's stop votes: a joiner's welcome
  int64_t samples_ = 0;           ///< this process's, as on_gradients counted them (its group's tally)
  ModeStats stats_;
  DeviceReduce device_reduce_;
  std::unique_ptr<ElasticGroup> group_;  ///< with --elastic
};

}  // namespace

Result<std::unique_ptr<Mode>> make_sync(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<SyncMode>(c.comm, c.settings));
}

}  // namespace cfmo::train::modes
