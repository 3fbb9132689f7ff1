#pragma once
/// Learning-rate schedules: linear warmup, then constant or cosine decay.

#include "core/error.h"

#include <cstdint>
#include <string>

namespace cfmo::optim {

struct Schedule {
  enum class Kind { kConstant, kCosine };
  Kind kind = Kind::kConstant;
  double base_lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  ///< needed by cosine

  static Result<Kind> parse_kind(const std::string& text);
  /// The learning rate for the update that follows `step` completed steps.
  double at(int64_t step) const;
};

}  // namespace cfmo::optim
