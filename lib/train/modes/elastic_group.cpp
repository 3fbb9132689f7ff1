#include "train/modes/elastic_group.h"

#include "train/modes/quorum.h"
#include "train/modes/timing.h"
#include "train/modes/wire.h"

#include <algorithm>
#include <map>

namespace cfmo::train::modes {
namespace {
// How long a wait sleeps without news: losses are found by the transport, not announced.
constexpr auto kNap = std::chrono::milliseconds(5);
}  // namespace

ElasticGroup::ElasticGroup(comm::Communicator& comm, comm::Channel channel, double peer_timeout_s)
    : comm_(comm), channel_(channel), peer_timeout_s_(peer_timeout_s), since_(static_cast<size_t>(comm.size()), 0) {
  for (int r = 0; r < comm.size(); ++r) members_.push_back(r);
  comm_.on_message(channel_, [this](int from, std::span<const std::byte> m) { on_message(from, m); });
}

ElasticGroup::~ElasticGroup() { comm_.on_message(channel_, nullptr); }

int ElasticGroup::index() const {
  const auto it = std::find(members_.begin(), members_.end(), comm_.rank());
  return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
}

// (Asked at every turn of a wait: the transport answers without copying its lists.)
bool ElasticGroup::lost(int rank) const { return comm_.is_lost_rank(rank); }

size_t ElasticGroup::joins_of(int rank) const { return comm_.joins_of(rank); }

void ElasticGroup::note_member(int rank) {
  const auto r = static_cast<size_t>(rank);
  if (r >= since_.size()) since_.resize(r + 1, 0);  // a new rank: the world grew
  since_[r] = joins_of(rank);
  retire(rank);
}

void ElasticGroup::retire(int rank) {
  const auto r = static_cast<size_t>(rank);
  if (r >= reconciled_.size()) reconciled_.resize(r + 1, 0);
  if (r >= retired_.size()) retired_.resize(r + 1, 0);
  retired_[r] += reconciled_[r];
  reconciled_[r] = 0;
}

void ElasticGroup::count(std::span<const int64_t> tally) {
  if (tally.size() != members_.size()) return;  // a sum got in a re-forming (kGroup): its tally stays the others'
  for (size_t i = 0; i < tally.size(); ++i) {
    const auto r = static_cast<size_t>(members_[i]);
    if (r >= reconciled_.size()) reconciled_.resize(r + 1, 0);
    reconciled_[r] = std::max(reconciled_[r], tally[i]);
  }
}

namespace {
void put_tally(std::vector<std::byte>& out, std::span<const int64_t> tally) {
  put(out, static_cast<uint32_t>(tally.size()));
  put_bytes(out, tally.data(), tally.size_bytes());
}

bool take_tally(std::span<const std::byte>& in, std::vector<int64_t>& tally, size_t most) {
  uint32_t n = 0;
  if (!take(in, n) || n > most || in.size() < n * sizeof(int64_t)) return false;
  tally.resize(n);
  if (n > 0) std::memcpy(tally.data(), in.data(), n * sizeof(int64_t));
  in = in.subspan(n * sizeof(int64_t));
  return true;
}
}  // namespace

bool ElasticGroup::gone(int rank) const {
  // A loss and the join in its place can both come and go between two looks
  // at lost_ranks(): the new process is not the member, and never sends its parts.
  const auto r = static_cast<size_t>(rank);
  return lost(rank) || joins_of(rank) > (r < since_.size() ? since_[r] : 0);
}

void ElasticGroup::send(int to, Kind kind, uint32_t epoch, uint64_t seq, std::span<const float> floats, bool has,
                        std::span<const int> ranks, std::span<const int64_t> tally) {
  std::vector<std::byte> out;
  put(out, static_cast<uint8_t>(kind));
  put(out, epoch);
  put(out, seq);
  if (kind == kPart) put(out, samples_);
  if (kind == kSum) put_tally(out, tally);
  if (kind == kGroup) {
    put(out, static_cast<uint32_t>(ranks.size()));
    for (const int r : ranks) put(out, static_cast<int32_t>(r));
  }
  if (kind == kJoin || kind == kGroup) put(out, static_cast<uint8_t>(has ? 1 : 0));
  put_floats(out, floats);
  comm_.post(to, channel_, std::move(out));
}

void ElasticGroup::send_grown(int to, Kind kind, std::span<const float> sum, std::span<const int> ranks,
                              std::span<const std::byte> state, bool after) {
  std::vector<std::byte> out;
  put(out, static_cast<uint8_t>(kind));
  // A welcome is of the group after this sum (counted already when `after`); a kSumGrow is this sum's.
  const bool ahead = kind == kWelcome && !after;
  put(out, ahead ? epoch_ + 1 : epoch_);
  put(out, ahead ? seq_ + 1 : seq_);
  put(out, static_cast<uint32_t>(ranks.size()));
  for (const int r : ranks) put(out, static_cast<int32_t>(r));
  if (kind == kWelcome) {
    put(out, static_cast<uint32_t>(after ? last_sum_members_ : members_.size()));
    put(out, static_cast<uint64_t>(state.size()));
    put_bytes(out, state.data(), state.size());
    put_tally(out, reconciled_);
    put_tally(out, retired_);
  } else {
    put_tally(out, tally_);
  }
  put_floats(out, sum);
  comm_.post(to, channel_, std::move(out));
}

void ElasticGroup::on_message(int from, std::span<const std::byte> m) {
  Message msg;
  uint8_t kind = 0;
  if (!take(m, kind) || kind < kPart || kind > kEnded || !take(m, msg.epoch) || !take(m, msg.seq)) return;
  msg.kind = static_cast<Kind>(kind);
  msg.from = from;
  if (msg.kind == kGroup || msg.kind == kWelcome || msg.kind == kSumGrow) {
    uint32_t n = 0;
    if (!take(m, n) || n > static_cast<uint32_t>(comm_.size())) return;
    for (uint32_t i = 0; i < n; ++i) {
      int32_t r = 0;
      if (!take(m, r) || r < 0 || r >= comm_.size()) return;
      msg.ranks.push_back(r);
    }
  }
  if (msg.kind == kJoin || msg.kind == kGroup) {
    uint8_t has = 0;
    if (!take(m, has)) return;
    msg.has = has != 0;
  }
  if (msg.kind == kPart && !take(m, msg.samples)) return;
  // A tally by rank may name a rank this one has not heard of yet (two joins at once): bounded, not by size().
  constexpr size_t kMostRanks = size_t{1} << 20;
  if ((msg.kind == kSum || msg.kind == kSumGrow) && !take_tally(m, msg.tally, kMostRanks)) return;
  if (msg.kind == kWelcome) {
    uint64_t bytes = 0;
    if (!take(m, msg.count) || !take(m, bytes) || bytes > m.size()) return;
    msg.state.assign(m.begin(), m.begin() + static_cast<std::ptrdiff_t>(bytes));
    m = m.subspan(static_cast<size_t>(bytes));
    if (!take_tally(m, msg.tally, kMostRanks) || !take_tally(m, msg.retired, kMostRanks)) return;
  }
  msg.floats.resize(m.size() / sizeof(float));
  if (!msg.floats.empty()) std::memcpy(msg.floats.data(), m.data(), msg.floats.size() * sizeof(float));
  bool too_late = false;
  {
    std::lock_guard lock(mutex_);
    too_late = closed_ && msg.kind == kAdmit;
    if (!too_late) inbox_.push_back(std::move(msg));
  }
  // (A post from the handler is allowed.)
  if (too_late) send(from, kEnded, 0, 0, {});
  arrived_.notify_all();
}

void ElasticGroup::close() {
  std::vector<int> asked;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    Message m;
    while (take_locked(m, [](const Message& x) { return x.kind == kAdmit; })) {
      if (std::find(asked.begin(), asked.end(), m.from) == asked.end()) asked.push_back(m.from);
    }
  }
  for (const int r : asked) send(r, kEnded, 0, 0, {});
}

