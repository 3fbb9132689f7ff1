// Mode cfmo, communication-free: H local steps, then each delta shard goes
// to its owner without waiting; the owner applies it weighted by
// beta^staleness and sends the fresh shard back; the worker rebases that
// shard when it arrives. See ALGORITHM.md, mode 3.
//
// kDeltaShard [u32 shard][u32 dtype | kLastRound][i64 base version][encoded floats (comm/codec.h)]
#include "train/modes/async_base.h"
#include "train/modes/outer_optimizer.h"
#include "train/modes/wire.h"

#include <cmath>
#include <memory>

namespace cfmo::modes {
namespace {

class CfmoMode final : public AsyncMode {
 public:
  CfmoMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial, const ModeResume& resume)
      : AsyncMode(settings, comm, initial, resume, OwnerState::kOuterMomentum),
        outer_(settings, owned_.size(), comm.size()),
        snapshot_(initial.size(), 0.0f) {
    if (!outer_.momentum().empty() && resume.outer_momentum.size() == initial.size()) {
      const auto first = static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(comm.rank())]);
      std::copy_n(resume.outer_momentum.begin() + first, owned_.size(), outer_.momentum().begin());
    }
    comm.on_message(channels::kDeltaShard, [this](int from, std::span<const std::byte> m) { on_delta(from, m); });
    start_serving_owner_state();
  }
  // Unregistered here, before this class's members go: the base's destructor would be too late.
  ~CfmoMode() override {
    comm_.on_message(channels::kDeltaShard, nullptr);
    stop_serving_owner_state();
  }
  std::string_view name() const override { return "cfmo"; }

  bool needs_params(const TrainPosition& position) const override {
    return position.step % settings_.sync_interval == 0 || inbox_pending();
  }
  Status after_step(const TrainPosition& position, std::span<float> params, Optimizer& optimizer) override {
    last_step_ = position.step;
    if (params.empty()) {  // not needed this step (needs_params): replies wait for the next one
      report_progress(position);
      return {};
    }
    for (auto& f : take_inbox()) rebase(f, params, optimizer);
    report_progress(position);
    if (position.step % settings_.sync_interval != 0) return {};
    // Shards whose last delta is still in flight wait for the next round; the
    // others go now: a slow owner never holds back the rest, nobody waits.
    send_round(params, /*only_idle=*/true);
    return {};
  }

  Status finish(std::span<float> params, Optimizer& optimizer) override {
    const auto start = Clock::now();
    const auto deadline = start + seconds(settings_.peer_timeout_s);
    auto apply = [&](FreshShard& f) { rebase(f, params, optimizer); };
    drain_replies(deadline, apply);
    // The last local progress counts too. Its replies carry no shard: this
    // rank's parameters are not used after the run, and rank 0 gathers the
    // global ones.
    send_round(params, /*only_idle=*/false, /*last=*/true);
    drain_replies(deadline + seconds(settings_.peer_timeout_s), apply);
    count_finish_wait(start);
    return end_handshake(params);
  }

 private:
  void send_round(std::span<const float> params, bool only_idle, bool last = false) {
    const auto lost = comm_.lost_ranks();
    uint64_t sent = 0;
    bool skipped = false;
    for (int j = 0; j < comm_.size(); ++j) {
      if (std::find(lost.begin(), lost.end(), j) != lost.end()) continue;
      if (only_idle && awaiting_[static_cast<size_t>(j)] > 0) {
        skipped = true;
        continue;
      }
      // Nothing trained since this shard went: its delta would be zero.
      if (last && sent_at_[static_cast<size_t>(j)] == last_step_) continue;
      sent_at_[static_cast<size_t>(j)] = last_step_;
      const size_t first = bounds_[static_cast<size_t>(j)];
      const size_t count = bounds_[static_cast<size_t>(j) + 1] - first;
      // The rebase of this shard keeps the progress made after this moment.
      std::copy(params.begin() + static_cast<std::ptrdiff_t>(first),
                params.begin() + static_cast<std::ptrdiff_t>(first + count),
                snapshot_.begin() + static_cast<std::ptrdiff_t>(first));
      delta_.resize(count);
      for (size_t i = 0; i < count; ++i) delta_[i] = params[first + i] - base_[first + i];
      std::vector<std::byte> out;
      put(out, static_cast<uint32_t>(j));
      put(out, static_cast<uint32_t>(settings_.delta_dtype) | (last ? kLastRound : 0u));
      put(out, base_version_[static_cast<size_t>(j)]);
      encode_floats(settings_.delta_dtype, delta_,
                    residual_.empty() ? std::span<float>() : std::span<float>(residual_).subspan(first, count), out);
      comm_.post(j, channels::kDeltaShard, std::move(out));
      ++awaiting_[static_cast<size_t>(j)];
      ++sent;
    }
    int64_t round = 0;
    {
      std::lock_guard lock(mutex_);
      stats_.contributions_sent += sent;
      if (sent > 0) ++stats_.rounds;
      if (skipped) ++stats_.deferred;
      round = stats_.rounds;
    }
    if (settings_.delta_sink && sent > 0) {
      // This rank's whole delta against its base, as cfmo-diverge reads it.
      full_delta_.resize(params.size());
      for (size_t i = 0; i < params.size(); ++i) full_delta_[i] = params[i] - base_[i];
      const int64_t oldest = *std::min_element(base_version_.begin(), base_version_.end());
      settings_.delta_sink(round, last_step_, oldest, base_, full_delta_);
    }
  }

  /// θ_k ← θ̄_new + (θ_k − θ_snapshot) on the shard; stale momentum discounted.
  void rebase(FreshShard& f, std::span<float> params, Optimizer& optimizer) {
    auto& waiting = awaiting_[static_cast<size_t>(f.shard)];
    waiting = std::max(0, waiting - 1);
    record_staleness(f.staleness, f.dropped);
    const size_t first = bounds_[static_cast<size_t>(f.shard)];
    if (f.values.size() != bounds_[static_cast<size_t>(f.shard) + 1] - first) return;
    const int64_t behind =
        std::max<int64_t>(0, f.version - base_version_[static_cast<size_t>(f.shard)] - 1) / comm_.size();
    for (size_t i = 0; i < f.values.size(); ++i) {
      params[first + i] = f.values[i] + (params[first + i] - snapshot_[first + i]);
      base_[first + i] = f.values[i];
    }
    base_version_[static_cast<size_t>(f.shard)] = f.version;
    if (behind > 0) {
      optimizer.scale_first_moment(static_cast<float>(std::pow(settings_.staleness_discount, behind)), first,
                                   f.values.size());
    }
  }

  /// Owner: apply a delta shard weighted by beta^staleness, reply with the fresh shard.
  void on_delta(int from, std::span<const std::byte> m) {
    uint32_t shard = 0;
    uint32_t dtype = 0;
    int64_t base_version = 0;
    if (!take(m, shard) || !take(m, dtype) || !take(m, base_version) || shard != static_cast<uint32_t>(comm_.rank())) {
      return;
    }
    const bool last = (dtype & kLastRound) != 0;
    dtype &= ~kLastRound;
    if (dtype > 2) return;
    incoming_.resize(owned_.size());
    if (!decode_floats(static_cast<WireDtype>(dtype), m, incoming_)) return;
    const int64_t s = staleness_of(base_version);
    const bool dropped = s > settings_.max_staleness;
    if (!dropped) {
      const float weight =
          static_cast<float>(std::pow(settings_.staleness_discount, s)) / static_cast<float>(comm_.size());
      std::lock_guard lock(mutex_);
      outer_.apply(owned_, incoming_, weight);
      ++version_;
      ++stats_.contributions_applied;
    }
    {
      std::lock_guard lock(mutex_);
      ++stats_.contributions_received;
      note_reconciled(from);
    }
    reply_fresh(from, s, dropped, /*with_shard=*/!last);
  }

  OuterOptimizer outer_;  ///< owner, under mutex_: the outer step on my shard
  std::vector<std::span<const float>> owner_state() const override {
    if (outer_.momentum().empty()) return {};
    return {outer_.momentum()};
  }

  /// In a delta's dtype field: the sender's last round, answered without the shard.
  static constexpr uint32_t kLastRound = 0x100;

  FloatBuffer snapshot_;
  std::vector<int64_t> sent_at_ =
      std::vector<int64_t>(static_cast<size_t>(comm_.size()), -1);  ///< step of each shard's last send
  FloatBuffer delta_;
  FloatBuffer full_delta_;  ///< for the delta sink
  int64_t last_step_ = 0;
  FloatBuffer incoming_;  ///< progress thread
};

}  // namespace

Result<std::unique_ptr<Mode>> make_cfmo(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<CfmoMode>(c.settings, c.comm, c.initial, c.resume));
}

}  // namespace cfmo::modes
