#include "moe/dispatch_engines.h"

#include "moe/channels.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace cfmo::moe {
namespace {

enum class Kind : uint32_t { kDispatch = 1, kResult = 2, kDone = 3 };

/// Every async message starts with this, then `count` uint32 expert counts,
/// padded to 16 bytes, then the rows.
struct WireHeader {
  uint32_t kind = 0;
  uint32_t run = 0;
  uint32_t iteration = 0;  ///< the iteration (low 32 bits); for kDone, unused
  uint32_t count = 0;
  /// kDispatch: microseconds left until the sender's deadline when it sent
  /// the chunk (kNoDeadline: none). Relative, so no clock is shared.
  uint32_t budget_us = 0;
};
static_assert(sizeof(WireHeader) == 20);
constexpr uint32_t kNoDeadline = ~uint32_t{0};

size_t rows_offset(size_t counts) { return (sizeof(WireHeader) + counts * sizeof(uint32_t) + 15) / 16 * 16; }

std::vector<std::byte> start_message(Kind kind, uint32_t run, int64_t iteration, std::span<const uint32_t> counts,
                                     uint32_t budget_us = kNoDeadline) {
  std::vector<std::byte> out(rows_offset(counts.size()));
  const WireHeader h{static_cast<uint32_t>(kind), run, static_cast<uint32_t>(iteration),
                     static_cast<uint32_t>(counts.size()), budget_us};
  std::memcpy(out.data(), &h, sizeof h);
  if (!counts.empty()) std::memcpy(out.data() + sizeof h, counts.data(), counts.size_bytes());
  return out;
}

/// One iteration of this rank between its dispatch and its combine.
struct IterationInFlight {
  int64_t iteration = 0;
  Routing routing;
  DispatchPlan plan;
  std::vector<std::vector<std::byte>> results;  ///< per rank: the result message (own rank: rows only)
  std::vector<size_t> offsets;                  ///< per rank: where the rows start in results
  std::vector<bool> have;
  int awaiting = 0;       ///< other ranks whose results are still out
  bool own_done = false;  ///< the own tokens for the own experts are computed
  Clock::time_point start;
  Clock::time_point dispatch_start;
  Clock::time_point deadline;
  Clock::time_point last_result;
  double waited_s = 0;  ///< time this rank sat waiting with this iteration the oldest
};

}  // namespace

AsyncEngine::AsyncEngine(comm::Communicator& comm) : comm_(comm) {
  comm_.on_message_owned(channels::kExperts,
                         [this](int from, std::vector<std::byte> payload) { on_message(from, std::move(payload)); });
}

AsyncEngine::~AsyncEngine() { comm_.on_message_owned(channels::kExperts, nullptr); }

void AsyncEngine::on_message(int from, std::vector<std::byte> payload) {
  if (payload.size() < sizeof(WireHeader)) return;
  WireHeader h;
  std::memcpy(&h, payload.data(), sizeof h);
  if (h.run != accepted_run_.load()) return;  // a straggling message of a finished run
  {
    std::lock_guard lock(mutex_);
    inbox_.push_back(Message{from, std::move(payload), Clock::now()});
  }
  arrived_.notify_one();
}