template <typename Match>
bool ElasticGroup::take_locked(Message& out, Match&& match) {
  for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
    if (match(*it)) {
      out = std::move(*it);
      inbox_.erase(it);
      return true;
    }
  }
  return false;
}

bool ElasticGroup::reform_asked_locked(uint32_t& epoch) const {
  bool asked = false;
  for (const Message& m : inbox_) {
    // A leader's call, or a member's join (it takes this rank for the leader).
    if ((m.kind == kReform || m.kind == kJoin) && m.epoch > epoch_ && m.epoch > target_epoch_) {
      epoch = asked ? std::max(epoch, m.epoch) : m.epoch;
      asked = true;
    }
  }
  return asked;
}

Status ElasticGroup::all_reduce_sum(std::span<float> data, int64_t samples) {
  samples_ = samples;
  for (;;) {
    bool done = false;
    tally_.clear();
    if (target_epoch_ <= epoch_) done = reduce_once(data) == Outcome::kDone;
    if (!done) {
      grow_to_.clear();
      CFMO_ASSIGN_OR_RETURN(done, reform(data));
    }
    if (done) {
      last_.assign(data.begin(), data.end());
      has_last_ = true;
      last_sum_members_ = members_.size();
      last_sum_ranks_ = members_;
      count(tally_);
      ++seq_;
      if (!grow_to_.empty()) {
        // Joiners were taken in at this sum: the next one is theirs too.
        for (const int r : grow_to_) {
          if (std::find(members_.begin(), members_.end(), r) == members_.end()) note_member(r);
        }
        members_ = std::move(grow_to_);
        grow_to_.clear();
        ++epoch_;
        target_epoch_ = epoch_;
      }
      return {};
    }
  }
}

