#pragma once
/// What the asynchronous modes (cfmo, asgd) share: the parameter vector cut
/// into K shards (owner_count, --owners: K <= W), shard j of the global
/// parameters served by its owner; the
/// budget keeper (the lowest live rank, fed every step's position, with the
/// next live rank as its standby); the inbox of fresh shards the owners send
/// back; snapshots of the global state for checkpoints; and the end-of-run
/// handshake that gathers the owners' shards on the keeper.
///
/// Joins at the end: the keeper takes a joiner in by answering its request
/// for the global state before the keeper's own end begins (end_handshake);
/// a joiner that asks later is told the run ended (as localsgd's group does
/// once closed): it trains nothing, yet hands the keeper in the end's gather
/// what it serves (a lost owner's shard handed to it as it came), and the
/// keeper waits for no report or last state of it (members()).
///
/// Ownership: shard j's owner is rank j while it lives (ranks K and up serve
/// nothing, unless they take a shard over). In a replicated mode
/// (cfmo) each owner keeps one other rank, its shard's backup (the next live
/// rank after it), up to date with every contribution it applies, so that a
/// lost owner's shard moves to its backup with every applied delta in it:
/// the owner of shard j is then the first live rank from j on (j, j + 1, ...
/// cyclically over all W ranks). Every survivor computes the same ownership from the same set
/// of lost ranks, so no agreement protocol is needed. Without replication
/// (asgd) a lost owner's shard is served by nobody.
///
/// Threads: the training thread calls the Mode methods; the communicator's
/// progress thread runs the message handlers, which act as the owner. mutex_
/// guards what both touch.
///
/// Messages (train/modes/wire.h encodes them):
///   kFreshShard  [u32 shard][u32 flags: 1 dropped][i64 version][i64 staleness][floats of the shard, or none]
///   kProgress    [position]                         every step, to the keeper and its standby
///   kSampleCounts [u64 n][n i64 retired][n i64 start][n i64 reconciled]
///                                                   the keeper to its standby: when it changes, and each second
///   kStop        []                                 the keeper: the budget is spent
///   kDone        []                                 this rank has finished: to the keeper
///                [u8 1]                             the keeper: every live rank has finished
///   kGather      [position][u32 n][n owner shards]  at the end, to the keeper
///   kGathered    []                                 the keeper holds every shard
///   kCheckpoint  [u32 0: request][u64 id]           the keeper to the owners
///                [u32 2: a join's request][u64 id]  a joiner to every rank: as a request; the
///                                                   keeper takes it in, or says the run ended
///                [u32 1: shards][u64 id][u8 has position][position if has][u32 n][n owner shards]
///                                                   an owner's answer (the position: the asker's
///                                                   last, where this rank keeps positions)
///                [u32 3: run ended][u64 id][u8 has position][position if has][u8 hand in]
///                                                   the keeper to a joiner it had not taken in
///                                                   when its end began: the run ended (hand in:
///                                                   the gather waits for a shard it serves)
/// where an owner shard is [u32 shard][i64 version][i64 owner steps]
/// [u32 buffers][u64 n][n floats: params][u64 n][n floats: owner state]...
/// (cfmo: owner steps are the pending round's contributions, the state the
/// outer momentum then the round's sum; asgd: the optimizer's steps and state)

#include "train/modes.h"
#include "train/modes/timing.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace cfmo::train::modes {

class AsyncMode : public Mode {
 public:
  /// What an owner's state buffers are in a snapshot: the outer momentum and
  /// the pending round's sum, with the round's contributions so far as its
  /// steps (cfmo), or the shard optimizer's state and steps (asgd).
  enum class OwnerState : uint8_t { kOuterMomentum, kOptimizer };

  AsyncMode(const ModeSettings& settings, comm::Communicator& comm, std::span<const float> initial,
            const ModeResume& resume, OwnerState owner_state_kind, bool replicated);
  ~AsyncMode() override;

