#include "train/modes/async_base.h"

#include "train/modes/quorum.h"
#include "train/modes/wire.h"

namespace cfmo::train::modes {

AsyncMode::AsyncMode(const ModeSettings& settings, comm::Communicator& comm, std::span<const float> initial,
                     const ModeResume& resume, OwnerState owner_state_kind, bool replicated)
    : settings_(settings),
      comm_(comm),
      shards_(owner_count(settings, comm.size())),
      bounds_(shard_bounds(initial.size(), shards_)),
      base_(initial.begin(), initial.end()),
      base_version_(static_cast<size_t>(shards_), 0),
      residual_(settings.delta_dtype == comm::WireDtype::kFp32 ? 0 : initial.size(), 0.0f),
      replicated_(replicated),
      owner_state_kind_(owner_state_kind),
      done_from_(comm.size()),
      lost_(static_cast<size_t>(comm.size()), false),
      gathered_from_(comm.size()) {
  const int me = comm.rank();
  // A joiner's parameters are nobody's: its shard comes back from the rank
  // that served it. Ranks K and up own none.
  if (!comm.joined()) {
    // A resumed run continues the shards' versions (the staleness counters,
    // one per shard: K of them) and this rank's error feedback where the
    // checkpoint has them for this world.
    const bool versions = resume.versions.size() == base_version_.size();
    if (versions) base_version_ = resume.versions;
    if (me < shards_) {
      Served& mine = served_[me];
      mine.values.assign(initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me)]),
                         initial.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(me) + 1]));
      if (versions) mine.version = resume.versions[static_cast<size_t>(me)];
    }
    if (resume.wire_residual.size() == residual_.size()) {
      std::copy(resume.wire_residual.begin(), resume.wire_residual.end(), residual_.begin());
    }
  }
  joining_ = comm.joined();
  if (resume.ranks.size() == static_cast<size_t>(comm.size())) {
    progress_ = resume.ranks;
    for (const auto& p : progress_) {
      start_samples_.push_back(p.samples);
      progress_samples_ += p.samples;
    }
    reconciled_samples_.assign(progress_.size(), 0);
  }
  stats_.staleness_histogram.assign(static_cast<size_t>(settings.max_staleness) + 2, 0);
  comm.on_message(channels::kFreshShard, [this](int from, std::span<const std::byte> m) { on_fresh(from, m); });
  comm.on_message(channels::kProgress, [this](int from, std::span<const std::byte> m) { on_progress(from, m); });
  comm.on_message(channels::kSampleCounts, [this](int, std::span<const std::byte> m) { on_sample_counts(m); });
  comm.on_message(channels::kStop, [this](int, std::span<const std::byte>) { stop_ = true; });
  comm.on_message(channels::kDone, [this](int from, std::span<const std::byte> m) {
    if (!m.empty()) {
      all_done_ = true;
      return;
    }
    refresh_membership();  // a rank new to this one (the world grew) is counted
    bool late = false;
    {
      std::lock_guard lock(mutex_);
      if (from < world_locked()) done_from_.mark(from);
      // Done after every other rank was (a joiner told the run ended that hands in a shard): told so at once.
      late = all_done_.load() && keeper_locked() == comm_.rank();
    }
    if (late) comm_.post(from, channels::kDone, std::vector<std::byte>{std::byte{1}});
  });
  comm.on_message(channels::kGather, [this](int from, std::span<const std::byte> m) { on_gather(from, m); });
  comm.on_message(channels::kGathered, [this](int from, std::span<const std::byte>) {
    gathered_by_ = from;
    gathered_ = true;
  });
}

AsyncMode::~AsyncMode() {
  for (comm::Channel c : {channels::kFreshShard, channels::kProgress, channels::kSampleCounts, channels::kStop,
                          channels::kDone, channels::kGather, channels::kGathered, channels::kCheckpoint}) {
    comm_.on_message(c, nullptr);
  }
}

void AsyncMode::keep_positions_locked() {
  if (!progress_.empty()) return;
  progress_.assign(static_cast<size_t>(world_locked()), TrainPosition{});
  reconciled_samples_.assign(progress_.size(), 0);
  for (int r = 0; r < world_locked(); ++r) progress_[static_cast<size_t>(r)].samples = start_samples(r);
  progress_samples_ = 0;
  for (const auto& p : progress_) progress_samples_ += p.samples;
}

