#include "diverge/thresholds.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

namespace cfmo::diverge {

Result<double> parse_fraction(std::string_view text, std::string_view flag) {
  auto bad = [&](std::string_view why) { return make_error(ErrorKind::kUsage, "{}: '{}' {}", flag, text, why); };
  std::string_view number = text;
  while (!number.empty() && number.back() == ' ') number.remove_suffix(1);
  const bool percent = !number.empty() && number.back() == '%';
  if (percent) number.remove_suffix(1);
  while (!number.empty() && number.back() == ' ') number.remove_suffix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (number.empty() || ec != std::errc() || end != number.data() + number.size() || !std::isfinite(value)) {
    return bad("is not a percentage or a fraction (e.g. 5% or 0.05)");
  }
  if (value < 0) return bad("is negative");
  if (!percent && value > 1) return bad(fmt::format("is ambiguous: write {}% for a percentage", value));
  return percent ? value / 100 : value;
}

namespace {

std::string where(const DeltaRow& row) {
  std::string out = describe(row);
  if (row.step) out += fmt::format(" (step {})", *row.step);
  return out;
}

}  // namespace

std::vector<Violation> find_violations(const DeltaRow& row, const Thresholds& thresholds) {
  std::vector<Violation> out;
  const auto& d = row.overall;
  if (thresholds.max_rel_l2 && !std::isnan(d.rel_l2) && d.rel_l2 > *thresholds.max_rel_l2) {
    out.push_back({&row, "", "rel_l2", d.rel_l2, *thresholds.max_rel_l2,
                   fmt::format("{}: relative L2 {} exceeds {}", where(row), format_percent(d.rel_l2),
                               format_percent(*thresholds.max_rel_l2))});
  }
  for (const auto& t : row.tensors) {
    const auto& td = t.divergence;
    if (thresholds.per_tensor && thresholds.max_rel_l2 && !std::isnan(td.rel_l2) &&
        td.rel_l2 > *thresholds.max_rel_l2) {
      out.push_back({&row, t.name, "rel_l2", td.rel_l2, *thresholds.max_rel_l2,
                     fmt::format("{}: tensor '{}': relative L2 {} exceeds {}", where(row), t.name,
                                 format_percent(td.rel_l2), format_percent(*thresholds.max_rel_l2))});
    }
    if (thresholds.max_abs && td.max_abs > *thresholds.max_abs) {
      out.push_back({&row, t.name, "max_abs", td.max_abs, *thresholds.max_abs,
                     fmt::format("{}: tensor '{}': max |delta| {:.6g} exceeds {:.6g}", where(row), t.name, td.max_abs,
                                 *thresholds.max_abs)});
    }
  }
  const int64_t nonfinite = d.nonfinite + d.base_nonfinite;
  if (thresholds.max_nonfinite && nonfinite > *thresholds.max_nonfinite) {
    std::string tensors;
    for (const auto& t : row.tensors) {
      const int64_t n = t.divergence.nonfinite + t.divergence.base_nonfinite;
      if (n > 0) tensors += fmt::format("{}{} in '{}'", tensors.empty() ? "" : ", ", n, t.name);
    }
    std::string split;
    if (d.base_nonfinite > 0) split = fmt::format(" ({} in the delta, {} in the base)", d.nonfinite, d.base_nonfinite);
    out.push_back({&row, "", "nonfinite", static_cast<double>(nonfinite),
                   static_cast<double>(*thresholds.max_nonfinite),
                   fmt::format("{}: {} non-finite values{} exceed {}: {}", where(row), nonfinite, split,
                               *thresholds.max_nonfinite, tensors)});
  }
  return out;
}

std::vector<Violation> find_violations(const Report& report, const Thresholds& thresholds) {
  std::vector<Violation> out;
  for (const auto& row : report.deltas) {
    auto found = find_violations(row, thresholds);
    out.insert(out.end(), std::make_move_iterator(found.begin()), std::make_move_iterator(found.end()));
  }
  return out;
}

std::string describe(const Thresholds& thresholds) {
  std::vector<std::string> parts;
  if (thresholds.max_rel_l2) {
    parts.push_back(fmt::format("relative L2 {}{}", format_percent(*thresholds.max_rel_l2),
                                thresholds.per_tensor ? " (also per tensor)" : ""));
  }
  if (thresholds.max_abs) parts.push_back(fmt::format("max |delta| {:.6g}", *thresholds.max_abs));
  if (thresholds.max_nonfinite) parts.push_back(fmt::format("non-finite {}", *thresholds.max_nonfinite));
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : ", ") + p;
  return out.empty() ? "no limits" : out;
}

}  // namespace cfmo::diverge
