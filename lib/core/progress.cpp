#include "core/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace cfmo {

std::string human_count(double value) {
  if (value < 10'000) return fmt::format("{:.0f}", value);
  if (value < 1e6) return fmt::format("{:.1f}k", value / 1e3);
  return fmt::format("{:.2f}M", value / 1e6);
}

std::string human_duration(double seconds) {
  // Past about 30 million years the conversion below would overflow (undefined behaviour), and
  // such an ETA, from a fraction near 0, means nothing anyway.
  constexpr double kMaxSeconds = 1e15;
  if (!std::isfinite(seconds) || seconds < 0 || seconds > kMaxSeconds) return "?";
  auto total = static_cast<long long>(seconds + 0.5);
  if (total >= 3600) return fmt::format("{}:{:02}:{:02}", total / 3600, total / 60 % 60, total % 60);
  return fmt::format("{}:{:02}", total / 60, total % 60);
}

std::string render_progress(const ProgressState& state, int width) {
  std::string tail;
  if (!state.metrics.empty()) tail = fmt::format("  {}", state.metrics);
  if (state.eta_s >= 0) tail += fmt::format("  ETA {}", human_duration(state.eta_s));
  const std::string head = state.label.empty() ? std::string() : fmt::format("{} ", state.label);
  int bar_width = width - static_cast<int>(head.size() + tail.size()) - 7;
  std::string bar;
  if (state.fraction >= 0 && bar_width >= 10) {
    double f = std::clamp(state.fraction, 0.0, 1.0);
    int filled = static_cast<int>(f * bar_width);
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "[" + std::string(...).
    bar += '[';
    bar.append(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(bar_width - filled), '.');
    bar += fmt::format("] {:3.0f}%", f * 100);
  }
  std::string line = head + bar + tail;
  // A line wider than the terminal wraps, and the caller's '\r' redraw then leaves a trail of lines.
  line.resize(std::min(line.size(), static_cast<size_t>(std::max(width, 0))));
  return line;
}

}  // namespace cfmo