AsyncMode::PartialGlobalState& AsyncMode::gather_locked() {
  if (gather_.received.empty()) gather_ = PartialGlobalState(shards_, world_locked());
  return gather_;
}

int AsyncMode::owner_of_locked(int shard) const {
  const int w = world_locked();
  if (!replicated_) return lost_locked(shard) ? -1 : shard;
  for (int k = 0; k < w; ++k) {
    const int r = (shard + k) % w;
    if (!lost_locked(r)) return r;
  }
  return -1;
}

int AsyncMode::backup_of_locked(int shard) const {
  const int owner = owner_of_locked(shard);
  if (owner < 0 || !replicated_) return -1;
  const int w = world_locked();
  for (int k = 1; k < w; ++k) {
    const int r = (owner + k) % w;
    if (!lost_locked(r)) return r;
  }
  return -1;
}

int AsyncMode::keeper_locked() const {
  for (int r = 0; r < world_locked(); ++r) {
    if (!lost_locked(r)) return r;
  }
  return comm_.rank();
}

int AsyncMode::standby_locked() const {
  const int keeper = keeper_locked();
  for (int r = keeper + 1; r < world_locked(); ++r) {
    if (!lost_locked(r)) return r;
  }
  return -1;
}

int AsyncMode::keeper() const {
  // After the end's gather, the rank that gathered; before, the transport's
  // latest word on who is lost (the membership refreshes only at steps).
  if (const int by = gathered_by_.load(); by >= 0) return by;
  const auto lost = comm_.lost_ranks();
  for (int r = 0; r < comm_.size(); ++r) {
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) return r;
  }
  return comm_.rank();
}

int AsyncMode::shard_served_by(int rank) const {
  if (!replicated_ || rank < 0 || rank >= shards_) return -1;  // ranks K and up own no shard
  // As owner_of_locked, on the transport's latest word (the membership refreshes only at steps).
  const auto lost = comm_.lost_ranks();
  for (int k = 0; k < comm_.size(); ++k) {
    const int r = (rank + k) % comm_.size();
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) return r;
  }
  return -1;
}

void AsyncMode::grow_locked(int world) {
  const auto w = static_cast<size_t>(world);
  if (w <= lost_.size()) return;
  lost_.resize(w, false);
  done_from_.grow(world);
  gathered_from_.grow(world);
  // The positions (kept by the keeper and its standby) and the samples counted apart.
  if (!progress_.empty()) {
    progress_.resize(w);
    reconciled_samples_.resize(w, 0);
  }
  if (!retired_samples_.empty()) retired_samples_.resize(w, 0);
  if (!start_samples_.empty()) start_samples_.resize(w, 0);
  for (PartialGlobalState* partial : {&gather_, &snapshot_}) {
    if (partial->received.empty()) continue;
    partial->state.ranks.resize(w);
    partial->state.owner_steps.resize(w, 0);
  }
}

void AsyncMode::refresh_membership() {
  // The joins first: a rank that joined after this read is still lost below,
  // and taken up next time; the size last, as the transport grows it before
  // it records the join of a new rank, so that it covers every rank read here.
  const auto joined = comm_.joined_ranks();
  const auto lost = comm_.lost_ranks();
  const int world = comm_.size();
  std::lock_guard lock(mutex_);
  if (joined.size() == joins_seen_ && lost == last_lost_) return;
  last_lost_ = lost;
  std::vector<int> before;
  for (int r = 0; r < world_locked(); ++r) {
    if (!lost_locked(r)) before.push_back(r);
  }
  // A new rank (the world grew) is one more join below: it starts with nothing, as a rejoined rank does.
  grow_locked(world);
  std::vector<int> rejoined;
  for (size_t i = joins_seen_; i < joined.size(); ++i) {
    const int r = joined[i];
    if (r == comm_.rank()) continue;
    rejoined.push_back(r);
    lost_[static_cast<size_t>(r)] = false;
    // A new process in r's place: what the last one trained up to its last
    // contribution is counted apart, and it is not done.
    const auto k = static_cast<size_t>(r);
    // (Positions are kept by the keeper and its standby only.)
    if (!progress_.empty()) {
      if (retired_samples_.empty()) retired_samples_.assign(progress_.size(), 0);  // W of them, on the first join
      retired_samples_[k] += reconciled_samples_[k];
      reconciled_samples_[k] = 0;
      if (start_samples_.empty()) start_samples_.assign(progress_.size(), 0);
      start_samples_[k] = progress_[k].samples;
    }
    done_from_.unmark(r);
    gathered_from_.unmark(r);
    // Not taken in until the keeper answers its request for the global state (turn_away_locked).
    if (std::find(unadmitted_.begin(), unadmitted_.end(), r) == unadmitted_.end()) unadmitted_.push_back(r);
    if (stop_sent_) comm_.post(r, channels::kStop, {});  // the budget was spent before it came
  }
  joins_seen_ = joined.size();
  std::vector<int> newly;
  for (const int r : lost) {
    if (r == comm_.rank() || lost_[static_cast<size_t>(r)]) continue;
    lost_[static_cast<size_t>(r)] = true;
    newly.push_back(r);
  }
  if (newly.empty() && rejoined.empty()) return;
  std::vector<int> after;
  for (int r = 0; r < world_locked(); ++r) {
    if (!lost_locked(r)) after.push_back(r);
  }
  live_ = static_cast<int>(after.size());
  if (!newly.empty()) {
    if (Status quorum = check_quorum(comm_, before, after); !quorum && cut_off_.message.empty()) {
      cut_off_ = quorum.error();
    }
  }
  on_membership_change_locked(newly, rejoined);
}

