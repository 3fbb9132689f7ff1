#include "model/expert_exchange.h"

#include "moe/channels.h"
#include "moe/stats.h"

#include <algorithm>
#include <cstring>

namespace cfmo::model {
namespace {

using Clock = std::chrono::steady_clock;

enum Kind : uint32_t { kRows = 1, kResults = 2, kGrads = 3, kGradResults = 4, kDone = 5 };
enum Flags : uint32_t { kEval = 1, kSkip = 2 };

/// Every message starts with this, then `count` uint32 row counts (one per
/// local expert of the owner), padded to 16 bytes, then fp32 rows.
struct Header {
  uint32_t kind = 0;
  uint32_t pass = 0;  ///< the requester's pass (low 32 bits)
  uint32_t layer = 0;
  uint32_t count = 0;
  uint32_t budget_us = 0;  ///< kRows: microseconds left to the requester's deadline when sent
  uint32_t flags = 0;
};
static_assert(sizeof(Header) == 24);
constexpr uint32_t kNoBudget = ~uint32_t{0};

size_t rows_offset(size_t counts) { return (sizeof(Header) + counts * sizeof(uint32_t) + 15) / 16 * 16; }

std::vector<std::byte> start_message(const Header& h, std::span<const uint32_t> counts, size_t rows, size_t row_bytes) {
  std::vector<std::byte> out(rows_offset(counts.size()) + rows * row_bytes);
  Header header = h;
  header.count = static_cast<uint32_t>(counts.size());
  std::memcpy(out.data(), &header, sizeof header);
  if (!counts.empty()) std::memcpy(out.data() + sizeof header, counts.data(), counts.size_bytes());
  return out;
}

size_t total_of(std::span<const uint32_t> counts) {
  size_t n = 0;
  for (const uint32_t c : counts) n += c;
  return n;
}

}  // namespace

ExpertExchange::ExpertExchange(comm::Communicator& comm, moe::ExpertPlacement placement, int layers,
                               std::vector<int> moe_layers, int dim, int expert_dim, double deadline_s,
                               TensorsOf tensors_of)
    : comm_(comm),
      placement_(placement),
      rank_(comm.rank()),
      ranks_(comm.size()),
      layers_(layers),
      moe_layers_(std::move(moe_layers)),
      dim_(dim),
      expert_dim_(expert_dim),
      setting_s_(deadline_s),
      deadline_s_(deadline_s < 0 ? kNoDeadline : deadline_s),
      tensors_of_(std::move(tensors_of)) {
  const auto r = static_cast<size_t>(ranks_);
  const auto l = static_cast<size_t>(layers_);
  served_.assign(r, std::vector<Served>(l));
  seen_rows_.assign(r, std::vector<int64_t>(l, -1));
  seen_grads_.assign(r, std::vector<int64_t>(l, -1));
  done_.assign(r, 0);
  lost_.assign(r, 0);
  round_trips_.assign(r, {});
  comm_.on_message_owned(moe::channels::kModelExperts,
                         [this](int from, std::vector<std::byte> payload) { on_message(from, std::move(payload)); });
}

ExpertExchange::~ExpertExchange() { comm_.on_message_owned(moe::channels::kModelExperts, nullptr); }

void ExpertExchange::on_message(int from, std::vector<std::byte> payload) {
  if (payload.size() < sizeof(Header) || from < 0 || from >= ranks_) return;
  {
    std::lock_guard lock(mutex_);
    inbox_.push_back(Message{from, std::move(payload), Clock::now()});
  }
  arrived_.notify_one();
}

std::vector<int> ExpertExchange::lost_ranks() const {
  std::vector<int> out;
  for (int p = 0; p < ranks_; ++p) {
    if (lost_[static_cast<size_t>(p)] != 0) out.push_back(p);
  }
  return out;
}

bool ExpertExchange::live(int p) const {
  return p != rank_ && lost_[static_cast<size_t>(p)] == 0 && done_[static_cast<size_t>(p)] == 0;
}

void ExpertExchange::refresh_lost() {
  for (const int p : comm_.lost_ranks()) {
    if (p >= 0 && p < ranks_) lost_[static_cast<size_t>(p)] = 1;
  }
}

Clock::time_point ExpertExchange::deadline_from(Clock::time_point start) const {
  if (deadline_s_ == kNoDeadline) return Clock::time_point::max();
  return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(deadline_s_));
}

