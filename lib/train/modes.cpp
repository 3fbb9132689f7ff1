#include "train/modes.h"

#include "tensor/ops.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

namespace cfmo {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }
Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// resize + memcpy rather than insert: GCC 12 warns falsely (-Wstringop-overflow)
// about inserting into an empty vector.
void put_bytes(std::vector<std::byte>& out, const void* data, size_t size) {
  const size_t at = out.size();
  out.resize(at + size);
  if (size > 0) std::memcpy(out.data() + at, data, size);
}

template <typename T>
void put(std::vector<std::byte>& out, const T& value) {
  put_bytes(out, &value, sizeof(T));
}

template <typename T>
bool take(std::span<const std::byte>& in, T& value) {
  if (in.size() < sizeof(T)) return false;
  std::memcpy(&value, in.data(), sizeof(T));
  in = in.subspan(sizeof(T));
  return true;
}

void put_floats(std::vector<std::byte>& out, std::span<const float> values) {
  put_bytes(out, values.data(), values.size_bytes());
}

/// A lockstep stop vote, carried by a collective as two counts:
/// workers that want to stop for a time limit, and for an interrupt.
struct StopVote {
  bool time_limit = false;
  bool interrupt = false;
  bool agreed = false;
  std::string reason;

  void want(std::string_view why) { (why == "interrupt" ? interrupt : time_limit) = true; }
  void write(float* slots) const {
    slots[0] = time_limit ? 1.0f : 0.0f;
    slots[1] = interrupt ? 1.0f : 0.0f;
  }
  void read(const float* summed) {
    if (summed[0] > 0 || summed[1] > 0) {
      agreed = true;
      reason = summed[1] > 0 ? "interrupt" : "time-limit";
    }
  }
};

class SoloMode final : public Mode {
 public:
  explicit SoloMode(std::string name) : name_(std::move(name)) {}
  std::string_view name() const override { return name_; }

 private:
  std::string name_;
};

/// Every step: gradients weighted by their example counts, summed by a ring
/// all-reduce, divided by the total: the same update as one worker with the
/// union of the batches.
class SyncMode final : public Mode {
 public:
  explicit SyncMode(Communicator& comm) : comm_(comm) {}
  std::string_view name() const override { return "sync"; }

  bool lockstep() const override { return true; }
  void want_stop(std::string_view reason) override { vote_.want(reason); }
  bool stop_requested() const override { return vote_.agreed; }
  std::string agreed_reason() const override { return vote_.reason; }

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
  StopVote vote_;
  DeviceReduce device_reduce_;
};

/// Local SGD / DiLoCo: H local steps, then a blocking all-reduce of the deltas
/// against the shared global parameters and an outer step.
class LocalSgdMode final : public Mode {
 public:
  LocalSgdMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial,
               const ModeResume& resume)
      : settings_(settings), comm_(comm), global_(initial.begin(), initial.end()), outer_(settings, initial.size(), 1) {
    if (resume.outer_momentum.size() == outer_.momentum().size()) {
      std::copy(resume.outer_momentum.begin(), resume.outer_momentum.end(), outer_.momentum().begin());
    }
  }
  std::string_view name() const override { return "localsgd"; }
  bool lockstep() const override { return true; }
  void want_stop(std::string_view reason) override { vote_.want(reason); }
  bool stop_requested() const override { return vote_.agreed; }
  std::string agreed_reason() const override { return vote_.reason; }

  bool needs_params(const TrainPosition& position) const override {
    return position.step % settings_.sync_interval == 0;
  }
  Status after_step(const TrainPosition& position, std::span<float> params, Optimizer&) override {
    last_step_ = position.step;
    since_sync_ = position.step % settings_.sync_interval;
    if (since_sync_ != 0) return {};
    return reconcile(params);
  }
  bool params_are_global() const override { return since_sync_ == 0; }
  std::span<const float> outer_momentum() const override { return outer_.momentum(); }
  Status finish(std::span<float> params, Optimizer&) override {
    // Every rank took the same number of steps, so all agree whether one more round is due.
    return since_sync_ != 0 ? reconcile(params) : Status{};
  }
  ModeStats stats() const override { return stats_; }

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
    Status status = comm_.all_reduce_sum(delta_);
    stats_.wait_s += seconds_since(start);
    CFMO_TRY(status);
    vote_.read(delta_.data() + params.size());
    outer_.apply(global_, std::span<const float>(delta_).first(params.size()), 1.0f / static_cast<float>(comm_.size()));
    std::copy(global_.begin(), global_.end(), params.begin());
    ++stats_.rounds;
    since_sync_ = 0;
    return {};
  }

  ModeSettings settings_;
  Communicator& comm_;
  FloatBuffer global_;
  OuterOptimizer outer_;
  FloatBuffer delta_;
  int64_t since_sync_ = 0;
  int64_t last_step_ = 0;
  ModeStats stats_;
  StopVote vote_;
};

