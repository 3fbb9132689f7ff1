#pragma once
/// What the asynchronous modes (cfmo, asgd) share: the parameter vector cut
/// into W shards, rank j the owner of shard j of the global parameters; the
/// budget keeper (rank 0, fed every step's position); the inbox of fresh
/// shards the owners send back; snapshots of the global state for
/// checkpoints; and the end-of-run handshake that gathers the owners' shards
/// on rank 0.
///
/// Threads: the training thread calls the Mode methods; the communicator's
/// progress thread runs the message handlers, which act as the owner. mutex_
/// guards what both touch.
///
/// Messages (train/modes/wire.h encodes them):
///   kFreshShard  [u32 shard][u32 flags: 1 dropped][i64 version][i64 staleness][floats of the shard, or none]
///   kProgress    [position]                         every step, to rank 0
///   kStop        []                                 rank 0: the budget is spent
///   kDone        []                                 this rank has finished
///   kGather      [position][owner shard]            at the end, to rank 0
///   kCheckpoint  [u32 0: request][u64 id]           rank 0 to the owners
///                [u32 1: shard][u64 id][owner shard] an owner's answer
/// where an owner shard is [u32 shard][i64 version][i64 owner steps]
/// [u32 buffers][u64 n][n floats: params][u64 n][n floats: owner state]...

#include "train/modes.h"
#include "train/modes/timing.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace cfmo::modes {

class AsyncMode : public Mode {
 public:
  /// What an owner's state buffers are in a snapshot: the outer momentum
  /// (cfmo) or the shard optimizer's state (asgd).
  enum class OwnerState : uint8_t { kOuterMomentum, kOptimizer };

  AsyncMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial, const ModeResume& resume,
            OwnerState owner_state_kind);
  ~AsyncMode() override;

  bool stop_requested() const override { return stop_.load(); }
  bool params_are_global() const override { return false; }
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
    return rank >= 0 && rank < comm_.size() ? reconciled_samples_[static_cast<size_t>(rank)] : 0;
  }
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

  /// Owner side: the reply carrying this shard as it is now (or, `with_shard`
  /// false, only its version: an acknowledgement).
  void reply_fresh(int to, int64_t staleness, bool dropped, bool with_shard = true);

  /// The owner's staleness of a contribution based on `base_version`, in rounds of W.
  int64_t staleness_of(int64_t base_version) const {
    return std::max<int64_t>(0, version_ - base_version) / comm_.size();
  }

  void record_staleness(int64_t s, bool dropped) {
    std::lock_guard lock(mutex_);
    const size_t bucket = std::min(static_cast<size_t>(std::max<int64_t>(0, s)), stats_.staleness_histogram.size() - 1);
    ++stats_.staleness_histogram[bucket];
    if (dropped) ++stats_.contributions_dropped;
  }

  /// Rank 0 as an owner, under mutex_: a contribution of `from` arrived. Its
  /// position then is its last progress report: sent before the contribution
  /// on the same link (cfmo), or with the step before (asgd).
  void note_reconciled(int from) {
    if (comm_.rank() != 0) return;
    const auto r = static_cast<size_t>(from);
    reconciled_samples_[r] = progress_[r].samples - start_samples_[r];
  }

  /// True while fresh shards wait to be applied.
  bool inbox_pending() const {
    std::lock_guard lock(mutex_);
    return !inbox_.empty();
  }

  /// Takes the fresh shards that arrived; the caller applies them.
  std::deque<FreshShard> take_inbox() {
    std::lock_guard lock(mutex_);
    std::deque<FreshShard> out;
    out.swap(inbox_);
    return out;
  }

  /// Replies still owed by owners that are alive.
  int outstanding() const;

  /// Every step: rank 0 keeps the budget and the positions a checkpoint records.
  void report_progress(const TrainPosition& position);

  /// Waits (draining the inbox through `apply`) until no reply is owed or the deadline passes.
  template <typename Apply>
  void drain_replies(Clock::time_point deadline, Apply&& apply) {
    while (outstanding() > 0 && Clock::now() < deadline) {
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

  /// The end: tell everyone this rank is done, serve owners' work until every
  /// live rank is done too, then gather the owned shards (and the owners'
  /// state, and each rank's last position) on rank 0.
  Status end_handshake(std::span<float> params);

  /// For the derived constructors, last, and destructors, first: the handler
  /// that calls owner_state() may run only while the derived members it reads
  /// exist (a request that comes before waits, unread, for the handler).
  void start_serving_owner_state();
  void stop_serving_owner_state();

  /// Owner side, under mutex_: the state of the outer or shard optimizer for
  /// my shard, each buffer the shard's size (cfmo: the outer momentum, if any;
  /// asgd: the optimizer's state), and its optimizer's steps.
  virtual std::vector<std::span<const float>> owner_state() const { return {}; }
  virtual int64_t owner_steps() const { return 0; }

  const ModeSettings settings_;
  Communicator& comm_;
  const std::vector<size_t> bounds_;

  // Worker side (training thread).
  FloatBuffer base_;                   ///< the global parameters as last received, per shard
  std::vector<int64_t> base_version_;  ///< their versions
  FloatBuffer residual_;               ///< error feedback for lossy wire dtypes
  std::vector<int> awaiting_ = std::vector<int>(static_cast<size_t>(comm_.size()), 0);
  TrainPosition position_;  ///< as last reported

  // Owner side (progress thread, except where mutex_ says otherwise).
  FloatBuffer owned_;    ///< my shard of the global parameters
  int64_t version_ = 0;  ///< contributions applied to it

  /// Guards inbox_, stats_, done_from_, progress_, the snapshots, and the
  /// owner's state whenever another thread reads it.
  mutable std::mutex mutex_;
  std::deque<FreshShard> inbox_;
  ModeStats stats_;

 private:
  static constexpr uint32_t kSnapshotRequest = 0;
  static constexpr uint32_t kSnapshotShard = 1;

  /// A global state being put together from the owners' shards.
  struct PartialGlobalState {
    PartialGlobalState() = default;
    explicit PartialGlobalState(int world) : received(static_cast<size_t>(world), false) {
      state.ranks.resize(static_cast<size_t>(world));
      state.versions.assign(static_cast<size_t>(world), 0);
      state.owner_steps.assign(static_cast<size_t>(world), 0);
    }
    GlobalState state;
    std::vector<bool> received;
    int count = 0;
  };

  /// True when every live rank has its flag in `flags` (guarded by mutex_) set.
  bool all_live(const std::vector<bool>& flags) const;
  void put_owner_shard(std::vector<std::byte>& out);
  bool take_owner_shard(int from, std::span<const std::byte>& m, PartialGlobalState& a);
  void on_fresh(int from, std::span<const std::byte> m);
  void on_progress(int from, std::span<const std::byte> m);
  void on_gather(int from, std::span<const std::byte> m);
  void on_checkpoint(int from, std::span<const std::byte> m);

  const OwnerState owner_state_kind_;
  std::atomic<bool> stop_{false};
  std::vector<bool> done_from_;
  std::vector<TrainPosition> progress_;      ///< rank 0: each rank's last reported position
  std::vector<int64_t> start_samples_;       ///< rank 0: each rank's samples when this run started
  std::vector<int64_t> reconciled_samples_;  ///< rank 0: see reconciled_samples()
  bool stop_sent_ = false;                   ///< rank 0, progress thread
  uint64_t snapshot_id_ = 0;                 ///< rank 0: the request being answered
  Clock::time_point snapshot_asked_;         ///< rank 0: when it was sent
  PartialGlobalState snapshot_;              ///< rank 0: its answers so far
  std::optional<GlobalState> ready_;         ///< rank 0: the last complete snapshot, until taken
  PartialGlobalState gather_;                ///< rank 0: the end's gather
  std::optional<GlobalState> final_;         ///< rank 0: the end's state, until taken
};

}  // namespace cfmo::modes