ElasticGroup::Outcome ElasticGroup::reduce_once(std::span<float> data) {
  if (members_.size() == 1) {
    tally_.assign(1, samples_);
    admit_joiners(data);  // a lone survivor still takes a joiner in
    return Outcome::kDone;
  }
  const int me = comm_.rank();
  const int leader = members_.front();
  if (me != leader) {
    send(leader, kPart, epoch_, seq_, data);
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        Message m;
        if (take_locked(m, [&](const Message& x) {
              return (x.kind == kSum || x.kind == kSumGrow) && x.epoch == epoch_ && x.seq == seq_;
            })) {
          if (m.floats.size() == data.size()) {
            std::copy(m.floats.begin(), m.floats.end(), data.begin());
            tally_ = std::move(m.tally);
            if (m.kind == kSumGrow) grow_to_ = m.ranks;
            return Outcome::kDone;
          }
        }
        uint32_t asked = 0;
        if (reform_asked_locked(asked)) {
          target_epoch_ = asked;
          return Outcome::kReform;
        }
        arrived_.wait_for(lock, kNap);
      }
      if (gone(leader)) {
        target_epoch_ = epoch_ + 1;
        return Outcome::kReform;
      }
    }
  }
  std::map<int, std::vector<float>> parts;
  std::map<int, int64_t> samples;
  parts[me].assign(data.begin(), data.end());
  samples[me] = samples_;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      Message m;
      while (take_locked(m, [&](const Message& x) { return x.kind == kPart && x.epoch == epoch_ && x.seq == seq_; })) {
        if (m.floats.size() == data.size()) {
          parts[m.from] = std::move(m.floats);
          samples[m.from] = m.samples;
        }
      }
      uint32_t asked = 0;
      if (reform_asked_locked(asked)) {
        target_epoch_ = asked;
        return Outcome::kReform;
      }
      if (parts.size() < members_.size()) arrived_.wait_for(lock, kNap);
    }
    if (parts.size() == members_.size()) break;
    for (const int r : members_) {
      if (r != me && gone(r)) {
        target_epoch_ = epoch_ + 1;
        return Outcome::kReform;
      }
    }
  }
  // In the members' order, so that the bits are the same whoever leads.
  std::fill(data.begin(), data.end(), 0.0f);
  for (const int r : members_) {
    const auto& part = parts[r];
    for (size_t i = 0; i < data.size(); ++i) data[i] += part[i];
    tally_.push_back(samples[r]);
  }
  if (admit_joiners(data)) return Outcome::kDone;
  for (const int r : members_) {
    if (r != me) send(r, kSum, epoch_, seq_, data, false, {}, tally_);
  }
  return Outcome::kDone;
}