void put_position(std::vector<std::byte>& out, const TrainPosition& p) {
  put(out, p.step);
  put(out, p.epoch);
  put(out, p.batch_in_epoch);
  put(out, p.samples);
  put(out, p.train_s);
}

bool take_position(std::span<const std::byte>& in, TrainPosition& p) {
  return take(in, p.step) && take(in, p.epoch) && take(in, p.batch_in_epoch) && take(in, p.samples) &&
         take(in, p.train_s);
}

/// [u64 count][count floats]
void put_vector(std::vector<std::byte>& out, std::span<const float> values) {
  put(out, static_cast<uint64_t>(values.size()));
  put_floats(out, values);
}

bool take_vector(std::span<const std::byte>& in, std::vector<float>& values) {
  uint64_t n = 0;
  if (!take(in, n) || n > in.size() / sizeof(float)) return false;
  values.resize(n);
  std::memcpy(values.data(), in.data(), n * sizeof(float));
  in = in.subspan(n * sizeof(float));
  return true;
}

/// What cfmo and asgd share: shard ownership, the budget keeper, the inbox of
/// fresh shards, snapshots of the global state for checkpoints and the
/// end-of-run handshake.
class AsyncMode : public Mode {
 public:
  AsyncMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial, const ModeResume& resume)
      : settings_(settings),
        comm_(comm),
        bounds_(shard_bounds(initial.size(), comm.size())),
        base_(initial.begin(), initial.end()),
        base_version_(static_cast<size_t>(comm.size()), 0),
        residual_(settings.delta_dtype == WireDtype::kFp32 ? 0 : initial.size(), 0.0f),
        done_from_(static_cast<size_t>(comm.size()), false),
        progress_(static_cast<size_t>(comm.size())) {
    const int me = comm.rank();
    owned_.assign(initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me)]),
                  initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me) + 1]));
    if (resume.ranks.size() == progress_.size()) progress_ = resume.ranks;
    for (const auto& p : progress_) start_samples_.push_back(p.samples);
    reconciled_samples_.assign(progress_.size(), 0);
    gather_ = Assembly(comm.size());
    stats_.staleness_histogram.assign(static_cast<size_t>(settings.max_staleness) + 2, 0);
    comm.on_message(channels::kFreshShard, [this](int from, std::span<const std::byte> m) { on_fresh(from, m); });
    comm.on_message(channels::kProgress, [this](int from, std::span<const std::byte> m) { on_progress(from, m); });
    comm.on_message(channels::kStop, [this](int, std::span<const std::byte>) { stop_ = true; });
    comm.on_message(channels::kDone, [this](int from, std::span<const std::byte>) {
      std::lock_guard lock(mutex_);
      done_from_[static_cast<size_t>(from)] = true;
    });
    comm.on_message(channels::kGather, [this](int from, std::span<const std::byte> m) { on_gather(from, m); });
  }

  ~AsyncMode() override {
    for (Channel c : {channels::kFreshShard, channels::kProgress, channels::kStop, channels::kDone, channels::kGather,
                      channels::kCheckpoint}) {
      comm_.on_message(c, nullptr);
    }
  }

  bool stop_requested() const override { return stop_.load(); }
  bool params_are_global() const override { return false; }
  ModeStats stats() const override {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  bool request_snapshot() override {
    if (comm_.rank() != 0) return false;
    std::vector<std::byte> out;
    {
      std::lock_guard lock(mutex_);
      // A request still being answered covers this one too, unless it is so
      // old that an owner must have been lost: then a new one replaces it.
      if (!snapshot_.received.empty() && Clock::now() - snapshot_asked_ < seconds(settings_.peer_timeout_s)) {
        return true;
      }
      snapshot_asked_ = Clock::now();
      ++snapshot_id_;
      snapshot_ = Assembly(comm_.size());
      put(out, kSnapshotRequest);
      put(out, snapshot_id_);
    }
    for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kCheckpoint, out);
    return true;
  }

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
  struct Fresh {
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
  void reply_fresh(int to, int64_t staleness, bool dropped, bool with_shard = true) {
    std::vector<std::byte> out;
    put(out, static_cast<uint32_t>(comm_.rank()));
    put(out, static_cast<uint32_t>(dropped ? 1 : 0));
    put(out, version_);
    put(out, staleness);
    if (with_shard) put_floats(out, owned_);
    comm_.post(to, channels::kFreshShard, std::move(out));
  }

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
  std::deque<Fresh> take_inbox() {
    std::lock_guard lock(mutex_);
    std::deque<Fresh> out;
    out.swap(inbox_);
    return out;
  }

  /// Replies still owed by owners that are alive.
  int outstanding() const {
    const auto lost = comm_.lost_ranks();
    int n = 0;
    for (int j = 0; j < comm_.size(); ++j) {
      if (std::find(lost.begin(), lost.end(), j) == lost.end()) n += awaiting_[static_cast<size_t>(j)];
    }
    return n;
  }

  /// Every step: rank 0 keeps the budget and the positions a checkpoint records.
  void report_progress(const TrainPosition& position) {
    position_ = position;
    std::vector<std::byte> out;
    put_position(out, position);
    comm_.post(0, channels::kProgress, std::move(out));
  }

  /// Waits (draining the inbox through `apply`) until no reply is owed or the deadline passes.
  template <typename Apply>
  void drain_replies(Clock::time_point deadline, Apply&& apply) {
    while (outstanding() > 0 && Clock::now() < deadline) {
      auto fresh = take_inbox();
      if (fresh.empty()) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      for (auto& f : fresh) apply(f);
    }
  }

  /// The end: tell everyone this rank is done, serve owners' work until every
  /// live rank is done too, then gather the owned shards (and the owners'
  /// state, and each rank's last position) on rank 0.
  Status end_handshake(std::span<float> params) {
    const auto start = Clock::now();
    const auto deadline = start + seconds(settings_.peer_timeout_s * 3);
    for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kDone, {});
    auto everyone_done = [&] {
      const auto lost = comm_.lost_ranks();
      std::lock_guard lock(mutex_);
      for (int r = 0; r < comm_.size(); ++r) {
        if (!done_from_[static_cast<size_t>(r)] && std::find(lost.begin(), lost.end(), r) == lost.end()) return false;
      }
      return true;
    };
    while (!everyone_done() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Owners' shards now include every contribution: send mine to rank 0.
    std::vector<std::byte> out;
    put_position(out, position_);
    put_owner_shard(out);
    comm_.post(0, channels::kGather, std::move(out));
    if (comm_.rank() == 0) {
      auto gathered_all = [&] {
        const auto lost = comm_.lost_ranks();
        std::lock_guard lock(mutex_);
        for (int r = 0; r < comm_.size(); ++r) {
          if (!gather_.received[static_cast<size_t>(r)] && std::find(lost.begin(), lost.end(), r) == lost.end()) {
            return false;
          }
        }
        return true;
      };
      while (!gathered_all() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::lock_guard lock(mutex_);
      GlobalState& g = gather_.state;
      for (int j = 0; j < comm_.size(); ++j) {
        // A lost owner's shard keeps rank 0's own values: the best there is.
        if (gather_.received[static_cast<size_t>(j)]) {
          std::copy_n(g.params.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(j)]), shard_size(j),
                      shard_of(params, j).begin());
        } else {
          g.ranks[static_cast<size_t>(j)] = progress_[static_cast<size_t>(j)];
        }
      }
      g.params.assign(params.begin(), params.end());
      final_ = std::move(g);
    }
    {
      std::lock_guard lock(mutex_);
      stats_.finish_wait_s += seconds_since(start);
    }
    const auto lost = comm_.lost_ranks();
    if (comm_.rank() != 0 && std::find(lost.begin(), lost.end(), 0) != lost.end()) {
      const Status health = comm_.health();  // a rank 0 that failed on its own said why: its kind counts
      return make_error(health ? ErrorKind::kPeer : health.error().kind,
                        "rank 0 was lost before it gathered the global parameters");
    }
    return {};
  }

  /// For the derived constructors, last, and destructors, first: the handler
  /// that calls owner_state() may run only while the derived members it reads
  /// exist (a request that comes before waits, unread, for the handler).
  void start_serving_owner_state() {
    comm_.on_message(channels::kCheckpoint, [this](int from, std::span<const std::byte> m) { on_checkpoint(from, m); });
  }
  void stop_serving_owner_state() { comm_.on_message(channels::kCheckpoint, nullptr); }

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
  std::deque<Fresh> inbox_;
  ModeStats stats_;

 private:
  static constexpr uint32_t kSnapshotRequest = 0;
  static constexpr uint32_t kSnapshotShard = 1;

  /// A global state being put together from the owners' shards.
  struct Assembly {
    Assembly() = default;
    explicit Assembly(int world) : received(static_cast<size_t>(world), false) {
      state.ranks.resize(static_cast<size_t>(world));
      state.versions.assign(static_cast<size_t>(world), 0);
      state.owner_steps.assign(static_cast<size_t>(world), 0);
    }
    GlobalState state;
    std::vector<bool> received;
    int count = 0;
  };

  /// [u32 shard][i64 version][i64 owner steps][u32 buffers][params][owner state...], under mutex_.
  void put_owner_shard(std::vector<std::byte>& out) {
    std::lock_guard lock(mutex_);
    const auto state = owner_state();
    put(out, static_cast<uint32_t>(comm_.rank()));
    put(out, version_);
    put(out, owner_steps());
    put(out, static_cast<uint32_t>(1 + state.size()));
    put_vector(out, owned_);
    for (const auto& buffer : state) put_vector(out, buffer);
  }

  /// Rank 0, under mutex_: an owner's shard into `a`; false when malformed.
  bool take_owner_shard(int from, std::span<const std::byte>& m, Assembly& a) {
    uint32_t shard = 0;
    int64_t version = 0;
    int64_t steps = 0;
    uint32_t buffers = 0;
    if (!take(m, shard) || shard != static_cast<uint32_t>(from) || !take(m, version) || !take(m, steps) ||
        !take(m, buffers) || buffers == 0 || a.received.size() != static_cast<size_t>(comm_.size()) ||
        a.received[shard]) {
      return false;
    }
    const size_t total = bounds_.back();
    const size_t first = bounds_[shard];
    std::vector<float> v;
    for (uint32_t b = 0; b < buffers; ++b) {
      if (!take_vector(m, v) || v.size() != shard_size(static_cast<int>(shard))) return false;
      std::vector<float>* into = nullptr;
      if (b == 0) {
        into = &a.state.params;
      } else if (settings_.name == "cfmo") {
        into = &a.state.outer_momentum;
      } else {
        if (a.state.owner_state.size() < b) a.state.owner_state.resize(b);
        into = &a.state.owner_state[b - 1];
      }
      if (into->empty()) into->assign(total, 0.0f);
      std::copy(v.begin(), v.end(), into->begin() + static_cast<std::ptrdiff_t>(first));
    }
    a.state.versions[shard] = version;
    a.state.owner_steps[shard] = steps;
    a.received[shard] = true;
    ++a.count;
    return true;
  }

  void on_fresh(int, std::span<const std::byte> m) {
    Fresh f;
    uint32_t shard = 0;
    uint32_t flags = 0;
    if (!take(m, shard) || !take(m, flags) || !take(m, f.version) || !take(m, f.staleness)) return;
    if (shard >= static_cast<uint32_t>(comm_.size())) return;
    f.shard = static_cast<int>(shard);
    f.dropped = (flags & 1) != 0;
    f.values.resize(m.size() / sizeof(float));
    std::memcpy(f.values.data(), m.data(), f.values.size() * sizeof(float));
    std::lock_guard lock(mutex_);
    inbox_.push_back(std::move(f));
  }

  void on_progress(int from, std::span<const std::byte> m) {
    TrainPosition p;
    if (!take_position(m, p)) return;
    bool stop = false;
    {
      std::lock_guard lock(mutex_);
      progress_[static_cast<size_t>(from)] = p;
      int64_t total = 0;
      for (const auto& q : progress_) total += q.samples;
      stop = settings_.sample_budget > 0 && total >= settings_.sample_budget && !stop_sent_;
      if (stop) stop_sent_ = true;
    }
    if (stop) {
      for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kStop, {});
    }
  }

  void on_gather(int from, std::span<const std::byte> m) {
    TrainPosition p;
    if (!take_position(m, p)) return;
    std::lock_guard lock(mutex_);
    if (take_owner_shard(from, m, gather_)) gather_.state.ranks[static_cast<size_t>(from)] = p;
  }

  /// A request (any rank, as an owner): my shard to rank 0, now. A shard
  /// (rank 0): into the snapshot of that request; complete when every owner's is in.
  void on_checkpoint(int from, std::span<const std::byte> m) {
    uint32_t kind = 0;
    uint64_t id = 0;
    if (!take(m, kind) || !take(m, id)) return;
    if (kind == kSnapshotRequest) {
      std::vector<std::byte> out;
      put(out, kSnapshotShard);
      put(out, id);
      put_owner_shard(out);
      comm_.post(from, channels::kCheckpoint, std::move(out));
      return;
    }
    if (kind != kSnapshotShard || comm_.rank() != 0) return;
    std::lock_guard lock(mutex_);
    if (id != snapshot_id_ || !take_owner_shard(from, m, snapshot_)) return;
    if (snapshot_.count < comm_.size()) return;
    // Every shard is in (a lost owner's never is: then no checkpoint is whole).
    snapshot_.state.ranks = progress_;
    ready_ = std::move(snapshot_.state);
    snapshot_ = Assembly();
  }

  std::atomic<bool> stop_{false};
  std::vector<bool> done_from_;
  std::vector<TrainPosition> progress_;      ///< rank 0: each rank's last reported position
  std::vector<int64_t> start_samples_;       ///< rank 0: each rank's samples when this run started
  std::vector<int64_t> reconciled_samples_;  ///< rank 0: see reconciled_samples()
  bool stop_sent_ = false;                   ///< rank 0, progress thread
  uint64_t snapshot_id_ = 0;                 ///< rank 0: the request being answered
  Clock::time_point snapshot_asked_;         ///< rank 0: when it was sent
  Assembly snapshot_;                        ///< rank 0: its answers so far
  std::optional<GlobalState> ready_;         ///< rank 0: the last complete snapshot, until taken
  Assembly gather_;                          ///< rank 0: the end's gather
  std::optional<GlobalState> final_;         ///< rank 0: the end's state, until taken
};

