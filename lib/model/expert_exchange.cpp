#include "model/expert_exchange.h"

#include "moe/channels.h"
#include "moe/stats.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

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

/// A message's parts (sizes checked against the message).
struct Parsed {
  Header h;
  std::vector<uint32_t> counts;
  size_t rows = 0;
  size_t offset = 0;
  const float* data = nullptr;
};

bool parse(const std::vector<std::byte>& bytes, size_t dim, Parsed& out) {
  std::memcpy(&out.h, bytes.data(), sizeof out.h);
  out.offset = rows_offset(out.h.count);
  if (bytes.size() < out.offset) return false;
  out.counts.resize(out.h.count);
  if (out.h.count > 0) std::memcpy(out.counts.data(), bytes.data() + sizeof out.h, out.h.count * sizeof(uint32_t));
  out.rows = (bytes.size() - out.offset) / (dim * sizeof(float));
  out.data = reinterpret_cast<const float*>(bytes.data() + out.offset);
  return true;
}

/// Allocates `bytes` on this thread's heap, writes every page and frees them.
void touch_heap(size_t bytes) {
  if (bytes == 0) return;
  auto* p = static_cast<volatile std::byte*>(std::malloc(bytes));
  if (p == nullptr) return;
  for (size_t i = 0; i < bytes; i += 4096) p[i] = std::byte{0};
  std::free(const_cast<std::byte*>(p));
}

/// `low` (a pass's low 32 bits) widened against `near` (passes differ by far less than 2^31).
int64_t widen(uint32_t low, int64_t near) { return near + static_cast<int32_t>(low - static_cast<uint32_t>(near)); }

uint32_t float_mode() {
#if defined(__x86_64__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

void set_float_mode([[maybe_unused]] uint32_t mode) {
#if defined(__x86_64__)
  if (_mm_getcsr() != mode) _mm_setcsr(mode);
#endif
}

}  // namespace

