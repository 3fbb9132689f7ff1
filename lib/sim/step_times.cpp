#include "sim/step_times.h"

#include "core/atomic_file.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <numeric>

namespace cfmo::sim {

Result<std::vector<double>> read_step_times(const std::filesystem::path& metrics) {
  auto text = read_file(metrics);
  if (!text) return make_error(ErrorKind::kInput, "--step-times: {}", text.error().message);
  std::vector<double> out;
  size_t start = 0;
  while (start < text->size()) {
    size_t end = text->find('\n', start);
    if (end == std::string::npos) end = text->size();
    const auto line = nlohmann::json::parse(std::string_view(*text).substr(start, end - start), nullptr, false);
    start = end + 1;
    if (!line.is_object() || line.value("type", "") != "step") continue;
    const auto it = line.find("compute_s");
    if (it != line.end() && it->is_number() && it->get<double>() > 0) out.push_back(it->get<double>());
  }
  if (out.empty()) {
    return make_error(ErrorKind::kInput,
                      "--step-times '{}': no step line with compute_s (a run of this version records it)",
                      metrics.string());
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
  return t;
}

double StepTimes::draw(int rank, double now) {
  Worker& w = workers_[static_cast<size_t>(rank)];
  double t = measured_.empty() ? step_time_s_ : measured_[w.rng.below(measured_.size())];
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
