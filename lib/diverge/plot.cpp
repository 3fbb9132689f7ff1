#include "diverge/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>

namespace cfmo::diverge {

std::vector<PlotSeries> rel_l2_series(const Report& report) {
  std::map<int, PlotSeries> by_rank;
  for (const auto& row : report.deltas) {
    if (!row.rank || !row.round) continue;
    auto& s = by_rank[*row.rank];
    s.rank = *row.rank;
    s.points.emplace_back(*row.round, row.overall.rel_l2);
  }
  std::vector<PlotSeries> out;
  for (auto& [rank, s] : by_rank) {
    std::stable_sort(s.points.begin(), s.points.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

// Tableau 10: distinct, and readable by most colour-blind viewers.
constexpr std::array<const char*, 10> kPalette = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                                  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

std::string xml_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
    }
  }
  return out;
}

// A step of 1, 2 or 5 times a power of ten giving about `target` intervals.
double nice_step(double range, int target) {
  const double raw = range / std::max(target, 1);
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

std::string tick_label(double value, double step) {
  // Enough decimals to tell neighbouring ticks apart.
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step)));
  return fmt::format("{:.{}f}", value, decimals);
}

}  // namespace

std::string render_svg(std::span<const PlotSeries> series, const SvgOptions& options) {
  const double width = std::max(options.width, 320);
  const double height = std::max(options.height, 200);
  const double left = 70, right = 130, top = options.subtitle.empty() ? 40 : 56, bottom = 50;
  const double plot_w = width - left - right;
  const double plot_h = height - top - bottom;

  int64_t x_min = 0, x_max = 0;
  double y_max = 0;
  bool any = false;
  size_t most_points = 0;
  for (const auto& s : series) {
    most_points = std::max(most_points, s.points.size());
    for (const auto& [round, value] : s.points) {
      x_min = any ? std::min(x_min, round) : round;
      x_max = any ? std::max(x_max, round) : round;
      any = true;
      if (std::isfinite(value)) y_max = std::max(y_max, value);
    }
  }
  if (options.threshold) y_max = std::max(y_max, *options.threshold);
  y_max = y_max > 0 ? y_max * 1.1 : 0.01;
  if (x_max == x_min) {
    x_min -= 1;
    x_max += 1;
  }
  const bool log_x = options.log2_x && x_min > 0;
  auto scale_x = [&](double x) { return log_x ? std::log2(x) : x; };
  const double x_span = scale_x(static_cast<double>(x_max)) - scale_x(static_cast<double>(x_min));
  auto px = [&](double round) {
    return left + (scale_x(round) - scale_x(static_cast<double>(x_min))) / x_span * plot_w;
  };
  auto py = [&](double value) { return top + plot_h - value / y_max * plot_h; };

  std::string svg;
  svg += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n",
      width, height);
  svg += fmt::format("<title>{}</title>\n", xml_escape(options.title));
  svg += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"white\"/>\n", width, height);
  svg += fmt::format("<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n", left + plot_w / 2,
                     xml_escape(options.title));
  if (!options.subtitle.empty()) {
    svg += fmt::format("<text x=\"{}\" y=\"40\" text-anchor=\"middle\" fill=\"#555\">{}</text>\n", left + plot_w / 2,
                       xml_escape(options.subtitle));
  }

  // Grid, ticks and their labels.
  svg += "<g stroke=\"#e0e0e0\" stroke-width=\"1\">\n";
  const double y_step = nice_step(y_max * 100, 5) / 100;
  std::string labels;
  for (double y = 0; y <= y_max + 1e-12; y += y_step) {
    svg += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>\n", left, py(y), left + plot_w,
                       py(y));
    labels += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", left - 6, py(y) + 4,
                          tick_label(y * 100, y_step * 100));
  }
  const double x_step = log_x ? 1.0 : std::max(1.0, nice_step(x_span, 8));
  // On a log2 axis the ticks are the powers of two in range, each a factor 2 apart.
  for (double x = log_x ? std::exp2(std::ceil(std::log2(static_cast<double>(x_min))))
                        : std::ceil(static_cast<double>(x_min) / x_step) * x_step;
       x <= static_cast<double>(x_max); x = log_x ? 2 * x : x + x_step) {
    svg += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>\n", px(x), top, px(x),
                       top + plot_h);
    labels += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", px(x),
                          top + plot_h + 18, tick_label(x, x_step));
  }
  svg += "</g>\n";
  svg += labels;
  // Axes and their titles.
  svg += fmt::format(
      "<g stroke=\"black\" stroke-width=\"1\"><line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\"/>"
      "<line x1=\"{0:.1f}\" y1=\"{2:.1f}\" x2=\"{3:.1f}\" y2=\"{2:.1f}\"/></g>\n",
      left, top, top + plot_h, left + plot_w);
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", left + plot_w / 2,
                     height - 12, xml_escape(options.x_label));
  svg += fmt::format(
      "<text x=\"16\" y=\"{0:.1f}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {0:.1f})\">{1}</text>\n",
      top + plot_h / 2, xml_escape(options.y_label));

  // The threshold.
  if (options.threshold) {
    const double y = py(*options.threshold);
    svg += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#d62728\" stroke-width=\"1.5\" "
        "stroke-dasharray=\"6 4\"/>\n",
        left, y, left + plot_w, y);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#d62728\">threshold {}</text>\n", left + plot_w + 6,
                       y + 4, format_percent(*options.threshold));
  }

  // One line per rank, broken where a value is undefined; dots when there are few points.
  const bool dots = most_points <= 200;
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const std::string name = i < options.names.size() ? xml_escape(options.names[i]) : fmt::format("rank {}", s.rank);
    const char* color = kPalette[i % kPalette.size()];
    // Past ten ranks the colours repeat; a dash pattern tells the cycles apart.
    const std::string dash =
        i >= kPalette.size() ? fmt::format(" stroke-dasharray=\"{} 3\"", 2 + 3 * (i / kPalette.size())) : "";
    svg += fmt::format("<g fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{}>\n", color, dash);
    std::string points;
    auto flush = [&] {
      if (!points.empty()) svg += fmt::format("<polyline points=\"{}\"/>\n", points);
      points.clear();
    };
    for (const auto& [round, value] : s.points) {
      if (!std::isfinite(value)) {
        flush();
        continue;
      }
      points += fmt::format("{}{:.1f},{:.1f}", points.empty() ? "" : " ", px(static_cast<double>(round)), py(value));
    }
    flush();
    svg += "</g>\n";
    if (dots) {
      svg += fmt::format("<g fill=\"{}\">\n", color);
      for (const auto& [round, value] : s.points) {
        if (!std::isfinite(value)) continue;
        svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\"><title>{} {} {}: {}</title></circle>\n",
                           px(static_cast<double>(round)), py(value), name, xml_escape(options.x_label), round,
                           format_percent(value));
      }
      svg += "</g>\n";
    }
    // Legend entry.
    const double ly = top + 10 + 18 * static_cast<double>(i);
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"{3}\" stroke-width=\"2\"{4}/>"
        "<text x=\"{5:.1f}\" y=\"{6:.1f}\">{7}</text>\n",
        left + plot_w + 6, ly, left + plot_w + 30, color, dash, left + plot_w + 36, ly + 4, name);
  }
  if (!any) {
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#555\">no rounds</text>\n",
                       left + plot_w / 2, top + plot_h / 2);
  }
  svg += "</svg>\n";
  return svg;
}

