// Mode cfmo, communication-free: H local steps, then each delta shard goes
// to its owner without waiting; the owner applies it weighted by
// beta^staleness and sends the fresh shard back; the worker rebases that
// shard when it arrives. See ALGORITHM.md, mode 3.
//
// Each owner keeps its shard's backup (async_base.h) up to date: every
// contribution it applies goes on to the backup, which applies it to its
// replica in the same order with the same weight, so the replica equals the
// shard bit for bit at the cost of one more delta per contribution; a new
// backup first gets the whole state. A lost owner's backup serves the shard
// from its replica, with every contribution that reached it.
//
// kDeltaShard [u32 shard][u32 dtype | kLastRound][i64 base version][encoded floats (comm/codec.h)]
// kReplica    [u32 0: apply][u32 shard][i64 version][f32 weight][u32 dtype][encoded floats]
//             [u32 1: whole][u32 shard][i64 version][u32 in round][u64 n][values][u64 n][momentum][u64 n][round sum]
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
      : AsyncMode(settings, comm, initial, resume, OwnerState::kOuterMomentum, /*replicated=*/true),
        snapshot_(initial.size(), 0.0f) {
    // Every rank starts from the same state, so each backup's replica starts
    // as its owner's shard. Rank j < K owns shard j; rank j + 1 backs it up.
    const int me = comm.rank();
    const int w = comm.size();
    if (me < shards_) {
      outer_.emplace(me, starting_outer(me, resume));
      std::lock_guard lock(mutex_);
      backup_[me] = backup_of_locked(me);
    }
    if (const int before = (me + w - 1) % w; before < shards_) {
      Replica& r = replicas_.emplace(before, Replica{{}, 0, starting_outer(before, resume)}).first->second;
      r.values.assign(initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(before)]),
                      initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(before) + 1]));
    }
    comm.on_message(channels::kDeltaShard, [this](int from, std::span<const std::byte> m) { on_delta(from, m); });
    comm.on_message(channels::kReplica, [this](int, std::span<const std::byte> m) { on_replica(m); });
    start_serving_owner_state();
  }
  // Unregistered here, before this class's members go: the base's destructor would be too late.
  ~CfmoMode() override {
    comm_.on_message(channels::kDeltaShard, nullptr);
    comm_.on_message(channels::kReplica, nullptr);
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
      return cut_off();
    }
    for (auto& f : take_inbox()) rebase(f, params, optimizer);
    report_progress(position);
    CFMO_TRY(cut_off());
    if (position.step % settings_.sync_interval != 0) return {};
    // Shards whose last delta is still in flight wait for the next round; the
    // others go now: a slow owner never holds back the rest, nobody waits.
    send_round(params, /*only_idle=*/true);
    return {};
  }

  Status finish(std::span<float> params, Optimizer& optimizer) override {
    CFMO_TRY(cut_off());
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
    refresh_membership();
    owners_.resize(static_cast<size_t>(shards_));
    {
      std::lock_guard lock(mutex_);
      for (int j = 0; j < shards_; ++j) owners_[static_cast<size_t>(j)] = owner_of_locked(j);
    }
    uint64_t sent = 0;
    bool skipped = false;
    for (int j = 0; j < shards_; ++j) {
      const int owner = owners_[static_cast<size_t>(j)];
      if (owner < 0) continue;
      // The reply of a lost owner never comes: its shard goes to the new one.
      if (awaiting_owner_[static_cast<size_t>(j)] != owner) forget_replies(j);
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
      out.reserve(kDeltaHeader + encoded_size(settings_.delta_dtype, count));
      put(out, static_cast<uint32_t>(j));
      put(out, static_cast<uint32_t>(settings_.delta_dtype) | (last ? kLastRound : 0u));
      put(out, base_version_[static_cast<size_t>(j)]);
      encode_floats(settings_.delta_dtype, delta_,
                    residual_.empty() ? std::span<float>() : std::span<float>(residual_).subspan(first, count), out);
      comm_.post(owner, channels::kDeltaShard, std::move(out));
      await_reply(j, owner);
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
    reply_came(f.shard);
    record_staleness(f.staleness, f.dropped);
    const size_t first = bounds_[static_cast<size_t>(f.shard)];
    if (f.values.size() != bounds_[static_cast<size_t>(f.shard) + 1] - first) return;
    const int64_t behind =
        std::max<int64_t>(0, f.version - base_version_[static_cast<size_t>(f.shard)] - 1) / comm_.size();
    for (size_t i = 0; i < f.values.size(); ++i)
      params[first + i] = f.values[i] + (params[first + i] - snapshot_[first + i]);
    {
      // Under the lock: a rank taking over a shard nobody holds a replica of starts from base_.
      std::lock_guard lock(mutex_);
      std::copy(f.values.begin(), f.values.end(), base_.begin() + static_cast<std::ptrdiff_t>(first));
      base_version_[static_cast<size_t>(f.shard)] = f.version;
    }
    if (behind > 0) {
      optimizer.scale_first_moment(static_cast<float>(std::pow(settings_.staleness_discount, behind)), first,
                                   f.values.size());
    }
  }

  /// Owner: apply a delta shard weighted by beta^staleness, pass it on to
  /// the shard's backup, reply with the fresh shard. A delta for a shard this
  /// rank does not serve (its sender saw an owner lost before this rank did)
  /// is answered without it: the worker's next delta carries it again.
  void on_delta(int from, std::span<const std::byte> m) {
    uint32_t shard = 0;
    uint32_t dtype = 0;
    int64_t base_version = 0;
    if (!take(m, shard) || !take(m, dtype) || !take(m, base_version) || shard >= static_cast<uint32_t>(shards_)) {
      return;
    }
    const bool last = (dtype & kLastRound) != 0;
    dtype &= ~kLastRound;
    if (dtype > 2) return;
    const std::span<const std::byte> encoded = m;
    incoming_.resize(shard_size(static_cast<int>(shard)));
    if (!decode_floats(static_cast<WireDtype>(dtype), m, incoming_)) return;
    refresh_membership();
    std::lock_guard lock(mutex_);
    ++stats_.contributions_received;
    note_reconciled(from);
    const auto it = served_.find(static_cast<int>(shard));
    if (it == served_.end()) {
      reply_fresh_locked(from, static_cast<int>(shard), 0, /*dropped=*/true, /*with_shard=*/false);
      return;
    }
    Served& served = it->second;
    const int64_t s = staleness_of(served, base_version);
    const bool dropped = s > settings_.max_staleness;
    if (!dropped) {
      const float weight =
          static_cast<float>(std::pow(settings_.staleness_discount, s)) / static_cast<float>(comm_.size());
      outer_.at(static_cast<int>(shard)).apply(served.values, incoming_, weight);
      ++served.version;
      ++stats_.contributions_applied;
      replicate_locked(static_cast<int>(shard), weight, dtype, encoded);
    }
    reply_fresh_locked(from, static_cast<int>(shard), s, dropped, /*with_shard=*/!last);
  }

  /// Under mutex_: the contribution just applied to `shard`, to its backup;
  /// the whole state instead to a backup new since the last one.
  void replicate_locked(int shard, float weight, uint32_t dtype, std::span<const std::byte> encoded) {
    const int backup = backup_of_locked(shard);
    if (backup < 0) return;
    if (backup_[shard] != backup) {
      send_whole_locked(shard, backup);
      return;
    }
    std::vector<std::byte> out;
    out.reserve(24 + encoded.size());
    put(out, kReplicaApply);
    put(out, static_cast<uint32_t>(shard));
    put(out, served_.at(shard).version);
    put(out, weight);
    put(out, dtype);
    put_bytes(out, encoded.data(), encoded.size());
    comm_.post(backup, channels::kReplica, std::move(out));
  }

  /// Under mutex_: `shard`'s whole state (values, version, outer state) to `backup`, its backup from now on.
  void send_whole_locked(int shard, int backup) {
    backup_[shard] = backup;
    if (backup < 0) return;
    const OuterOptimizer& outer = outer_.at(shard);
    std::vector<std::byte> out;
    put(out, kReplicaWhole);
    put(out, static_cast<uint32_t>(shard));
    put(out, served_.at(shard).version);
    put(out, static_cast<uint32_t>(outer.in_round()));
    put_vector(out, served_.at(shard).values);
    put_vector(out, outer.momentum());
    put_vector(out, outer.round_sum());
    comm_.post(backup, channels::kReplica, std::move(out));
  }

  /// A backup: an owner's applied contribution, or its whole state, into the replica.
  void on_replica(std::span<const std::byte> m) {
    uint32_t kind = 0;
    uint32_t shard = 0;
    int64_t version = 0;
    if (!take(m, kind) || !take(m, shard) || !take(m, version) || shard >= static_cast<uint32_t>(shards_)) {
      return;
    }
    const int j = static_cast<int>(shard);
    std::lock_guard lock(mutex_);
    if (served_.count(j) != 0) return;  // this rank serves it now: an old owner's late words
    if (kind == kReplicaWhole) {
      uint32_t in_round = 0;
      std::vector<float> values;
      std::vector<float> momentum;
      std::vector<float> round_sum;
      if (!take(m, in_round) || !take_vector(m, values) || !take_vector(m, momentum) || !take_vector(m, round_sum) ||
          values.size() != shard_size(j)) {
        return;
      }
      Replica r{{}, version, OuterOptimizer(settings_, shard_size(j), comm_.size())};
      r.values.assign(values.begin(), values.end());
      r.outer.restore(static_cast<int>(in_round), momentum, round_sum);
      replicas_.insert_or_assign(j, std::move(r));
      return;
    }
    float weight = 0;
    uint32_t dtype = 0;
    const auto it = replicas_.find(j);
    if (kind != kReplicaApply || it == replicas_.end() || !take(m, weight) || !take(m, dtype) || dtype > 2) return;
    replica_incoming_.resize(shard_size(j));
    if (!decode_floats(static_cast<WireDtype>(dtype), m, replica_incoming_)) return;
    it->second.outer.apply(it->second.values, replica_incoming_, weight);
    it->second.version = version;
  }

  /// Under mutex_: the shards whose owner is this rank now take up their
  /// replicas (or, where every holder was lost, this rank's last global
  /// values of them); every shard served gets its backup's whole state when
  /// its backup changed.
  void on_membership_change_locked(const std::vector<int>&) override {
    const int me = comm_.rank();
    for (int j = 0; j < shards_; ++j) {
      if (owner_of_locked(j) != me || served_.count(j) != 0) continue;
      Served taken;
      const auto r = replicas_.find(j);
      if (r != replicas_.end()) {
        taken.values = std::move(r->second.values);
        taken.version = r->second.version;
        outer_.insert_or_assign(j, std::move(r->second.outer));
        replicas_.erase(r);
      } else {
        const auto first = base_.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(j)]);
        taken.values.assign(first, first + static_cast<std::ptrdiff_t>(shard_size(j)));
        taken.version = base_version_[static_cast<size_t>(j)];
        outer_.insert_or_assign(j, OuterOptimizer(settings_, shard_size(j), comm_.size()));
      }
      served_.insert_or_assign(j, std::move(taken));
      backup_[j] = -1;
    }
    for (const auto& entry : served_) {
      const int j = entry.first;
      const int backup = backup_of_locked(j);
      if (backup_[j] != backup) send_whole_locked(j, backup);
    }
  }

  /// A shard's outer optimizer as the run starts (with the resumed momentum).
  OuterOptimizer starting_outer(int shard, const ModeResume& resume) const {
    OuterOptimizer outer(settings_, shard_size(shard), comm_.size());
    if (!outer.momentum().empty() && resume.outer_momentum.size() == bounds_.back()) {
      const auto first = static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(shard)]);
      std::copy_n(resume.outer_momentum.begin() + first, shard_size(shard), outer.momentum().begin());
    }
    return outer;
  }

  std::vector<std::span<const float>> owner_state(int shard) const override {
    const auto it = outer_.find(shard);
    if (it == outer_.end() || it->second.momentum().empty()) return {};
    return {it->second.momentum()};
  }

  /// A backup's copy of an owner's shard.
  struct Replica {
    FloatBuffer values;
    int64_t version = 0;
    OuterOptimizer outer;
  };

  // Under mutex_.
  std::map<int, OuterOptimizer> outer_;  ///< the outer step of each shard served
  std::map<int, int> backup_;            ///< each shard served: the backup its contributions go to (-1: none)
  std::map<int, Replica> replicas_;      ///< the shards this rank is the backup of
  static constexpr uint32_t kReplicaApply = 0;
  static constexpr uint32_t kReplicaWhole = 1;

  /// In a delta's dtype field: the sender's last round, answered without the shard.
  static constexpr uint32_t kLastRound = 0x100;
  /// A delta's bytes before its floats: shard, dtype, base version.
  static constexpr size_t kDeltaHeader = 16;

  FloatBuffer snapshot_;
  std::vector<int64_t> sent_at_ =
      std::vector<int64_t>(static_cast<size_t>(shards_), -1);  ///< step of each shard's last send
  std::vector<int> owners_;                                    ///< send_round's: each shard's owner now
  FloatBuffer delta_;
  FloatBuffer full_delta_;  ///< for the delta sink
  int64_t last_step_ = 0;
  FloatBuffer incoming_;          ///< progress thread
  FloatBuffer replica_incoming_;  ///< progress thread
};

}  // namespace

Result<std::unique_ptr<Mode>> make_cfmo(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<CfmoMode>(c.settings, c.comm, c.initial, c.resume));
}

}  // namespace cfmo::modes