  bool stop_requested() const override { return stop_.load(); }
  bool params_are_global() const override { return false; }
  std::span<const float> wire_residual() const override { return residual_; }
  ModeStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  bool request_snapshot() override;
  std::optional<GlobalState> take_snapshot() override {
    std::lock_guard lock(mutex_);
    std::optional<GlobalState> out;
    out.swap(ready_);
    return out;
  }
  int64_t reconciled_samples(int rank) const override {
    std::lock_guard lock(mutex_);
    return rank >= 0 && static_cast<size_t>(rank) < reconciled_samples_.size()
               ? reconciled_samples_[static_cast<size_t>(rank)]
               : 0;
  }
  int64_t retired_samples(int rank) const override {
    std::lock_guard lock(mutex_);
    const auto r = static_cast<size_t>(rank);
    return rank >= 0 && r < retired_samples_.size() ? retired_samples_[r] : 0;
  }
  int keeper() const override;
  /// The keeper, once a joiner was told the run ended: every rank but those
  /// (nothing of theirs to wait for at the end); else empty: every rank.
  std::vector<int> members() const override;
  /// K: the shards, and the ranks 0..K-1 that own them.
  int shards() const { return shards_; }
  bool survives_losses() const override { return true; }
  int shard_served_by(int rank) const override;
  std::optional<GlobalState> final_state() override {
    std::lock_guard lock(mutex_);
    std::optional<GlobalState> out;
    out.swap(final_);
    return out;
  }

 protected:
  struct FreshShard {
    int shard = 0;
    int64_t version = 0;
    int64_t staleness = 0;
    bool dropped = false;
    std::vector<float> values;
  };

  std::span<float> shard_of(std::span<float> v, int j) const {
    return v.subspan(bounds_[static_cast<size_t>(j)],
                     bounds_[static_cast<size_t>(j) + 1] - bounds_[static_cast<size_t>(j)]);
  }
  size_t shard_size(int j) const { return bounds_[static_cast<size_t>(j) + 1] - bounds_[static_cast<size_t>(j)]; }

  /// An owner's state of a shard it serves: the shard's values and the
  /// contributions applied to them.
  struct Served {
    tensor::FloatBuffer values;
    int64_t version = 0;
  };

  /// Owner side, under mutex_: the reply carrying `shard` as it is now (or,
  /// `with_shard` false, only its version: an acknowledgement; also the answer
  /// for a shard this rank does not serve).
  void reply_fresh_locked(int to, int shard, int64_t staleness, bool dropped, bool with_shard = true);

  /// The staleness of a contribution to `served` based on `base_version`, in
  /// rounds of W (of the whole world even after losses: the versions a
  /// contribution of a fresh worker can miss grow with W, a round's own and
  /// the previous round's after its reply).
  int64_t staleness_of(const Served& served, int64_t base_version) const {
    return std::max<int64_t>(0, served.version - base_version) / comm_.size();
  }
  /// W_live: the ranks alive as refresh_membership last saw them. After a
  /// loss the survivors' contributions weigh 1 / W_live, so that a round of
  /// them still moves the global parameters by their mean.
  int live() const { return live_.load(); }

  /// Under mutex_: whether `rank` is lost as this rank last saw it (refresh_membership).
  bool lost_locked(int rank) const { return lost_[static_cast<size_t>(rank)]; }
  /// Under mutex_: the ranks of the world as refresh_membership last saw it
  /// (it grows with a join when none was lost; the transport's size() may be
  /// ahead of it for a moment, and a rank this mode does not know yet has no
  /// place in its tables).
  int world_locked() const { return static_cast<int>(lost_.size()); }
  /// Under mutex_: the rank serving `shard` now, -1 if none (see the top of this file).
  int owner_of_locked(int shard) const;
  /// Under mutex_: the rank keeping `shard`'s replica for its owner, -1 if none.
  int backup_of_locked(int shard) const;
  /// Under mutex_: the lowest live rank, and the one after it (-1 if none).
  int keeper_locked() const;
  int standby_locked() const;

  /// Takes up the ranks the transport found lost, and those a new process
  /// joined (in a lost rank's place, or a new rank: the world grew), since
  /// the last call; on a change calls
  /// on_membership_change_locked (both threads call it, at each step and with
  /// each contribution).
  void refresh_membership();
  /// Under mutex_, after `newly_lost` were lost and `rejoined` came back (a
  /// new process in their place, which starts with nothing): a replicated
  /// mode moves the shards (hands each to its owner now, promotes its
  /// replicas, refreshes its backups).
  virtual void on_membership_change_locked(const std::vector<int>& /*newly_lost*/,
                                           const std::vector<int>& /*rejoined*/) {}

  /// A joining rank (Mode::join): asks every live rank for the shards it
  /// serves, again every half second until every shard is in (its own too,
  /// handed over by the rank that served it meanwhile), then takes them as
  /// its parameters and base, and its place's last position as the keeper
  /// knew it. kRunEnded when the keeper's end had begun before it took this
  /// rank in: then this rank has taken part in the end's handshake (it
  /// trains nothing, but hands the keeper what it serves) and `position` is
  /// its place's last as the keeper knew it.
  Result<Joined> take_global_state(std::span<float> params, TrainPosition& position);
  /// The error this rank ends with when a loss left it on the losing side
  /// (train/modes/quorum.h): then it must not go on; ok otherwise.
  Status cut_off() const;

