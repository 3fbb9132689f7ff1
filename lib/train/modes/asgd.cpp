// Mode asgd: classic asynchronous SGD over the shards of async_base.h. Every
// step a worker sends each gradient shard to its owner, which applies it at
// once with its own instance of the inner optimizer for that shard (no
// staleness correction) and sends the shard back.
//
// A lost owner's shard is served by nobody (it is not replicated), and the
// workers' copies of it stay as its last replies left them. A process that
// joins in its place (a restarted rank, --join) gets every live rank's copy
// of its shard (sent at a step, or while that rank ends: a join as the run
// ends gets them too), serves the freshest (the highest version) with its
// inner optimizer afresh (the lost one's state went with it), then takes the
// other owners' shards as a cfmo joiner does, or, told the run ended, hands
// the keeper that shard in the end's gather.
//
// kGradShard [u32 shard][u32 dtype][i64 base version][f32 lr][encoded floats (comm/codec.h)]
// kReplica   [u32 shard][i64 version][floats]   a worker's copy of a lost owner's shard, to its joiner
#include "train/modes/async_base.h"
#include "train/modes/wire.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>

namespace cfmo::train::modes {
namespace {

class AsgdMode final : public AsyncMode {
 public:
  AsgdMode(const ModeSettings& settings, comm::Communicator& comm, std::span<const float> initial,
           std::unique_ptr<optim::Optimizer> shard_optimizer, const ModeResume& resume)
      : AsyncMode(settings, comm, initial, resume, OwnerState::kOptimizer, /*replicated=*/false),
        optimizer_(std::move(shard_optimizer)) {
    // A resumed owner takes up its shard of the saved owners' state (ranks K and up own none).
    auto state = optimizer_->state();
    const int me = comm.rank();
    if (me < shards_ && resume.owner_state.size() == state.size() &&
        resume.owner_steps.size() > static_cast<size_t>(me)) {
      const auto first = static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me)]);
      for (size_t i = 0; i < state.size(); ++i) {
        if (resume.owner_state[i].size() != initial.size()) continue;
        std::copy_n(resume.owner_state[i].begin() + first, state[i].buffer->size(), state[i].buffer->begin());
      }
      optimizer_->set_step_count(resume.owner_steps[static_cast<size_t>(me)]);
    }
    comm.on_message(channels::kGradShard, [this](int from, std::span<const std::byte> m) { on_grad(from, m); });
    comm.on_message(channels::kReplica, [this](int from, std::span<const std::byte> m) { on_copy(from, m); });
    start_serving_owner_state();
  }
  ~AsgdMode() override {
    comm_.on_message(channels::kGradShard, nullptr);
    comm_.on_message(channels::kReplica, nullptr);
    stop_serving_owner_state();
  }
  std::string_view name() const override { return "asgd"; }
  /// A lost owner's shard is nobody's; once a process joined in its place, that process's again.
  int shard_served_by(int rank) const override {
    if (rank < 0 || rank >= shards_) return -1;
    const auto lost = comm_.lost_ranks();
    return std::find(lost.begin(), lost.end(), rank) == lost.end() ? rank : -1;
  }
  Result<Joined> join(std::span<float> params, optim::Optimizer&, TrainPosition& position) override {
    if (comm_.rank() < shards_) CFMO_TRY(take_own_shard());
    return take_global_state(params, position);
  }
  bool owns_update() const override { return true; }
  bool uses_gradients() const override { return true; }

  Status on_gradients(std::span<float> grads, int count, float lr) override {
    if (count == 0) return {};
    const auto lost = comm_.lost_ranks();
    uint64_t sent = 0;
    for (int j = 0; j < shards_; ++j) {
      if (std::find(lost.begin(), lost.end(), j) != lost.end()) continue;
      const size_t first = bounds_[static_cast<size_t>(j)];
      const size_t n = bounds_[static_cast<size_t>(j) + 1] - first;
      std::vector<std::byte> out;
      out.reserve(kGradHeader + encoded_size(settings_.delta_dtype, n));
      put(out, static_cast<uint32_t>(j));
      put(out, static_cast<uint32_t>(settings_.delta_dtype));
      put(out, base_version_[static_cast<size_t>(j)]);
      put(out, lr);
      comm::encode_floats(settings_.delta_dtype, grads.subspan(first, n),
                          residual_.empty() ? std::span<float>() : std::span<float>(residual_).subspan(first, n), out);
      comm_.post(j, channels::kGradShard, std::move(out));
      await_reply(j, j);
      ++sent;
    }
    std::lock_guard lock(mutex_);
    stats_.contributions_sent += sent;
    ++stats_.rounds;
    return {};
  }

  bool needs_params(const TrainPosition&) const override {
    return inbox_pending() || outstanding() > settings_.max_staleness * shards_ || joins_unseen();
  }
  Status after_step(const TrainPosition& position, std::span<float> params, optim::Optimizer&) override {
    if (params.empty()) {  // not needed this step (needs_params): replies wait for the next one
      report_progress(position);
      return cut_off();
    }
    hand_copies_to_joiners(params);
    for (auto& f : take_inbox()) apply(f, params);
    // Bounded staleness (SSP): with more than max_staleness rounds of pushes
    // (K shards each) unanswered, wait before computing the next gradient; 0
    // waits for each reply.
    const int limit = settings_.max_staleness * shards_;
    if (outstanding() > limit) {
      const auto start = Clock::now();
      while (outstanding() > limit && !stop_requested()) {
        hand_copies_to_joiners(params);  // a join makes the replies its lost owner owed count again
        for (auto& f : take_inbox()) apply(f, params);
        seam_yield();
      }
      std::lock_guard lock(mutex_);
      stats_.wait_s += seconds_since(start);
    }
    report_progress(position);
    return cut_off();
  }

  Status finish(std::span<float> params, optim::Optimizer&) override {
    CFMO_TRY(cut_off());
    const auto start = Clock::now();
    drain_replies(start + seconds(settings_.peer_timeout_s), params, [&](FreshShard& f) { apply(f, params); });
    count_finish_wait(start);
    return end_handshake(params);
  }

 private:
  void apply(FreshShard& f, std::span<float> params) {
    reply_came(f.shard);
    record_staleness(f.staleness, f.dropped);
    const size_t first = bounds_[static_cast<size_t>(f.shard)];
    if (params.empty() || f.values.size() != bounds_[static_cast<size_t>(f.shard) + 1] - first) return;
    // Replies can overtake each other only across owners; a newer version wins.
    if (f.version < base_version_[static_cast<size_t>(f.shard)]) return;
    std::copy(f.values.begin(), f.values.end(), params.begin() + static_cast<std::ptrdiff_t>(first));
    base_version_[static_cast<size_t>(f.shard)] = f.version;
  }

  void on_grad(int from, std::span<const std::byte> m) {
    uint32_t shard = 0;
    uint32_t dtype = 0;
    int64_t base_version = 0;
    float lr = 0;
    if (!take(m, shard) || !take(m, dtype) || !take(m, base_version) || !take(m, lr) ||
        shard != static_cast<uint32_t>(comm_.rank()) || comm_.rank() >= shards_ || dtype > 2) {
      return;
    }
    incoming_.resize(shard_size(comm_.rank()));
    if (!comm::decode_floats(static_cast<comm::WireDtype>(dtype), m, incoming_)) return;
    // Classic asynchronous SGD applies every gradient, however stale (its
    // workers wait instead once they are max_staleness rounds ahead).
    std::lock_guard lock(mutex_);
    const auto it = served_.find(comm_.rank());
    if (it == served_.end()) {
      // A joiner that has not its shard back yet: the gradient is dropped, its sender told so.
      ++stats_.contributions_received;
      reply_fresh_locked(from, comm_.rank(), 0, true, false);
      return;
    }
    Served& mine = it->second;
    const int64_t s = staleness_of(mine, base_version);
    optimizer_->step(mine.values, incoming_, lr);
    ++mine.version;
    ++stats_.contributions_applied;
    ++stats_.contributions_received;
    note_reconciled(from);
    reply_fresh_locked(from, comm_.rank(), s, false);
  }

  /// A join as this rank ends gets its copy too, and the replies its lost process owed are given up.
  void while_ending(std::span<const float> params) override { hand_copies_to_joiners(params); }

  /// Whether a rank joined since hand_copies_to_joiners last looked.
  bool joins_unseen() const { return comm_.joined_ranks().size() != joins_handled_; }

  /// A worker, at a step: each owner that joined since gets this rank's copy
  /// of its shard (the one the last reply left), and the replies its lost
  /// process owed are given up.
  void hand_copies_to_joiners(std::span<const float> params) {
    if (!joins_unseen()) return;
    {
      // A joiner told the run ended holds no global values to copy.
      std::lock_guard lock(mutex_);
      if (joining_) return;
    }
    const auto joined = comm_.joined_ranks();
    for (; joins_handled_ < joined.size(); ++joins_handled_) {
      const int r = joined[joins_handled_];
      if (r == comm_.rank() || r >= shards_) continue;
      forget_replies(r);
      const size_t first = bounds_[static_cast<size_t>(r)];
      std::vector<std::byte> out;
      put(out, static_cast<uint32_t>(r));
      put(out, base_version_[static_cast<size_t>(r)]);
      put_floats(out, params.subspan(first, shard_size(r)));
      comm_.post(r, channels::kReplica, std::move(out));
    }
  }

  /// A joiner: a live rank's copy of the shard it owns.
  void on_copy(int from, std::span<const std::byte> m) {
    uint32_t shard = 0;
    int64_t version = 0;
    if (!take(m, shard) || !take(m, version) || shard != static_cast<uint32_t>(comm_.rank()) ||
        m.size() != shard_size(comm_.rank()) * sizeof(float)) {
      return;
    }
    std::lock_guard lock(mutex_);
    if (!joining_) return;
    Served& copy = copies_[from];
    copy.version = version;
    copy.values.resize(shard_size(comm_.rank()));
    std::memcpy(copy.values.data(), m.data(), m.size());
  }

  /// A joining owner: waits for every live rank's copy of its shard (until
  /// 2x the peer timeout + 5 s, then takes what came) and serves the
  /// freshest. A rank that left (the run ended there) owes none; with every
  /// other rank gone and no copy, it serves nothing, and take_global_state
  /// says why.
  Status take_own_shard() {
    const int me = comm_.rank();
    const double timeout_s = settings_.peer_timeout_s * 2 + 5;
    const auto deadline = Clock::now() + seconds(timeout_s);
    for (;;) {
      std::vector<int> owe;  // the ranks neither lost nor gone
      for (int r = 0; r < comm_.size(); ++r) {
        if (r != me && !comm_.is_lost_rank(r) && !comm_.said_goodbye(r)) owe.push_back(r);
      }
      {
        std::lock_guard lock(mutex_);
        const bool all = std::all_of(owe.begin(), owe.end(), [&](int r) { return copies_.count(r) != 0; });
        if (all && copies_.empty()) return {};
        const bool late = Clock::now() > deadline;
        if (all || (late && !copies_.empty())) {
          auto freshest = copies_.begin();
          for (auto it = copies_.begin(); it != copies_.end(); ++it) {
            if (it->second.version > freshest->second.version) freshest = it;
          }
          served_.insert_or_assign(me, std::move(freshest->second));
          copies_.clear();
          return {};
        }
        if (late) break;
      }
      seam_sleep_for(std::chrono::milliseconds(2));
    }
    return make_error(ErrorKind::kPeer, "rank {} joined, but no worker sent its copy of shard {} within {:.1f}s", me,
                      me, timeout_s);
  }

  // asgd serves its own shard only (it is not replicated).
  std::vector<std::span<const float>> owner_state(int) const override {
    std::vector<std::span<const float>> out;
    for (const auto& s : optimizer_->state()) out.emplace_back(*s.buffer);
    return out;
  }
  int64_t owner_steps(int) const override { return optimizer_->step_count(); }

  /// A gradient shard's bytes before its floats: shard, dtype, base version, lr.
  static constexpr size_t kGradHeader = 20;

  std::unique_ptr<optim::Optimizer> optimizer_;  ///< progress thread: the inner optimizer for my shard (none past K)
  tensor::FloatBuffer incoming_;                 ///< progress thread
  size_t joins_handled_ = 0;                     ///< training thread: of comm_.joined_ranks(), copies sent
  std::map<int, Served> copies_;                 ///< a joiner, under mutex_: each rank's copy of its shard
};

}  // namespace

Result<std::unique_ptr<Mode>> make_asgd(const ModeContext& c) {
  const int shards = owner_count(c.settings, c.comm.size());
  const auto bounds = shard_bounds(c.initial.size(), shards);
  const int me = c.comm.rank();
  const size_t own = me < shards ? bounds[static_cast<size_t>(me) + 1] - bounds[static_cast<size_t>(me)] : 0;
  // The owner's optimizer sees its shard as one flat tensor: element-wise optimizers only.
  std::vector<model::ParamInfo> shard_layout = {{"shard", {static_cast<int64_t>(own)}, 0, own}};
  CFMO_ASSIGN_OR_RETURN(auto optimizer, optim::make_optimizer(c.optimizer_config, shard_layout, own));
  return std::unique_ptr<Mode>(
      std::make_unique<AsgdMode>(c.settings, c.comm, c.initial, std::move(optimizer), c.resume));
}

}  // namespace cfmo::train::modes