ExpertExchange::ExpertExchange(comm::Communicator& comm, moe::ExpertPlacement placement, int layers,
                               std::vector<int> moe_layers, int dim, int expert_dim, double deadline_s, double slowdown,
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
      tensors_of_(std::move(tensors_of)),
      deadline_s_(deadline_s < 0 ? kNoDeadline : deadline_s),
      pacer_(slowdown, 0, 1, 0, comm.rank()) {
  const auto r = static_cast<size_t>(ranks_);
  const auto l = static_cast<size_t>(layers_);
  served_.assign(r, std::vector<Served>(l));
  seen_rows_.assign(r, std::vector<int64_t>(l, -1));
  seen_grads_.assign(r, std::vector<int64_t>(l, -1));
  done_.assign(r, 0);
  lost_.assign(r, 0);
  round_trips_.assign(r, {});
  mxcsr_ = float_mode();
  // The copy's layout, once: every MoE layer's local experts, each fc_w, fc_b, proj_w, proj_b.
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const size_t per_expert = 2 * c * d + c + d;
  const auto local = static_cast<size_t>(placement_.count(rank_));
  snapshot_.resize(moe_layers_.size() * local * per_expert);
  snapshot_of_.assign(l, {});
  float* at = snapshot_.data();
  for (const int layer : moe_layers_) {
    for (size_t i = 0; i < local; ++i) {
      ExpertTensors t;
      t.fc_w = at;
      t.fc_b = at + c * d;
      t.proj_w = t.fc_b + d;
      t.proj_b = t.proj_w + d * c;
      at += per_expert;
      snapshot_of_[static_cast<size_t>(layer)].push_back(t);
    }
  }
  server_ = std::thread([this] { serve_loop(); });
  comm_.on_message_owned(moe::channels::kModelExperts,
                         [this](int from, std::vector<std::byte> payload) { on_message(from, std::move(payload)); });
}

ExpertExchange::~ExpertExchange() {
  comm_.on_message_owned(moe::channels::kModelExperts, nullptr);  // returns once no handler runs
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  requested_.notify_all();
  server_.join();
}

void ExpertExchange::on_message(int from, std::vector<std::byte> payload) {
  if (payload.size() < sizeof(Header) || from < 0 || from >= ranks_) return;
  Header h;
  std::memcpy(&h, payload.data(), sizeof h);
  const bool reply = h.kind == kResults || h.kind == kGradResults;
  bool wake = !reply;
  {
    std::lock_guard lock(mutex_);
    bool awaited = false;
    if (reply) {
      // The training thread sleeps until the last reply it awaits is in
      // (or its deadline, or a health check); a late one waits in replies_.
      const auto f = static_cast<size_t>(from);
      const uint32_t want = h.kind == kResults ? kRows : kGrads;
      awaited = request_.kind == want && request_.layer == static_cast<int>(h.layer) && request_.pass == h.pass &&
                f < request_.awaiting.size() && request_.awaiting[f] != 0;
      if (awaited) {
        request_.awaiting[f] = 0;
        wake = --request_.pending == 0;
      }
    }
    (reply ? replies_ : requests_).push_back(Message{from, std::move(payload), Clock::now(), awaited});
  }
  if (wake) (reply ? answered_ : requested_).notify_one();
}

void ExpertExchange::open_request(uint32_t kind, int layer, std::vector<std::vector<std::byte>>* results,
                                  std::vector<uint8_t>* have, std::vector<uint8_t> awaiting, Clock::time_point start) {
  std::lock_guard lock(mutex_);
  const auto pending = static_cast<int>(std::count(awaiting.begin(), awaiting.end(), uint8_t{1}));
  request_ = Request{kind, layer, static_cast<uint32_t>(pass_), results, have, std::move(awaiting), pending, start};
}

void ExpertExchange::close_request() {
  std::lock_guard lock(mutex_);
  request_ = Request{};
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

void ExpertExchange::take_snapshot(bool finishing) {
  std::lock_guard copying(snapshot_mutex_);  // waits for a chunk the server is computing
  for (const int layer : moe_layers_) {
    const std::vector<ExpertTensors> live_params = tensors_of_(layer, false);
    const std::vector<ExpertTensors>& copy = snapshot_of_[static_cast<size_t>(layer)];
    const auto c = static_cast<size_t>(dim_);
    const auto d = static_cast<size_t>(expert_dim_);
    for (size_t i = 0; i < copy.size() && i < live_params.size(); ++i) {
      std::copy_n(live_params[i].fc_w, c * d, copy[i].fc_w);
      std::copy_n(live_params[i].fc_b, d, copy[i].fc_b);
      std::copy_n(live_params[i].proj_w, d * c, copy[i].proj_w);
      std::copy_n(live_params[i].proj_b, c, copy[i].proj_b);
    }
  }
  bool retry = false;
  {
    std::lock_guard lock(mutex_);
    snapshot_pass_ = pass_;
    ++snapshots_;
    if (finishing) {
      finishing_ = true;
      stash_.clear();
    }
    no_deadline_ = deadline_s_ == kNoDeadline;
    mxcsr_ = float_mode();
    retry = !deferred_.empty();  // the server sleeps otherwise: no wake-up for nothing
  }
  if (retry) requested_.notify_one();
}

void ExpertExchange::prepare(size_t rows_per_peer) {
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const size_t chunks = static_cast<size_t>(ranks_ - 1) * moe_layers_.size() * rows_per_peer * sizeof(float);
  // The server, per peer and layer: the rows, fc and act kept, the results,
  // the gradients in and out, d_act; this thread: the rows and gradients sent.
  std::unique_lock lock(mutex_);
  warm_bytes_ = chunks * (4 * c + 3 * d);
  requested_.notify_one();
  lock.unlock();
  touch_heap(chunks * 2 * c);
  lock.lock();
  answered_.wait(lock, [&] { return warm_bytes_ == 0 || stop_; });
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
  take_snapshot(false);  // chunks that waited for this pass are served now, in the order they came
}

void ExpertExchange::pump(Clock::time_point until, const std::function<bool()>& done, bool watch_served) {
  auto last_health = Clock::time_point{};
  std::deque<Message> batch;
  std::unique_lock lock(mutex_);
  watch_served_ = watch_served;
  while (true) {
    if (const auto now = Clock::now(); now - last_health > std::chrono::milliseconds(20)) {
      lock.unlock();
      refresh_lost();
      lock.lock();
      last_health = now;
    }
    if (!replies_.empty()) {
      batch.swap(replies_);
      lock.unlock();
      for (const Message& m : batch) take_reply(m);  // the training thread's own state only
      batch.clear();
      lock.lock();
      continue;  // done() may count replies that came meanwhile: they are taken first
    }
    if (done() || Clock::now() >= until) {
      watch_served_ = false;
      return;
    }
    const auto limit = std::min(until, Clock::now() + std::chrono::milliseconds(20));  // health checks between
    answered_.wait_until(lock, limit, [&] { return done(); });
  }
}

void ExpertExchange::take_reply(const Message& m) {
  // For the exchange this rank waits in (marked on arrival), or late. The
  // request is this thread's to close, so it is still the one marked for
  // unless the message outlived it (then kind, layer or pass differ).
  if (!m.awaited) return;
  Parsed in;
  if (!parse(m.bytes, static_cast<size_t>(dim_), in) || in.h.layer >= static_cast<uint32_t>(layers_)) return;
  const auto f = static_cast<size_t>(m.from);
  const uint32_t want = in.h.kind == kResults ? kRows : kGrads;
  if (request_.kind == want && request_.layer == static_cast<int>(in.h.layer) && request_.pass == in.h.pass) {
    (*request_.results)[f].assign(m.bytes.begin() + static_cast<ptrdiff_t>(in.offset), m.bytes.end());
    (*request_.have)[f] = 1;
    note_round_trip(m.from, moe::seconds_between(request_.start, m.arrived));
  }
}

void ExpertExchange::serve_loop() {
  pthread_setname_np(pthread_self(), "cfmo-experts");
  uint64_t retried = 0;  // the snapshot after which deferred_ was last tried
  while (true) {
    Message m;
    {
      std::unique_lock lock(mutex_);
      requested_.wait(lock, [&] {
        return stop_ || warm_bytes_ > 0 || !requests_.empty() || (!deferred_.empty() && retried != snapshots_);
      });
      if (stop_) return;
      if (warm_bytes_ > 0) {
        lock.unlock();
        touch_heap(warm_bytes_);
        lock.lock();
        warm_bytes_ = 0;
        answered_.notify_all();
        continue;
      }
      if (!deferred_.empty() && retried != snapshots_) {
        // What waited for a later pass goes first: it came before the rest.
        retried = snapshots_;
        requests_.insert(requests_.begin(), std::make_move_iterator(deferred_.begin()),
                         std::make_move_iterator(deferred_.end()));
        deferred_.clear();
      }
      m = std::move(requests_.front());
      requests_.pop_front();
      set_float_mode(mxcsr_);
    }
    std::vector<std::byte> reply;
    bool served = true;
    // --slowdown: the chunk takes FACTOR times its time before its answer
    // goes, as a slow rank's compute would (the step loop stretches only the
    // training thread's); the sleep holds no lock.
    pacer_.run([&] { served = serve(m, reply); });
    if (!served) {
      std::lock_guard lock(mutex_);
      deferred_.push_back(std::move(m));
    } else if (!reply.empty()) {
      comm_.post(m.from, moe::channels::kModelExperts, std::move(reply));
    }
  }
}

bool ExpertExchange::serve(const Message& m, std::vector<std::byte>& reply) {
  Parsed in;
  const int from = m.from;
  const auto f = static_cast<size_t>(from);
  if (!parse(m.bytes, static_cast<size_t>(dim_), in)) return true;  // not ours: ignored
  if (in.h.kind == kDone) {
    bool wake = false;
    {
      std::lock_guard lock(mutex_);
      done_[f] = 1;
      wake = watch_served_;
    }
    if (wake) answered_.notify_one();
    return true;
  }
  if (in.h.layer >= static_cast<uint32_t>(layers_) || (in.h.kind != kRows && in.h.kind != kGrads)) return true;
  const auto layer = static_cast<int>(in.h.layer);
  const auto l = static_cast<size_t>(layer);
  // The copy stays this pass's until the chunk is computed.
  std::lock_guard computing(snapshot_mutex_);
  int64_t at_pass = 0;
  bool no_deadline = false;
  double row_cost_s = 0;
  {
    std::lock_guard lock(mutex_);
    if (snapshot_pass_ < 0 && !finishing_) return false;  // nothing to compute with yet
    at_pass = snapshot_pass_;
    no_deadline = no_deadline_ && !finishing_;
    row_cost_s = row_cost_s_;
  }
  const int64_t pass = widen(in.h.pass, at_pass);
  // With no deadline a chunk is served in its own pass, never with
  // parameters another pass has changed: the results are sync's.
  if (no_deadline && pass > at_pass) return false;
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  Served& s = served_[f][l];
  if (in.h.kind == kRows) {
    const bool serves = in.rows > 0 && in.counts.size() == static_cast<size_t>(placement_.count(rank_));
    // A result that cannot be back before the requester's deadline would be
    // late: its compute goes to chunks that can still make theirs.
    const bool hopeless = serves && in.h.budget_us != kNoBudget &&
                          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(row_cost_s * static_cast<double>(in.rows))) >
                              m.arrived + std::chrono::microseconds(in.h.budget_us);
    if (serves && hopeless) ++skipped_chunks_;
    if (serves && !hopeless) {
      reply = start_message(Header{kResults, in.h.pass, in.h.layer, 0, 0, 0}, in.counts, in.rows, row_bytes);
      serve_rows(from, layer, pass, at_pass, (in.h.flags & kEval) != 0, in.counts, in.data,
                 reinterpret_cast<float*>(reply.data() + rows_offset(in.counts.size())));
    } else {
      std::lock_guard lock(mutex_);
      if (s.awaiting) ++skipped_grads_;  // its gradients never came
      s.awaiting = false;
    }
    bool wake = false;
    {
      std::lock_guard lock(mutex_);
      seen_rows_[f][l] = std::max(seen_rows_[f][l], pass);
      wake = watch_served_;
    }
    if (wake) answered_.notify_one();
    return true;
  }
  // The gradients of rows served: only this thread changes s's vectors.
  const bool matches = s.awaiting && s.pass == pass;
  if (!matches) {
    if (in.rows > 0) ++skipped_grads_;  // rows this rank never served (late, skipped) or served anew since
  } else if ((in.h.flags & kSkip) == 0 && in.rows > 0 && in.rows == s.in.size() / static_cast<size_t>(dim_)) {
    reply = start_message(Header{kGradResults, in.h.pass, in.h.layer, 0, 0, 0}, s.counts, in.rows, row_bytes);
    serve_grads(from, layer, pass, in.data, reinterpret_cast<float*>(reply.data() + rows_offset(s.counts.size())));
  }
  bool wake = false;
  {
    // After the stash: end_pass, which waits for seen_grads_, then finds the weight gradients there.
    std::lock_guard lock(mutex_);
    if (matches) s.awaiting = false;
    seen_grads_[f][l] = std::max(seen_grads_[f][l], pass);
    wake = watch_served_;
  }
  if (wake) answered_.notify_one();
  return true;
}

void ExpertExchange::serve_rows(int source, int layer, int64_t pass, int64_t at_pass, bool eval,
                                std::span<const uint32_t> counts, const float* rows, float* out) {
  const auto start = Clock::now();
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const size_t n = total_of(counts);
  Served& s = served_[static_cast<size_t>(source)][static_cast<size_t>(layer)];
  s.counts.assign(counts.begin(), counts.end());
  s.in.assign(rows, rows + n * c);
  s.fc.resize(n * d);
  s.act.resize(n * d);
  const std::vector<ExpertTensors>& experts = snapshot_of_[static_cast<size_t>(layer)];
  size_t first = 0;
  for (size_t i = 0; i < counts.size() && i < experts.size(); ++i) {
    const auto k = static_cast<int>(counts[i]);
    expert_forward(s.in.data() + first * c, k, experts[i], dim_, expert_dim_, s.fc.data() + first * d,
                   s.act.data() + first * d, out + first * c);
    first += counts[i];
  }
  std::lock_guard lock(mutex_);
  if (s.awaiting) ++skipped_grads_;  // the last rows' gradients never came
  s.pass = pass;
  s.at_pass = at_pass;
  s.awaiting = !eval;
  if (n > 0) {
    const double cost = moe::seconds_between(start, Clock::now()) / static_cast<double>(n);
    row_cost_s_ = row_cost_s_ == 0 ? cost : 0.8 * row_cost_s_ + 0.2 * cost;
  }
}

void ExpertExchange::serve_grads(int source, int layer, int64_t pass, const float* d_out, float* dx) {
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
  const std::vector<ExpertTensors>& experts = snapshot_of_[static_cast<size_t>(layer)];
  size_t first = 0;
  for (size_t i = 0; i < st.counts.size() && i < experts.size(); ++i) {
    const auto k = static_cast<int>(st.counts[i]);
    expert_backward_inputs(st.d_out.data() + first * c, k, s.fc.data() + first * d, experts[i], dim_, expert_dim_,
                           st.d_act.data() + first * d, dx + first * c);
    first += st.counts[i];
  }
  s.fc.clear();
  std::lock_guard lock(mutex_);
  if (!finishing_) stash_.push_back(std::move(st));  // after finish no pass adds them
}

void ExpertExchange::await_replies(Clock::time_point deadline, MoeMlp::Timing& timing) {
  const auto wait = Clock::now();
  pump(
      deadline,
      [&] {  // under mutex_
        for (size_t p = 0; p < request_.awaiting.size(); ++p) {
          if (request_.awaiting[p] != 0 && lost_[p] == 0) return false;
        }
        return true;
      },
      /*watch_served=*/false);
  timing.combine_s += moe::seconds_between(wait, Clock::now());
}

void ExpertExchange::forward(int layer, const float* x, int top_k, const moe::DispatchPlan& plan,
                             std::vector<std::vector<std::byte>>& results, std::vector<uint8_t>& have,
                             MoeMlp::Timing& timing) {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  // Emptied, not freed: the buffers of the last pass take this one's rows.
  results.resize(r);
  for (auto& rows : results) rows.clear();
  have.assign(r, 0);
  refresh_lost();
  std::vector<uint8_t> awaiting(r, 0);
  for (int p = 0; p < ranks_; ++p) {
    const auto pi = static_cast<size_t>(p);
    awaiting[pi] = p != rank_ && lost_[pi] == 0 && !plan.slots[pi].empty() ? 1 : 0;
  }
  open_request(kRows, layer, &results, &have, std::move(awaiting), start);
  for (int p = 0; p < ranks_; ++p) {
    const auto pi = static_cast<size_t>(p);
    if (p == rank_ || lost_[pi] != 0) continue;  // a finished peer still serves until every rank has
    const Header h{kRows, static_cast<uint32_t>(pass_), static_cast<uint32_t>(layer),
                   0,     budget_us(deadline),          training_ ? 0u : static_cast<uint32_t>(kEval)};
    std::vector<std::byte> message = start_message(h, plan.counts[pi], 0, row_bytes);
    moe::encode_rows(x, dim_, top_k, plan.slots[pi], comm::WireDtype::kFp32, message);
    comm_.post(p, moe::channels::kModelExperts, std::move(message));
  }
  // The own rows for the own experts, while the rest travel and the server
  // computes the peers' (the copy is this pass's: only this thread writes it).
  const auto me = static_cast<size_t>(rank_);
  std::vector<std::byte>& own = own_rows_;
  own.clear();
  moe::encode_rows(x, dim_, top_k, plan.slots[me], comm::WireDtype::kFp32, own);
  results[me].resize(own.size());
  serve_rows(rank_, layer, pass_, pass_, !training_, plan.counts[me], reinterpret_cast<const float*>(own.data()),
             reinterpret_cast<float*>(results[me].data()));
  have[me] = 1;
  timing.dispatch_s += moe::seconds_between(start, Clock::now());
  await_replies(deadline, timing);
  for (size_t p = 0; p < r; ++p) {
    timing.kept += static_cast<int64_t>(plan.slots[p].size());
    if (have[p] == 0) timing.late += static_cast<int64_t>(plan.slots[p].size());
  }
  close_request();
}

void ExpertExchange::backward(int layer, const moe::DispatchPlan& plan,
                              const std::vector<std::vector<std::byte>>& d_out, const std::vector<uint8_t>& have,
                              std::vector<std::vector<std::byte>>& d_in, MoeMlp::Timing& timing) {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  std::vector<uint8_t> got(r, 0);
  d_in.resize(r);
  for (auto& rows : d_in) rows.clear();
  refresh_lost();
  std::vector<uint8_t> awaiting(r, 0);
  for (int p = 0; p < ranks_; ++p) {
    const auto pi = static_cast<size_t>(p);
    awaiting[pi] = p != rank_ && lost_[pi] == 0 && have[pi] != 0 && !plan.slots[pi].empty() ? 1 : 0;
  }
  open_request(kGrads, layer, &d_in, &got, std::move(awaiting), start);
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
  }
  const auto me = static_cast<size_t>(rank_);
  Served& own = served_[me][static_cast<size_t>(layer)];
  if (own.awaiting && own.pass == pass_ && !plan.slots[me].empty()) {
    d_in[me].resize(plan.slots[me].size() * row_bytes);
    serve_grads(rank_, layer, pass_, reinterpret_cast<const float*>(d_out[me].data()),
                reinterpret_cast<float*>(d_in[me].data()));
    got[me] = 1;
  }
  {
    std::lock_guard lock(mutex_);
    own.awaiting = false;
  }
  timing.dispatch_s += moe::seconds_between(start, Clock::now());
  await_replies(deadline, timing);
  for (size_t p = 0; p < r; ++p) {
    if (have[p] != 0 && got[p] == 0 && p != me) timing.late_grads += static_cast<int64_t>(plan.slots[p].size());
    if (got[p] == 0) d_in[p].clear();
  }
  close_request();
}