Status AsyncMode::cut_off() const {
  std::lock_guard lock(mutex_);
  if (cut_off_.message.empty()) return {};
  return cut_off_;
}

bool AsyncMode::request_snapshot() {
  refresh_membership();
  {
    std::lock_guard lock(mutex_);
    if (keeper_locked() != comm_.rank()) return false;
    // A request still being answered covers this one too, unless it is so
    // old that an owner must have been lost: then a new one replaces it.
    if (!snapshot_.received.empty() && Clock::now() - snapshot_asked_ < seconds(settings_.peer_timeout_s)) {
      return true;
    }
  }
  post_snapshot_request();
  return true;
}

void AsyncMode::post_snapshot_request(bool again, uint32_t kind) {
  std::vector<std::byte> out;
  {
    std::lock_guard lock(mutex_);
    snapshot_asked_ = Clock::now();
    if (!again || snapshot_.received.empty()) {
      ++snapshot_id_;
      snapshot_ = PartialGlobalState(shards_, world_locked());
    }
    put(out, kind);
    put(out, snapshot_id_);
  }
  for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kCheckpoint, out);
}

bool AsyncMode::turn_away_locked(int from) {
  if (keeper_locked() != comm_.rank()) return false;  // the keeper decides; the others answer as owners
  const auto it = std::find(unadmitted_.begin(), unadmitted_.end(), from);
  if (it == unadmitted_.end()) return false;  // taken in already (this is a request asked again)
  if (joins_closed_) return true;
  unadmitted_.erase(it);
  return false;
}

bool AsyncMode::hands_in_locked(int from) {
  if (gathered_by_.load() >= 0) return false;  // the gather is over
  for (int j = 0; j < shards_; ++j) {
    if (owner_of_locked(j) == from && (gather_.received.empty() || !gather_.received[static_cast<size_t>(j)])) {
      return true;
    }
  }
  // Nothing of it to wait for: it counts as done and gathered.
  if (from < world_locked()) {
    done_from_.mark(from);
    gathered_from_.mark(from);
  }
  return false;
}

std::vector<int> AsyncMode::members() const {
  std::lock_guard lock(mutex_);
  if (!joins_closed_) return {};
  // The ranks this rank knows, but the joiners it did not take in: a process
  // the transport took in after the keeper's last look is none either.
  std::vector<int> out;
  for (int r = 0; r < world_locked(); ++r) {
    if (std::find(unadmitted_.begin(), unadmitted_.end(), r) == unadmitted_.end()) out.push_back(r);
  }
  return out;
}