/// Communication-free: see ALGORITHM.md, mode 3.
class CfmoMode final : public AsyncMode {
 public:
  CfmoMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial, const ModeResume& resume)
      : AsyncMode(settings, comm, initial, resume),
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
    auto apply = [&](Fresh& f) { rebase(f, params, optimizer); };
    drain_replies(deadline, apply);
    // The last local progress counts too. Its replies carry no shard: this
    // rank's parameters are not used after the run, and rank 0 gathers the
    // global ones.
    send_round(params, /*only_idle=*/false, /*last=*/true);
    drain_replies(deadline + seconds(settings_.peer_timeout_s), apply);
    {
      std::lock_guard lock(mutex_);
      stats_.finish_wait_s += seconds_since(start);
    }
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
  void rebase(Fresh& f, std::span<float> params, Optimizer& optimizer) {
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

/// Classic asynchronous SGD over the same shards: owners run the inner optimizer.
class AsgdMode final : public AsyncMode {
 public:
  AsgdMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial,
           std::unique_ptr<Optimizer> shard_optimizer, const ModeResume& resume)
      : AsyncMode(settings, comm, initial, resume), optimizer_(std::move(shard_optimizer)) {
    // A resumed owner takes up its shard of the saved owners' state.
    auto state = optimizer_->state();
    if (resume.owner_state.size() == state.size() && resume.owner_steps.size() == static_cast<size_t>(comm.size())) {
      const auto first = static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(comm.rank())]);
      for (size_t i = 0; i < state.size(); ++i) {
        if (resume.owner_state[i].size() != initial.size()) continue;
        std::copy_n(resume.owner_state[i].begin() + first, state[i].buffer->size(), state[i].buffer->begin());
      }
      optimizer_->set_step_count(resume.owner_steps[static_cast<size_t>(comm.rank())]);
    }
    comm.on_message(channels::kGradShard, [this](int from, std::span<const std::byte> m) { on_grad(from, m); });
    start_serving_owner_state();
  }
  ~AsgdMode() override {
    comm_.on_message(channels::kGradShard, nullptr);
    stop_serving_owner_state();
  }
  std::string_view name() const override { return "asgd"; }
  bool owns_update() const override { return true; }
  bool uses_gradients() const override { return true; }

  Status on_gradients(std::span<float> grads, int count, float lr) override {
    if (count == 0) return {};
    const auto lost = comm_.lost_ranks();
    for (int j = 0; j < comm_.size(); ++j) {
      if (std::find(lost.begin(), lost.end(), j) != lost.end()) continue;
      const size_t first = bounds_[static_cast<size_t>(j)];
      const size_t n = bounds_[static_cast<size_t>(j) + 1] - first;
      std::vector<std::byte> out;
      put(out, static_cast<uint32_t>(j));
      put(out, static_cast<uint32_t>(settings_.delta_dtype));
      put(out, base_version_[static_cast<size_t>(j)]);
      put(out, lr);
      encode_floats(settings_.delta_dtype, grads.subspan(first, n),
                    residual_.empty() ? std::span<float>() : std::span<float>(residual_).subspan(first, n), out);
      comm_.post(j, channels::kGradShard, std::move(out));
      ++awaiting_[static_cast<size_t>(j)];
      std::lock_guard lock(mutex_);
      ++stats_.contributions_sent;
    }
    std::lock_guard lock(mutex_);
    ++stats_.rounds;
    return {};
  }

  bool needs_params(const TrainPosition&) const override {
    return inbox_pending() || outstanding() > settings_.max_staleness * comm_.size();
  }
  Status after_step(const TrainPosition& position, std::span<float> params, Optimizer&) override {
    if (params.empty()) {  // not needed this step (needs_params): replies wait for the next one
      report_progress(position);
      return {};
    }
    for (auto& f : take_inbox()) apply(f, params);
    // Bounded staleness (SSP): with more than max_staleness rounds of pushes
    // unanswered, wait before computing the next gradient; 0 waits for each reply.
    const int limit = settings_.max_staleness * comm_.size();
    if (outstanding() > limit) {
      const auto start = Clock::now();
      while (outstanding() > limit && !stop_requested()) {
        for (auto& f : take_inbox()) apply(f, params);
        std::this_thread::yield();
      }
      std::lock_guard lock(mutex_);
      stats_.wait_s += seconds_since(start);
    }
    report_progress(position);
    return {};
  }

  Status finish(std::span<float> params, Optimizer&) override {
    const auto start = Clock::now();
    drain_replies(start + seconds(settings_.peer_timeout_s), [&](Fresh& f) { apply(f, params); });
    {
      std::lock_guard lock(mutex_);
      stats_.finish_wait_s += seconds_since(start);
    }
    return end_handshake(params);
  }

 private:
  void apply(Fresh& f, std::span<float> params) {
    auto& waiting = awaiting_[static_cast<size_t>(f.shard)];
    waiting = std::max(0, waiting - 1);
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
        shard != static_cast<uint32_t>(comm_.rank()) || dtype > 2) {
      return;
    }
    incoming_.resize(owned_.size());
    if (!decode_floats(static_cast<WireDtype>(dtype), m, incoming_)) return;
    // Classic asynchronous SGD applies every gradient, however stale (its
    // workers wait instead once they are max_staleness rounds ahead).
    const int64_t s = staleness_of(base_version);
    {
      std::lock_guard lock(mutex_);
      optimizer_->step(owned_, incoming_, lr);
      ++version_;
      ++stats_.contributions_applied;
      ++stats_.contributions_received;
      note_reconciled(from);
    }
    reply_fresh(from, s, false);
  }

  std::vector<std::span<const float>> owner_state() const override {
    std::vector<std::span<const float>> out;
    for (const auto& s : optimizer_->state()) out.emplace_back(*s.buffer);
    return out;
  }
  int64_t owner_steps() const override { return optimizer_->step_count(); }

  std::unique_ptr<Optimizer> optimizer_;  ///< progress thread: the inner optimizer for my shard
  FloatBuffer incoming_;                  ///< progress thread
};

}  // namespace

