// cfmo-train simulate's outputs: the table (one row per size and mode), the
// JSON object and the SVG plot of efficiency against workers.
#include "diverge/plot.h"
#include "sim/simulation.h"

#include <fmt/format.h>

#include <map>

namespace cfmo::sim {
namespace {

/// "1.2 GB": bytes in a column.
std::string bytes_text(double bytes) {
  static constexpr std::array<const char*, 5> kUnits = {"B", "kB", "MB", "GB", "TB"};
  size_t unit = 0;
  while (bytes >= 1000 && unit + 1 < kUnits.size()) {
    bytes /= 1000;
    ++unit;
  }
  return fmt::format("{:.{}f} {}", bytes, unit == 0 ? 0 : 1, kUnits[unit]);
}

/// The share of the replies that came back at least one round stale.
double stale_share(const std::vector<uint64_t>& histogram) {
  uint64_t all = 0;
  for (auto n : histogram) all += n;
  return all > 0 && !histogram.empty() ? static_cast<double>(all - histogram[0]) / static_cast<double>(all) : 0;
}

nlohmann::ordered_json link_json(const LinkLoad& l) {
  return {{"max_bytes", l.max_bytes}, {"mean_bytes", l.mean_bytes}, {"max_busy_s", l.max_busy_s}};
}

}  // namespace

std::string simulate_table(const std::vector<SimulateRow>& rows) {
  std::string out = fmt::format("{:>7} {:<9} {:>12} {:>10} {:>9} {:>9} {:>10} {:>10} {:>9} {:>7} {:>10} {:>8}\n",
                                "workers", "mode", "samples/s", "efficiency", "mean wait", "max wait", "host link",
                                "spine link", "owner max", "stale", "virtual s", "wall s");
  const bool math = !rows.empty() && rows.front().test_loss >= 0;
  if (math) out.insert(out.size() - 1, fmt::format(" {:>9} {:>8}", "test loss", "test acc"));
  for (const auto& r : rows) {
    out += fmt::format(
        "{:>7} {:<9} {:>12.0f} {:>10.3f} {:>9.2f} {:>9.2f} {:>10} {:>10} {:>9} {:>6.1f}% {:>10.1f} {:>8.2f}\n",
        r.workers, r.mode, r.samples_per_s, r.efficiency, r.wait_s_mean, r.wait_s_max,
        bytes_text(static_cast<double>(r.host_uplinks.max_bytes)),
        bytes_text(static_cast<double>(r.spine_uplinks.max_bytes)), r.owner_received_max,
        100 * stale_share(r.staleness_histogram), r.virtual_s, r.wall_s);
    if (math) out.insert(out.size() - 1, fmt::format(" {:>9.4f} {:>8.4f}", r.test_loss, r.test_accuracy));
  }
  return out;
}

nlohmann::ordered_json simulate_json(const std::vector<SimulateRow>& rows, const SimulateOptions& options) {
  nlohmann::ordered_json runs = nlohmann::ordered_json::array();
  for (const auto& r : rows) {
    const nlohmann::ordered_json owners = {
        {"count", r.owners}, {"received_max", r.owner_received_max}, {"received_mean", r.owner_received_mean}};
    runs.push_back({{"mode", r.mode},
                    {"workers", r.workers},
                    {"steps", r.steps},
                    {"samples", r.samples},
                    {"virtual_s", r.virtual_s},
                    {"samples_per_s", r.samples_per_s},
                    {"solo_samples_per_s", r.solo_samples_per_s},
                    {"efficiency", r.efficiency},
                    {"wait_s", {{"mean", r.wait_s_mean}, {"max", r.wait_s_max}}},
                    {"finish_wait_s_mean", r.finish_wait_s_mean},
                    {"rounds", r.rounds},
                    {"messages", r.messages},
                    {"links",
                     {{"host_up", link_json(r.host_uplinks)},
                      {"host_down", link_json(r.host_downlinks)},
                      {"spine_up", link_json(r.spine_uplinks)}}},
                    {"owners", owners},
                    {"keeper_messages", r.keeper_messages},
                    {"contributions_dropped", r.contributions_dropped},
                    {"staleness_histogram", r.staleness_histogram},
                    {"test_loss", r.test_loss >= 0 ? nlohmann::ordered_json(r.test_loss) : nullptr},
                    {"test_accuracy", r.test_accuracy >= 0 ? nlohmann::ordered_json(r.test_accuracy) : nullptr},
                    {"wall_s", r.wall_s},
                    {"events", r.events}});
  }
  const auto& n = options.network;
  return {{"simulate",
           {{"steps", options.steps},
            {"batch", options.batch},
            {"params", options.math ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(options.params)},
            {"math", options.math},
            {"step_time_s", options.step_times.measured.empty() ? options.step_times.step_time_s : -1},
            {"measured_steps", options.step_times.measured.size()},
            {"link_bandwidth", n.bandwidth},
            {"link_latency", n.latency},
            {"topology", to_string(n.topology)},
            {"runs", runs}}}};
}

std::string simulate_svg(const std::vector<SimulateRow>& rows) {
  std::map<std::string, diverge::PlotSeries> by_mode;
  std::vector<std::string> order;
  for (const auto& r : rows) {
    auto [it, fresh] = by_mode.try_emplace(r.mode);
    if (fresh) order.push_back(r.mode);
    it->second.points.emplace_back(r.workers, r.efficiency);
  }
  std::vector<diverge::PlotSeries> series;
  for (const auto& m : order) series.push_back(by_mode[m]);
  diverge::SvgOptions options;
  options.names = order;
  options.title = "Simulated efficiency against workers";
  options.subtitle = "cfmo-train simulate: total samples/s over the sum of the workers' solo samples/s";
  options.x_label = "workers";
  options.y_label = "efficiency (%)";
  options.log2_x = true;
  return diverge::render_svg(series, options);
}

}  // namespace cfmo::sim