  void record_staleness(int64_t s, bool dropped) {
    std::lock_guard lock(mutex_);
    const size_t bucket = std::min(static_cast<size_t>(std::max<int64_t>(0, s)), stats_.staleness_histogram.size() - 1);
    ++stats_.staleness_histogram[bucket];
    if (dropped) ++stats_.contributions_dropped;
  }

  /// An owner, under mutex_: a contribution of `from` arrived. Its position
  /// then is its last progress report, where this rank receives them (the
  /// keeper and its standby): sent before the contribution on the same link
  /// (cfmo), or with the step before (asgd).
  void note_reconciled(int from) {
    const auto r = static_cast<size_t>(from);
    if (r >= progress_.size())
      return;  // not the keeper nor its standby (no positions kept here), or a rank unknown yet
    reconciled_samples_[r] = std::max(reconciled_samples_[r], progress_[r].samples - start_samples(from));
  }

  /// True while fresh shards wait to be applied.
  bool inbox_pending() const {
    std::lock_guard lock(mutex_);
    return !inbox_.empty();
  }

  /// Takes the fresh shards that arrived; the caller applies them. (A vector:
  /// an empty deque allocates, and this is called at every step and poll.)
  std::vector<FreshShard> take_inbox() {
    std::lock_guard lock(mutex_);
    std::vector<FreshShard> out;
    out.swap(inbox_);
    return out;
  }

  /// Replies still owed by owners that are alive.
  int outstanding() const;

  /// Worker side: a contribution to `shard` went to `owner`, or its reply came
  /// (or, `forget`, the owner was lost: its replies never come). The total
  /// they keep makes outstanding() O(1) while no rank is lost.
  void await_reply(int shard, int owner) {
    ++awaiting_[static_cast<size_t>(shard)];
    awaiting_owner_[static_cast<size_t>(shard)] = owner;
    ++awaiting_total_;
  }
  void reply_came(int shard) {
    int& waiting = awaiting_[static_cast<size_t>(shard)];
    if (waiting == 0) return;
    --waiting;
    --awaiting_total_;
  }
  void forget_replies(int shard) {
    awaiting_total_ -= awaiting_[static_cast<size_t>(shard)];
    awaiting_[static_cast<size_t>(shard)] = 0;
  }

  /// Every step: the keeper keeps the budget and the positions a checkpoint
  /// records; its standby keeps them too, to take over.
  void report_progress(const TrainPosition& position);

  /// Waits (draining the inbox through `apply`, and doing while_ending's
  /// duties with `params`) until no reply is owed or the deadline passes.
  template <typename Apply>
  void drain_replies(Clock::time_point deadline, std::span<const float> params, Apply&& apply) {
    while (outstanding() > 0 && Clock::now() < deadline) {
      while_ending(params);
      auto fresh = take_inbox();
      if (fresh.empty()) {
        seam_sleep_for(std::chrono::microseconds(200));
        continue;
      }
      for (auto& f : fresh) apply(f);
    }
  }

  /// Adds the time since `start` to finish_wait_s.
  void count_finish_wait(Clock::time_point start) {
    std::lock_guard lock(mutex_);
    stats_.finish_wait_s += seconds_since(start);
  }

  /// The training thread, while this rank ends (finish's drain, and each
  /// wait of end_handshake), with this rank's parameters: what its steps
  /// did for the others and a rank that joins as the run ends still needs
  /// (asgd: this rank's copy of a joined owner's shard). Nothing by default.
  virtual void while_ending(std::span<const float> /*params*/) {}

  /// The end: tell everyone this rank is done, serve owners' work until every
  /// live rank is done too, then gather the owned shards (and the owners'
  /// state, and each rank's last position) on the keeper; a rank leaves once
  /// the keeper holds them all (or the keeper moved and holds them then).
  Status end_handshake(std::span<float> params);

  /// For the derived constructors, last, and destructors, first: the handler
  /// that calls owner_state() may run only while the derived members it reads
  /// exist (a request that comes before waits, unread, for the handler).
  void start_serving_owner_state();
  void stop_serving_owner_state();

