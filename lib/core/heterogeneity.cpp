#include "core/heterogeneity.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string_view>

namespace cfmo {
namespace {

bool number(std::string_view text, double& out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && std::isfinite(out);
}

}  // namespace

Result<Heterogeneity> parse_heterogeneity(const std::vector<std::string>& slowdown, const std::string& straggler,
                                          int rank, int ranks) {
  Heterogeneity h;
  for (const auto& item : slowdown) {
    const auto eq = item.find('=');
    double r = 0;
    double factor = 0;
    if (eq == std::string::npos || !number(std::string_view(item).substr(0, eq), r) ||
        !number(std::string_view(item).substr(eq + 1), factor) || r < 0 || r != std::floor(r) || factor < 1) {
      return make_error(ErrorKind::kUsage, "--slowdown '{}': expected RANK=FACTOR with FACTOR >= 1", item);
    }
    if (static_cast<int>(r) >= ranks && ranks > 1) {
      // Ranks, not workers: cfmo-moe reads --slowdown here too.
      return make_error(ErrorKind::kUsage, "--slowdown '{}': there is no rank {} in a run of {} ranks", item,
                        static_cast<int>(r), ranks);
    }
    if (static_cast<int>(r) == rank) h.slowdown = factor;
  }
  if (!straggler.empty()) {
    const auto colon = straggler.find(':');
    if (colon == std::string::npos || !number(std::string_view(straggler).substr(0, colon), h.straggler_p) ||
        !number(std::string_view(straggler).substr(colon + 1), h.straggler_factor) || h.straggler_p < 0 ||
        h.straggler_p > 1 || h.straggler_factor < 1) {
      return make_error(ErrorKind::kUsage, "--straggler '{}': expected P:FACTOR with P in [0, 1] and FACTOR >= 1",
                        straggler);
    }
  }
  return h;
}

Result<Thermal> parse_thermal(const std::string& text) {
  Thermal t;
  const auto first = text.find(':');
  const auto second = first == std::string::npos ? first : text.find(':', first + 1);
  const std::string_view v(text);
  if (second == std::string::npos || !number(v.substr(0, first), t.share) ||
      !number(v.substr(first + 1, second - first - 1), t.speed) || !number(v.substr(second + 1), t.stretch_s) ||
      t.share < 0 || t.share > 1 || t.speed <= 0 || t.speed > 1 || t.stretch_s <= 0) {
    return make_error(ErrorKind::kUsage,
                      "--thermal '{}': expected P:X:S with P in [0, 1], X in (0, 1] and S > 0 seconds", text);
  }
  return t;
}

Result<std::vector<SpeedShare>> parse_speeds(const std::string& text) {
  std::vector<SpeedShare> out;
  double total = 0;
  size_t start = 0;
  const std::string_view v(text);
  while (start <= v.size()) {
    const auto comma = std::min(v.find(',', start), v.size());
    const std::string_view item = v.substr(start, comma - start);
    const auto colon = item.find(':');
    SpeedShare s;
    if (colon == std::string_view::npos || !number(item.substr(0, colon), s.share) ||
        !number(item.substr(colon + 1), s.speed) || s.share <= 0 || s.speed <= 0) {
      return make_error(ErrorKind::kUsage, "--speeds '{}': expected SHARE:SPEED,... with shares and speeds > 0", text);
    }
    total += s.share;
    out.push_back(s);
    start = comma + 1;
  }
  if (std::abs(total - 1) > 1e-6) {
    return make_error(ErrorKind::kUsage, "--speeds '{}': the shares add up to {}, not 1", text, total);
  }
  return out;
}

}  // namespace cfmo
