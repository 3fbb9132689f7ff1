#include "sim/sim_communicator.h"

#include <algorithm>

namespace cfmo::sim {

class SimWorld::Rank final : public comm::Communicator {
 public:
  Rank(SimWorld& world, int rank) : world_(world), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }

  Status all_reduce_sum(std::span<float> data) override {
    double waited = 0;
    Status s = world_.all_reduce(rank_, data, waited);
    stats_.collective_wait_s += waited;
    return s;
  }
  Status all_to_all_v(const std::vector<std::span<const std::byte>>&,
                      const std::vector<std::span<std::byte>>&) override {
    return make_error(ErrorKind::kInternal, "the simulated transport has no all-to-all (no mode uses one)");
  }
  Status barrier() override {
    double waited = 0;
    Status s = world_.barrier(rank_, waited);
    stats_.collective_wait_s += waited;
    return s;
  }
  void post(int peer, comm::Channel channel, std::vector<std::byte> payload) override {
    if (peer < 0 || peer >= world_.size()) return;
    if (peer != rank_) {
      stats_.bytes_sent += payload.size();
      ++stats_.messages_sent;
    }
    world_.post(rank_, peer, channel, std::move(payload));
  }
  void on_message(comm::Channel channel, Handler handler) override { set(channel.id, {std::move(handler), nullptr}); }
  void on_message_owned(comm::Channel channel, OwnedHandler handler) override {
    set(channel.id, {nullptr, std::move(handler)});
  }
  std::vector<int> lost_ranks() const override { return {}; }
  Status health() const override { return {}; }
  comm::CommStats stats() const override { return stats_; }

  /// A message's payload to its channel's handler: `owned`, where the
  /// message had a buffer of its own, else the bytes in `payload`.
  void receive(int from, uint8_t channel, std::span<const std::byte> payload, std::vector<std::byte>* owned) {
    if (from != rank_) {
      stats_.bytes_received += payload.size();
      ++stats_.messages_received;
    }
    const Entry* found = find(channel);
    if (found == nullptr) return;
    const Entry& entry = *found;
    if (entry.owned) {
      std::vector<std::byte> buffer;
      if (owned != nullptr) {
        buffer = std::move(*owned);
      } else {
        buffer.assign(payload.begin(), payload.end());
      }
      entry.owned(from, std::move(buffer));
    } else if (entry.view) {
      entry.view(from, payload);
    }
  }

 private:
  struct Entry {
    Handler view;
    OwnedHandler owned;
  };
  // One thread runs the whole simulation, so unlike comm::HandlerTable (a
  // lock and 256 entries a rank: 16 KiB each, a cache miss a message) no
  // lock, and only the channels a mode registers, in the rank itself (the
  // modes register fewer than kEntries; more go to `more_`). An entry keeps
  // its place: a handler that registers another runs on undisturbed.
  static constexpr size_t kEntries = 12;
  Entry* find(uint8_t channel) {
    for (size_t i = 0; i < used_; ++i) {
      if (channels_[i] == channel) return &entries_[i];
    }
    for (auto& [c, entry] : more_) {
      if (c == channel) return entry.get();
    }
    return nullptr;
  }
  void set(uint8_t channel, Entry entry) {
    if (Entry* e = find(channel); e != nullptr) {
      *e = std::move(entry);
    } else if (used_ < kEntries) {
      channels_[used_] = channel;
      entries_[used_++] = std::move(entry);
    } else {
      more_.emplace_back(channel, std::make_unique<Entry>(std::move(entry)));
    }
  }

  SimWorld& world_;
  const int rank_;
  comm::CommStats stats_;
  size_t used_ = 0;                           ///< of channels_ and entries_
  std::array<uint8_t, kEntries> channels_{};  ///< those with a handler (or that had one)
  std::array<Entry, kEntries> entries_;
  std::vector<std::pair<uint8_t, std::unique_ptr<Entry>>> more_;
};

SimWorld::SimWorld(Scheduler& scheduler, Network& network, int size, Sizer sizer)
    : scheduler_(scheduler), network_(network), sizer_(std::move(sizer)) {
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
  fiber_of_.assign(static_cast<size_t>(size), -1);
  inbound_.resize(static_cast<size_t>(size));
}

SimWorld::~SimWorld() = default;

comm::Communicator& SimWorld::rank(int r) { return *ranks_[static_cast<size_t>(r)]; }

