#pragma once
/// Relative L2 per rank over rounds, drawn as a plain SVG file (axes, a
/// dashed threshold line, a legend) or as Unicode sparklines for a terminal.

#include "diverge/report.h"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace cfmo::diverge {

struct PlotSeries {
  int rank = 0;
  std::vector<std::pair<int64_t, double>> points;  ///< (round, relative L2), by round; NaN where undefined
};

/// One series per rank, from the deltas that have a rank and a round.
std::vector<PlotSeries> rel_l2_series(const Report& report);

struct SvgOptions {
  std::optional<double> threshold;  ///< a fraction; drawn as a dashed line
  int width = 800;
  int height = 450;
  std::string title = "Relative L2 divergence per rank";
  std::string subtitle{};  ///< e.g. the run directory
  std::string x_label = "round";
  std::string y_label = "relative L2 (%)";  ///< values are fractions, shown as percents
  bool log2_x = false;                      ///< x on a log2 scale, ticks at powers of two (x > 0)
  std::vector<std::string> names{};         ///< the legend's name of each series (none: "rank N")
};

std::string render_svg(std::span<const PlotSeries> series, const SvgOptions& options);

/// A line per rank: "rank 0  ▁▂▃▅▇  last 1.2%  max 3.4% at round 17", the
/// rounds of all ranks on one axis, at most `columns` characters wide
/// (several rounds share a cell, showing their largest value, when they
/// do not fit).
std::string render_sparklines(std::span<const PlotSeries> series, std::optional<double> threshold, int columns);

}  // namespace cfmo::diverge
