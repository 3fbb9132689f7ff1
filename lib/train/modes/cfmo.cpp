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
// With --deterministic (settings.deterministic) the order of every message
// that changes a value is fixed: an owner holds a round's contributions to a
// shard until every rank's is in (or the rank said it finished) and applies
// them in rank order, and a worker waits after sending its round until every
// reply is back. Every contribution is then fresh (staleness 0), every
// worker's parameters are the global ones right after a round (a checkpoint
// there is a consistent cut), and a run is bitwise the same each time.
//
// kDeltaShard [u32 shard][u32 dtype | kLastRound | kFinished][i64 base version][encoded floats (comm/codec.h)]
//             (kFinished, --deterministic: no delta; the sender sends no more rounds)
// kReplica    [u32 0: apply][u32 shard][i64 version][f32 weight][u32 dtype][encoded floats]
//             [u32 1: whole][u32 shard][i64 version][u32 in round][u64 n][values][u64 n][momentum][u64 n][round sum]
//             [u32 2: hand-over] as whole, to its owner: a join brought it back
//             [u32 3: copy request][u32 shard][i64 0]  a joiner owning a shard it holds nothing of, to each rank
//             [u32 4: copy][u32 shard][i64 version][u32 served][u64 n][values]  the answer: that rank's copy
//             of the shard (served: 1 where it serves the shard, whose hand-over then comes)
#include "train/modes/async_base.h"
#include "train/modes/outer_optimizer.h"
#include "train/modes/reply_hold.h"
#include "train/modes/wire.h"

#include <cmath>
#include <memory>
#include <set>