uint32_t ExpertExchange::budget_us(Clock::time_point deadline) const {
  if (deadline == Clock::time_point::max()) return kNoBudget;
  const double left = std::max(0.0, moe::seconds_between(Clock::now(), deadline)) * 1e6;
  return static_cast<uint32_t>(std::min(left, static_cast<double>(kNoBudget - 1)));
}

void ExpertExchange::note_round_trip(int peer, double seconds) {
  if (setting_s_ >= 0 || training_passes_ > kWarmupPasses) return;
  round_trips_[static_cast<size_t>(peer)].push_back(seconds);
}

void ExpertExchange::begin_pass(bool training) {
  ++pass_;
  training_ = training;
  if (training) ++training_passes_;
  if (setting_s_ < 0 && deadline_s_ == kNoDeadline && training_passes_ > kWarmupPasses) {
    // Adaptive: 1.5 x the median over peers of each one's median round
    // trip, so that one slow peer does not set it for everyone.
    std::vector<double> medians;
    for (const auto& trips : round_trips_) {
      if (!trips.empty()) medians.push_back(moe::percentile(trips, 0.5));
    }
    if (!medians.empty()) deadline_s_ = std::max(1e-4, 1.5 * moe::percentile(medians, 0.5));
  }
  // Chunks that waited for this pass are served now, in the order they came.
  if (!deferred_.empty()) {
    std::deque<Message> again;
    again.swap(deferred_);
    for (Message& m : again) {
      if (!handle(m)) deferred_.push_back(std::move(m));
    }
  }
}

void ExpertExchange::pump(Clock::time_point until, const std::function<bool()>& done) {
  auto last_health = Clock::time_point{};
  while (true) {
    const auto now = Clock::now();
    if (now - last_health > std::chrono::milliseconds(20)) {
      refresh_lost();
      last_health = now;
    }
    std::deque<Message> batch;
    {
      std::lock_guard lock(mutex_);
      batch.swap(inbox_);
    }
    for (Message& m : batch) {
      if (!handle(m)) deferred_.push_back(std::move(m));
    }
    if (done() || Clock::now() >= until) return;
    if (batch.empty()) {
      const auto limit = std::min(until, Clock::now() + std::chrono::milliseconds(20));  // health checks between
      std::unique_lock lock(mutex_);
      arrived_.wait_until(lock, limit, [&] { return !inbox_.empty(); });
    }
  }
}