Result<Joined> AsyncMode::take_global_state(std::span<float> params, TrainPosition& position) {
  const auto deadline = Clock::now() + seconds(settings_.peer_timeout_s * 2 + 5);
  Clock::time_point asked{};
  const auto first_asked = Clock::now();
  std::optional<GlobalState> ready_for_join;
  for (;;) {
    refresh_membership();
    // Every shard, and the position if the keeper knew one (a rank lost before its first report had none).
    const bool placed = [&] {
      std::lock_guard lock(mutex_);
      return join_position_.step > 0 || keeper_answered_ || Clock::now() - first_asked > std::chrono::seconds(1);
    }();
    if (run_ended_.load()) {
      // Too late to train. A shard the keeper's gather still needs of it (its
      // lost owner's, handed over to it as it came) goes there, in the end's
      // handshake as any rank's; else the keeper counts it done already.
      {
        std::lock_guard lock(mutex_);
        position = join_position_;
        position_ = position;
      }
      if (hand_in_.load()) CFMO_TRY(end_handshake(params));
      return Joined::kRunEnded;
    }
    // Every other rank gone: none will answer. It ended if one left as it
    // ended (the keeper's mode gone before this rank asked), not as it failed.
    if (const Others others = others_of(comm_); others.live == 0) {
      if (others.one_left) {
        std::lock_guard lock(mutex_);
        position = join_position_;
        position_ = position;
        return Joined::kRunEnded;
      }
      return make_error(ErrorKind::kPeer, "rank {} joined, but every other rank of the run is lost", comm_.rank());
    }
    if (!ready_for_join) ready_for_join = take_snapshot();
    if (auto& got = ready_for_join; got && placed && got->params.size() == params.size()) {
      std::copy(got->params.begin(), got->params.end(), params.begin());
      std::lock_guard lock(mutex_);
      std::copy(got->params.begin(), got->params.end(), base_.begin());
      for (size_t j = 0; j < base_version_.size(); ++j) base_version_[j] = got->versions[j];
      position = join_position_;
      position_ = position;
      joining_ = false;
      return Joined::kTakenIn;
    }
    if (Clock::now() > deadline) {
      // Which shards, from whom: the line says where to look.
      std::vector<std::string> missing;
      {
        std::lock_guard lock(mutex_);
        for (int j = 0; j < shards_; ++j) {
          if (snapshot_.received.empty() || !snapshot_.received[static_cast<size_t>(j)]) {
            missing.push_back(fmt::format("shard {} from rank {}", j, owner_of_locked(j)));
          }
        }
        if (!placed) missing.emplace_back("no position from the keeper");
        if (ready_for_join) {
          missing.push_back(
              fmt::format("a state of {} parameters came, {} expected", ready_for_join->params.size(), params.size()));
        }
      }
      return make_error(ErrorKind::kPeer,
                        "rank {} joined, but the owners' shards of the global parameters did not all come within "
                        "{:.1f}s (missing: {})",
                        comm_.rank(), settings_.peer_timeout_s * 2 + 5, fmt::join(missing, ", "));
    }
    // Asked again while incomplete: an owner that answered before its shard came back to this rank, or one lost
    // meanwhile. The same request, the shards in so far kept: an owner whose answer waits behind its stream of
    // replica deltas to this rank (its backup) answered more than 500 ms late under load, and a new request each
    // time dropped every answer of the last and never completed.
    if (!ready_for_join && Clock::now() - asked > std::chrono::milliseconds(500)) {
      post_snapshot_request(/*again=*/asked != Clock::time_point{}, kJoinRequest);
      asked = Clock::now();
    }
    seam_sleep_for(std::chrono::milliseconds(2));
  }
}

void AsyncMode::reply_fresh_locked(int to, int shard, int64_t staleness, bool dropped, bool with_shard) {
  const auto it = served_.find(shard);
  std::vector<std::byte> out;
  out.reserve(24 + (with_shard && it != served_.end() ? it->second.values.size() * sizeof(float) : 0));
  put(out, static_cast<uint32_t>(shard));
  put(out, static_cast<uint32_t>(dropped ? 1 : 0));
  put(out, it != served_.end() ? it->second.version : int64_t{0});
  put(out, staleness);
  if (with_shard && it != served_.end()) put_floats(out, it->second.values);
  comm_.post(to, channels::kFreshShard, std::move(out));
}

int AsyncMode::outstanding() const {
  const auto lost = comm_.lost_ranks();
  if (lost.empty()) return awaiting_total_;  // polled: O(1) while nobody is lost
  int n = 0;
  for (int j = 0; j < shards_; ++j) {
    const int owner = awaiting_owner_[static_cast<size_t>(j)];
    if (owner >= 0 && std::find(lost.begin(), lost.end(), owner) == lost.end()) n += awaiting_[static_cast<size_t>(j)];
  }
  return n;
}

