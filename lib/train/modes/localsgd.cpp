// Mode localsgd (Local SGD / DiLoCo): H local steps, then a blocking
// all-reduce of the deltas against the shared global parameters and an
// outer step. With --elastic the sum goes through an ElasticGroup: a lost
// worker leaves the group, and the others average their deltas without it.
// Without it, the ring all-reduce (no leader to funnel every delta through)
// and a lost worker ends the run with status 4, as in sync.
#include "train/modes/elastic_group.h"
#include "train/modes/lockstep.h"
#include "train/modes/outer_optimizer.h"
#include "train/modes/timing.h"
#include "train/modes/wire.h"

#include <algorithm>
#include <memory>

namespace cfmo::train::modes {
namespace {

class LocalSgdMode final : public LockstepMode {
 public:
  LocalSgdMode(const ModeSettings& settings, comm::Communicator& comm, std::span<const float> initial,
               const ModeResume& resume)
      : settings_(settings),
        comm_(comm),
        global_(initial.begin(), initial.end()),
        outer_(settings, initial.size(), 1),
        start_samples_(resume.start_samples) {
    if (settings.elastic) {
      group_ = std::make_unique<ElasticGroup>(comm, channels::kElastic, settings.peer_timeout_s);
      // A joiner taken in at a round gets the global parameters before it,
      // the outer momentum and the position: it then takes the round's outer
      // step itself, as every member does, to the same bits.
      group_->set_welcome([this] {
        std::vector<std::byte> out;
        put_position(out, position_);
        put_vector(out, global_);
        put_vector(out, outer_.momentum());
        return out;
      });
    }
    if (resume.outer_momentum.size() == outer_.momentum().size()) {
      std::copy(resume.outer_momentum.begin(), resume.outer_momentum.end(), outer_.momentum().begin());
    }
  }
  std::string_view name() const override { return "localsgd"; }

  bool needs_params(const TrainPosition& position) const override {
    return position.step % settings_.sync_interval == 0;
  }
  Status after_step(const TrainPosition& position, std::span<float> params, optim::Optimizer&) override {
    last_step_ = position.step;
    position_ = position;
    since_sync_ = position.step % settings_.sync_interval;
    if (since_sync_ != 0) return {};
    return reconcile(params);
  }
  bool params_are_global() const override { return since_sync_ == 0; }
  std::span<const float> outer_momentum() const override { return outer_.momentum(); }
  Status finish(std::span<float> params, optim::Optimizer&) override {
    // Every rank took the same number of steps, so all agree whether one more round is due.
    const Status last = since_sync_ != 0 ? reconcile(params) : Status{};
    // No sum comes after it: a joiner not taken in by now comes too late.
    if (group_) group_->close();
    return last;
  }
  ModeStats stats() const override { return stats_; }
  bool survives_losses() const override { return group_ != nullptr; }
  Result<Joined> join(std::span<float> params, optim::Optimizer&, TrainPosition& position) override {
    if (!group_) return make_error(ErrorKind::kUsage, "--join: localsgd takes joining workers only with --elastic");
    // The leader takes a joiner in at the end of a round: up to H steps away.
    CFMO_ASSIGN_OR_RETURN(auto welcomed, group_->join(std::max(60.0, 4 * settings_.peer_timeout_s)));
    if (!welcomed) return Joined::kRunEnded;
    const auto& welcome = *welcomed;
    std::span<const std::byte> state = welcome.state;
    std::vector<float> momentum;
    std::vector<float> global;
    if (!take_position(state, position) || !take_vector(state, global) || !take_vector(state, momentum) ||
        global.size() != params.size() || welcome.sum.size() != params.size() + 2 ||
        momentum.size() != outer_.momentum().size()) {
      return make_error(ErrorKind::kPeer, "rank {} joined, but the leader's welcome is malformed", comm_.rank());
    }
    std::copy(global.begin(), global.end(), global_.begin());
    std::copy(momentum.begin(), momentum.end(), outer_.momentum().begin());
    vote_.read(welcome.sum.data() + params.size());
    outer_.set_round(round_of(position.step));
    outer_.apply(global_, std::span<const float>(welcome.sum).first(params.size()),
                 1.0f / static_cast<float>(welcome.members));
    std::copy(global_.begin(), global_.end(), params.begin());
    position_ = position;
    start_samples_ = position.samples;  // this process's own count starts here
    last_step_ = position.step;
    since_sync_ = 0;
    return Joined::kTakenIn;
  }
  int keeper() const override { return group_ ? first_live(comm_, group_->members()) : 0; }
  std::vector<int> members() const override { return group_ ? group_->members() : std::vector<int>(); }
  std::vector<int> round_members() const override { return group_ ? group_->last_sum_ranks() : std::vector<int>(); }
  int64_t reconciled_samples(int rank) const override { return group_ ? group_->reconciled_samples(rank) : 0; }
  int64_t retired_samples(int rank) const override { return group_ ? group_->retired_samples(rank) : 0; }

 private:
  Status reconcile(std::span<float> params) {
    // [deltas..., stop votes]: a worker that wants to stop says so at the next round.
    delta_.resize(params.size() + 2);
    for (size_t i = 0; i < params.size(); ++i) delta_[i] = params[i] - global_[i];
    if (settings_.delta_sink) {
      settings_.delta_sink(stats_.rounds + 1, last_step_, stats_.rounds, global_,
                           std::span<const float>(delta_).first(params.size()));
    }
    vote_.write(delta_.data() + params.size());
    const auto start = Clock::now();
    Status status =
        group_ ? group_->all_reduce_sum(delta_, position_.samples - start_samples_) : comm_.all_reduce_sum(delta_);
    stats_.wait_s += seconds_since(start);
    CFMO_TRY(status);
    vote_.read(delta_.data() + params.size());
    const auto members = static_cast<float>(group_ ? group_->last_sum_members() : static_cast<size_t>(comm_.size()));
    outer_.set_round(round_of(last_step_));
    outer_.apply(global_, std::span<const float>(delta_).first(params.size()), 1.0f / members);
    std::copy(global_.begin(), global_.end(), params.begin());
    ++stats_.rounds;
    since_sync_ = 0;
    return {};
  }

  /// The outer round a reconciliation at `step` is (0 the first): the rounds
  /// at each multiple of H before it; a last round between two counts as the next.
  int64_t round_of(int64_t step) const { return std::max<int64_t>(0, step - 1) / settings_.sync_interval; }

  ModeSettings settings_;
  comm::Communicator& comm_;
  tensor::FloatBuffer global_;
  OuterOptimizer outer_;
  tensor::FloatBuffer delta_;
  int64_t since_sync_ = 0;
  int64_t last_step_ = 0;
  TrainPosition position_;  ///< as after_step last saw it: a joiner's welcome
  int64_t start_samples_;   ///< position.samples at this process's start: its own samples count from there
  ModeStats stats_;
  std::unique_ptr<ElasticGroup> group_;  ///< with --elastic
};

}  // namespace

Result<std::unique_ptr<Mode>> make_localsgd(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<LocalSgdMode>(c.settings, c.comm, c.initial, c.resume));
}

}  // namespace cfmo::train::modes
