#pragma once
/// One row of the report: a mode at one size, gathered from every rank, in
/// the terms of nccl-tests and the OSU benchmarks (algbw = bytes / time,
/// busbw = algbw (n-1)/n; percentiles over every rank's iterations; min,
/// avg and max across ranks of each rank's mean), and its renderings.

#include "comm/communicator.h"
#include "moe/dispatch_engines.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace cfmo::moe {

/// A time's distribution: p50/p99 over all samples, min/avg/max over the ranks' means.
struct TimeStats {
  double p50 = 0, p99 = 0, min = 0, avg = 0, max = 0;
};

/// The check of one rank's last output against the single-process reference.
struct CheckValues {
  double max_abs_err = 0;         ///< over every token
  double ontime_max_abs_err = 0;  ///< over tokens none of whose results was late
  double sq_err = 0;
  double sq_ref = 0;
  double ref_max_abs = 0;
  bool done = false;
};

/// What the report says about the run, besides the measurements.
struct RunSettings {
  std::string mode;
  int64_t tokens_per_rank = 0;
  int experts = 0, hidden = 0, ffn = 0, top_k = 0, in_flight = 0;
  double capacity_factor = 0;
  int64_t capacity = -1;
  std::string drop_policy, routing, dtype, late_policy;
  std::string device = "cpu";  ///< where the experts ran: "cpu", or the GPU's description
  int64_t warmup = 0, iters = 0;
  double deadline_s = 0;
  std::vector<std::string> slowdown;
  std::string straggler;
};

struct ModeSummary {
  RunSettings settings;
  int ranks = 1;
  double tokens_per_s = 0;
  TimeStats dispatch, combine, a2a, iteration;
  double algbw_gbps = 0, busbw_gbps = 0, bytes_per_peer = 0;
  double dropped_frac = 0, late_frac = 0, stale_frac = 0, staleness_mean = 0;
  int64_t staleness_max = 0, late_arrivals = 0, skipped_chunks = 0;
  double overlap_share = 0, imbalance = 1;
  std::string check = "skipped";
  double max_abs_err = 0, rel_err = 0;
  std::optional<double> rel_err_vs_sync, speedup_vs_sync;
  std::vector<double> rank_tokens_per_s;

  nlohmann::ordered_json to_json() const;
};

/// Every rank calls it with its own record (a collective): every rank gets the summary.
Result<ModeSummary> summarize(comm::Communicator& comm, const RunSettings& settings, const RankRecord& record,
                              const CheckValues& check);

/// Relative L2 error ||a - b|| / ||b|| over every rank's vectors (a collective).
Result<double> global_relative_error(comm::Communicator& comm, std::span<const float> a, std::span<const float> b);

/// Nearest-rank percentile (q in [0, 1]) of unsorted samples.
double percentile(std::vector<double> samples, double q);

/// OSU / nccl-tests style: '#' header lines, then one row per summary.
std::string render_table(const std::vector<ModeSummary>& rows);
std::string render_json(const std::vector<ModeSummary>& rows);
std::string render_csv(const std::vector<ModeSummary>& rows);

}  // namespace cfmo::moe