bool ExpertExchange::handle(Message& m) {
  Header h;
  std::memcpy(&h, m.bytes.data(), sizeof h);
  const int from = m.from;
  const auto f = static_cast<size_t>(from);
  if (h.kind == kDone) {
    done_[f] = 1;
    return true;
  }
  const size_t offset = rows_offset(h.count);
  if (m.bytes.size() < offset || h.layer >= static_cast<uint32_t>(layers_)) return true;  // not ours: ignored
  const auto layer = static_cast<int>(h.layer);
  const auto l = static_cast<size_t>(layer);
  std::vector<uint32_t> counts(h.count);
  if (h.count > 0) std::memcpy(counts.data(), m.bytes.data() + sizeof h, h.count * sizeof(uint32_t));
  const size_t rows = (m.bytes.size() - offset) / (static_cast<size_t>(dim_) * sizeof(float));
  const auto* data = reinterpret_cast<const float*>(m.bytes.data() + offset);
  // The requester's pass, widened against this rank's (passes differ by far less than 2^31).
  const auto pass = pass_ + static_cast<int32_t>(h.pass - static_cast<uint32_t>(pass_));
  const bool no_deadline = deadline_s_ == kNoDeadline;

  if (h.kind == kRows || h.kind == kGrads) {
    // With no deadline a chunk is served in its own pass, never with
    // parameters another pass has changed: the results are sync's.
    if (no_deadline && !finishing_ && pass > pass_) return false;
  }
  if (h.kind == kRows) {
    seen_rows_[f][l] = std::max(seen_rows_[f][l], pass);
    Served& s = served_[f][l];
    if (s.awaiting) ++skipped_grads_;  // its gradients never came
    s.awaiting = false;
    if (rows == 0 || counts.size() != static_cast<size_t>(placement_.count(rank_))) return true;
    // A result that cannot be back before the requester's deadline would be
    // late: its compute goes to chunks that can still make theirs.
    if (h.budget_us != kNoBudget &&
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(row_cost_s_ * static_cast<double>(rows))) >
            m.arrived + std::chrono::microseconds(h.budget_us)) {
      ++skipped_chunks_;
      return true;
    }
    const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
    std::vector<std::byte> reply = start_message(Header{kResults, h.pass, h.layer, 0, 0, 0}, counts, rows, row_bytes);
    serve_rows(from, layer, pass, (h.flags & kEval) != 0, counts, data, &reply, rows_offset(counts.size()));
    comm_.post(from, moe::channels::kModelExperts, std::move(reply));
    return true;
  }
  if (h.kind == kGrads) {
    seen_grads_[f][l] = std::max(seen_grads_[f][l], pass);
    Served& s = served_[f][l];
    if (!s.awaiting || s.pass != pass) {
      if (rows > 0) ++skipped_grads_;  // rows this rank never served (late, skipped) or served anew since
      return true;
    }
    s.awaiting = false;
    if ((h.flags & kSkip) != 0 || rows == 0 || rows != s.in.size() / static_cast<size_t>(dim_)) return true;
    const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
    std::vector<std::byte> reply =
        start_message(Header{kGradResults, h.pass, h.layer, 0, 0, 0}, s.counts, rows, row_bytes);
    serve_grads(from, layer, pass, data, &reply, rows_offset(s.counts.size()));
    comm_.post(from, moe::channels::kModelExperts, std::move(reply));
    return true;
  }
  // A reply: for the exchange this rank waits in, or late.
  const uint32_t want = h.kind == kResults ? kRows : kGrads;
  if (request_.kind == want && request_.layer == layer && static_cast<uint32_t>(pass_) == h.pass &&
      request_.awaiting[f] != 0) {
    request_.awaiting[f] = 0;
    (*request_.results)[f].assign(m.bytes.begin() + static_cast<ptrdiff_t>(offset), m.bytes.end());
    (*request_.have)[f] = 1;
    note_round_trip(from, moe::seconds_between(request_.start, m.arrived));
  }
  return true;
}

void ExpertExchange::serve_rows(int source, int layer, int64_t pass, bool eval, std::span<const uint32_t> counts,
                                const float* rows, std::vector<std::byte>* reply, size_t offset) {
  const auto start = Clock::now();
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const size_t n = total_of(counts);
  Served& s = served_[static_cast<size_t>(source)][static_cast<size_t>(layer)];
  s.pass = pass;
  s.at_pass = pass_;
  s.awaiting = !eval;
  s.counts.assign(counts.begin(), counts.end());
  s.in.assign(rows, rows + n * c);
  s.fc.resize(n * d);
  s.act.resize(n * d);
  auto* out = reinterpret_cast<float*>(reply->data() + offset);
  const std::vector<ExpertTensors> experts = tensors_of_(layer, false);
  size_t first = 0;
  for (size_t i = 0; i < counts.size() && i < experts.size(); ++i) {
    const auto k = static_cast<int>(counts[i]);
    expert_forward(s.in.data() + first * c, k, experts[i], dim_, expert_dim_, s.fc.data() + first * d,
                   s.act.data() + first * d, out + first * c);
    first += counts[i];
  }
  if (n > 0) {
    const double cost = moe::seconds_between(start, Clock::now()) / static_cast<double>(n);
    row_cost_s_ = row_cost_s_ == 0 ? cost : 0.8 * row_cost_s_ + 0.2 * cost;
  }
}

