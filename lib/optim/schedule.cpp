#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace cfmo::optim {

Result<Schedule::Kind> Schedule::parse_kind(const std::string& text) {
  if (text == "constant") return Kind::kConstant;
  if (text == "cosine") return Kind::kCosine;
  return make_error(ErrorKind::kUsage, "--schedule '{}': expected constant or cosine", text);
}

double Schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  if (kind == Kind::kConstant) return base_lr;
  const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace cfmo::optim