  /// Owner side, under mutex_: the state of the outer or shard optimizer for
  /// `shard`, which this rank serves, each buffer the shard's size (cfmo: the
  /// outer momentum, if any; asgd: the optimizer's state), and its optimizer's steps.
  virtual std::vector<std::span<const float>> owner_state(int /*shard*/) const { return {}; }
  virtual int64_t owner_steps(int /*shard*/) const { return 0; }

  const ModeSettings settings_;
  comm::Communicator& comm_;
  const int shards_;  ///< K
  const std::vector<size_t> bounds_;

  // Worker side (training thread).
  tensor::FloatBuffer base_;           ///< the global parameters as last received, per shard
  std::vector<int64_t> base_version_;  ///< their versions, per shard
  tensor::FloatBuffer residual_;       ///< error feedback for lossy wire dtypes
  std::vector<int> awaiting_ = std::vector<int>(static_cast<size_t>(shards_), 0);  ///< per shard
  int awaiting_total_ = 0;                                                         ///< their sum
  TrainPosition position_;                                                         ///< as last reported

  // Worker side (training thread): the owner each shard's awaited replies come from.
  std::vector<int> awaiting_owner_ = std::vector<int>(static_cast<size_t>(shards_), -1);

  // Owner side, under mutex_.
  std::map<int, Served> served_;  ///< the shards this rank serves: its own, and those it took over
  const bool replicated_;         ///< a lost owner's shard moves to its backup
  bool joining_ = false;          ///< a joiner until take_global_state has the global state (under mutex_)

  /// Guards inbox_, stats_, done_from_, progress_, the snapshots, the
  /// membership, and the owners' state.
  mutable std::mutex mutex_;
  std::vector<FreshShard> inbox_;
  ModeStats stats_;

 private:
  static constexpr uint32_t kSnapshotRequest = 0;
  static constexpr uint32_t kSnapshotShard = 1;
  static constexpr uint32_t kJoinRequest = 2;
  static constexpr uint32_t kRunEnded = 3;

  /// A global state being put together from the owners' shards.
  struct PartialGlobalState {
    PartialGlobalState() = default;
    PartialGlobalState(int shards, int world) : received(static_cast<size_t>(shards), false) {
      state.ranks.resize(static_cast<size_t>(world));
      state.versions.assign(static_cast<size_t>(shards), 0);
      // Per rank, as a checkpoint records them: rank j < K owns shard j, the others none (0).
      state.owner_steps.assign(static_cast<size_t>(world), 0);
    }
    GlobalState state;
    std::vector<bool> received;
    int count = 0;
  };

  /// A flag per rank and how many are set.
  struct RankFlags {
    explicit RankFlags(int world) : set(static_cast<size_t>(world), false) {}
    void mark(int rank) {
      if (set[static_cast<size_t>(rank)]) return;
      set[static_cast<size_t>(rank)] = true;
      ++count;
    }
    void grow(int world) {
      if (static_cast<size_t>(world) > set.size()) set.resize(static_cast<size_t>(world), false);
    }
    void unmark(int rank) {
      if (!set[static_cast<size_t>(rank)]) return;
      set[static_cast<size_t>(rank)] = false;
      --count;
    }
    bool operator[](int rank) const { return set[static_cast<size_t>(rank)]; }
    std::vector<bool> set;
    int count = 0;
  };

  /// Under mutex_: the per-rank tables grow to `world` ranks (a new rank, which starts alive).
  void grow_locked(int world);
  /// True when every live rank has its flag in `flags` (guarded by mutex_)
  /// set: O(lost ranks), not O(W), for it is polled.
  bool all_live(const RankFlags& flags) const;
  /// The samples `rank` had when this run started (0 unless resumed).
  int64_t start_samples(int rank) const {
    return start_samples_.empty() ? 0 : start_samples_[static_cast<size_t>(rank)];
  }
  /// Under mutex_: progress_ and reconciled_samples_, made on first use (the
  /// keeper and its standby only: every rank keeping W positions would make
  /// the run's memory grow as W^2).
  void keep_positions_locked();
  /// Under mutex_: gather_, made on first use (the keeper).
  PartialGlobalState& gather_locked();
  /// The end's first half: tell the keeper this rank is done (again when the
  /// keeper moves); the keeper tells every rank once all live ranks are.
  void wait_until_all_done(Clock::time_point deadline, std::span<const float> params);
  /// A snapshot request to every rank, numbered anew (the keeper's checkpoints, a joiner's state), or
  /// `again`: the request being answered, posted once more, the shards in so far kept (a joiner's).
  /// `kind`: kSnapshotRequest, or a joiner's kJoinRequest.
  void post_snapshot_request(bool again = false, uint32_t kind = kSnapshotRequest);
  /// The keeper, under mutex_: whether a joiner's request from `from` comes
  /// too late (the keeper's end began before it took that rank in).
  bool turn_away_locked(int from);
  /// The keeper, under mutex_, turning `from` away: whether the end's gather
  /// waits for a shard it serves (a lost owner's, handed to it); if not, it
  /// counts as done and gathered.
  bool hands_in_locked(int from);
  /// Under mutex_: [u32 n][n owner shards], those this rank serves.
  void put_owner_shards_locked(std::vector<std::byte>& out);
  /// Under mutex_: owner shards into `a`; false when malformed.
  bool take_owner_shards(std::span<const std::byte>& m, PartialGlobalState& a);
  bool take_owner_shard(std::span<const std::byte>& m, PartialGlobalState& a);
  /// The keeper's end: whether every shard and every live rank's position is in.
  bool gather_complete();
  void on_fresh(int from, std::span<const std::byte> m);
  void on_progress(int from, std::span<const std::byte> m);
  /// The keeper: its sample counts to `standby` when it is new, or a second after the last ones.
  void send_sample_counts(int standby);
  /// The standby: the keeper's counts replace its own, which miss what came before it stood by.
  void on_sample_counts(std::span<const std::byte> m);
  void on_gather(int from, std::span<const std::byte> m);
  void on_checkpoint(int from, std::span<const std::byte> m);