void AsyncMode::report_progress(const TrainPosition& position) {
  position_ = position;
  refresh_membership();
  int keeper = 0;
  int standby = -1;
  {
    std::lock_guard lock(mutex_);
    keeper = keeper_locked();
    standby = standby_locked();
  }
  std::vector<std::byte> out;
  put_position(out, position);
  if (standby >= 0) comm_.post(standby, channels::kProgress, out);
  comm_.post(keeper, channels::kProgress, std::move(out));
  if (keeper == comm_.rank() && standby >= 0) {
    send_sample_counts(standby);
  } else if (was_standby_ && keeper != comm_.rank()) {
    // A standby whose place a join took (a process in a lower rank's
    // place: the new standby, or the keeper where the keeper was lost)
    // hands its counts on: the keeper's go there too, but a keeper lost
    // before they did left the joiner keeping the run without them (and
    // without the lost keeper's own samples).
    if (standby >= 0 && standby != comm_.rank()) send_sample_counts(standby);
    if (keeper != last_keeper_) send_sample_counts(keeper);
  }
  was_standby_ = standby == comm_.rank();
  last_keeper_ = keeper;
}

void AsyncMode::send_sample_counts(int standby) {
  // A standby that takes over as keeper writes the summary: the samples of
  // the processes replaced by joins before it stood by (a joiner in its own
  // place, a rank that came after one lost) are known only here. Sent when
  // the standby changes and every second, so that a loss of this rank just
  // after a join leaves the standby at most a second behind.
  std::vector<std::byte> out;
  {
    std::lock_guard lock(mutex_);
    if (progress_.empty()) return;
    const auto now = Clock::now();
    if (standby == counts_sent_to_ && now - counts_sent_at_ < std::chrono::seconds(1)) return;
    counts_sent_to_ = standby;
    counts_sent_at_ = now;
    const size_t n = progress_.size();
    put(out, static_cast<uint64_t>(n));
    for (size_t r = 0; r < n; ++r) put(out, r < retired_samples_.size() ? retired_samples_[r] : int64_t{0});
    for (size_t r = 0; r < n; ++r) put(out, start_samples(static_cast<int>(r)));
    for (size_t r = 0; r < n; ++r) put(out, reconciled_samples_[r]);
  }
  comm_.post(standby, channels::kSampleCounts, std::move(out));
}

void AsyncMode::on_sample_counts(std::span<const std::byte> m) {
  uint64_t n = 0;
  if (!take(m, n) || n > m.size() / (3 * sizeof(int64_t))) return;
  std::vector<int64_t> counts(3 * n);
  for (auto& c : counts) take(m, c);
  refresh_membership();  // the keeper's joins are this rank's too before its counts replace these
  std::lock_guard lock(mutex_);
  keep_positions_locked();
  const size_t w = std::max(progress_.size(), static_cast<size_t>(n));
  if (keeper_locked() == comm_.rank()) {
    // The keeper's own are the newest, but it takes what it lacks (each a
    // count that only grows): a joiner that keeps the run as it comes (its
    // keeper lost as it came) has only what that keeper and the standby it
    // displaced sent it, maybe read after the loss.
    for (auto* v : {&retired_samples_, &start_samples_, &reconciled_samples_}) v->resize(w, 0);
    for (size_t r = 0; r < n; ++r) {
      retired_samples_[r] = std::max(retired_samples_[r], counts[r]);
      start_samples_[r] = std::max(start_samples_[r], counts[n + r]);
      reconciled_samples_[r] = std::max(reconciled_samples_[r], counts[2 * n + r]);
    }
    progress_.resize(w);
    return;
  }
  retired_samples_.assign(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(n));
  start_samples_.assign(counts.begin() + static_cast<std::ptrdiff_t>(n),
                        counts.begin() + static_cast<std::ptrdiff_t>(2 * n));
  std::vector<int64_t> reconciled(counts.begin() + static_cast<std::ptrdiff_t>(2 * n), counts.end());
  retired_samples_.resize(w, 0);
  start_samples_.resize(w, 0);
  reconciled.resize(w, 0);
  reconciled_samples_ = std::move(reconciled);
  progress_.resize(w);
}

bool AsyncMode::all_live(const RankFlags& flags) const {
  auto lost = comm_.lost_ranks();
  std::sort(lost.begin(), lost.end());
  lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
  std::lock_guard lock(mutex_);
  // Of the ranks this mode knows (a rank the world grew by counts once refresh_membership took it up).
  int set_or_lost = flags.count;
  for (const int r : lost) {
    if (r >= 0 && r < world_locked() && !flags[r]) ++set_or_lost;
  }
  return set_or_lost >= world_locked();
}