std::string render_sparklines(std::span<const PlotSeries> series, std::optional<double> threshold, int columns) {
  static constexpr std::array<const char*, 8> kBars = {"\u2581", "\u2582", "\u2583", "\u2584",
                                                       "\u2585", "\u2586", "\u2587", "\u2588"};
  std::set<int64_t> all_rounds;
  double top = threshold.value_or(0);
  for (const auto& s : series) {
    for (const auto& [round, value] : s.points) {
      all_rounds.insert(round);
      if (std::isfinite(value)) top = std::max(top, value);
    }
  }
  const std::vector<int64_t> rounds(all_rounds.begin(), all_rounds.end());
  // "rank 12  " before the line, "  last 12.3%  max 45.6% at round 123456  3 above 5%" after it.
  const int reserved = 60;
  const size_t cells = std::max<size_t>(8, static_cast<size_t>(std::max(columns - reserved, 8)));
  const size_t per_cell = rounds.empty() ? 1 : (rounds.size() + cells - 1) / cells;
  const size_t used_cells = rounds.empty() ? 0 : (rounds.size() + per_cell - 1) / per_cell;

  std::string out;
  if (!rounds.empty()) {
    out += fmt::format("rounds {}..{}{}, scale 0..{}{}\n", rounds.front(), rounds.back(),
                       per_cell > 1 ? fmt::format(" ({} per character, the largest shown)", per_cell) : "",
                       format_percent(top), threshold ? fmt::format(", threshold {}", format_percent(*threshold)) : "");
  }
  for (const auto& s : series) {
    std::vector<double> cell(used_cells, std::nan(""));
    double last = std::nan("");
    double max_value = std::nan("");
    int64_t max_round = 0;
    int above = 0;
    for (const auto& [round, value] : s.points) {
      const size_t index = static_cast<size_t>(std::lower_bound(rounds.begin(), rounds.end(), round) - rounds.begin());
      if (!std::isfinite(value)) continue;
      double& c = cell[index / per_cell];
      c = std::isnan(c) ? value : std::max(c, value);
      last = value;
      if (std::isnan(max_value) || value > max_value) {
        max_value = value;
        max_round = round;
      }
      if (threshold && value > *threshold) ++above;
    }
    std::string line;
    for (double v : cell) {
      if (std::isnan(v)) {
        line += ' ';
        continue;
      }
      const double level = top > 0 ? v / top * 7 : 0;
      line += kBars[static_cast<size_t>(std::clamp(std::lround(level), 0L, 7L))];
    }
    out += fmt::format("rank {:<3} {}  last {}  max {}", s.rank, line, format_percent(last), format_percent(max_value));
    if (!std::isnan(max_value)) out += fmt::format(" at round {}", max_round);
    if (threshold) out += fmt::format("  {} above {}", above, format_percent(*threshold));
    out += "\n";
  }
  return out;
}

}  // namespace cfmo::diverge