void ExpertExchange::end_pass() {
  const auto start = Clock::now();
  const auto deadline = deadline_from(start);
  const auto r = static_cast<size_t>(ranks_);
  const bool no_deadline = deadline_s_ == kNoDeadline;
  pump(
      deadline,
      [&] {  // under mutex_
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
      },
      /*watch_served=*/true);
  if (!training_) return;  // what peers' training passes left waits for this rank's next
  std::vector<Stashed> stash;
  {
    std::lock_guard lock(mutex_);
    stash.swap(stash_);
  }
  // The weight gradients by layer, then source rank: sync dispatch's order.
  std::stable_sort(stash.begin(), stash.end(), [](const Stashed& a, const Stashed& b) {
    return std::tie(a.layer, a.source, a.pass) < std::tie(b.layer, b.source, b.pass);
  });
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  for (const Stashed& st : stash) {
    const std::vector<ExpertTensors> g = tensors_of_(st.layer, true);
    size_t first = 0;
    for (size_t i = 0; i < st.counts.size() && i < g.size(); ++i) {
      const auto k = static_cast<int>(st.counts[i]);
      expert_backward_weights(st.d_out.data() + first * c, k, st.in.data() + first * c, st.act.data() + first * d,
                              st.d_act.data() + first * d, g[i], dim_, expert_dim_);
      first += st.counts[i];
    }
  }
}

Status ExpertExchange::finish() {
  if (finished_) return {};
  finished_ = true;
  // The deferred chunks are served now, with the parameters as they are at
  // the end: this rank's no longer change.
  take_snapshot(/*finishing=*/true);
  for (int p = 0; p < ranks_; ++p) {
    if (p != rank_) comm_.post(p, moe::channels::kModelExperts, start_message(Header{kDone, 0, 0, 0, 0, 0}, {}, 0, 0));
  }
  pump(
      Clock::time_point::max(),
      [&] {
        for (int p = 0; p < ranks_; ++p) {
          if (live(p)) return false;
        }
        return true;
      },
      /*watch_served=*/true);
  return {};
}

}  // namespace cfmo::model