bool AsyncMode::gather_complete() {
  if (!all_live(gathered_from_)) return false;
  std::lock_guard lock(mutex_);
  const PartialGlobalState& gather = gather_locked();
  for (int j = 0; j < shards_; ++j) {
    if (!gather.received[static_cast<size_t>(j)] && owner_of_locked(j) >= 0) return false;
  }
  return true;
}

void AsyncMode::wait_until_all_done(Clock::time_point deadline, std::span<const float> params) {
  // Done goes to the keeper only, which answers every rank once all live
  // ranks are done: 2W messages, where done from everyone to everyone was
  // W^2. A rank is done once its contributions were answered (finish drains
  // its replies first), so the owners' shards then hold them all.
  int told = -1;
  while (!all_done_.load() && Clock::now() < deadline) {
    refresh_membership();
    while_ending(params);
    int keeper = 0;
    {
      std::lock_guard lock(mutex_);
      keeper = keeper_locked();
    }
    if (keeper != told) {  // first, and again when the keeper was lost
      comm_.post(keeper, channels::kDone, {});
      told = keeper;
    }
    if (keeper == comm_.rank() && all_live(done_from_)) {
      const std::vector<std::byte> all{std::byte{1}};
      for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kDone, all);
      all_done_ = true;
      break;
    }
    seam_sleep_for(std::chrono::milliseconds(1));
  }
}

Status AsyncMode::end_handshake(std::span<float> params) {
  {
    // The keeper takes no joiner in from here on (turn_away_locked): one
    // that asks now is told the run ended, and nothing waits for its training.
    std::lock_guard lock(mutex_);
    joins_closed_ = true;
  }
  const auto start = Clock::now();
  const auto deadline = start + seconds(settings_.peer_timeout_s * 3);
  wait_until_all_done(deadline, params);
  if (!all_done_.load()) {
    // The keeper waited its whole end for some rank: say which (a rank that
    // is not the keeper says below that nobody gathered).
    std::lock_guard lock(mutex_);
    std::vector<int> waiting;
    for (int r = 0; r < world_locked() && keeper_locked() == comm_.rank(); ++r) {
      if (!done_from_[r] && !comm_.is_lost_rank(r)) waiting.push_back(r);
    }
    if (!waiting.empty()) {
      return make_error(ErrorKind::kPeer, "rank {} ended, but rank {} did not finish within {:.1f}s", comm_.rank(),
                        fmt::join(waiting, ", rank "), settings_.peer_timeout_s * 3);
    }
  }
  // Owners' shards now include every contribution: each goes to the keeper,
  // again to a new keeper if it is lost, and again when this rank takes over
  // a lost owner's shard meanwhile.
  int sent_to = -1;
  size_t sent_shards = 0;
  bool keeping = false;
  while (Clock::now() < deadline) {
    refresh_membership();
    CFMO_TRY(cut_off());
    std::vector<std::byte> out;
    int keeper = 0;
    {
      std::lock_guard lock(mutex_);
      keeper = keeper_locked();
      if (keeper != sent_to || served_.size() != sent_shards) {
        put_position(out, position_);
        put_owner_shards_locked(out);
        sent_shards = served_.size();
      }
    }
    if (!out.empty()) {
      comm_.post(keeper, channels::kGather, std::move(out));
      sent_to = keeper;
    }
    keeping = keeper == comm_.rank();
    if (keeping && gather_complete()) break;
    if (!keeping && gathered_.load()) break;
    while_ending(params);
    seam_sleep_for(std::chrono::milliseconds(1));
  }
  if (keeping) {
    std::lock_guard lock(mutex_);
    PartialGlobalState& gather = gather_locked();
    GlobalState& g = gather.state;
    for (int j = 0; j < shards_; ++j) {
      // A shard whose every holder was lost keeps the keeper's own values: the best there is.
      if (gather.received[static_cast<size_t>(j)]) {
        std::copy_n(g.params.begin() + static_cast<std::ptrdiff_t>(bounds_[static_cast<size_t>(j)]), shard_size(j),
                    shard_of(params, j).begin());
      }
    }
    for (int r = 0; r < world_locked() && r < static_cast<int>(g.ranks.size()); ++r) {
      // (A joiner told the run ended trained nothing: its place's last position is the keeper's.)
      const bool turned_away = std::find(unadmitted_.begin(), unadmitted_.end(), r) != unadmitted_.end();
      if ((!gathered_from_[r] || turned_away) && !progress_.empty()) {
        g.ranks[static_cast<size_t>(r)] = progress_[static_cast<size_t>(r)];
      }
    }
    g.params.assign(params.begin(), params.end());
    final_ = std::move(g);
  }
  if (keeping) {
    gathered_by_ = comm_.rank();
    for (int r = 0; r < comm_.size(); ++r) {
      if (r != comm_.rank()) comm_.post(r, channels::kGathered, {});
    }
  }
  count_finish_wait(start);
  if (!keeping && !gathered_.load()) {
    const Status health = comm_.health();  // a keeper that failed on its own said why: its kind counts
    return make_error(health ? ErrorKind::kPeer : health.error().kind,
                      "no live rank gathered the global parameters within {:.1f}s", settings_.peer_timeout_s * 3);
  }
  return {};
}

