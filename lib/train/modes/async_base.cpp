#include "train/modes/async_base.h"

#include "train/modes/wire.h"

namespace cfmo::modes {

AsyncMode::AsyncMode(const ModeSettings& settings, Communicator& comm, std::span<const float> initial,
                     const ModeResume& resume, OwnerState owner_state_kind)
    : settings_(settings),
      comm_(comm),
      bounds_(shard_bounds(initial.size(), comm.size())),
      base_(initial.begin(), initial.end()),
      base_version_(static_cast<size_t>(comm.size()), 0),
      residual_(settings.delta_dtype == WireDtype::kFp32 ? 0 : initial.size(), 0.0f),
      owner_state_kind_(owner_state_kind),
      done_from_(static_cast<size_t>(comm.size()), false),
      progress_(static_cast<size_t>(comm.size())) {
  const int me = comm.rank();
  owned_.assign(initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me)]),
                initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me) + 1]));
  if (resume.ranks.size() == progress_.size()) progress_ = resume.ranks;
  for (const auto& p : progress_) start_samples_.push_back(p.samples);
  reconciled_samples_.assign(progress_.size(), 0);
  gather_ = PartialGlobalState(comm.size());
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

AsyncMode::~AsyncMode() {
  for (Channel c : {channels::kFreshShard, channels::kProgress, channels::kStop, channels::kDone, channels::kGather,
                    channels::kCheckpoint}) {
    comm_.on_message(c, nullptr);
  }
}

bool AsyncMode::request_snapshot() {
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
    snapshot_ = PartialGlobalState(comm_.size());
    put(out, kSnapshotRequest);
    put(out, snapshot_id_);
  }
  for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kCheckpoint, out);
  return true;
}

void AsyncMode::reply_fresh(int to, int64_t staleness, bool dropped, bool with_shard) {
  std::vector<std::byte> out;
  put(out, static_cast<uint32_t>(comm_.rank()));
  put(out, static_cast<uint32_t>(dropped ? 1 : 0));
  put(out, version_);
  put(out, staleness);
  if (with_shard) put_floats(out, owned_);
  comm_.post(to, channels::kFreshShard, std::move(out));
}

int AsyncMode::outstanding() const {
  const auto lost = comm_.lost_ranks();
  int n = 0;
  for (int j = 0; j < comm_.size(); ++j) {
    if (std::find(lost.begin(), lost.end(), j) == lost.end()) n += awaiting_[static_cast<size_t>(j)];
  }
  return n;
}

void AsyncMode::report_progress(const TrainPosition& position) {
  position_ = position;
  std::vector<std::byte> out;
  put_position(out, position);
  comm_.post(0, channels::kProgress, std::move(out));
}

bool AsyncMode::all_live(const std::vector<bool>& flags) const {
  const auto lost = comm_.lost_ranks();
  std::lock_guard lock(mutex_);
  for (int r = 0; r < comm_.size(); ++r) {
    if (!flags[static_cast<size_t>(r)] && std::find(lost.begin(), lost.end(), r) == lost.end()) return false;
  }
  return true;
}

Status AsyncMode::end_handshake(std::span<float> params) {
  const auto start = Clock::now();
  const auto deadline = start + seconds(settings_.peer_timeout_s * 3);
  for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kDone, {});
  while (!all_live(done_from_) && Clock::now() < deadline) seam_sleep_for(std::chrono::milliseconds(1));
  // Owners' shards now include every contribution: send mine to rank 0.
  std::vector<std::byte> out;
  put_position(out, position_);
  put_owner_shard(out);
  comm_.post(0, channels::kGather, std::move(out));
  if (comm_.rank() == 0) {
    while (!all_live(gather_.received) && Clock::now() < deadline) {
      seam_sleep_for(std::chrono::milliseconds(1));
    }
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
  count_finish_wait(start);
  const auto lost = comm_.lost_ranks();
  if (comm_.rank() != 0 && std::find(lost.begin(), lost.end(), 0) != lost.end()) {
    const Status health = comm_.health();  // a rank 0 that failed on its own said why: its kind counts
    return make_error(health ? ErrorKind::kPeer : health.error().kind,
                      "rank 0 was lost before it gathered the global parameters");
  }
  return {};
}

void AsyncMode::start_serving_owner_state() {
  comm_.on_message(channels::kCheckpoint, [this](int from, std::span<const std::byte> m) { on_checkpoint(from, m); });
}

void AsyncMode::stop_serving_owner_state() { comm_.on_message(channels::kCheckpoint, nullptr); }

/// [u32 shard][i64 version][i64 owner steps][u32 buffers][params][owner state...], under mutex_.
void AsyncMode::put_owner_shard(std::vector<std::byte>& out) {
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
bool AsyncMode::take_owner_shard(int from, std::span<const std::byte>& m, PartialGlobalState& a) {
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
    } else if (owner_state_kind_ == OwnerState::kOuterMomentum) {
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

void AsyncMode::on_fresh(int, std::span<const std::byte> m) {
  FreshShard f;
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

void AsyncMode::on_progress(int from, std::span<const std::byte> m) {
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

void AsyncMode::on_gather(int from, std::span<const std::byte> m) {
  TrainPosition p;
  if (!take_position(m, p)) return;
  std::lock_guard lock(mutex_);
  if (take_owner_shard(from, m, gather_)) gather_.state.ranks[static_cast<size_t>(from)] = p;
}

/// A request (any rank, as an owner): my shard to rank 0, now. A shard
/// (rank 0): into the snapshot of that request; complete when every owner's is in.
void AsyncMode::on_checkpoint(int from, std::span<const std::byte> m) {
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
  snapshot_ = PartialGlobalState();
}

}  // namespace cfmo::modes
