#include "moe/dispatch.h"

#include "core/rng.h"

#include <cstring>
#include <thread>

namespace cfmo::moe {

DispatchPlan plan_dispatch(const Routing& routing, const ExpertPlacement& placement) {
  std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(routing.experts));
  for (int64_t t = 0; t < routing.tokens; ++t) {
    for (int j = 0; j < routing.top_k; ++j) {
      const auto a = static_cast<size_t>(t * routing.top_k + j);
      if (routing.kept[a] != 0) by_expert[static_cast<size_t>(routing.expert[a])].push_back(static_cast<int32_t>(a));
    }
  }
  DispatchPlan plan;
  plan.slots.resize(static_cast<size_t>(placement.ranks));
  plan.counts.resize(static_cast<size_t>(placement.ranks));
  for (int p = 0; p < placement.ranks; ++p) {
    auto& slots = plan.slots[static_cast<size_t>(p)];
    auto& counts = plan.counts[static_cast<size_t>(p)];
    for (int i = 0; i < placement.count(p); ++i) {
      const auto& list = by_expert[static_cast<size_t>(placement.expert(p, i))];
      counts.push_back(static_cast<uint32_t>(list.size()));
      slots.insert(slots.end(), list.begin(), list.end());
    }
  }
  return plan;
}

Status exchange_buffers(comm::Communicator* comm, std::vector<std::vector<std::byte>>& out,
                        std::vector<std::vector<std::byte>>& in) {
  if (comm == nullptr) {
    in.resize(1);
    in[0] = out[0];
    return {};
  }
  std::vector<std::span<const std::byte>> send_spans;
  std::vector<std::span<std::byte>> recv_spans;
  for (size_t p = 0; p < out.size(); ++p) {
    send_spans.emplace_back(out[p]);
    recv_spans.emplace_back(in[p]);
  }
  return comm->all_to_all_v(send_spans, recv_spans);
}

Result<std::vector<std::vector<uint32_t>>> exchange_counts(comm::Communicator* comm, const DispatchPlan& plan,
                                                           int local_experts) {
  const size_t ranks = plan.counts.size();
  const auto mine = static_cast<size_t>(local_experts);
  std::vector<std::vector<std::byte>> out(ranks);
  std::vector<std::vector<std::byte>> in(ranks, std::vector<std::byte>(mine * sizeof(uint32_t)));
  for (size_t p = 0; p < ranks; ++p) {
    const auto& c = plan.counts[p];
    out[p].resize(c.size() * sizeof(uint32_t));
    if (!c.empty()) std::memcpy(out[p].data(), c.data(), out[p].size());
  }
  CFMO_TRY(exchange_buffers(comm, out, in));
  std::vector<std::vector<uint32_t>> counts(ranks, std::vector<uint32_t>(mine));
  for (size_t p = 0; p < ranks; ++p) {
    if (mine > 0 && in[p].size() >= mine * sizeof(uint32_t))
      std::memcpy(counts[p].data(), in[p].data(), mine * sizeof(uint32_t));
  }
  return counts;
}

size_t row_bytes(comm::WireDtype dtype, int hidden) { return comm::encoded_size(dtype, static_cast<size_t>(hidden)); }

void encode_rows(const float* x, int hidden, int top_k, std::span<const int32_t> slots, comm::WireDtype dtype,
                 std::vector<std::byte>& out) {
  const size_t bytes = row_bytes(dtype, hidden);
  const size_t at = out.size();
  out.resize(at + bytes * slots.size());
  std::vector<std::byte> row;
  for (size_t i = 0; i < slots.size(); ++i) {
    const float* source = x + static_cast<size_t>(slots[i] / top_k) * static_cast<size_t>(hidden);
    std::byte* target = out.data() + at + i * bytes;
    if (dtype == comm::WireDtype::kFp32) {
      std::memcpy(target, source, bytes);
    } else {
      row.clear();
      comm::encode_floats(dtype, std::span<const float>(source, static_cast<size_t>(hidden)), {}, row);
      std::memcpy(target, row.data(), bytes);
    }
  }
}

