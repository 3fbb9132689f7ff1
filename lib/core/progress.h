#pragma once
/// Renders a one-line progress bar; the caller decides where it goes
/// (stderr on a TTY), so the library never prints.

#include <string>

namespace cfmo {

struct ProgressState {
  double fraction = 0;  ///< 0..1 of the run; negative when unknown
  double eta_s = -1;    ///< seconds left, or negative when unknown
  std::string label;    ///< e.g. "epoch 2/10"
  std::string metrics;  ///< e.g. "loss 0.4123  41.2k samples/s"
};

/// "epoch 2/10 [########....] 61%  loss 0.41  41.2k samples/s  ETA 0:12"
std::string render_progress(const ProgressState& state, int width = 80);

/// 1234 -> "1234", 41234 -> "41.2k", 5e6 -> "5.00M".
std::string human_count(double value);
/// 75 -> "1:15", 3700 -> "1:01:40".
std::string human_duration(double seconds);

}  // namespace cfmo
