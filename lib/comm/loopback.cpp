#include "comm/loopback.h"

#include "comm/collectives.h"
#include "comm/communicator_base.h"
#include "comm/transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

namespace cfmo::comm {

using LoopbackClock = std::chrono::steady_clock;

namespace {

constexpr uint8_t kGoodbye = 0xFE;  // as UCX's: a rank leaving on purpose
static_assert(kLastClientChannel < kGoodbye);
// How long a waiting thread sleeps at most without news (a bound, not a poll
// interval: every change wakes the waiters).
constexpr auto kMaxNap = std::chrono::milliseconds(100);

LoopbackClock::duration seconds(double s) {
  return std::chrono::duration_cast<LoopbackClock::duration>(std::chrono::duration<double>(s));
}

struct Message {
  LoopbackClock::time_point due;
  uint64_t order = 0;
  int from = -1;
  uint8_t channel = 0;
  bool collective = false;
  uint32_t tag = 0;
  std::vector<std::byte> payload;
};

struct Link {
  LoopbackClock::duration delay{};
  bool held = false;
  std::deque<Message> waiting;         ///< while held
  LoopbackClock::time_point last_due;  ///< the last message's arrival: later ones arrive no earlier
};

}  // namespace

/// The world's state, shared by its ranks and the network handle; one mutex
/// guards all of it (a rank's PeerHealth and handlers have their own).
struct LoopbackState {
  struct Rank {
    std::deque<Message> inbox;                                     ///< channel messages, by (due, order)
    std::map<std::pair<int, uint32_t>, std::deque<Message>> mail;  ///< collectives' messages by (from, tag)
    bool present = true;                                           ///< its Communicator exists
    std::optional<LoopbackClock::time_point> quiet_since;          ///< silenced or killed
    bool killed = false;
    bool joins_closed = false;  ///< close_joins: its run is ending
    /// Its Communicator's: a new process took `rank`'s place, or the world
    /// grew by the new rank `rank` (join).
    std::function<void(int rank)> rejoined;
  };

  LoopbackState(int n, LoopbackOptions o)
      : size(n),
        options(o),
        links(static_cast<size_t>(n), std::vector<Link>(static_cast<size_t>(n))),
        ranks(static_cast<size_t>(n)) {}

  Link& link(int from, int to) { return links[static_cast<size_t>(from)][static_cast<size_t>(to)]; }
  Rank& at(int r) { return ranks[static_cast<size_t>(r)]; }
  bool quiet(int r) { return at(r).quiet_since.has_value(); }
  bool connected(int from, int to) { return at(to).present && !quiet(from) && !quiet(to); }

  /// Under mutex: a message leaves `from` for `to` (dropped if they are not connected).
  void send(int from, int to, Message m) {
    if (!connected(from, to)) return;
    m.from = from;
    m.order = next_order++;
    Link& l = link(from, to);
    if (l.held) {
      l.waiting.push_back(std::move(m));
      return;
    }
    arrive(to, l, std::move(m));
  }

  /// Under mutex: `m` is on its way over `l`, due after the link's delay and after the link's last message.
  void arrive(int to, Link& l, Message m) {
    m.due = std::max(LoopbackClock::now() + l.delay, l.last_due);
    l.last_due = m.due;
    Rank& r = at(to);
    if (m.collective) {
      r.mail[{m.from, m.tag}].push_back(std::move(m));
    } else {
      const auto at_or_after = std::upper_bound(
          r.inbox.begin(), r.inbox.end(), m,
          [](const Message& a, const Message& b) { return std::tie(a.due, a.order) < std::tie(b.due, b.order); });
      r.inbox.insert(at_or_after, std::move(m));
      ++in_flight;
    }
    changed.notify_all();
  }

  /// Under mutex: `rank` takes no more messages (silenced, killed or gone): what waits for it is dropped.
  void drop_incoming(int rank) {
    Rank& r = at(rank);
    in_flight -= static_cast<int64_t>(r.inbox.size());
    r.inbox.clear();
    r.mail.clear();
    for (int p = 0; p < size; ++p) {
      link(p, rank).waiting.clear();
      if (quiet(rank)) link(rank, p).waiting.clear();
    }
    changed.notify_all();
  }