void AsyncMode::start_serving_owner_state() {
  comm_.on_message(channels::kCheckpoint, [this](int from, std::span<const std::byte> m) { on_checkpoint(from, m); });
}

void AsyncMode::stop_serving_owner_state() { comm_.on_message(channels::kCheckpoint, nullptr); }

/// [u32 n] then, per shard, [u32 shard][i64 version][i64 owner steps][u32 buffers][params][owner state...].
void AsyncMode::put_owner_shards_locked(std::vector<std::byte>& out) {
  put(out, static_cast<uint32_t>(served_.size()));
  for (const auto& [shard, served] : served_) {
    const auto state = owner_state(shard);
    put(out, static_cast<uint32_t>(shard));
    put(out, served.version);
    put(out, owner_steps(shard));
    put(out, static_cast<uint32_t>(1 + state.size()));
    put_vector(out, served.values);
    for (const auto& buffer : state) put_vector(out, buffer);
  }
}

bool AsyncMode::take_owner_shards(std::span<const std::byte>& m, PartialGlobalState& a) {
  uint32_t n = 0;
  if (!take(m, n) || n > static_cast<uint32_t>(shards_)) return false;
  for (uint32_t i = 0; i < n; ++i) {
    if (!take_owner_shard(m, a)) return false;
  }
  return true;
}

/// Under mutex_: one owner shard into `a` (a shard already in stays: its
/// first answer counts); false when malformed.
bool AsyncMode::take_owner_shard(std::span<const std::byte>& m, PartialGlobalState& a) {
  uint32_t shard = 0;
  int64_t version = 0;
  int64_t steps = 0;
  uint32_t buffers = 0;
  if (!take(m, shard) || shard >= static_cast<uint32_t>(shards_) || !take(m, version) || !take(m, steps) ||
      !take(m, buffers) || buffers == 0 || a.received.size() != static_cast<size_t>(shards_)) {
    return false;
  }
  const bool keep = !a.received[shard];
  const size_t total = bounds_.back();
  const size_t first = bounds_[shard];
  std::vector<float> v;
  for (uint32_t b = 0; b < buffers; ++b) {
    if (!take_vector(m, v) || v.size() != shard_size(static_cast<int>(shard))) return false;
    if (!keep) continue;
    std::vector<float>* into = nullptr;
    if (b == 0) {
      into = &a.state.params;
    } else if (owner_state_kind_ == OwnerState::kOuterMomentum) {
      into = b == 1 ? &a.state.outer_momentum : &a.state.outer_round_sum;
    } else {
      if (a.state.owner_state.size() < b) a.state.owner_state.resize(b);
      into = &a.state.owner_state[b - 1];
    }
    if (into->empty()) into->assign(total, 0.0f);
    std::copy(v.begin(), v.end(), into->begin() + static_cast<std::ptrdiff_t>(first));
  }
  if (!keep) return true;
  a.state.versions[shard] = version;
  if (owner_state_kind_ == OwnerState::kOuterMomentum) {
    if (a.state.outer_in_round.empty()) a.state.outer_in_round.assign(a.received.size(), 0);  // per shard: K
    a.state.outer_in_round[shard] = steps;
  } else {
    a.state.owner_steps[shard] = steps;
  }
  a.received[shard] = true;
  ++a.count;
  return true;
}