void ExpertExchange::serve_grads(int source, int layer, int64_t pass, const float* d_out, std::vector<std::byte>* reply,
                                 size_t offset) {
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  Served& s = served_[static_cast<size_t>(source)][static_cast<size_t>(layer)];
  const size_t n = s.in.size() / c;
  Stashed st;
  st.layer = layer;
  st.source = source;
  st.pass = pass;
  st.counts = s.counts;
  st.in = std::move(s.in);
  st.act = std::move(s.act);
  st.d_out.assign(d_out, d_out + n * c);
  st.d_act.resize(n * d);
  auto* dx = reinterpret_cast<float*>(reply->data() + offset);
  const std::vector<ExpertTensors> experts = tensors_of_(layer, false);
  size_t first = 0;
  for (size_t i = 0; i < st.counts.size() && i < experts.size(); ++i) {
    const auto k = static_cast<int>(st.counts[i]);
    expert_backward_inputs(st.d_out.data() + first * c, k, s.fc.data() + first * d, experts[i], dim_, expert_dim_,
                           st.d_act.data() + first * d, dx + first * c);
    first += st.counts[i];
  }
  s.fc.clear();
  stash_.push_back(std::move(st));
}

void ExpertExchange::await_replies(Clock::time_point deadline, MoeMlp::Timing& timing) {
  const auto wait = Clock::now();
  pump(deadline, [&] {
    for (size_t p = 0; p < request_.awaiting.size(); ++p) {
      if (request_.awaiting[p] != 0 && lost_[p] == 0) return false;
    }
    return true;
  });
  timing.combine_s += moe::seconds_between(wait, Clock::now());
}

void ExpertExchange::forward(int layer, const float* x, int top_k, const moe::DispatchPlan& plan,
                             std::vector<std::vector<std::byte>>& results, std::vector<uint8_t>& have,
                             MoeMlp::Timing& timing) {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  results.assign(r, {});
  have.assign(r, 0);
  refresh_lost();
  request_ = Request{kRows, layer, &results, &have, std::vector<uint8_t>(r, 0), start};
  for (int p = 0; p < ranks_; ++p) {
    const auto pi = static_cast<size_t>(p);
    if (p == rank_ || lost_[pi] != 0) continue;  // a finished peer still serves until every rank has
    const Header h{kRows, static_cast<uint32_t>(pass_), static_cast<uint32_t>(layer),
                   0,     budget_us(deadline),          training_ ? 0u : static_cast<uint32_t>(kEval)};
    std::vector<std::byte> message = start_message(h, plan.counts[pi], 0, row_bytes);
    moe::encode_rows(x, dim_, top_k, plan.slots[pi], comm::WireDtype::kFp32, message);
    comm_.post(p, moe::channels::kModelExperts, std::move(message));
    request_.awaiting[pi] = plan.slots[pi].empty() ? 0 : 1;
  }
  // The own rows for the own experts, while the rest travel.
  const auto me = static_cast<size_t>(rank_);
  std::vector<std::byte> own;
  moe::encode_rows(x, dim_, top_k, plan.slots[me], comm::WireDtype::kFp32, own);
  results[me].resize(own.size());
  seen_rows_[me][static_cast<size_t>(layer)] = pass_;
  serve_rows(rank_, layer, pass_, !training_, plan.counts[me], reinterpret_cast<const float*>(own.data()), &results[me],
             0);
  have[me] = 1;
  timing.dispatch_s += moe::seconds_between(start, Clock::now());
  await_replies(deadline, timing);
  for (size_t p = 0; p < r; ++p) {
    timing.kept += static_cast<int64_t>(plan.slots[p].size());
    if (have[p] == 0) timing.late += static_cast<int64_t>(plan.slots[p].size());
  }
  request_ = Request{};
}