  /// The ranks now: changed under mutex (a join grows it), read anywhere.
  std::atomic<int> size;
  const LoopbackOptions options;
  std::mutex mutex;
  std::condition_variable changed;  ///< any change: a message, a loss, a departure, a handler done
  uint64_t next_order = 0;
  int64_t in_flight = 0;                 ///< channel messages in inboxes or being handled
  std::vector<std::vector<Link>> links;  ///< [from][to]; a new rank's links have no delay nor hold
  std::vector<Rank> ranks;
};

namespace {

class LoopbackCommunicator final : public CommunicatorBase {
 public:
  LoopbackCommunicator(std::shared_ptr<LoopbackState> state, int rank, bool joined = false)
      : CommunicatorBase(rank, state->size),
        state_(std::move(state)),
        rank_(rank),
        joined_(joined),
        starting_world_(*this, rank, state_->size),
        collectives_(starting_world_),
        reported_(static_cast<size_t>(state_->size), false) {
    {
      std::lock_guard lock(state_->mutex);
      // Under the state's mutex, as reported_: the peer is live again, and may be found lost anew.
      state_->at(rank_).rejoined = [this](int peer) {
        reported_[static_cast<size_t>(peer)] = false;
        // A new rank first (the world grew): the peers' health knows it before size() says so.
        if (static_cast<size_t>(peer) >= reported_.size()) {
          peers_.grow(peer + 1);
          reported_.resize(static_cast<size_t>(peer) + 1, false);
        }
        peers_.rejoined(peer);
      };
    }
    progress_thread_ = std::thread([this] { progress_loop(); });
  }

  ~LoopbackCommunicator() override {
    {
      std::lock_guard lock(state_->mutex);
      Message goodbye;
      goodbye.channel = kGoodbye;
      goodbye.payload = peers_.goodbye();
      for (int p = 0; p < state_->size; ++p) {
        if (p != rank_) state_->send(rank_, p, goodbye);
      }
      peers_.set_stopping();
      stop_ = true;
      state_->at(rank_).rejoined = nullptr;
      state_->changed.notify_all();
    }
    progress_thread_.join();
    std::lock_guard lock(state_->mutex);
    state_->at(rank_).present = false;
    state_->drop_incoming(rank_);
  }

  int rank() const override { return rank_; }
  int size() const override { return state_->size.load(); }
  bool joined() const override { return joined_; }
  void close_joins() override {
    std::lock_guard lock(state_->mutex);
    state_->at(rank_).joins_closed = true;
  }

  Status all_reduce_sum(std::span<float> data) override {
    return run_collective([&] { return collectives_.all_reduce_sum(data); });
  }
  Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                      const std::vector<std::span<std::byte>>& recv) override {
    return run_collective([&] { return collectives_.all_to_all_v(send, recv); });
  }
  Status barrier() override {
    return run_collective([&] { return collectives_.barrier(); });
  }

  void post(int peer, Channel channel, std::vector<std::byte> payload) override {
    if (peer < 0 || peer >= state_->size) return;
    std::lock_guard lock(state_->mutex);
    if (peer != rank_ && state_->connected(rank_, peer)) {
      stats_bytes_sent_ += payload.size();
      ++stats_messages_sent_;
    }
    Message m;
    m.channel = channel.id;
    m.payload = std::move(payload);
    state_->send(rank_, peer, std::move(m));
  }

 private:
  friend class StartingWorld<LoopbackCommunicator>;

  template <typename Body>
  Status run_collective(Body&& body) {
    CFMO_TRY(health());
    std::lock_guard one_at_a_time(collective_call_mutex_);
    const auto start = LoopbackClock::now();
    Status result = body();
    add_collective_wait(std::chrono::duration<double>(LoopbackClock::now() - start).count());
    return result;
  }