bool ElasticGroup::admit_joiners(std::span<const float> sum) {
  std::vector<int> joiners;
  {
    std::lock_guard lock(mutex_);
    Message m;
    while (take_locked(m, [](const Message& x) { return x.kind == kAdmit; })) {
      const bool member = std::find(members_.begin(), members_.end(), m.from) != members_.end();
      if (!member && !lost(m.from) && std::find(joiners.begin(), joiners.end(), m.from) == joiners.end()) {
        joiners.push_back(m.from);
      }
    }
  }
  if (joiners.empty() || (!welcome_ && !welcome_later_)) return false;
  std::vector<int> grown = members_;
  grown.insert(grown.end(), joiners.begin(), joiners.end());
  std::sort(grown.begin(), grown.end());
  // The joiners' places start their count afresh (their welcome says so), as
  // every member's will when it takes them in; this sum's tally first.
  count(tally_);
  for (const int r : joiners) retire(r);
  for (const int r : members_) {
    if (r != comm_.rank()) send_grown(r, kSumGrow, sum, grown);
  }
  if (welcome_later_) {
    welcome_due_ = std::move(joiners);
  } else {
    const std::vector<std::byte> state = welcome_();
    for (const int r : joiners) send_grown(r, kWelcome, sum, grown, state);
  }
  grow_to_ = std::move(grown);
  return true;
}

void ElasticGroup::send_welcome(std::span<const std::byte> state) {
  // The group has grown by them already (all_reduce_sum counted the sum): its epoch and sums are theirs.
  for (const int r : welcome_due_) send_grown(r, kWelcome, {}, members_, state, /*after=*/true);
  welcome_due_.clear();
}

Result<std::optional<ElasticGroup::Welcome>> ElasticGroup::join(double timeout_s) {
  const auto deadline = Clock::now() + seconds(timeout_s);
  Clock::time_point asked{};
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      Message w;
      if (take_locked(w, [](const Message& x) { return x.kind == kWelcome; })) {
        for (int r = 0; r < comm_.size(); ++r) note_member(r);
        members_ = w.ranks;
        epoch_ = w.epoch;
        target_epoch_ = w.epoch;
        seq_ = w.seq;
        last_ = w.floats;
        has_last_ = !w.floats.empty();  // a welcome sent later carries no sum
        last_sum_members_ = w.count;
        last_sum_ranks_ = members_;
        reconciled_ = std::move(w.tally);
        retired_ = std::move(w.retired);
        std::erase_if(inbox_, [&](const Message& x) { return x.epoch < epoch_ && x.kind != kAdmit; });
        return std::optional<Welcome>(Welcome{std::move(w.state), std::move(w.floats), w.count});
      }
      // (Asked again after a welcome was sent: the welcome above counts, not this.)
      if (take_locked(w, [](const Message& x) { return x.kind == kEnded; })) return std::optional<Welcome>();
    }
    if (Clock::now() > deadline) {
      return make_error(ErrorKind::kPeer, "rank {} joined, but the group's leader did not take it in within {:.1f}s",
                        comm_.rank(), timeout_s);
    }
    // The others' goodbyes: a run whose every other rank left or is lost
    // takes nobody in. It ended if one left as it ended (not as it failed).
    const Others others = others_of(comm_);
    const int live = others.lowest_live;  // the leader
    if (live < 0) {
      if (others.one_left) return std::optional<Welcome>();
      return make_error(ErrorKind::kPeer, "rank {} joined, but every other rank of the run is lost", comm_.rank());
    }
    if (Clock::now() - asked > std::chrono::seconds(1)) {
      // Asked again in case the leader was lost meanwhile.
      asked = Clock::now();
      send(live, kAdmit, 0, 0, {});
    }
    std::unique_lock lock(mutex_);
    arrived_.wait_for(lock, kNap);
  }
}