  const OwnerState owner_state_kind_;
  std::atomic<bool> stop_{false};
  RankFlags done_from_;                      ///< the keeper (and a rank that may become it): who said done
  std::atomic<bool> all_done_{false};        ///< the keeper said every live rank is done
  std::vector<bool> lost_;                   ///< the lost ranks as refresh_membership last saw them
  size_t joins_seen_ = 0;                    ///< of comm_.joined_ranks(), taken up by refresh_membership
  std::vector<int> last_lost_;               ///< comm_.lost_ranks() as refresh_membership last saw it
  std::vector<int64_t> retired_samples_;     ///< see retired_samples(); none until a join
  TrainPosition join_position_;              ///< a joiner: its place's last position, from the owners' answers
  bool keeper_answered_ = false;             ///< a joiner: the keeper's answer (with the position it knew) is in
  Error cut_off_{ErrorKind::kPeer, {}};      ///< see cut_off(); empty message: not cut off
  size_t lost_count_ = 0;                    ///< how many
  std::atomic<int> live_{comm_.size()};      ///< see live()
  std::vector<TrainPosition> progress_;      ///< keeper and standby: each rank's last reported position (else empty)
  int64_t progress_samples_ = 0;             ///< the sum of progress_'s samples, kept as they come: the budget
  std::vector<int64_t> start_samples_;       ///< resumed: each rank's samples when this run started (else empty)
  std::vector<int64_t> reconciled_samples_;  ///< keeper and standby: see reconciled_samples()
  int counts_sent_to_ = -1;                  ///< the keeper: the standby its sample counts last went to
  bool was_standby_ = false;                 ///< (the training thread) this rank was, at its last report_progress
  int last_keeper_ = -1;                     ///< (the training thread) the keeper then
  Clock::time_point counts_sent_at_;         ///< and when
  bool stop_sent_ = false;                   ///< the keeper
  uint64_t snapshot_id_ = 0;                 ///< the keeper: the request being answered
  Clock::time_point snapshot_asked_;         ///< the keeper: when it was sent
  PartialGlobalState snapshot_;              ///< the keeper: its answers so far
  std::optional<GlobalState> ready_;         ///< the keeper: the last complete snapshot, until taken
  PartialGlobalState gather_;                ///< the keeper: the end's gather, by shard
  RankFlags gathered_from_;                  ///< the keeper: the ranks whose end position is in
  std::atomic<bool> gathered_{false};        ///< the keeper said it holds every shard
  std::atomic<int> gathered_by_{-1};         ///< and which rank that was
  std::optional<GlobalState> final_;         ///< the keeper: the end's state, until taken
  bool joins_closed_ = false;                ///< the keeper: its end began, it takes no joiner in
  /// Joiners not taken in: not yet answered by this rank as the keeper, or
  /// told the run ended (every rank keeps it, its standby too: one whose
  /// progress comes trains, and leaves it).
  std::vector<int> unadmitted_;
  std::atomic<bool> run_ended_{false};  ///< a joiner: the keeper said the run ended
  std::atomic<bool> hand_in_{false};    ///< and that its gather waits for a shard this rank serves
};

}  // namespace cfmo::train::modes
