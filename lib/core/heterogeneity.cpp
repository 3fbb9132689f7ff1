#include "core/heterogeneity.h"

#include <charconv>
#include <cmath>
#include <string_view>

namespace cfmo {

Result<Heterogeneity> parse_heterogeneity(const std::vector<std::string>& slowdown, const std::string& straggler,
                                          int rank, int ranks) {
  Heterogeneity h;
  auto number = [](std::string_view text, double& out) {
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    return ec == std::errc() && end == text.data() + text.size() && std::isfinite(out);
  };
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

}  // namespace cfmo