Result<bool> ElasticGroup::reform(std::span<float> data) {
  const int me = comm_.rank();
  const auto deadline = Clock::now() + seconds(2 * peer_timeout_s_ + 2);
  uint32_t epoch = std::max(target_epoch_, epoch_ + 1);
  auto live_members = [&] {
    std::vector<int> live;
    for (const int r : members_) {
      if (r == me || !gone(r)) live.push_back(r);
    }
    return live;
  };
  auto expired = [&] { return Clock::now() > deadline; };
  auto too_late = [&] {
    return make_error(ErrorKind::kPeer,
                      "the workers could not re-form their group without the lost ones within {:.1f}s",
                      2 * peer_timeout_s_ + 2);
  };
  // Takes up the group `g` announced; true when it carried the sum this rank missed.
  auto apply = [&](const Message& g) -> Result<bool> {
    members_ = g.ranks;
    epoch_ = g.epoch;
    target_epoch_ = g.epoch;
    {
      // A joiner's ask (epoch 0) stays for the new group's leader: it would otherwise wait a second to ask again.
      std::lock_guard lock(mutex_);
      std::erase_if(inbox_, [&](const Message& x) { return x.epoch < epoch_ && x.kind != kAdmit; });
    }
    if (g.seq == seq_) return false;  // the sum in flight is redone by the new group
    if (g.seq == seq_ + 1 && g.has && g.floats.size() == data.size()) {
      std::copy(g.floats.begin(), g.floats.end(), data.begin());
      return true;
    }
    return make_error(ErrorKind::kInternal, "the re-formed group is at sum {}, this rank at {}", g.seq, seq_);
  };
  for (;;) {
    if (expired()) return too_late();
    const auto live = live_members();
    CFMO_TRY(check_quorum(comm_, members_, live));
    const int leader = live.front();
    if (leader != me) {
      send(leader, kJoin, epoch, seq_, has_last_ ? std::span<const float>(last_) : std::span<const float>(), has_last_);
      bool rejoin = false;
      while (!rejoin) {
        if (expired()) return too_late();
        {
          std::unique_lock lock(mutex_);
          Message g;
          if (take_locked(g, [&](const Message& x) { return x.kind == kGroup && x.epoch == epoch; })) {
            lock.unlock();
            return apply(g);
          }
          uint32_t asked = 0;
          if (reform_asked_locked(asked) && asked > epoch) {
            epoch = asked;
            rejoin = true;
            continue;
          }
          arrived_.wait_for(lock, kNap);
        }
        if (gone(leader)) rejoin = true;
      }
      continue;
    }
    // This rank leads: it calls every live member and waits for their joins.
    for (const int r : live) {
      if (r != me) send(r, kReform, epoch, 0, {});
    }
    std::map<int, Message> joins;
    joins[me] = Message{kJoin, me, epoch, seq_, {}, has_last_, last_};
    bool restart = false;
    for (;;) {
      if (expired()) return too_late();
      {
        std::unique_lock lock(mutex_);
        Message j;
        while (take_locked(j, [&](const Message& x) { return x.kind == kJoin && x.epoch == epoch; })) {
          joins[j.from] = std::move(j);
        }
        uint32_t asked = 0;
        if (reform_asked_locked(asked) && asked > epoch) {
          epoch = asked;
          restart = true;
          break;
        }
      }
      const auto now_live = live_members();
      if (now_live.front() != me) {
        restart = true;  // a lower rank it had taken for lost is back in its view: cannot happen, but never hang
        break;
      }
      if (std::all_of(now_live.begin(), now_live.end(), [&](int r) { return joins.count(r) != 0; })) break;
      std::unique_lock lock(mutex_);
      arrived_.wait_for(lock, kNap);
    }
    if (restart) continue;
    const auto members = live_members();
    uint64_t newest = 0;
    for (const int r : members) newest = std::max(newest, joins[r].seq);
    // The sum before the newest, as a member that got it holds it.
    std::span<const float> missed;
    for (const int r : members) {
      if (joins[r].seq == newest && joins[r].has) missed = joins[r].floats;
    }
    Message mine;
    for (const int r : members) {
      const bool behind = joins[r].seq + 1 == newest;
      if (r == me) {
        mine = Message{kGroup,
                       me,
                       epoch,
                       newest,
                       members,
                       behind,
                       behind ? std::vector<float>(missed.begin(), missed.end()) : std::vector<float>()};
        continue;
      }
      send(r, kGroup, epoch, newest, behind ? missed : std::span<const float>(), behind, members);
    }
    return apply(mine);
  }
}

}  // namespace cfmo::train::modes