void AsyncMode::on_fresh(int, std::span<const std::byte> m) {
  FreshShard f;
  uint32_t shard = 0;
  uint32_t flags = 0;
  if (!take(m, shard) || !take(m, flags) || !take(m, f.version) || !take(m, f.staleness)) return;
  if (shard >= static_cast<uint32_t>(shards_)) return;
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
  refresh_membership();
  bool stop = false;
  {
    std::lock_guard lock(mutex_);
    keep_positions_locked();
    if (static_cast<size_t>(from) >= progress_.size()) return;  // a rank this one does not know yet
    // It trains: taken in (by the keeper; its standby, which may come to keep the run, learns it so).
    if (!unadmitted_.empty()) std::erase(unadmitted_, from);
    TrainPosition& kept = progress_[static_cast<size_t>(from)];
    progress_samples_ += p.samples - kept.samples;  // the total kept as it goes: O(1) per step, not O(W)
    kept = p;
    if (keeper_locked() != comm_.rank()) return;  // the standby only keeps the positions
    stop = settings_.sample_budget > 0 && progress_samples_ >= settings_.sample_budget && !stop_sent_;
    if (stop) stop_sent_ = true;
  }
  if (stop) {
    for (int r = 0; r < comm_.size(); ++r) comm_.post(r, channels::kStop, {});
  }
}

void AsyncMode::on_gather(int from, std::span<const std::byte> m) {
  TrainPosition p;
  if (!take_position(m, p)) return;
  refresh_membership();  // a rank new to this one (the world grew) is counted
  std::lock_guard lock(mutex_);
  PartialGlobalState& gather = gather_locked();
  if (from < world_locked() && take_owner_shards(m, gather)) {
    gather.state.ranks[static_cast<size_t>(from)] = p;
    gathered_from_.mark(from);
    done_from_.mark(from);  // a rank gathers once done: a keeper new since it said so counts it
  }
}

/// A request (any rank, as an owner): the shards I serve to the keeper, now.
/// Shards (the keeper): into the snapshot of that request; complete when every shard is in.
void AsyncMode::on_checkpoint(int from, std::span<const std::byte> m) {
  uint32_t kind = 0;
  uint64_t id = 0;
  if (!take(m, kind) || !take(m, id)) return;
  if (kind == kSnapshotRequest || kind == kJoinRequest) {
    refresh_membership();  // a joiner's shard goes back to it before the answer
    std::vector<std::byte> out;
    {
      std::lock_guard lock(mutex_);
      const bool ended = kind == kJoinRequest && turn_away_locked(from);
      const bool hand_in = ended && hands_in_locked(from);
      put(out, ended ? kRunEnded : kSnapshotShard);
      put(out, id);
      // The asker's last position, where this rank keeps positions (the keeper, its standby): for a joiner.
      const TrainPosition known =
          static_cast<size_t>(from) >= progress_.size() ? TrainPosition{} : progress_[static_cast<size_t>(from)];
      put(out, static_cast<uint8_t>(known.step > 0 ? 1 : 0));
      if (known.step > 0) put_position(out, known);
      if (ended) put(out, static_cast<uint8_t>(hand_in ? 1 : 0));
      if (!ended) put_owner_shards_locked(out);
    }
    comm_.post(from, channels::kCheckpoint, std::move(out));
    return;
  }
  uint8_t has_position = 0;
  TrainPosition position;
  if ((kind != kSnapshotShard && kind != kRunEnded) || !take(m, has_position) ||
      (has_position != 0 && !take_position(m, position))) {
    return;
  }
  std::lock_guard lock(mutex_);
  if (has_position != 0 && position.samples >= join_position_.samples) join_position_ = position;
  // The keeper keeps every rank's position: its answer says all there is (none for a new rank), no need to wait.
  if (from == keeper_locked()) keeper_answered_ = true;
  if (kind == kRunEnded) {
    uint8_t hand_in = 0;
    if (!joining_ || !take(m, hand_in)) return;
    hand_in_ = hand_in != 0;
    run_ended_ = true;
    return;
  }
  if (id != snapshot_id_ || !take_owner_shards(m, snapshot_)) return;
  if (snapshot_.count < shards_) return;
  // Every shard is in (one whose every holder was lost never is: then no checkpoint is whole).
  keep_positions_locked();
  snapshot_.state.ranks = progress_;
  ready_ = std::move(snapshot_.state);
  snapshot_ = PartialGlobalState();
}

}  // namespace cfmo::train::modes
