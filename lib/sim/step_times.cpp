#include "sim/step_times.h"

#include "core/atomic_file.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <numeric>

namespace cfmo::sim {

Result<RecordedSteps> read_recorded_steps(const std::filesystem::path& metrics) {
  auto text = read_file(metrics);
  if (!text) return make_error(ErrorKind::kInput, "--step-times: {}", text.error().message);
  RecordedSteps out;
  double last_wall = -1;  // the step line before's wall_s
  size_t start = 0;
  while (start < text->size()) {
    size_t end = text->find('\n', start);
    if (end == std::string::npos) end = text->size();
    const auto line = nlohmann::json::parse(std::string_view(*text).substr(start, end - start), nullptr, false);
    start = end + 1;
    if (!line.is_object() || line.value("type", "") != "step") continue;
    const auto it = line.find("compute_s");
    if (it == line.end() || !it->is_number() || !(it->get<double>() > 0)) continue;
    const double compute = it->get<double>();
    const double wait = line.value("wait_s", -1.0);
    const double wall = line.value("wall_s", -1.0);
    // What the line before's step did not take of the time since: the
    // previous step's time after it (a line per step: --log-every 1).
    if (!out.between.empty() && wait >= 0 && last_wall >= 0 && wall >= last_wall) {
      out.between.back() = std::max(0.0, wall - last_wall - compute - wait);
    }
    out.compute.push_back(compute);
    out.between.push_back(0);
    last_wall = wait >= 0 ? wall : -1;
  }
  if (out.compute.empty()) {
    return make_error(ErrorKind::kInput,
                      "--step-times '{}': no step line with compute_s (a run of this version records it)",
                      metrics.string());
  }
  return out;
}

Result<std::vector<double>> read_step_times(const std::filesystem::path& metrics) {
  CFMO_ASSIGN_OR_RETURN(auto steps, read_recorded_steps(metrics));
  return std::move(steps.compute);
}

Result<std::vector<RecordedSteps>> read_ranks_step_times(const std::filesystem::path& metrics) {
  std::vector<RecordedSteps> out;
  CFMO_ASSIGN_OR_RETURN(auto first, read_recorded_steps(metrics));
  out.push_back(std::move(first));
  for (int r = 1;; ++r) {
    const auto path = metrics.parent_path() / fmt::format("metrics-rank-{}.jsonl", r);
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) break;
    CFMO_ASSIGN_OR_RETURN(auto steps, read_recorded_steps(path));
    out.push_back(std::move(steps));
  }
  return out;
}

Result<StepTimes> StepTimes::make(const StepTimeOptions& options, int workers) {
  StepTimes t;
  if (!(options.step_time_s > 0) || !std::isfinite(options.step_time_s)) {
    return make_error(ErrorKind::kUsage, "--step-time: {} is not a positive number of seconds", options.step_time_s);
  }
  t.measured_ = options.measured;
  t.step_time_s_ = options.step_time_s;
  t.natural_mean_ = t.measured_.empty() ? t.step_time_s_
                                        : std::accumulate(t.measured_.begin(), t.measured_.end(), 0.0) /
                                              static_cast<double>(t.measured_.size());
  t.seed_ = options.seed;
  t.by_rank_ = options.by_rank;
  CFMO_ASSIGN_OR_RETURN(t.straggler_, parse_heterogeneity({}, options.straggler, 0, workers));
  if (!options.thermal.empty()) {
    CFMO_ASSIGN_OR_RETURN(auto thermal, parse_thermal(options.thermal));
    t.thermal_ = thermal;
  }
  std::vector<SpeedShare> speeds = {{1.0, 1.0}};
  if (!options.speeds.empty()) {
    CFMO_ASSIGN_OR_RETURN(speeds, parse_speeds(options.speeds));
  }
  double edge = 0;
  size_t group = 0;
  for (int r = 0; r < workers; ++r) {
    // Shares in rank order: a worker belongs to the group its position falls in.
    const double position = (r + 0.5) / workers;
    while (group + 1 < speeds.size() && position >= edge + speeds[group].share) edge += speeds[group++].share;
    CFMO_ASSIGN_OR_RETURN(const Heterogeneity mine, parse_heterogeneity(options.slowdown, "", r, workers));
    Worker w;
    w.factor = mine.slowdown / speeds[group].speed;
    w.rng = Rng(options.seed, 0x5173000ULL + static_cast<uint64_t>(r));
    t.workers_.push_back(w);
  }
  // A simulation of the run itself: in a real run the workers' steps are
  // not independent draws (a loaded machine slows them together, the first
  // steps are slow), and a lockstep mode waits for each step's slowest.
  for (size_t r = 0; r < t.by_rank_.size() && r < t.workers_.size(); ++r) {
    t.workers_[r].replay = !t.by_rank_[r].compute.empty();
  }
  return t;
}

double StepTimes::between(int rank) const {
  const Worker& w = workers_[static_cast<size_t>(rank)];
  if (!w.replay || w.next == 0) return 0;
  const auto& between = by_rank_[static_cast<size_t>(rank)].between;
  return between[(w.next - 1) % between.size()];
}

double StepTimes::draw(int rank, double now) {
  Worker& w = workers_[static_cast<size_t>(rank)];
  const auto& mine = w.replay ? by_rank_[static_cast<size_t>(rank)].compute : measured_;
  double t = w.replay            ? mine[w.next++ % mine.size()]
             : measured_.empty() ? step_time_s_
                                 : measured_[w.rng.below(measured_.size())];
  t *= w.factor;
  if (straggler_.straggler_p > 0 && w.rng.uniform() < straggler_.straggler_p) t *= straggler_.straggler_factor;
  if (thermal_ && thermal_->share > 0) {
    // Throttled or not for the whole stretch: a draw keyed by worker and stretch.
    const auto stretch = static_cast<uint64_t>(std::floor(now / thermal_->stretch_s));
    Rng r(seed_ ^ 0x7E3A1ULL, (static_cast<uint64_t>(rank) << 32) ^ stretch);
    if (r.uniform() < thermal_->share) t /= thermal_->speed;
  }
  return t;
}

}  // namespace cfmo::sim