  Status exchange(uint32_t tag, std::span<const SendTo> sends, std::span<const ReceiveFrom> receives,
                  std::string_view what) {
    LoopbackState& s = *state_;
    std::unique_lock lock(s.mutex);
    for (const SendTo& t : sends) {
      if (s.connected(rank_, t.peer)) stats_bytes_sent_ += t.bytes.size();
      Message m;
      m.collective = true;
      m.tag = tag;
      m.payload.assign(t.bytes.begin(), t.bytes.end());
      s.send(rank_, t.peer, std::move(m));
    }
    for (const ReceiveFrom& r : receives) {
      for (;;) {
        auto& mail = s.at(rank_).mail;
        const auto box = mail.find({r.peer, tag});
        const auto now = LoopbackClock::now();
        auto wake = now + kMaxNap;
        if (box != mail.end() && !box->second.empty()) {
          Message& m = box->second.front();
          if (m.due <= now) {
            if (m.payload.size() != r.into.size()) {
              return make_error(ErrorKind::kInternal, "{}: {} bytes from rank {}, {} expected", what, m.payload.size(),
                                r.peer, r.into.size());
            }
            if (!m.payload.empty()) std::memcpy(r.into.data(), m.payload.data(), m.payload.size());
            stats_bytes_received_ += m.payload.size();
            box->second.pop_front();
            if (box->second.empty()) mail.erase(box);
            break;
          }
          wake = std::min(wake, m.due);
        }
        if (peers_.is_lost(r.peer) || peers_.departed(r.peer)) return peers_.failure_of(what, r.peer);
        s.changed.wait_until(lock, wake);
      }
    }
    return {};
  }

  /// Under the state's mutex: finds peers lost by silence (after the
  /// timeout) or by a kill (at once); returns when to look again.
  LoopbackClock::time_point check_silence() {
    LoopbackState& s = *state_;
    const auto now = LoopbackClock::now();
    auto next = now + kMaxNap;
    const auto mine = s.at(rank_).quiet_since;
    for (int p = 0; p < s.size; ++p) {
      if (p == rank_ || reported_[static_cast<size_t>(p)]) continue;
      auto since = s.at(p).quiet_since;
      if (mine && (!since || *mine < *since)) since = mine;
      if (!since) continue;
      const bool killed = s.at(p).killed || s.at(rank_).killed;
      const double silent = std::chrono::duration<double>(now - *since).count();
      if (killed || silent >= s.options.peer_timeout_s) {
        reported_[static_cast<size_t>(p)] = true;
        peers_.mark_lost(
            p, killed ? std::string("connection error: killed") : fmt::format("no message for {:.1f}s", silent));
        s.changed.notify_all();
      } else {
        next = std::min(next, *since + seconds(s.options.peer_timeout_s));
      }
    }
    return next;
  }

  void progress_loop() {
    LoopbackState& s = *state_;
    std::unique_lock lock(s.mutex);
    while (!stop_) {
      auto wake = check_silence();
      auto& inbox = s.at(rank_).inbox;
      if (!inbox.empty() && !s.quiet(rank_)) {
        if (inbox.front().due <= LoopbackClock::now()) {
          Message m = std::move(inbox.front());
          inbox.pop_front();
          lock.unlock();
          handle(m);
          lock.lock();
          --s.in_flight;
          s.changed.notify_all();
          continue;
        }
        wake = std::min(wake, inbox.front().due);
      }
      s.changed.wait_until(lock, wake);
    }
  }

  void handle(Message& m) {
    if (m.channel == kGoodbye) {
      peers_.on_goodbye(m.from, m.payload);  // the loop's notify then wakes a collective waiting on the leaver
      return;
    }
    if (m.from != rank_) {
      stats_bytes_received_ += m.payload.size();
      ++stats_messages_received_;
    }
    handlers_.deliver(m.from, m.channel, m.payload);
  }

  const std::shared_ptr<LoopbackState> state_;
  const int rank_;
  const bool joined_;                                   ///< joined a run under way (LoopbackNetwork::join)
  StartingWorld<LoopbackCommunicator> starting_world_;  ///< before collectives_, which refers to it
  Collectives collectives_;                             ///< under collective_call_mutex_
  std::mutex collective_call_mutex_;
  std::vector<bool> reported_;  ///< progress thread, under the state's mutex: peers already found lost
  bool stop_ = false;           ///< under the state's mutex
  std::thread progress_thread_;
};

}  // namespace

void LoopbackNetwork::set_delay(int from, int to, double seconds_each) {
  std::lock_guard lock(state_->mutex);
  for (int f = 0; f < state_->size; ++f) {
    for (int t = 0; t < state_->size; ++t) {
      if ((from < 0 || f == from) && (to < 0 || t == to)) state_->link(f, t).delay = seconds(seconds_each);
    }
  }
}