OuterOptimizer::OuterOptimizer(const ModeSettings& settings, size_t size, int contributions_per_round)
    : nesterov_(settings.outer_optimizer == "nesterov"),
      lr_(static_cast<float>(settings.outer_lr)),
      mu_(static_cast<float>(settings.outer_momentum)),
      per_round_(std::max(1, contributions_per_round)),
      momentum_(nesterov_ ? size : 0, 0.0f),
      round_sum_(nesterov_ && per_round_ > 1 ? size : 0, 0.0f) {}

void OuterOptimizer::apply(std::span<float> global, std::span<const float> delta, float weight) {
  const size_t n = global.size();
  for (size_t i = 0; i < n; ++i) global[i] += lr_ * weight * delta[i];
  if (!nesterov_) return;
  if (per_round_ > 1) {
    for (size_t i = 0; i < n; ++i) round_sum_[i] += weight * delta[i];
    if (++in_round_ < per_round_) return;
    in_round_ = 0;
    for (size_t i = 0; i < n; ++i) {
      momentum_[i] = mu_ * momentum_[i] + round_sum_[i];
      round_sum_[i] = 0;
      global[i] += lr_ * mu_ * momentum_[i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    momentum_[i] = mu_ * momentum_[i] + weight * delta[i];
    global[i] += lr_ * mu_ * momentum_[i];
  }
}

std::vector<size_t> shard_bounds(size_t size, int shards) {
  std::vector<size_t> bounds(static_cast<size_t>(shards) + 1, size);
  bounds[0] = 0;
  for (int j = 1; j < shards; ++j) {
    const size_t even = size * static_cast<size_t>(j) / static_cast<size_t>(shards);
    bounds[static_cast<size_t>(j)] = std::min(size, (even + 15) / 16 * 16);
  }
  return bounds;
}

Result<std::unique_ptr<Mode>> make_mode(const ModeSettings& settings, Communicator* comm,
                                        const std::vector<ParamInfo>& layout, std::span<const float> initial,
                                        const OptimizerConfig& optimizer_config, const ModeResume& resume) {
  if (comm == nullptr || comm->size() == 1) return std::unique_ptr<Mode>(std::make_unique<SoloMode>(settings.name));
  if (settings.name == "sync") return std::unique_ptr<Mode>(std::make_unique<SyncMode>(*comm));
  if (settings.name == "localsgd") {
    return std::unique_ptr<Mode>(std::make_unique<LocalSgdMode>(settings, *comm, initial, resume));
  }
  if (settings.name == "cfmo") {
    return std::unique_ptr<Mode>(std::make_unique<CfmoMode>(settings, *comm, initial, resume));
  }
  if (settings.name == "asgd") {
    const auto bounds = shard_bounds(initial.size(), comm->size());
    const size_t own = bounds[static_cast<size_t>(comm->rank()) + 1] - bounds[static_cast<size_t>(comm->rank())];
    // The owner's optimizer sees its shard as one flat tensor: element-wise optimizers only.
    std::vector<ParamInfo> shard_layout = {{"shard", {static_cast<int64_t>(own)}, 0, own}};
    CFMO_ASSIGN_OR_RETURN(auto optimizer, make_optimizer(optimizer_config, shard_layout, own));
    return std::unique_ptr<Mode>(std::make_unique<AsgdMode>(settings, *comm, initial, std::move(optimizer), resume));
  }
  (void)layout;
  return make_error(ErrorKind::kUsage, "--mode '{}': expected sync, localsgd, cfmo or asgd", settings.name);
}

}  // namespace cfmo