void compute_block(ExpertFfn& expert, const std::byte* rows, size_t count, comm::WireDtype dtype, int hidden,
                   std::byte* out, std::vector<float>& scratch) {
  if (count == 0) return;
  if (dtype == comm::WireDtype::kFp32) {
    expert.forward(reinterpret_cast<const float*>(rows), static_cast<int64_t>(count), reinterpret_cast<float*>(out));
    return;
  }
  const size_t n = count * static_cast<size_t>(hidden);
  if (scratch.size() < 2 * n) scratch.resize(2 * n);
  std::span<const std::byte> in(rows, count * row_bytes(dtype, hidden));
  (void)comm::decode_floats(dtype, in, std::span<float>(scratch.data(), n));
  expert.forward(scratch.data(), static_cast<int64_t>(count), scratch.data() + n);
  std::vector<std::byte> encoded;
  comm::encode_floats(dtype, std::span<const float>(scratch.data() + n, n), {}, encoded);
  std::memcpy(out, encoded.data(), encoded.size());
}

void compute_rows(std::span<const std::byte> rows, std::span<const uint32_t> counts, std::vector<ExpertFfn>& experts,
                  comm::WireDtype dtype, int hidden, std::vector<std::byte>& out, size_t offset,
                  std::vector<float>& scratch) {
  const size_t bytes = row_bytes(dtype, hidden);
  size_t total = 0;
  for (uint32_t c : counts) total += c;
  out.resize(offset + total * bytes);
  size_t row = 0;
  for (size_t i = 0; i < counts.size() && i < experts.size(); ++i) {
    compute_block(experts[i], rows.data() + row * bytes, counts[i], dtype, hidden, out.data() + offset + row * bytes,
                  scratch);
    row += counts[i];
  }
}

void locate_results(std::span<const std::byte> results, std::span<const int32_t> slots, comm::WireDtype dtype,
                    int hidden, std::vector<float>& decoded, std::vector<const float*>& rows) {
  const size_t bytes = row_bytes(dtype, hidden);
  const auto h = static_cast<size_t>(hidden);
  for (size_t i = 0; i < slots.size() && (i + 1) * bytes <= results.size(); ++i) {
    const auto a = static_cast<size_t>(slots[i]);
    if (dtype == comm::WireDtype::kFp32) {
      rows[a] = reinterpret_cast<const float*>(results.data() + i * bytes);
    } else {
      std::span<const std::byte> in = results.subspan(i * bytes, bytes);
      (void)comm::decode_floats(dtype, in, std::span<float>(decoded.data() + a * h, h));
      rows[a] = decoded.data() + a * h;
    }
  }
}

void combine(const float* x, const Routing& routing, std::span<const float* const> rows, int hidden, float* y) {
  const auto h = static_cast<size_t>(hidden);
  for (int64_t t = 0; t < routing.tokens; ++t) {
    float* out = y + static_cast<size_t>(t) * h;
    std::memcpy(out, x + static_cast<size_t>(t) * h, h * sizeof(float));
    for (int j = 0; j < routing.top_k; ++j) {
      const auto a = static_cast<size_t>(t * routing.top_k + j);
      const float* r = rows[a];
      if (r == nullptr) continue;
      const float g = routing.gate[a];
      for (size_t i = 0; i < h; ++i) out[i] += g * r[i];
    }
  }
}

Pacer::Pacer(double slowdown, double straggler_p, double straggler_factor, uint64_t seed, int rank)
    : slowdown_(slowdown), straggler_p_(straggler_p), straggler_factor_(straggler_factor) {
  state_ = seed ^ (0x5354524147ULL + static_cast<uint64_t>(rank) * 0x9E3779B97F4A7C15ULL);
  factor_ = slowdown_;
}

void Pacer::new_iteration() {
  factor_ = slowdown_;
  if (straggler_p_ > 0) {
    const double u = static_cast<double>(splitmix64(state_) >> 11) * 0x1.0p-53;
    if (u < straggler_p_) factor_ *= straggler_factor_;
  }
}

void Pacer::pause(double natural_s) {
  if (factor_ <= 1) return;
  owed_s_ += (factor_ - 1) * natural_s;
  // A sleep overshoots by tens of microseconds: sleep once a fraction of a
  // millisecond is owed, and count what the sleep really took.
  if (owed_s_ < 200e-6) return;
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(owed_s_));
  owed_s_ -= seconds_between(start, Clock::now());
}

}  // namespace cfmo::moe