void LoopbackNetwork::hold(int from, int to) {
  std::lock_guard lock(state_->mutex);
  state_->link(from, to).held = true;
}

void LoopbackNetwork::release(int from, int to) {
  std::lock_guard lock(state_->mutex);
  Link& l = state_->link(from, to);
  l.held = false;
  while (!l.waiting.empty()) {
    Message m = std::move(l.waiting.front());
    l.waiting.pop_front();
    if (state_->connected(from, to)) state_->arrive(to, l, std::move(m));
  }
}

void LoopbackNetwork::silence(int rank) {
  std::lock_guard lock(state_->mutex);
  auto& r = state_->at(rank);
  if (!r.quiet_since) r.quiet_since = LoopbackClock::now();
  state_->drop_incoming(rank);
}

void LoopbackNetwork::kill(int rank) {
  std::lock_guard lock(state_->mutex);
  auto& r = state_->at(rank);
  if (!r.quiet_since) r.quiet_since = LoopbackClock::now();
  r.killed = true;
  state_->drop_incoming(rank);
  state_->changed.notify_all();  // the others' progress loops find the kill now, not at their next nap's end
}

bool LoopbackNetwork::drain(double timeout_s) {
  std::unique_lock lock(state_->mutex);
  return state_->changed.wait_for(lock, seconds(timeout_s), [&] { return state_->in_flight == 0; });
}

Result<std::unique_ptr<Communicator>> LoopbackNetwork::join(int rank, bool past_close) {
  {
    std::lock_guard lock(state_->mutex);
    const int size = state_->size.load();
    // The lowest live rank serves joins, as UCX's leader does at the
    // rendezvous: once its run ends, or with nobody live, nobody is taken in.
    int leader = 0;
    while (leader < size && (!state_->at(leader).present || state_->quiet(leader))) ++leader;
    if (leader == size) return make_error(ErrorKind::kPeer, "loopback: no live rank takes rank {} in", rank);
    if (state_->at(leader).joins_closed && !past_close) {
      return make_error(ErrorKind::kPeer, "loopback: the run ends: rank {} takes nobody in", leader);
    }
    if (rank == size) {
      // A new rank: the world grows by one. The tables first, then every
      // rank's communicator (its health knows the rank, the join recorded),
      // then the size that others read, as UCX's ranks take one in.
      const auto n = static_cast<size_t>(size) + 1;
      state_->ranks.resize(n);
      state_->links.resize(n);
      for (auto& row : state_->links) row.resize(n);
      for (int p = 0; p < size; ++p) {
        if (state_->at(p).rejoined) state_->at(p).rejoined(rank);
      }
      state_->size.store(size + 1);
      state_->changed.notify_all();
    } else {
      if (rank < 0 || rank > size) {
        return make_error(ErrorKind::kUsage, "loopback: no rank {} in a world of {}", rank, size);
      }
      auto& r = state_->at(rank);
      if (r.present || !r.quiet_since) {
        return make_error(ErrorKind::kUsage, "loopback: rank {} is not free (lost, its Communicator destroyed)", rank);
      }
      r = LoopbackState::Rank{};
      for (int p = 0; p < size; ++p) {
        for (Link* l : {&state_->link(p, rank), &state_->link(rank, p)}) {
          l->held = false;
          l->waiting.clear();
        }
        if (p != rank && state_->at(p).rejoined) state_->at(p).rejoined(rank);
      }
      state_->changed.notify_all();
    }
  }
  // (Outside the lock: the new rank's Communicator takes it.)
  return std::unique_ptr<Communicator>(std::make_unique<LoopbackCommunicator>(state_, rank, /*joined=*/true));
}

LoopbackWorld make_loopback_world(int size, const LoopbackOptions& options) {
  auto state = std::make_shared<LoopbackState>(std::max(1, size), options);
  LoopbackWorld world;
  for (int r = 0; r < state->size; ++r) world.ranks.push_back(std::make_unique<LoopbackCommunicator>(state, r));
  world.network = std::make_unique<LoopbackNetwork>(state);
  return world;
}

}  // namespace cfmo::comm