namespace cfmo::train::modes {
namespace {

class CfmoMode final : public AsyncMode {
 public:
  CfmoMode(const ModeSettings& settings, comm::Communicator& comm, std::span<const float> initial,
           const ModeResume& resume)
      : AsyncMode(settings, comm, initial, resume, OwnerState::kOuterMomentum, /*replicated=*/true),
        snapshot_(initial.size(), 0.0f) {
    // Every rank starts from the same state, so each backup's replica starts
    // as its owner's shard. Rank j < K owns shard j; rank j + 1 backs it up.
    // A joiner starts with nothing: its shard comes back from the rank that
    // served it, its replica from its owner.
    const int me = comm.rank();
    const int w = comm.size();
    if (!comm.joined()) {
      if (me < shards_) outer_.emplace(me, starting_outer(me, resume));
      if (const int before = (me + w - 1) % w; before < shards_) {
        const int64_t version =
            resume.versions.size() == static_cast<size_t>(shards_) ? resume.versions[static_cast<size_t>(before)] : 0;
        Replica& r = replicas_.emplace(before, Replica{{}, version, starting_outer(before, resume)}).first->second;
        r.values.assign(initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(before)]),
                        initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(before) + 1]));
      }
      if (me < shards_) {
        std::lock_guard lock(mutex_);
        backup_[me] = backup_of_locked(me);
      }
    }
    if (resume.ranks.size() == static_cast<size_t>(w)) {
      // A resumed rank starts on the global parameters: nothing to send until it trains.
      last_step_ = resume.ranks[static_cast<size_t>(me)].step;
      std::fill(sent_at_.begin(), sent_at_.end(), last_step_);
    }
    comm.on_message(channels::kDeltaShard, [this](int from, std::span<const std::byte> m) { on_delta(from, m); });
    comm.on_message(channels::kReplica, [this](int from, std::span<const std::byte> m) { on_replica(from, m); });
    start_serving_owner_state();
  }
  // Unregistered here, before this class's members go: the base's destructor would be too late.
  ~CfmoMode() override {
    comm_.on_message(channels::kDeltaShard, nullptr);
    comm_.on_message(channels::kReplica, nullptr);
    stop_serving_owner_state();
  }
  std::string_view name() const override { return "cfmo"; }
  Result<Joined> join(std::span<float> params, optim::Optimizer&, TrainPosition& position) override {
    return take_global_state(params, position);
  }

  bool needs_params(const TrainPosition& position) const override {
    return position.step % settings_.sync_interval == 0 || inbox_pending();
  }
  Status after_step(const TrainPosition& position, std::span<float> params, optim::Optimizer& optimizer) override {
    last_step_ = position.step;
    {
      std::lock_guard lock(mutex_);
      reply_due_locked(hold_.tick(position.step));
    }
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
    if (!settings_.deterministic) return {};
    CFMO_TRY(await_round(params, optimizer));
    round_done_at_ = position.step;
    return {};
  }
  /// --deterministic, right after a round: every reply is in, so this rank's
  /// parameters are the global ones (and the owners hold no pending round).
  bool params_are_global() const override { return settings_.deterministic && round_done_at_ == last_step_; }

  Status finish(std::span<float> params, optim::Optimizer& optimizer) override {
    {
      // This owner takes no more steps to release held replies by: all go now, and later ones at once.
      std::lock_guard lock(mutex_);
      reply_due_locked(hold_.release_all());
    }
    CFMO_TRY(cut_off());
    const auto start = Clock::now();
    const auto deadline = start + seconds(settings_.peer_timeout_s);
    auto apply = [&](FreshShard& f) { rebase(f, params, optimizer); };
    drain_replies(deadline, params, apply);
    // The last local progress counts too. Its replies carry no shard: this
    // rank's parameters are not used after the run, and rank 0 gathers the
    // global ones.
    send_round(params, /*only_idle=*/false, /*last=*/true);
    if (settings_.deterministic) CFMO_TRY(await_round(params, optimizer));
    drain_replies(deadline + seconds(settings_.peer_timeout_s), params, apply);
    count_finish_wait(start);
    return end_handshake(params);
  }

 private:
  /// --deterministic: waits until every reply of the round just sent is in
  /// and rebased. A lost rank ends the run: its contributions to the rounds
  /// in progress would never come, and going on without them is not the
  /// order an uninterrupted run has.
  Status await_round(std::span<float> params, optim::Optimizer& optimizer) {
    const auto start = Clock::now();
    Status status;
    while (outstanding() > 0) {
      refresh_membership();
      if (const auto lost = comm_.lost_ranks(); !lost.empty()) {
        status =
            make_error(ErrorKind::kPeer, "--deterministic: rank {} was lost ({}); a deterministic run cannot go on",
                       lost.front(), comm_.lost_reason(lost.front()));
        break;
      }
      auto fresh = take_inbox();
      if (fresh.empty()) {
        seam_sleep_for(std::chrono::microseconds(100));
        continue;
      }
      for (auto& f : fresh) rebase(f, params, optimizer);
    }
    for (auto& f : take_inbox()) rebase(f, params, optimizer);
    std::lock_guard lock(mutex_);
    stats_.wait_s += seconds_since(start);
    return status;
  }

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
      // Nothing trained since this shard went: its delta would be zero. A
      // deterministic owner waits for every rank's round: it is told this
      // rank sends no more.
      if (last && sent_at_[static_cast<size_t>(j)] == last_step_) {
        if (settings_.deterministic) {
          std::vector<std::byte> out;
          put(out, static_cast<uint32_t>(j));
          put(out, static_cast<uint32_t>(settings_.delta_dtype) | kLastRound | kFinished);
          put(out, base_version_[static_cast<size_t>(j)]);
          comm_.post(owner, channels::kDeltaShard, std::move(out));
          await_reply(j, owner);
        }
        continue;
      }
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
      out.reserve(kDeltaHeader + comm::encoded_size(settings_.delta_dtype, count));
      put(out, static_cast<uint32_t>(j));
      put(out, static_cast<uint32_t>(settings_.delta_dtype) | (last ? kLastRound : 0u));
      put(out, base_version_[static_cast<size_t>(j)]);
      comm::encode_floats(settings_.delta_dtype, delta_,
                          residual_.empty() ? std::span<float>() : std::span<float>(residual_).subspan(first, count),
                          out);
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
  void rebase(FreshShard& f, std::span<float> params, optim::Optimizer& optimizer) {
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
    const bool finished = (dtype & kFinished) != 0;
    dtype &= ~(kLastRound | kFinished);
    if (dtype > 2) return;
    const std::span<const std::byte> encoded = m;
    incoming_.resize(shard_size(static_cast<int>(shard)));
    if (!finished && !comm::decode_floats(static_cast<comm::WireDtype>(dtype), m, incoming_)) return;
    refresh_membership();
    std::lock_guard lock(mutex_);
    if (settings_.deterministic) {
      // Held until the round is whole, then applied in rank order.
      Round& round = rounds_[static_cast<int>(shard)];
      if (finished) {
        mark_finished_locked(from);
        reply_fresh_locked(from, static_cast<int>(shard), 0, /*dropped=*/false, /*with_shard=*/false);
      } else {
        const bool added =
            round.from
                .emplace(from, Held{base_version, dtype, last, std::vector<std::byte>(encoded.begin(), encoded.end()),
                                    std::vector<float>(incoming_.begin(), incoming_.end())})
                .second;
        if (added && finished_[static_cast<size_t>(from)]) ++round.finished_in;
        if (last) mark_finished_locked(from);
      }
      apply_whole_rounds_locked();
      return;
    }
    if (finished) return;  // only sent with --deterministic
    apply_locked(from, static_cast<int>(shard), base_version, dtype, last, encoded, incoming_);
  }

  /// Under mutex_: one contribution of `from` to `shard`: applied weighted by
  /// beta^staleness / W_live (or dropped), passed on to the backup, answered
  /// unless `reply` is false; returns its staleness (-1: answered already, a
  /// shard this rank does not serve).
  int64_t apply_locked(int from, int shard, int64_t base_version, uint32_t dtype, bool last,
                       std::span<const std::byte> encoded, std::span<const float> delta, bool reply = true) {
    ++stats_.contributions_received;
    note_reconciled(from);
    const auto it = served_.find(shard);
    if (it == served_.end()) {
      reply_fresh_locked(from, shard, 0, /*dropped=*/true, /*with_shard=*/false);
      return -1;
    }
    Served& served = it->second;
    const int64_t s = staleness_of(served, base_version);
    const bool dropped = s > settings_.max_staleness;
    if (!dropped) {
      // 1 / W_live: after a loss a round of the survivors' deltas moves the shard by their mean.
      const float weight = static_cast<float>(std::pow(settings_.staleness_discount, s)) / static_cast<float>(live());
      OuterOptimizer& outer = outer_.at(shard);
      outer.set_round(round_of(served.version));
      outer.apply(served.values, delta, weight);
      ++served.version;
      ++stats_.contributions_applied;
      replicate_locked(shard, weight, dtype, encoded);
    }
    if (!reply) return s;
    if (last) {
      // Answered at once (the sender trains no more); rounds stop waiting for it.
      reply_fresh_locked(from, shard, s, dropped, /*with_shard=*/false);
      reply_due_locked(hold_.finished(from));
    } else {
      reply_due_locked(hold_.applied(shard, {from, s, dropped}));
    }
    return s;
  }

  /// Under mutex_: the replies ReplyHold says are due, each with its shard as it is now.
  void reply_due_locked(const std::vector<ReplyHold::Due>& due) {
    for (const auto& d : due) reply_fresh_locked(d.reply.to, d.shard, d.reply.staleness, d.reply.dropped);
    stats_.replies_held = hold_.held();
    stats_.reply_rounds_cut = hold_.cut_rounds();
  }

  /// --deterministic, under mutex_: every shard's round that holds a
  /// contribution of each rank not finished is applied, in rank order.
  void apply_whole_rounds_locked() {
    for (auto& [shard, round] : rounds_) {
      if (round.from.empty()) continue;
      // Every rank is in, finished or lost: counted as they come (O(1) a
      // delta, where a look at each of W ranks was O(W)); ranks only a loss
      // ends a deterministic run with are looked at one by one.
      bool whole = round.from.size() + static_cast<size_t>(finished_count_ - round.finished_in) ==
                   static_cast<size_t>(comm_.size());
      if (!whole && live() < comm_.size()) {
        whole = true;
        for (int r = 0; r < comm_.size() && whole; ++r) {
          whole = round.from.count(r) != 0 || finished_[static_cast<size_t>(r)] || lost_locked(r);
        }
      }
      if (!whole) continue;
      // All applied first, then every reply with the round's result: each
      // worker's rebase lands on the same global shard.
      std::vector<std::pair<int, int64_t>> applied;
      for (auto& [from, held] : round.from) {
        applied.emplace_back(from, apply_locked(from, shard, held.base_version, held.dtype, held.last, held.encoded,
                                                held.delta, /*reply=*/false));
      }
      for (const auto& [from, s] : applied) {
        if (s < 0) continue;
        reply_fresh_locked(from, shard, s, s > settings_.max_staleness, /*with_shard=*/!round.from.at(from).last);
      }
      round.from.clear();
      round.finished_in = 0;
    }
  }

  /// --deterministic, under mutex_: `rank` sends no more rounds.
  void mark_finished_locked(int rank) {
    if (finished_[static_cast<size_t>(rank)]) return;
    finished_[static_cast<size_t>(rank)] = true;
    ++finished_count_;
    for (auto& entry : rounds_) {
      if (entry.second.from.count(rank) != 0) ++entry.second.finished_in;
    }
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
    send_state_locked(shard, backup, kReplicaWhole);
  }

  /// Under mutex_: `shard`'s whole state to `to`, as a replica (kReplicaWhole) or to serve (kHandOver).
  void send_state_locked(int shard, int to, uint32_t kind) {
    post_whole(to, kind, shard, served_.at(shard).version, served_.at(shard).values, outer_.at(shard));
  }

  /// [kind][shard][version][in round][values][momentum][round sum] to `to`.
  void post_whole(int to, uint32_t kind, int shard, int64_t version, std::span<const float> values,
                  const OuterOptimizer& outer) {
    std::vector<std::byte> out;
    put(out, kind);
    put(out, static_cast<uint32_t>(shard));
    put(out, version);
    put(out, static_cast<uint32_t>(outer.in_round()));
    put_vector(out, values);
    put_vector(out, outer.momentum());
    put_vector(out, outer.round_sum());
    comm_.post(to, channels::kReplica, std::move(out));
  }

  /// Under mutex_: a shard handed over to this rank, its owner now (a join
  /// moved it back); of two hand-overs (the rank that served it and a
  /// replica's holder) the newer counts. Its backup gets the whole state.
  void take_handed_over_locked(int j, int64_t version, std::span<const std::byte> m) {
    auto whole = take_whole(j, version, m);
    if (!whole) return;
    if (const auto it = served_.find(j);
        it != served_.end() && it->second.version >= version && from_copies_.count(j) == 0) {
      return;
    }
    from_copies_.erase(j);
    Served taken;
    taken.values = std::move(whole->values);
    taken.version = version;
    served_.insert_or_assign(j, std::move(taken));
    outer_.insert_or_assign(j, std::move(whole->outer));
    replicas_.erase(j);
    send_whole_locked(j, backup_of_locked(j));
  }

  /// Under mutex_: this rank, shard `j`'s owner now, serves it from the replica it holds.
  void serve_replica_locked(int j) {
    auto r = replicas_.find(j);
    Served taken;
    taken.values = std::move(r->second.values);
    taken.version = r->second.version;
    outer_.insert_or_assign(j, std::move(r->second.outer));
    replicas_.erase(r);
    served_.insert_or_assign(j, std::move(taken));
    backup_[j] = -1;
  }

  /// A backup: an owner's applied contribution, or its whole state, into the
  /// replica; a joiner's request for this rank's copy of a shard, and the copy.
  void on_replica(int from, std::span<const std::byte> m) {
    uint32_t kind = 0;
    uint32_t shard = 0;
    int64_t version = 0;
    if (!take(m, kind) || !take(m, shard) || !take(m, version) || shard >= static_cast<uint32_t>(shards_)) {
      return;
    }
    const int j = static_cast<int>(shard);
    // A copy's asker may be a join this rank has not taken up: a shard it
    // serves goes back to the joiner first (a hand-over) where it is its owner.
    if (kind == kCopyRequest) refresh_membership();
    std::lock_guard lock(mutex_);
    if (kind == kCopyRequest) {
      send_copy_locked(j, from);
      return;
    }
    if (kind == kCopy) {
      take_copy_locked(j, from, version, m);
      return;
    }
    if (kind == kHandOver) {
      take_handed_over_locked(j, version, m);
      return;
    }
    if (served_.count(j) != 0) return;  // this rank serves it now: an old owner's late words
    if (kind == kReplicaWhole) {
      if (auto r = take_whole(j, version, m)) replicas_.insert_or_assign(j, std::move(*r));
      // A joiner that became the shard's owner before its replica came (the
      // owner was lost while the message waited for the joiner's handler)
      // serves it now, as the membership change would have.
      if (joining_ && replicas_.count(j) != 0 && owner_of_locked(j) == comm_.rank()) {
        serve_replica_locked(j);
        outer_.at(j).set_contributions_per_round(live());
        send_whole_locked(j, backup_of_locked(j));
      }
      return;
    }
    float weight = 0;
    uint32_t dtype = 0;
    const auto it = replicas_.find(j);
    if (kind != kReplicaApply || it == replicas_.end() || !take(m, weight) || !take(m, dtype) || dtype > 2) return;
    replica_incoming_.resize(shard_size(j));
    if (!comm::decode_floats(static_cast<comm::WireDtype>(dtype), m, replica_incoming_)) return;
    // The owner applied it at one version fewer: the same round as there.
    it->second.outer.set_round(round_of(version - 1));
    it->second.outer.apply(it->second.values, replica_incoming_, weight);
    it->second.version = version;
  }

  /// Under mutex_: a shard this rank serves whose owner is another rank now
  /// (a join brought that rank back) goes to it whole, with a replica this
  /// rank holds of a rank that came back (it may not have promoted it yet);
  /// the shards whose owner is this rank now take up their replicas (or,
  /// where every holder was lost, this rank's last global values of them,
  /// which a joiner does not have); every shard served
  /// gets its backup's whole state when its backup changed.
  void on_membership_change_locked(const std::vector<int>& newly_lost, const std::vector<int>& rejoined) override {
    const int me = comm_.rank();
    // A new rank (the world grew) has its place in the per-rank tables; it serves no shard (K stays).
    finished_.resize(std::max(finished_.size(), static_cast<size_t>(world_locked())), false);
    // Held replies go before any shard moves; rounds wait for the live ranks only.
    reply_due_locked(hold_.flush());
    for (const int r : newly_lost) reply_due_locked(hold_.finished(r));
    for (const int r : rejoined) hold_.rejoined(r);
    for (auto it = served_.begin(); it != served_.end();) {
      const int owner = owner_of_locked(it->first);
      if (owner == me || owner < 0) {
        ++it;
        continue;
      }
      send_state_locked(it->first, owner, kHandOver);
      outer_.erase(it->first);
      backup_.erase(it->first);
      it = served_.erase(it);
    }
    for (const int r : rejoined) {
      const auto replica = replicas_.find(r);
      if (replica == replicas_.end()) continue;
      // As a hand-over: the whole replica, the state it was kept with.
      post_whole(r, kHandOver, r, replica->second.version, replica->second.values, replica->second.outer);
      replicas_.erase(replica);
    }
    for (int j = 0; j < shards_; ++j) {
      if (owner_of_locked(j) != me || served_.count(j) != 0) continue;
      if (replicas_.count(j) != 0) {
        serve_replica_locked(j);
        continue;
      }
      // A joiner's base_ is nobody's yet: it takes up only a replica it holds
      // (a rank lost while it joins, whose backup it is; the joiner itself
      // waits for that shard, here or when the replica comes); its own comes
      // handed over. A replica the owner sent before its loss may never
      // come: it went while the joiner was still loading, before it took any
      // message, and a large message needs its sender alive until it is
      // taken. So the joiner also asks every rank for its copy, and serves
      // the freshest once all have answered, unless the replica came first.
      if (joining_) {
        ask_copies_locked(j);
        continue;
      }
      Served taken;
      const auto first = base_.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(j)]);
      taken.values.assign(first, first + static_cast<std::ptrdiff_t>(shard_size(j)));
      taken.version = base_version_[static_cast<size_t>(j)];
      outer_.insert_or_assign(j, OuterOptimizer(settings_, shard_size(j), live()));
      served_.insert_or_assign(j, std::move(taken));
      backup_[j] = -1;
    }
    // A joiner's copies: a rank come back since it asked is asked too, a
    // rank lost before its copy came is answered for.
    for (const auto& [j, got] : copies_) {
      if (served_.count(j) != 0) continue;
      for (const int r : rejoined) {
        if (got.count(r) == 0) post_copy_request_locked(j, r);
      }
      serve_copy_if_whole_locked(j);
    }
    // A round of the outer step is now one contribution of each survivor.
    for (auto& entry : outer_) entry.second.set_contributions_per_round(live());
    for (auto& entry : replicas_) entry.second.outer.set_contributions_per_round(live());
    for (const auto& entry : served_) {
      const int j = entry.first;
      const int backup = backup_of_locked(j);
      if (backup_[j] != backup) send_whole_locked(j, backup);
    }
  }

  /// A joiner, under mutex_: asks every live rank once for its copy of shard `j`.
  void ask_copies_locked(int j) {
    if (!copies_.emplace(j, std::map<int, Copy>{}).second) return;
    for (int r = 0; r < world_locked(); ++r) {
      if (r != comm_.rank() && !lost_locked(r)) post_copy_request_locked(j, r);
    }
  }

  void post_copy_request_locked(int j, int to) {
    std::vector<std::byte> out;
    put(out, kCopyRequest);
    put(out, static_cast<uint32_t>(j));
    put(out, int64_t{0});
    comm_.post(to, channels::kReplica, std::move(out));
  }

  /// Under mutex_: this rank's copy of shard `j` to `to`: the shard itself
  /// where it serves it, else the freshest global values it has of it (a
  /// reply not yet rebased on, or those it last rebased on).
  void send_copy_locked(int j, int to) {
    const size_t first = bounds_[static_cast<size_t>(j)];
    const auto served = served_.find(j);
    std::span<const float> values = std::span<const float>(base_).subspan(first, shard_size(j));
    int64_t version = base_version_[static_cast<size_t>(j)];
    if (served != served_.end()) {
      values = served->second.values;
      version = served->second.version;
    } else {
      for (const FreshShard& f : inbox_) {
        if (f.shard == j && f.values.size() == shard_size(j) && f.version > version) {
          values = f.values;
          version = f.version;
        }
      }
    }
    std::vector<std::byte> out;
    put(out, kCopy);
    put(out, static_cast<uint32_t>(j));
    put(out, version);
    put(out, static_cast<uint32_t>(served != served_.end() ? 1 : 0));
    put_vector(out, values);
    comm_.post(to, channels::kReplica, std::move(out));
  }

  /// A joiner, under mutex_: `from`'s copy of shard `j`, asked for above.
  void take_copy_locked(int j, int from, int64_t version, std::span<const std::byte> m) {
    const auto asked = copies_.find(j);
    uint32_t served = 0;
    std::vector<float> values;
    if (asked == copies_.end() || !take(m, served) || !take_vector(m, values) || values.size() != shard_size(j)) {
      return;
    }
    Copy& copy = asked->second[from];
    copy.values.assign(values.begin(), values.end());
    copy.version = version;
    copy.served = served != 0;
    serve_copy_if_whole_locked(j);
  }

  /// A joiner, under mutex_: once every live rank's copy of shard `j` is in
  /// and none of them serves it (then its hand-over comes), serves the
  /// freshest (the highest version) with a new outer state (the owner's was
  /// lost with it), as a rank that holds no replica serves its last global
  /// values; nothing where the shard is served already (the replica came)
  /// or is another rank's now.
  void serve_copy_if_whole_locked(int j) {
    const auto asked = copies_.find(j);
    if (asked == copies_.end() || served_.count(j) != 0 || replicas_.count(j) != 0 ||
        owner_of_locked(j) != comm_.rank()) {
      return;
    }
    const auto& copies = asked->second;
    const Copy* freshest = nullptr;
    for (int r = 0; r < world_locked(); ++r) {
      if (r == comm_.rank() || lost_locked(r)) continue;
      const auto it = copies.find(r);
      if (it == copies.end() || it->second.served) return;
      if (freshest == nullptr || it->second.version > freshest->version) freshest = &it->second;
    }
    if (freshest == nullptr) return;
    Served taken;
    taken.values.assign(freshest->values.begin(), freshest->values.end());
    taken.version = freshest->version;
    outer_.insert_or_assign(j, OuterOptimizer(settings_, shard_size(j), live()));
    served_.insert_or_assign(j, std::move(taken));
    from_copies_.insert(j);
    backup_[j] = -1;
    send_whole_locked(j, backup_of_locked(j));
  }

  /// The outer round (--outer-warmup) of a contribution applied to a shard at
  /// `version`: rounds of W contributions, as the staleness counts them.
  int64_t round_of(int64_t version) const { return std::max<int64_t>(0, version) / comm_.size(); }

  /// A shard's outer optimizer as the run starts (with the resumed momentum).
  OuterOptimizer starting_outer(int shard, const ModeResume& resume) const {
    OuterOptimizer outer(settings_, shard_size(shard), comm_.size());
    if (!outer.momentum().empty() && resume.outer_momentum.size() == bounds_.back()) {
      const auto first = static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(shard)]);
      std::copy_n(resume.outer_momentum.begin() + first, shard_size(shard), outer.momentum().begin());
      // The round the owner had in progress, where the checkpoint has it (of
      // this world and these K shards).
      if (resume.outer_round_sum.size() == bounds_.back() &&
          resume.outer_in_round.size() == static_cast<size_t>(shards_)) {
        outer.restore(
            static_cast<int>(resume.outer_in_round[static_cast<size_t>(shard)]), outer.momentum(),
            std::span<const float>(resume.outer_round_sum).subspan(static_cast<size_t>(first), shard_size(shard)));
      }
    }
    return outer;
  }

  /// The outer momentum and the pending round's sum (what a checkpoint
  /// needs to finish the round), with the round's contributions as the steps.
  std::vector<std::span<const float>> owner_state(int shard) const override {
    const auto it = outer_.find(shard);
    if (it == outer_.end() || it->second.momentum().empty()) return {};
    if (it->second.round_sum().empty()) return {it->second.momentum()};
    return {it->second.momentum(), it->second.round_sum()};
  }
  int64_t owner_steps(int shard) const override {
    const auto it = outer_.find(shard);
    return it == outer_.end() ? 0 : it->second.in_round();
  }

  /// A backup's copy of an owner's shard.
  struct Replica {
    tensor::FloatBuffer values;
    int64_t version = 0;
    OuterOptimizer outer;
  };

  /// A whole state's rest after [kind][shard][version]; none when malformed.
  std::optional<Replica> take_whole(int j, int64_t version, std::span<const std::byte> m) const {
    uint32_t in_round = 0;
    std::vector<float> values;
    std::vector<float> momentum;
    std::vector<float> round_sum;
    if (!take(m, in_round) || !take_vector(m, values) || !take_vector(m, momentum) || !take_vector(m, round_sum) ||
        values.size() != shard_size(j)) {
      return std::nullopt;
    }
    Replica r{{}, version, OuterOptimizer(settings_, shard_size(j), live())};
    r.values.assign(values.begin(), values.end());
    r.outer.restore(static_cast<int>(in_round), momentum, round_sum);
    return r;
  }

  // Under mutex_.
  std::map<int, OuterOptimizer> outer_;  ///< the outer step of each shard served
  std::map<int, int> backup_;            ///< each shard served: the backup its contributions go to (-1: none)
  std::map<int, Replica> replicas_;      ///< the shards this rank is the backup of
  static constexpr uint32_t kReplicaApply = 0;
  static constexpr uint32_t kReplicaWhole = 1;
  static constexpr uint32_t kHandOver = 2;  ///< as kReplicaWhole, to serve: a join gave the shard back
  static constexpr uint32_t kCopyRequest = 3;
  static constexpr uint32_t kCopy = 4;
  /// A joiner, under mutex_: the shards it owns but holds nothing of, each
  /// with the copies of it that came, by rank.
  struct Copy {
    std::vector<float> values;
    int64_t version = 0;
    bool served = false;  ///< its sender serves the shard: a hand-over comes
  };
  std::map<int, std::map<int, Copy>> copies_;
  std::set<int> from_copies_;  ///< a joiner, under mutex_: shards served from a copy (a hand-over replaces them)

  /// In a delta's dtype field: the sender's last round, answered without the shard.
  static constexpr uint32_t kLastRound = 0x100;
  /// A delta's bytes before its floats: shard, dtype, base version.
  static constexpr size_t kDeltaHeader = 16;
  /// --deterministic, with kLastRound: no delta, the sender has finished (its owners stop waiting for it).
  static constexpr uint32_t kFinished = 0x200;

  /// --deterministic: a contribution held until its round is whole.
  struct Held {
    int64_t base_version = 0;
    uint32_t dtype = 0;
    bool last = false;
    std::vector<std::byte> encoded;  ///< for the backup
    std::vector<float> delta;
  };
  struct Round {
    std::map<int, Held> from;  ///< by rank: rank order is the order of application
    int finished_in = 0;       ///< of those ranks, how many finished (finished_)
  };
  std::map<int, Round> rounds_;  ///< under mutex_: each shard's round being collected
  /// Under mutex_: this owner's replies held for their round (--reply-hold
  /// round; not with --deterministic, whose owners answer whole rounds anyway).
  /// At most 2H of the owner's steps: ranks of equal speed drift some steps
  /// apart, and a bound of H cut rounds short on 3 local workers
  /// and kept none of the accuracy (bench/RESULTS.md); 2H leaves a round for
  /// the link and still bounds what a slow peer costs the others.
  ReplyHold hold_{shards_, comm_.size(), 2 * settings_.sync_interval,
                  settings_.hold_replies && !settings_.deterministic};
  std::vector<bool> finished_ = std::vector<bool>(static_cast<size_t>(comm_.size()), false);  ///< under mutex_
  int finished_count_ = 0;      ///< under mutex_: of finished_
  int64_t round_done_at_ = -1;  ///< --deterministic: the step of the last round whose replies are all in

  tensor::FloatBuffer snapshot_;
  std::vector<int64_t> sent_at_ =
      std::vector<int64_t>(static_cast<size_t>(shards_), -1);  ///< step of each shard's last send
  std::vector<int> owners_;                                    ///< send_round's: each shard's owner now
  tensor::FloatBuffer delta_;
  tensor::FloatBuffer full_delta_;  ///< for the delta sink
  int64_t last_step_ = 0;
  tensor::FloatBuffer incoming_;          ///< progress thread
  tensor::FloatBuffer replica_incoming_;  ///< progress thread
};

}  // namespace

Result<std::unique_ptr<Mode>> make_cfmo(const ModeContext& c) {
  return std::unique_ptr<Mode>(std::make_unique<CfmoMode>(c.settings, c.comm, c.initial, c.resume));
}

}  // namespace cfmo::train::modes