void SimWorld::post(int from, int to, comm::Channel channel, std::vector<std::byte> payload) {
  const uint64_t bytes = sizer_ ? sizer_(channel, from, to, payload.size()) : payload.size();
  const double arrival = std::max(network_.deliver(from, to, bytes, scheduler_.time()), scheduler_.time());
  ++messages_;
  auto& queue = inbound_[static_cast<size_t>(to)];
  Message m;
  m.t = arrival;
  m.order = scheduler_.take_order();
  m.from = from;
  m.channel = channel.id;
  if (payload.size() <= kInline) {
    m.size = static_cast<uint16_t>(payload.size());
    std::copy(payload.begin(), payload.end(), m.bytes.begin());
  } else {
    m.boxed = true;
    if (free_boxes_.empty()) {
      m.box = static_cast<uint32_t>(boxes_.size());
      boxes_.push_back(std::move(payload));
    } else {
      m.box = free_boxes_.back();
      free_boxes_.pop_back();
      boxes_[m.box] = std::move(payload);
    }
  }
  // A link delivers in the order sent, so a message goes last, but for one to
  // itself (no link: it arrives now, before a busy rank's whole backlog) and
  // where latencies differ (between racks): then before those due later.
  // (A scan from the back made asgd's self-messages cost the backlog each.)
  size_t at = queue.size();
  if (at > 0 && queue.back().t > arrival) {
    size_t lo = 0;  // the first due after `arrival`
    while (lo < at) {
      const size_t mid = lo + (at - lo) / 2;
      if (queue[mid].t > arrival) {
        at = mid;
      } else {
        lo = mid + 1;
      }
    }
  }
  const bool first = at == 0;
  queue.insert(at, m);
  if (first) arm(to);  // the event of the one it overtook stays, and finds it no longer first
}

void SimWorld::arm(int to) {
  auto& queue = inbound_[static_cast<size_t>(to)];
  const Message& head = queue.front();
  // The next head, read when this one is delivered: in cache by then, mostly,
  // where reading it then was a miss a message (it was written long before).
  if (queue.size() > 1) __builtin_prefetch(&queue[1]);
  scheduler_.at_order(head.t, head.order, this, (head.order << kRankBits) | static_cast<uint64_t>(to));
}

void SimWorld::fire(uint64_t arg) {
  const int to = static_cast<int>(arg & ((uint64_t{1} << kRankBits) - 1));
  auto& queue = inbound_[static_cast<size_t>(to)];
  if (queue.empty() || (queue.front().order << kRankBits) >> kRankBits != arg >> kRankBits) return;  // overtaken
  const Message m = queue.front();
  queue.pop_front();
  if (!queue.empty()) arm(to);
  Rank& rank = *ranks_[static_cast<size_t>(to)];
  if (m.boxed) {
    std::vector<std::byte> payload = std::move(boxes_[m.box]);  // a handler that posts may move boxes_
    free_boxes_.push_back(m.box);
    rank.receive(m.from, m.channel, payload, &payload);
  } else {
    rank.receive(m.from, m.channel, std::span<const std::byte>(m.bytes.data(), m.size), nullptr);
  }
  scheduler_.poke(fiber_of_[static_cast<size_t>(to)]);
}

// Every rank calls the collectives in the same order, and a rank waits in
// one until all have come: so there is one at a time, and the last to come
// finishes it for everyone (`finish(start)` says when it ends).
Status SimWorld::meet(int rank, const std::function<double(double)>& finish, double& waited) {
  const int fiber = scheduler_.current();
  if (fiber < 0) return make_error(ErrorKind::kInternal, "simulated rank {}: a collective outside a worker", rank);
  Collective& c = collective_;
  ++c.arrived;
  const double start = scheduler_.time();
  if (c.arrived < size()) {
    c.fibers.push_back(fiber);
    scheduler_.suspend();
  } else {
    const double done = finish(start);
    for (int f : c.fibers) scheduler_.wake(f, done);
    collective_ = Collective{};
    scheduler_.sleep(done - start);
  }
  waited = scheduler_.time() - start;
  return {};
}

Status SimWorld::all_reduce(int rank, std::span<float> data, double& waited) {
  if (size() == 1) return {};
  Collective& c = collective_;
  if (c.arrived == 0) {
    c.floats = data.size();
    c.buffers.assign(static_cast<size_t>(size()), {});
  } else if (c.floats != data.size()) {
    return make_error(ErrorKind::kInternal, "simulated all-reduce: rank {} brings {} floats, others {}", rank,
                      data.size(), c.floats);
  }
  c.buffers[static_cast<size_t>(rank)] = data;
  return meet(
      rank,
      [&](double start) {
        std::vector<float> sum(c.floats, 0.0f);
        for (const auto& b : c.buffers) {
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += b[i];
        }
        for (auto& b : c.buffers) std::copy(sum.begin(), sum.end(), b.begin());
        const uint64_t bytes = c.floats * sizeof(float);
        return network_.ring_all_reduce(sizer_ ? sizer_(kCollective, rank, rank, bytes) : bytes, start);
      },
      waited);
}

Status SimWorld::barrier(int rank, double& waited) {
  if (size() == 1) return {};
  return meet(
      rank, [&](double start) { return network_.barrier(start); }, waited);
}

}  // namespace cfmo::sim