Result<RankRecord> AsyncEngine::run(const EngineSetup& s, int64_t first_iteration, int64_t iterations,
                                    double deadline_s) {
  const int ranks = comm_.size();
  const int me = comm_.rank();
  const auto r_count = static_cast<size_t>(ranks);
  const int hidden = s.inputs->hidden;
  const auto h = static_cast<size_t>(hidden);
  const size_t row = row_bytes(s.dtype, hidden);
  const auto mine = static_cast<size_t>(s.placement.count(me));
  const size_t assignments = static_cast<size_t>(s.inputs->tokens) * static_cast<size_t>(s.top_k);
  const bool stale_policy = s.late_policy == LatePolicy::kStale;
  // A run from iteration 0 starts a new measurement: no slot has a result yet.
  if (stale_policy && (stale_rows_.size() != assignments * h || first_iteration == 0)) {
    stale_rows_.assign(assignments * h, 0.0f);
    stale_iteration_.assign(assignments, -1);
  }

  // Accept this run's messages before anyone can send one: after the barrier.
  accepted_run_.store(++run_);
  {
    std::lock_guard lock(mutex_);
    inbox_.clear();
  }
  CFMO_TRY(comm_.barrier());

  RankRecord record;
  record.load.assign(static_cast<size_t>(s.placement.experts), 0);
  std::deque<IterationInFlight> flights;
  // Plans of recently combined iterations, so a late result can still refresh the stale slots.
  std::deque<std::pair<int64_t, std::vector<std::vector<int32_t>>>> recent;
  std::vector<bool> done(r_count, false);
  // Per peer, the newest iteration it has dispatched: a peer opens iteration
  // j only after combining j - in_flight, so a chunk that old can only be late.
  std::vector<int64_t> newest(r_count, -1);
  done[static_cast<size_t>(me)] = true;
  std::vector<float> scratch;
  std::vector<float> decoded;
  std::vector<float> output(static_cast<size_t>(s.inputs->tokens) * h);
  std::vector<const float*> rows;
  std::vector<uint8_t> late_mask;
  int64_t next = first_iteration;
  const int64_t end = first_iteration + iterations;
  const auto run_start = Clock::now();
  Clock::time_point last_finish = run_start;

  auto results_in_flight = [&] {
    return std::any_of(flights.begin(), flights.end(), [](const IterationInFlight& f) { return f.awaiting > 0; });
  };
  // Seconds of expert compute per row on this rank lately (simulated
  // slowness included): what serving a chunk will take.
  double row_cost_s = 0;
  auto timed_compute = [&](auto&& work, size_t rows = 0) {
    const bool overlapped = results_in_flight();
    const double took = s.pacer->run(work);
    record.compute_s += took;
    if (overlapped) record.overlapped_s += took;
    if (rows > 0) {
      const double cost = took / static_cast<double>(rows);
      row_cost_s = row_cost_s == 0 ? cost : 0.8 * row_cost_s + 0.2 * cost;
    }
  };

  // What is left of a flight's deadline, for the chunks it sends.
  auto budget_us = [&](const IterationInFlight& f) -> uint32_t {
    if (f.deadline == Clock::time_point::max()) return kNoDeadline;
    const double left = std::max(0.0, seconds_between(Clock::now(), f.deadline)) * 1e6;
    return static_cast<uint32_t>(std::min(left, static_cast<double>(kNoDeadline - 1)));
  };

  auto start_flight = [&](int64_t i) {
    s.pacer->new_iteration();
    IterationInFlight f;
    f.iteration = i;
    f.start = Clock::now();
    timed_compute([&] { f.routing = route_iteration(s, i); });
    f.plan = plan_dispatch(f.routing, s.placement);
    f.results.resize(r_count);
    f.offsets.assign(r_count, 0);
    f.have.assign(r_count, false);
    const float* x = s.inputs->batch(i);
    f.dispatch_start = Clock::now();
    f.deadline =
        deadline_s > 0
            ? f.dispatch_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(deadline_s))
            : Clock::time_point::max();
    for (int p = 0; p < ranks; ++p) {
      const auto pi = static_cast<size_t>(p);
      if (p == me || f.plan.slots[pi].empty()) continue;
      std::vector<std::byte> message = start_message(Kind::kDispatch, run_, i, f.plan.counts[pi], budget_us(f));
      const size_t header = message.size();
      encode_rows(x, hidden, s.top_k, f.plan.slots[pi], s.dtype, message);
      record.dispatch_bytes += static_cast<double>(message.size() - header);
      record.peer_bytes += static_cast<double>(message.size() - header);
      comm_.post(p, channels::kExperts, std::move(message));
      ++f.awaiting;
    }
    flights.push_back(std::move(f));
  };

  // The own tokens for the own experts, while the rest travel: after the
  // chunks that peers sent are served (they wait on them; this rank's own
  // combine waits on its remote results anyway).
  auto compute_own = [&](IterationInFlight& f) {
    const auto mi = static_cast<size_t>(me);
    std::vector<std::byte> own;
    encode_rows(s.inputs->batch(f.iteration), hidden, s.top_k, f.plan.slots[mi], s.dtype, own);
    record.dispatch_bytes += static_cast<double>(own.size());
    timed_compute([&] { compute_rows(own, f.plan.counts[mi], *s.experts, s.dtype, hidden, f.results[mi], 0, scratch); },
                  f.plan.slots[mi].size());
    f.have[mi] = true;
    f.own_done = true;
    f.last_result = std::max(f.last_result, Clock::now());
  };

  auto finish_flight = [&] {
    IterationInFlight& f = flights.front();
    const auto finish_start = Clock::now();
    rows.assign(assignments, nullptr);
    late_mask.assign(assignments, 0);
    if (s.dtype != comm::WireDtype::kFp32) decoded.resize(assignments * h);
    for (size_t p = 0; p < r_count; ++p) {
      const auto& slots = f.plan.slots[p];
      if (f.have[p]) {
        std::span<const std::byte> bytes(f.results[p]);
        locate_results(bytes.subspan(f.offsets[p]), slots, s.dtype, hidden, decoded, rows);
        if (stale_policy) {
          for (int32_t a : slots) {
            const auto ai = static_cast<size_t>(a);
            std::memcpy(stale_rows_.data() + ai * h, rows[ai], h * sizeof(float));
            stale_iteration_[ai] = f.iteration;
          }
        }
        continue;
      }
      for (int32_t a : slots) {
        const auto ai = static_cast<size_t>(a);
        late_mask[ai] = 1;
        ++record.late;
        if (stale_policy && stale_iteration_[ai] >= 0) {
          rows[ai] = stale_rows_.data() + ai * h;
          ++record.stale;
          const int64_t age = f.iteration - stale_iteration_[ai];
          record.staleness_sum += static_cast<double>(age);
          record.staleness_max = std::max(record.staleness_max, age);
        }
      }
    }
    combine(s.inputs->batch(f.iteration), f.routing, rows, hidden, output.data());
    const auto finished = Clock::now();
    const auto arrived = f.awaiting == 0 ? f.last_result : finished;
    record.dispatch_us.push_back(seconds_between(f.dispatch_start, arrived) * 1e6);
    record.a2a_us.push_back(seconds_between(f.dispatch_start, arrived) * 1e6);
    record.roundtrip_us.push_back(seconds_between(f.dispatch_start, arrived) * 1e6);
    record.combine_us.push_back((f.waited_s + seconds_between(finish_start, finished)) * 1e6);
    record.iteration_us.push_back(seconds_between(f.start, finished) * 1e6);
    ++record.iterations;
    record.tokens += f.routing.tokens;
    record.assignments += static_cast<int64_t>(assignments);
    record.dropped += f.routing.dropped;
    for (size_t e = 0; e < record.load.size(); ++e) record.load[e] += f.routing.load[e];
    if (f.iteration + 1 == end) {
      record.last_iteration = f.iteration;
      record.last_output = output;
      record.last_late = late_mask;
    }
    if (stale_policy) {
      recent.emplace_back(f.iteration, std::move(f.plan.slots));
      if (recent.size() > 8) recent.pop_front();
    }
    flights.pop_front();
    last_finish = finished;
  };

  auto handle = [&](Message& m) -> Status {
    WireHeader hd;
    std::memcpy(&hd, m.bytes.data(), sizeof hd);
    const auto from = static_cast<size_t>(m.from);
    if (m.from < 0 || m.from >= ranks) return {};
    if (hd.kind == static_cast<uint32_t>(Kind::kDone)) {
      done[from] = true;
      return {};
    }
    const size_t offset = rows_offset(hd.count);
    if (m.bytes.size() < offset) {
      return make_error(ErrorKind::kPeer, "rank {} sent a truncated message ({} bytes)", m.from, m.bytes.size());
    }
    std::vector<uint32_t> counts(hd.count);
    if (hd.count > 0) std::memcpy(counts.data(), m.bytes.data() + sizeof hd, hd.count * sizeof(uint32_t));
    size_t total = 0;
    for (uint32_t c : counts) total += c;
    if (m.bytes.size() != offset + total * row) {
      return make_error(ErrorKind::kPeer, "rank {} sent {} bytes for {} rows", m.from, m.bytes.size(), total);
    }
    if (hd.kind == static_cast<uint32_t>(Kind::kDispatch)) {
      if (done[from]) {  // it combined without us already (a small done can overtake a big chunk)
        ++record.skipped_chunks;
        return {};
      }
      if (static_cast<int64_t>(hd.iteration) + s.in_flight <= newest[from]) {
        ++record.skipped_chunks;  // its requester has combined that iteration: too late to matter
        return {};
      }
      // A result that cannot be back before the requester's deadline could
      // only be late: with the residual policy nobody would use it, so the
      // compute goes to chunks that can still make theirs (with stale, a
      // late result still refreshes its slots). The arrival is no earlier
      // than the send, so only the compute estimate can misjudge.
      if (!stale_policy && hd.budget_us != kNoDeadline &&
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(row_cost_s * static_cast<double>(total))) >
              m.arrived + std::chrono::microseconds(hd.budget_us)) {
        ++record.skipped_chunks;
        return {};
      }
      if (counts.size() != mine) {
        return make_error(ErrorKind::kPeer, "rank {} sent rows for {} experts, this rank has {}", m.from, counts.size(),
                          mine);
      }
      std::vector<std::byte> reply = start_message(Kind::kResult, run_, hd.iteration, counts);
      const size_t header = reply.size();
      timed_compute(
          [&] {
            compute_rows(std::span<const std::byte>(m.bytes).subspan(offset), counts, *s.experts, s.dtype, hidden,
                         reply, header, scratch);
          },
          total);
      comm_.post(m.from, channels::kExperts, std::move(reply));
      return {};
    }
    // A result: for a flight still waiting, or late.
    for (IterationInFlight& f : flights) {
      if (static_cast<uint32_t>(f.iteration) != hd.iteration || f.have[from]) continue;
      f.results[from] = std::move(m.bytes);
      f.offsets[from] = offset;
      f.have[from] = true;
      --f.awaiting;
      f.last_result = m.arrived;
      return {};
    }
    ++record.late_arrivals;
    if (stale_policy) {
      for (const auto& [iteration, slots] : recent) {
        if (static_cast<uint32_t>(iteration) != hd.iteration) continue;
        std::vector<const float*> late_rows(assignments, nullptr);
        if (s.dtype != comm::WireDtype::kFp32) decoded.resize(assignments * h);
        locate_results(std::span<const std::byte>(m.bytes).subspan(offset), slots[from], s.dtype, hidden, decoded,
                       late_rows);
        for (int32_t a : slots[from]) {
          const auto ai = static_cast<size_t>(a);
          if (late_rows[ai] == nullptr || stale_iteration_[ai] > iteration) continue;
          std::memcpy(stale_rows_.data() + ai * h, late_rows[ai], h * sizeof(float));
          stale_iteration_[ai] = iteration;
        }
      }
    }
    return {};
  };

  auto drain = [&]() -> Result<bool> {
    std::deque<Message> batch;
    {
      std::lock_guard lock(mutex_);
      batch.swap(inbox_);
    }
    for (const Message& m : batch) {
      WireHeader hd;
      std::memcpy(&hd, m.bytes.data(), sizeof hd);
      if (hd.kind == static_cast<uint32_t>(Kind::kDispatch) && m.from >= 0 && m.from < ranks) {
        auto& n = newest[static_cast<size_t>(m.from)];
        n = std::max(n, static_cast<int64_t>(hd.iteration));
      }
    }
    for (Message& m : batch) CFMO_TRY(handle(m));
    return !batch.empty();
  };

  auto wait_for_messages = [&](Clock::time_point until) {
    const auto limit = std::min(until, Clock::now() + std::chrono::milliseconds(20));  // health checks between
    const auto before = Clock::now();
    std::unique_lock lock(mutex_);
    arrived_.wait_until(lock, limit, [&] { return !inbox_.empty(); });
    lock.unlock();
    if (!flights.empty()) flights.front().waited_s += seconds_between(before, Clock::now());
  };

  // Each turn: serve what arrived (peers' chunks first: they wait on them),
  // combine the oldest iteration once its results are in or its deadline has
  // passed, open a new iteration while fewer than in_flight are, compute the
  // own rows of the oldest open one, else wait for a message.
  while (!flights.empty() || next < end) {
    CFMO_TRY(comm_.health());
    CFMO_ASSIGN_OR_RETURN(const bool any, drain());
    if (!flights.empty() && (flights.front().awaiting == 0 || Clock::now() >= flights.front().deadline)) {
      if (!flights.front().own_done) compute_own(flights.front());  // local: never late
      finish_flight();
      continue;
    }
    if (next < end && static_cast<int>(flights.size()) < s.in_flight) {
      start_flight(next++);
      continue;
    }
    if (auto f = std::find_if(flights.begin(), flights.end(), [](const IterationInFlight& g) { return !g.own_done; });
        f != flights.end()) {
      compute_own(*f);
      continue;
    }
    if (!any) wait_for_messages(flights.empty() ? Clock::now() : flights.front().deadline);
  }
  record.wall_s = seconds_between(run_start, last_finish);

  // Done: serve the others until each of them is done too.
  for (int p = 0; p < ranks; ++p) {
    if (p != me) comm_.post(p, channels::kExperts, start_message(Kind::kDone, run_, end, {}));
  }
  while (!std::all_of(done.begin(), done.end(), [](bool d) { return d; })) {
    CFMO_TRY(comm_.health());
    CFMO_ASSIGN_OR_RETURN(const bool any, drain());
    if (!any) wait_for_messages(Clock::time_point::max());
  }
  return record;
}

}  // namespace cfmo::moe
