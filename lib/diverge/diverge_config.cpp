#include "diverge/diverge_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <sstream>

namespace cfmo::diverge {

namespace {

constexpr std::array<Subcommand, 4> kSubcommands = {Subcommand::kReport, Subcommand::kCheck, Subcommand::kPlot,
                                                    Subcommand::kWatch};

bool has(Subcommand s, std::initializer_list<Subcommand> among) {
  return std::find(among.begin(), among.end(), s) != among.end();
}

}  // namespace

std::string_view to_string(Subcommand subcommand) {
  switch (subcommand) {
    case Subcommand::kReport:
      return "report";
    case Subcommand::kCheck:
      return "check";
    case Subcommand::kPlot:
      return "plot";
    case Subcommand::kWatch:
      return "watch";
  }
  return "?";
}

void add_diverge_options(OptionTable& t, DivergeConfig& c, Subcommand s) {
  using enum Subcommand;
  const std::string select = "Selection";
  t.add("tensor", &c.tensor, "only tensors whose names match this shell pattern (repeatable, e.g. 'layers.0.*')",
        select);
  t.add("rank", &c.rank, "only these ranks (e.g. 0 or 0,2)", select);
  t.add("round", &c.round, "only these rounds (e.g. 7, 5..9, 10.., ..4; comma-separated)", select);
  t.add("last", &c.last, "only the last N rounds (0: all)", select);
  t.add("threads", &c.threads, "threads reading and reducing deltas (0: all cores)", select);
  t.add("header_only", &c.header_only,
        "use the statistics in each .cfd header without decompressing payloads or verifying checksums", select);

  const std::string limits = "Limits";
  if (has(s, {kCheck, kPlot, kWatch})) {
    t.add("max_rel_l2", &c.max_rel_l2,
          s == kPlot ? "draw the threshold line at this relative L2 (5% or 0.05; \"off\": none)"
                     : "largest relative L2 |delta|/|base| per delta (5% or 0.05; \"off\": no limit)",
          limits);
  }
  if (has(s, {kCheck, kWatch})) {
    t.add("max_abs", &c.max_abs, "largest |delta| of any value in any tensor (empty: no limit)", limits);
    t.add("max_nonfinite", &c.max_nonfinite,
          "most non-finite values (NaN, inf) per delta, in the delta and the base together (-1: no limit)", limits);
  }
  const std::string output = "Output";
  if (has(s, {kReport, kCheck, kWatch})) {
    t.add("per_tensor", &c.per_tensor,
          s == kCheck   ? "also hold every tensor to --max-rel-l2"
          : s == kWatch ? "also show every tensor, and hold each to --max-rel-l2"
                        : "in a table of several deltas, also show every tensor",
          output);
  }
  if (s == kPlot) {
    t.add("format", &c.format, "svg or sparkline (default svg)", output);
    t.add("output", &c.output, "file to write the SVG to (-: standard output)", output, "-o");
    t.add("width", &c.width, "SVG width in pixels", output);
    t.add("height", &c.height, "SVG height in pixels", output);
  } else {
    t.add("format", &c.format, "table, json or csv (default table)", output);
  }
  if (s == kCheck)
    t.add("quiet", &c.quiet, "print nothing when every limit holds, only the violations otherwise", output);
  if (s == kWatch) {
    const std::string follow = "Following";
    t.add("interval", &c.interval, "how often to look for new deltas (e.g. 1s, 500ms)", follow);
    t.add("timeout", &c.timeout, "stop after this long (e.g. 30m; empty: no limit)", follow);
    t.add("max_rounds", &c.max_rounds, "stop after printing this many deltas (0: no limit)", follow);
    t.add("follow", &c.follow, "keep watching after the run has finished (RUN/model.safetensors written)", follow);
  }
}

Status load_diverge_config(OptionTable& table, const std::filesystem::path& file, Subcommand subcommand) {
  SharedConfigShape shape;
  for (const Subcommand s : kSubcommands) shape.subcommands.emplace_back(to_string(s));
  shape.knows = [](size_t s, std::string_view key) {
    DivergeConfig scratch;
    OptionTable t;
    add_diverge_options(t, scratch, kSubcommands[s]);
    return t.has(key);
  };
  shape.sections = true;
  const auto index =
      static_cast<size_t>(std::find(kSubcommands.begin(), kSubcommands.end(), subcommand) - kSubcommands.begin());
  return load_shared_config(table, file, shape, index);
}

std::string diverge_config_toml(const OptionTable& table, Subcommand subcommand) {
  return fmt::format("[{}]\n{}", to_string(subcommand), table.to_toml());
}

Result<DivergePlan> validate(const DivergeConfig& c, Subcommand s) {
  using enum Subcommand;
  DivergePlan plan;
  plan.selection.tensor_globs = c.tensor;
  CFMO_ASSIGN_OR_RETURN(plan.selection.ranks, parse_ranks(c.rank));
  CFMO_ASSIGN_OR_RETURN(plan.selection.rounds, parse_rounds(c.round));
  for (const auto& glob : c.tensor) {
    if (glob.empty()) return make_error(ErrorKind::kUsage, "--tensor: empty pattern");
  }
  if (c.last < 0) return make_error(ErrorKind::kUsage, "--last: must be 0 (all) or a positive number of rounds");
  plan.selection.last = c.last;
  if (c.threads < 0 || c.threads > 1024) return make_error(ErrorKind::kUsage, "--threads: must be in 0..1024");

  if (s != kReport && c.max_rel_l2 != "off" && !c.max_rel_l2.empty()) {
    CFMO_ASSIGN_OR_RETURN(plan.thresholds.max_rel_l2, parse_fraction(c.max_rel_l2, "--max-rel-l2"));
  }
  if (s == kCheck || s == kWatch) {
    if (!c.max_abs.empty()) {
      double value = 0;
      const auto [end, ec] = std::from_chars(c.max_abs.data(), c.max_abs.data() + c.max_abs.size(), value);
      if (ec != std::errc() || end != c.max_abs.data() + c.max_abs.size() || !std::isfinite(value) || value < 0) {
        return make_error(ErrorKind::kUsage, "--max-abs: '{}' is not a non-negative number", c.max_abs);
      }
      plan.thresholds.max_abs = value;
    }
    if (c.max_nonfinite < -1) return make_error(ErrorKind::kUsage, "--max-nonfinite: must be -1 (no limit) or more");
    if (c.max_nonfinite >= 0) plan.thresholds.max_nonfinite = c.max_nonfinite;
    plan.thresholds.per_tensor = c.per_tensor;
  }

  if (s == kPlot) {
    if (c.format.empty() || c.format == "svg") {
      plan.format = OutputFormat::kSvg;
    } else if (c.format == "sparkline") {
      plan.format = OutputFormat::kSparkline;
    } else {
      return make_error(ErrorKind::kUsage, "--format: '{}' is not svg or sparkline", c.format);
    }
    if (c.width < 320 || c.width > 20000) return make_error(ErrorKind::kUsage, "--width: must be in 320..20000");
    if (c.height < 200 || c.height > 20000) return make_error(ErrorKind::kUsage, "--height: must be in 200..20000");
    if (c.output.empty()) return make_error(ErrorKind::kUsage, "--output: empty (use - for standard output)");
  } else if (c.format.empty() || c.format == "table") {
    plan.format = OutputFormat::kTable;
  } else if (c.format == "json") {
    plan.format = OutputFormat::kJson;
  } else if (c.format == "csv") {
    plan.format = OutputFormat::kCsv;
  } else {
    return make_error(ErrorKind::kUsage, "--format: '{}' is not table, json or csv", c.format);
  }

  if (s == kWatch) {
    auto interval = parse_duration(c.interval);
    if (!interval || *interval <= 0) {
      return make_error(ErrorKind::kUsage, "--interval: '{}' is not a positive duration (e.g. 1s, 500ms)", c.interval);
    }
    plan.interval_s = *interval;
    if (!c.timeout.empty()) {
      auto timeout = parse_duration(c.timeout);
      if (!timeout || *timeout <= 0) {
        return make_error(ErrorKind::kUsage, "--timeout: '{}' is not a positive duration (e.g. 30m)", c.timeout);
      }
      plan.timeout_s = *timeout;
    }
    if (c.max_rounds < 0) return make_error(ErrorKind::kUsage, "--max-rounds: must be 0 (no limit) or more");
  }
  return plan;
}

}  // namespace cfmo::diverge
