#include "moe/dispatch_engines.h"

#include <cstring>

namespace cfmo::moe {

InputPool make_inputs(uint64_t seed, int rank, int64_t tokens, int hidden, int64_t iterations) {
  InputPool pool;
  pool.tokens = tokens;
  pool.hidden = hidden;
  // A few distinct batches are enough to keep caches honest; drawing one per
  // iteration would time the generator instead of the layer.
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(iterations, 4));
  pool.batches.resize(static_cast<size_t>(count));
  for (int64_t b = 0; b < count; ++b) {
    auto& batch = pool.batches[static_cast<size_t>(b)];
    batch.resize(static_cast<size_t>(tokens) * static_cast<size_t>(hidden));
    make_hidden_states(seed, rank, static_cast<uint64_t>(b), tokens, hidden, batch.data());
  }
  return pool;
}

Routing route_iteration(const EngineSetup& s, int64_t iteration) {
  const int rank = s.comm->rank();
  Routing routing = s.router->route(s.inputs->batch(iteration), s.inputs->tokens,
                                    (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(iteration),
                                    static_cast<int64_t>(rank) * s.inputs->tokens);
  apply_capacity(routing, s.capacity);
  return routing;
}

Result<RankRecord> run_sync(const EngineSetup& s, int64_t first_iteration, int64_t iterations) {
  comm::Communicator& comm = *s.comm;
  const int ranks = comm.size();
  const int me = comm.rank();
  const int hidden = s.inputs->hidden;
  const size_t row = row_bytes(s.dtype, hidden);
  const auto r_count = static_cast<size_t>(ranks);
  const auto mine = static_cast<size_t>(s.placement.count(me));
  RankRecord record;
  record.load.assign(static_cast<size_t>(s.placement.experts), 0);
  std::vector<std::vector<std::byte>> send(r_count);
  std::vector<std::vector<std::byte>> received(r_count);
  std::vector<std::vector<std::byte>> replies(r_count);
  std::vector<std::vector<std::byte>> results(r_count);
  std::vector<float> scratch;
  std::vector<float> decoded;
  std::vector<float> output(static_cast<size_t>(s.inputs->tokens) * static_cast<size_t>(hidden));
  std::vector<const float*> rows;

  CFMO_TRY(comm.barrier());
  const auto run_start = Clock::now();
  for (int64_t i = first_iteration; i < first_iteration + iterations; ++i) {
    s.pacer->new_iteration();
    const auto start = Clock::now();
    Routing routing;
    record.compute_s += s.pacer->run([&] { routing = route_iteration(s, i); });
    const DispatchPlan plan = plan_dispatch(routing, s.placement);
    const float* x = s.inputs->batch(i);
    for (size_t p = 0; p < r_count; ++p) {
      send[p].clear();
      encode_rows(x, hidden, s.top_k, plan.slots[p], s.dtype, send[p]);
      record.dispatch_bytes += static_cast<double>(send[p].size());
      if (static_cast<int>(p) != me) record.peer_bytes += static_cast<double>(send[p].size());
    }

    // The layout: every rank learns how many rows each other rank sends it, per expert.
    const auto dispatch_start = Clock::now();
    CFMO_ASSIGN_OR_RETURN(const auto incoming, exchange_counts(&comm, plan, static_cast<int>(mine)));
    const auto layout_done = Clock::now();
    for (size_t p = 0; p < r_count; ++p) {
      size_t n = 0;
      for (uint32_t c : incoming[p]) n += c;
      received[p].resize(n * row);
      results[p].resize(plan.slots[p].size() * row);
    }
    CFMO_TRY(exchange_buffers(&comm, send, received));
    const auto dispatch_done = Clock::now();

    record.compute_s += s.pacer->run([&] {
      for (size_t p = 0; p < r_count; ++p) {
        replies[p].clear();
        compute_rows(received[p], incoming[p], *s.experts, s.dtype, hidden, replies[p], 0, scratch);
      }
    });

    const auto combine_start = Clock::now();
    CFMO_TRY(exchange_buffers(&comm, replies, results));
    rows.assign(routing.expert.size(), nullptr);
    if (s.dtype != comm::WireDtype::kFp32) decoded.resize(routing.expert.size() * static_cast<size_t>(hidden));
    for (size_t p = 0; p < r_count; ++p) locate_results(results[p], plan.slots[p], s.dtype, hidden, decoded, rows);
    combine(x, routing, rows, hidden, output.data());
    const auto end = Clock::now();

    record.dispatch_us.push_back(seconds_between(dispatch_start, dispatch_done) * 1e6);
    record.a2a_us.push_back(seconds_between(layout_done, dispatch_done) * 1e6);
    record.combine_us.push_back(seconds_between(combine_start, end) * 1e6);
    record.roundtrip_us.push_back(seconds_between(dispatch_start, end) * 1e6);
    record.iteration_us.push_back(seconds_between(start, end) * 1e6);
    ++record.iterations;
    record.tokens += routing.tokens;
    record.assignments += static_cast<int64_t>(routing.expert.size());
    record.dropped += routing.dropped;
    for (size_t e = 0; e < record.load.size(); ++e) record.load[e] += routing.load[e];
    if (i + 1 == first_iteration + iterations) {
      record.last_iteration = i;
      record.last_output = output;
      record.last_late.assign(routing.expert.size(), 0);
    }
  }
  record.wall_s = seconds_between(run_start, Clock::now());
  return record;
}

}  // namespace cfmo::moe
