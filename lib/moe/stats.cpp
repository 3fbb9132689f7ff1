#include "moe/stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace cfmo::moe {
namespace {

// The scalars each rank contributes, in this order, then load[E], then the four sample series.
enum Scalar : size_t {
  kWall,
  kTokens,
  kAssignments,
  kDropped,
  kLate,
  kStale,
  kStalenessSum,
  kStalenessMax,
  kLateArrivals,
  kSkippedChunks,
  kCompute,
  kOverlapped,
  kDispatchBytes,
  kPeerBytes,
  kMaxAbsErr,
  kOntimeMaxAbsErr,
  kSqErr,
  kSqRef,
  kRefMaxAbs,
  kCheckDone,
  kScalars
};

TimeStats time_stats(const std::vector<std::vector<double>>& per_rank) {
  TimeStats t;
  std::vector<double> all;
  std::vector<double> means;
  for (const auto& samples : per_rank) {
    all.insert(all.end(), samples.begin(), samples.end());
    means.push_back(samples.empty()
                        ? 0.0
                        : std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(samples.size()));
  }
  if (all.empty()) return t;
  t.p50 = percentile(all, 0.50);
  t.p99 = percentile(all, 0.99);
  t.min = *std::min_element(means.begin(), means.end());
  t.max = *std::max_element(means.begin(), means.end());
  t.avg = std::accumulate(means.begin(), means.end(), 0.0) / static_cast<double>(means.size());
  return t;
}

nlohmann::ordered_json optional_number(const std::optional<double>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

std::string percent(double fraction) { return fmt::format("{:.2f}", fraction * 100); }

}  // namespace

double percentile(std::vector<double> samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const auto n = samples.size();
  auto index = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
  index = std::clamp<size_t>(index, 1, n);
  return samples[index - 1];
}

Result<ModeSummary> summarize(comm::Communicator& comm, const RunSettings& settings, const RankRecord& record,
                              const CheckValues& check) {
  const auto ranks = static_cast<size_t>(comm.size());
  const auto me = static_cast<size_t>(comm.rank());
  const auto experts = static_cast<size_t>(settings.experts);
  const size_t iters = record.dispatch_us.size();
  const size_t stride = kScalars + experts + 4 * iters;
  std::vector<float> table(ranks * stride, 0.0f);
  float* mine = table.data() + me * stride;
  const double scalars[kScalars] = {record.wall_s,
                                    static_cast<double>(record.tokens),
                                    static_cast<double>(record.assignments),
                                    static_cast<double>(record.dropped),
                                    static_cast<double>(record.late),
                                    static_cast<double>(record.stale),
                                    record.staleness_sum,
                                    static_cast<double>(record.staleness_max),
                                    static_cast<double>(record.late_arrivals),
                                    static_cast<double>(record.skipped_chunks),
                                    record.compute_s,
                                    record.overlapped_s,
                                    record.dispatch_bytes,
                                    record.peer_bytes,
                                    check.max_abs_err,
                                    check.ontime_max_abs_err,
                                    check.sq_err,
                                    check.sq_ref,
                                    check.ref_max_abs,
                                    check.done ? 1.0 : 0.0};
  for (size_t i = 0; i < kScalars; ++i) mine[i] = static_cast<float>(scalars[i]);
  for (size_t e = 0; e < experts && e < record.load.size(); ++e) {
    mine[kScalars + e] = static_cast<float>(record.load[e]);
  }
  const std::vector<double>* series[4] = {&record.dispatch_us, &record.combine_us, &record.a2a_us,
                                          &record.iteration_us};
  for (size_t k = 0; k < 4; ++k) {
    for (size_t i = 0; i < iters && i < series[k]->size(); ++i) {
      mine[kScalars + experts + k * iters + i] = static_cast<float>((*series[k])[i]);
    }
  }
  CFMO_TRY(comm.all_reduce_sum(table));

  auto at = [&](size_t rank, size_t index) { return static_cast<double>(table[rank * stride + index]); };
  auto sum = [&](size_t index) {
    double s = 0;
    for (size_t r = 0; r < ranks; ++r) s += at(r, index);
    return s;
  };
  auto max_of = [&](size_t index) {
    double m = 0;
    for (size_t r = 0; r < ranks; ++r) m = std::max(m, at(r, index));
    return m;
  };

  ModeSummary s;
  s.settings = settings;
  s.ranks = static_cast<int>(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    const double wall = at(r, kWall);
    const double rate = wall > 0 ? at(r, kTokens) / wall : 0;
    s.rank_tokens_per_s.push_back(rate);
    s.tokens_per_s += rate;
  }
  std::vector<std::vector<double>> per_rank[4];
  for (size_t k = 0; k < 4; ++k) {
    for (size_t r = 0; r < ranks; ++r) {
      std::vector<double> samples(iters);
      for (size_t i = 0; i < iters; ++i) samples[i] = at(r, kScalars + experts + k * iters + i);
      per_rank[k].push_back(std::move(samples));
    }
  }
  s.dispatch = time_stats(per_rank[0]);
  s.combine = time_stats(per_rank[1]);
  s.a2a = time_stats(per_rank[2]);
  s.iteration = time_stats(per_rank[3]);
  const double iterations = static_cast<double>(std::max<size_t>(iters, 1));
  // nccl-tests: algbw = bytes per rank / time of the collective (the slowest rank's), busbw = algbw (n-1)/n.
  const double bytes = sum(kDispatchBytes) / static_cast<double>(ranks) / iterations;
  if (s.a2a.max > 0) s.algbw_gbps = bytes / (s.a2a.max * 1e-6) / 1e9;
  s.busbw_gbps = s.algbw_gbps * static_cast<double>(ranks - 1) / static_cast<double>(ranks);
  if (ranks > 1) s.bytes_per_peer = sum(kPeerBytes) / static_cast<double>(ranks) / iterations / double(ranks - 1);
  const double assignments = std::max(1.0, sum(kAssignments));
  s.dropped_frac = sum(kDropped) / assignments;
  s.late_frac = sum(kLate) / assignments;
  s.stale_frac = sum(kStale) / assignments;
  s.staleness_mean = sum(kStale) > 0 ? sum(kStalenessSum) / sum(kStale) : 0;
  s.staleness_max = static_cast<int64_t>(max_of(kStalenessMax));
  s.late_arrivals = static_cast<int64_t>(sum(kLateArrivals));
  s.skipped_chunks = static_cast<int64_t>(sum(kSkippedChunks));
  s.overlap_share = sum(kCompute) > 0 ? sum(kOverlapped) / sum(kCompute) : 0;
  std::vector<int64_t> load(experts, 0);
  for (size_t e = 0; e < experts; ++e) load[e] = static_cast<int64_t>(std::llround(sum(kScalars + e)));
  s.imbalance = load_imbalance(load);
  if (sum(kCheckDone) >= static_cast<double>(ranks)) {
    s.max_abs_err = max_of(kMaxAbsErr);
    s.rel_err = sum(kSqRef) > 0 ? std::sqrt(sum(kSqErr) / sum(kSqRef)) : std::sqrt(sum(kSqErr));
    // Bit-identical is expected; the tolerance only forgives a BLAS that
    // orders a block's sums by its alignment.
    const double tolerance = (settings.dtype == "bf16" ? 1e-2 : 1e-5) * std::max(1.0, max_of(kRefMaxAbs));
    s.check = max_of(kOntimeMaxAbsErr) <= tolerance ? "pass" : "fail";
  }
  return s;
}

Result<double> global_relative_error(comm::Communicator& comm, std::span<const float> a, std::span<const float> b) {
  double diff = 0;
  double ref = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    diff += d * d;
    ref += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  std::vector<float> sums = {static_cast<float>(diff), static_cast<float>(ref)};
  CFMO_TRY(comm.all_reduce_sum(sums));
  return sums[1] > 0 ? std::sqrt(static_cast<double>(sums[0]) / static_cast<double>(sums[1]))
                     : std::sqrt(static_cast<double>(sums[0]));
}

nlohmann::ordered_json ModeSummary::to_json() const {
  const RunSettings& c = settings;
  nlohmann::ordered_json j;
  j["mode"] = c.mode;
  j["ranks"] = ranks;
  j["experts"] = c.experts;
  j["tokens_per_rank"] = c.tokens_per_rank;
  j["hidden"] = c.hidden;
  j["ffn"] = c.ffn;
  j["top_k"] = c.top_k;
  j["dtype"] = c.dtype;
  j["device"] = c.device;
  j["routing"] = c.routing;
  j["capacity_factor"] = c.capacity_factor;
  j["capacity"] = c.capacity;
  j["drop_policy"] = c.drop_policy;
  j["warmup"] = c.warmup;
  j["iters"] = c.iters;
  j["in_flight"] = c.mode == "async" ? c.in_flight : 1;
  j["deadline_us"] = c.mode == "async" && c.deadline_s > 0 ? nlohmann::ordered_json(c.deadline_s * 1e6)
                                                           : nlohmann::ordered_json(nullptr);
  j["late_policy"] = c.late_policy;
  j["tokens_per_s"] = tokens_per_s;
  j["iteration_p50_us"] = iteration.p50;
  j["iteration_p99_us"] = iteration.p99;
  for (const auto& [name, t] : {std::pair{"dispatch", dispatch}, std::pair{"combine", combine}}) {
    const std::string n = name;
    j[n + "_p50_us"] = t.p50;
    j[n + "_p99_us"] = t.p99;
    j[n + "_min_us"] = t.min;
    j[n + "_avg_us"] = t.avg;
    j[n + "_max_us"] = t.max;
  }
  j["a2a_p50_us"] = a2a.p50;
  j["a2a_max_us"] = a2a.max;
  j["algbw_gbps"] = algbw_gbps;
  j["busbw_gbps"] = busbw_gbps;
  j["bytes_per_peer"] = bytes_per_peer;
  j["dropped_frac"] = dropped_frac;
  j["late_frac"] = late_frac;
  j["stale_frac"] = stale_frac;
  j["staleness_mean"] = staleness_mean;
  j["staleness_max"] = staleness_max;
  j["late_arrivals"] = late_arrivals;
  j["skipped_chunks"] = skipped_chunks;
  j["overlap_share"] = overlap_share;
  j["imbalance"] = imbalance;
  j["check"] = check;
  j["max_abs_err"] = max_abs_err;
  j["rel_err"] = rel_err;
  j["rel_err_vs_sync"] = optional_number(rel_err_vs_sync);
  j["speedup_vs_sync"] = optional_number(speedup_vs_sync);
  j["rank_tokens_per_s"] = rank_tokens_per_s;
  j["slowdown"] = c.slowdown;
  j["straggler"] = c.straggler;
  return j;
}

std::string render_table(const std::vector<ModeSummary>& rows) {
  std::string out;
  if (rows.empty()) return out;
  const RunSettings& c = rows.front().settings;
  out += fmt::format("# cfmo-moe: {} ranks, {} experts, top-{}, hidden {}, ffn {}, {} payload, routing {}\n",
                     rows.front().ranks, c.experts, c.top_k, c.hidden, c.ffn, c.dtype, c.routing);
  if (c.device != "cpu") out += fmt::format("# experts on {}; tokens staged through host memory for UCX\n", c.device);
  out += fmt::format("# capacity factor {} ({}), {} warmup + {} measured iterations{}{}\n", c.capacity_factor,
                     c.drop_policy, c.warmup, c.iters,
                     c.slowdown.empty() ? "" : fmt::format(", simulated slowdown {}", fmt::join(c.slowdown, ",")),
                     c.straggler.empty() ? "" : fmt::format(", simulated stragglers {}", c.straggler));
  out += "# times in us: p50/p99 over every rank's iterations, avg and max across ranks of each rank's mean\n";
  out += "# algbw = dispatched bytes per rank / all-to-all time, busbw = algbw (n-1)/n (nccl-tests)\n";
  out += fmt::format(
      "#{:>9} {:>6} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>6} {:>6} "
      "{:>7} {:>6} {:>5} {:>8}\n",
      "tokens", "mode", "tokens/s", "disp p50", "disp p99", "disp max", "comb p50", "comb p99", "comb max", "peer B",
      "algbw", "busbw", "drop%", "late%", "stale", "overlap", "imbal", "check", "speedup");
  for (const auto& r : rows) {
    out += fmt::format(
        " {:>9} {:>6} {:>11.0f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.0f} {:>7.2f} "
        "{:>7.2f} {:>6} {:>6} {:>6.2f} {:>7.2f} {:>6.2f} {:>5} {:>8}\n",
        r.settings.tokens_per_rank, r.settings.mode, r.tokens_per_s, r.dispatch.p50, r.dispatch.p99, r.dispatch.max,
        r.combine.p50, r.combine.p99, r.combine.max, r.bytes_per_peer, r.algbw_gbps, r.busbw_gbps,
        percent(r.dropped_frac), percent(r.late_frac), r.staleness_mean, r.overlap_share, r.imbalance, r.check,
        r.speedup_vs_sync ? fmt::format("{:.2f}x", *r.speedup_vs_sync) : std::string("-"));
  }
  for (const auto& r : rows) {
    if (r.settings.mode != "async") continue;
    out += fmt::format(
        "# tokens {}: async deadline {}, late policy {}, {} in flight; late {}% ({}% stale, mean age {:.2f}), "
        "{} late arrivals, {} chunks skipped{}\n",
        r.settings.tokens_per_rank,
        r.settings.deadline_s > 0 ? fmt::format("{:.0f} us", r.settings.deadline_s * 1e6) : "none",
        r.settings.late_policy, r.settings.in_flight, percent(r.late_frac), percent(r.stale_frac), r.staleness_mean,
        r.late_arrivals, r.skipped_chunks,
        r.rel_err_vs_sync ? fmt::format(", relative error against sync {:.3g}", *r.rel_err_vs_sync) : "");
  }
  return out;
}

std::string render_json(const std::vector<ModeSummary>& rows) {
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const auto& r : rows) all.push_back(r.to_json());
  return all.dump() + "\n";
}

std::string render_csv(const std::vector<ModeSummary>& rows) {
  std::string out;
  if (rows.empty()) return out;
  auto cell = [](const nlohmann::ordered_json& v) -> std::string {
    if (v.is_null()) return "";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_array()) {
      std::string joined;
      for (const auto& item : v) {
        if (!joined.empty()) joined += ";";
        joined += item.is_string() ? item.get<std::string>() : item.dump();
      }
      return joined;
    }
    return v.dump();
  };
  std::vector<std::string> keys;
  const nlohmann::ordered_json first = rows.front().to_json();
  for (auto it = first.begin(); it != first.end(); ++it) keys.push_back(it.key());
  out += fmt::format("{}\n", fmt::join(keys, ","));
  for (const auto& r : rows) {
    const nlohmann::ordered_json j = r.to_json();
    std::vector<std::string> cells;
    for (auto it = j.begin(); it != j.end(); ++it) cells.push_back(cell(*it));
    out += fmt::format("{}\n", fmt::join(cells, ","));
  }
  return out;
}

}  // namespace cfmo::moe
