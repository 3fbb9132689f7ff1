#pragma once
/// The limits a check holds deltas to, and every place a report exceeds them.

#include "core/error.h"
#include "diverge/report.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::diverge {

struct Thresholds {
  std::optional<double> max_rel_l2;      ///< a fraction (0.05 for 5%), per delta
  std::optional<double> max_abs;         ///< per tensor
  std::optional<int64_t> max_nonfinite;  ///< non-finite values per delta, in the delta and the base together
  bool per_tensor = false;               ///< also hold every tensor to max_rel_l2
};

/// "5%", "0.5 %" or "0.05" -> 0.05. A bare number above 1 is ambiguous ("5"
/// would be 500%) and refused; write "150%". Usage errors name `flag`.
Result<double> parse_fraction(std::string_view text, std::string_view flag);

struct Violation {
  const DeltaRow* delta = nullptr;
  std::string tensor;  ///< empty for a delta's overall figure
  std::string metric;  ///< "rel_l2", "max_abs" or "nonfinite"
  double value = 0;
  double limit = 0;
  std::string message;  ///< one line naming the delta (and tensor), the value and the limit
};

/// Every violation, in report order. A relative L2 that is undefined (a
/// zero base) is not held to max_rel_l2.
std::vector<Violation> find_violations(const Report& report, const Thresholds& thresholds);
/// The same for one delta (watch checks rows as they arrive).
std::vector<Violation> find_violations(const DeltaRow& row, const Thresholds& thresholds);

/// "5%, max |delta| 0.01, non-finite 0" for messages.
std::string describe(const Thresholds& thresholds);

}  // namespace cfmo::diverge