void ExpertExchange::backward(int layer, const moe::DispatchPlan& plan,
                              const std::vector<std::vector<std::byte>>& d_out, const std::vector<uint8_t>& have,
                              std::vector<std::vector<std::byte>>& d_in, MoeMlp::Timing& timing) {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  std::vector<uint8_t> got(r, 0);
  d_in.assign(r, {});
  refresh_lost();
  request_ = Request{kGrads, layer, &d_in, &got, std::vector<uint8_t>(r, 0), start};
  for (int p = 0; p < ranks_; ++p) {
    const auto pi = static_cast<size_t>(p);
    if (p == rank_ || lost_[pi] != 0) continue;
    const bool send = have[pi] != 0 && !plan.slots[pi].empty();
    const Header h{kGrads,
                   static_cast<uint32_t>(pass_),
                   static_cast<uint32_t>(layer),
                   0,
                   0,
                   send ? 0u : static_cast<uint32_t>(kSkip)};
    std::vector<std::byte> message = start_message(h, {}, send ? plan.slots[pi].size() : 0, row_bytes);
    if (send) std::memcpy(message.data() + rows_offset(0), d_out[pi].data(), plan.slots[pi].size() * row_bytes);
    comm_.post(p, moe::channels::kModelExperts, std::move(message));
    request_.awaiting[pi] = send ? 1 : 0;
  }
  const auto me = static_cast<size_t>(rank_);
  seen_grads_[me][static_cast<size_t>(layer)] = pass_;
  Served& own = served_[me][static_cast<size_t>(layer)];
  if (own.awaiting && own.pass == pass_ && !plan.slots[me].empty()) {
    own.awaiting = false;
    d_in[me].resize(plan.slots[me].size() * row_bytes);
    serve_grads(rank_, layer, pass_, reinterpret_cast<const float*>(d_out[me].data()), &d_in[me], 0);
    got[me] = 1;
  }
  own.awaiting = false;
  timing.dispatch_s += moe::seconds_between(start, Clock::now());
  await_replies(deadline, timing);
  for (size_t p = 0; p < r; ++p) {
    if (have[p] != 0 && got[p] == 0 && p != me) timing.late_grads += static_cast<int64_t>(plan.slots[p].size());
    if (got[p] == 0) d_in[p].clear();
  }
  request_ = Request{};
}

void ExpertExchange::end_pass() {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const bool no_deadline = deadline_s_ == kNoDeadline;
  pump(deadline, [&] {
    for (size_t p = 0; p < r; ++p) {
      if (!live(static_cast<int>(p))) continue;
      for (const int layer : moe_layers_) {
        const auto l = static_cast<size_t>(layer);
        // Rows served in this pass whose gradients are still out.
        if (served_[p][l].awaiting && served_[p][l].at_pass == pass_) return false;
        // With no deadline every live peer's rows (and gradients) of this pass come first.
        if (no_deadline && (seen_rows_[p][l] < pass_ || (training_ && seen_grads_[p][l] < pass_))) return false;
      }
    }
    return true;
  });
  if (!training_) return;  // what peers' training passes left waits for this rank's next
  // The weight gradients by layer, then source rank: sync dispatch's order.
  std::stable_sort(stash_.begin(), stash_.end(), [](const Stashed& a, const Stashed& b) {
    return std::tie(a.layer, a.source, a.pass) < std::tie(b.layer, b.source, b.pass);
  });
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  for (const Stashed& st : stash_) {
    const std::vector<ExpertTensors> g = tensors_of_(st.layer, true);
    size_t first = 0;
    for (size_t i = 0; i < st.counts.size() && i < g.size(); ++i) {
      const auto k = static_cast<int>(st.counts[i]);
      expert_backward_weights(st.d_out.data() + first * c, k, st.in.data() + first * c, st.act.data() + first * d,
                              st.d_act.data() + first * d, g[i], dim_, expert_dim_);
      first += st.counts[i];
    }
  }
  stash_.clear();
}

Status ExpertExchange::finish() {
  if (finishing_) return {};
  finishing_ = true;
  stash_.clear();
  for (int p = 0; p < ranks_; ++p) {
    if (p != rank_) comm_.post(p, moe::channels::kModelExperts, start_message(Header{kDone, 0, 0, 0, 0, 0}, {}, 0, 0));
  }
  // The deferred chunks are served now: this rank's parameters no longer change.
  std::deque<Message> again;
  again.swap(deferred_);
  for (Message& m : again) handle(m);
  pump(Clock::time_point::max(), [&] {
    for (int p = 0; p < ranks_; ++p) {
      if (live(p)) return false;
    }
    return true;
  });
  return {};
}

}  // namespace cfmo::model
