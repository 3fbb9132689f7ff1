#include "diverge/commands.h"

#include "core/atomic_file.h"
#include "diverge/plot.h"
#include "diverge/report.h"
#include "diverge/thresholds.h"
#include "diverge/watch.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <thread>

namespace cfmo::diverge {
namespace {

using Json = nlohmann::ordered_json;

ReportOptions report_options(const DivergeConfig& config, const DivergePlan& plan) {
  ReportOptions options;
  options.selection = plan.selection;
  options.threads = config.threads;
  options.header_only = config.header_only;
  return options;
}

/// The PATHs and --base/--against of report and check.
Result<std::vector<ReportInput>> inputs_of(const CommandPaths& given) {
  std::vector<ReportInput> inputs;
  for (const auto& path : given.paths) {
    // Two checkpoints given as PATHs would each be read as a .cfd file and fail as "bad magic".
    if (path.ends_with(".safetensors")) {
      return make_error(ErrorKind::kUsage, "'{}' is a checkpoint: compare two with --base GLOBAL --against LOCAL",
                        path);
    }
    inputs.push_back(classify_path(path));
  }
  if (given.base.empty() != given.against.empty()) {
    return make_error(ErrorKind::kUsage, "--base and --against go together: give both checkpoints");
  }
  if (!given.base.empty()) inputs.push_back({ReportInput::Kind::kSafetensorsPair, given.base, given.against});
  if (inputs.empty()) {
    return make_error(ErrorKind::kUsage, "nothing to read: give a run directory, a .cfd file, or --base and --against");
  }
  return inputs;
}

Result<Report> read_inputs(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths) {
  CFMO_ASSIGN_OR_RETURN(const std::vector<ReportInput> inputs, inputs_of(paths));
  return build_report(inputs, report_options(config, plan));
}

template <typename T>
Json optional_json(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

std::string violations_json(const Report& report, const std::vector<Violation>& violations,
                            const Thresholds& thresholds) {
  Json j;
  j["ok"] = violations.empty();
  j["limits"] = {{"max_rel_l2", optional_json(thresholds.max_rel_l2)},
                 {"max_abs", optional_json(thresholds.max_abs)},
                 {"max_nonfinite", optional_json(thresholds.max_nonfinite)},
                 {"per_tensor", thresholds.per_tensor}};
  j["violations"] = Json::array();
  for (const auto& v : violations) {
    j["violations"].push_back({{"source", v.delta->source},
                               {"rank", optional_json(v.delta->rank)},
                               {"round", optional_json(v.delta->round)},
                               {"step", optional_json(v.delta->step)},
                               {"tensor", v.tensor.empty() ? Json(nullptr) : Json(v.tensor)},
                               {"metric", v.metric},
                               {"value", v.value},
                               {"limit", v.limit},
                               {"message", v.message}});
  }
  const auto summary = summarize(report);
  j["deltas"] = summary.deltas;
  j["max_rel_l2"] = summary.worst ? Json(summary.worst->overall.rel_l2) : Json(nullptr);
  j["max_abs"] = summary.max_abs;
  j["nonfinite"] = summary.nonfinite + summary.base_nonfinite;
  j["verified"] = report.verified;
  return j.dump(2) + "\n";
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string violations_csv(const std::vector<Violation>& violations) {
  std::string out = "source,rank,round,step,tensor,metric,value,limit\n";
  auto optional = [](const auto& v) { return v ? fmt::format("{}", *v) : std::string(); };
  for (const auto& v : violations) {
    out +=
        fmt::format("{},{},{},{},{},{},{},{}\n", csv_field(v.delta->source), optional(v.delta->rank),
                    optional(v.delta->round), optional(v.delta->step), csv_field(v.tensor), v.metric, v.value, v.limit);
  }
  return out;
}

std::string violations_text(const Report& report, const std::vector<Violation>& violations,
                            const Thresholds& thresholds, bool quiet) {
  std::string out;
  for (const auto& v : violations) out += v.message + "\n";
  const auto s = summarize(report);
  const std::string largest = s.worst ? fmt::format("; largest relative L2 {} ({})",
                                                    format_percent(s.worst->overall.rel_l2), describe(*s.worst))
                                      : "";
  if (!violations.empty()) {
    out += fmt::format("{} violation(s) in {} delta(s); limits: {}{}\n", violations.size(), s.deltas,
                       describe(thresholds), largest);
  } else if (!quiet) {
    out += fmt::format("ok: {} delta(s) within limits ({}){}\n", s.deltas, describe(thresholds), largest);
  }
  return out;
}

/// One delta's output in watch, with the violations it brought.
std::string watch_row(const DeltaRow& row, const std::vector<Violation>& found, OutputFormat format, bool per_tensor) {
  if (format == OutputFormat::kJson) {
    auto line = Json::parse(format_json_line(row));
    line["violations"] = Json::array();
    for (const auto& v : found) line["violations"].push_back(v.message);
    return line.dump() + "\n";
  }
  if (format == OutputFormat::kCsv) return format_csv_rows(row);
  std::string out = format_table_row(row, per_tensor);
  for (const auto& v : found) out += fmt::format("  ! {}\n", v.message);
  return out;
}

}  // namespace

void DivergeCommandLine::register_cli(CLI::App& app, Subcommand subcommand, const char* paths_help) {
  const bool many = subcommand == Subcommand::kReport || subcommand == Subcommand::kCheck;
  // Checked by the subcommand, not CLI11, so that --print-config needs no path.
  if (many) {
    app.add_option("PATH", paths.paths, paths_help);
  } else {
    app.add_option("RUNDIR", paths.run_dir, paths_help);
  }
  app.add_option("--config", config_file, "TOML file with any of the options below")->group("General");
  app.add_flag("--print-config", print_config, "print the merged configuration as TOML and exit")->group("General");
  if (many) {
    app.add_option("--base", paths.base, "the global checkpoint (.safetensors) to compare --against")->group("General");
    app.add_option("--against", paths.against, "the local checkpoint (.safetensors) compared with --base")
        ->group("General");
  }
  add_diverge_options(table, config, subcommand);
  table.register_cli(app);
  // One value per occurrence (--tensor a --tensor b), so that a list flag
  // does not swallow the PATHs after it.
  for (const char* list : {"--tensor", "--rank", "--round"}) app.get_option(list)->allow_extra_args(false);
}

Result<CommandOutput> run_report(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths) {
  CFMO_ASSIGN_OR_RETURN(const Report report, read_inputs(config, plan, paths));
  CommandOutput out;
  switch (plan.format) {
    case OutputFormat::kJson:
      out.text = format_json(report);
      break;
    case OutputFormat::kCsv:
      out.text = format_csv(report);
      break;
    default:
      out.text = format_table(report, config.per_tensor);
  }
  out.notes = report.notes;
  return out;
}

Result<CommandOutput> run_check(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths) {
  CFMO_ASSIGN_OR_RETURN(const Report report, read_inputs(config, plan, paths));
  const auto violations = find_violations(report, plan.thresholds);
  CommandOutput out;
  switch (plan.format) {
    case OutputFormat::kJson:
      out.text = violations_json(report, violations, plan.thresholds);
      break;
    case OutputFormat::kCsv:
      out.text = violations_csv(violations);
      break;
    default:
      out.text = violations_text(report, violations, plan.thresholds, config.quiet);
  }
  if (!config.quiet) out.notes = report.notes;
  out.status = violations.empty() ? 0 : static_cast<int>(ErrorKind::kCheckFailed);
  return out;
}

Result<CommandOutput> run_plot(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths,
                               int columns) {
  if (paths.run_dir.empty()) return make_error(ErrorKind::kUsage, "plot: which run directory?");
  const ReportInput input = classify_path(paths.run_dir);
  if (input.kind != ReportInput::Kind::kRunDir) {
    return make_error(ErrorKind::kInput, "'{}': not a run directory", paths.run_dir);
  }
  CFMO_ASSIGN_OR_RETURN(const Report report, build_report(std::span(&input, 1), report_options(config, plan)));
  const auto series = rel_l2_series(report);
  CommandOutput out;
  if (plan.format == OutputFormat::kSparkline) {
    out.text = render_sparklines(series, plan.thresholds.max_rel_l2, columns);
    return out;
  }
  SvgOptions options;
  options.threshold = plan.thresholds.max_rel_l2;
  options.width = config.width;
  options.height = config.height;
  options.subtitle = paths.run_dir;
  std::string svg = render_svg(series, options);
  if (config.output == "-") {
    out.text = std::move(svg);
  } else {
    CFMO_TRY(write_file_atomic(config.output, svg));
  }
  return out;
}

Result<CommandOutput> run_watch(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths,
                                const std::function<void(std::string_view)>& emit, const std::function<bool()>& stop) {
  if (paths.run_dir.empty()) return make_error(ErrorKind::kUsage, "watch: which run directory?");
  CFMO_ASSIGN_OR_RETURN(RunWatcher watcher, RunWatcher::open(paths.run_dir));

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto timed_out = [&] {
    return plan.timeout_s && std::chrono::duration<double>(Clock::now() - start).count() >= *plan.timeout_s;
  };
  ReportOptions options = report_options(config, plan);
  const Selection backlog = options.selection;  // --last applies to what is there at the start
  options.selection.last = 0;
  bool first_poll = true;
  int64_t printed = 0;
  size_t violations = 0;
  if (plan.format == OutputFormat::kTable) emit(format_table_header());
  if (plan.format == OutputFormat::kCsv) emit(format_csv_header());

  for (;;) {
    CFMO_ASSIGN_OR_RETURN(const auto fresh, watcher.poll());
    auto wanted = select_deltas(fresh, first_poll ? backlog : options.selection);
    first_poll = false;
    if (config.max_rounds > 0 && static_cast<int64_t>(wanted.size()) > config.max_rounds - printed) {
      wanted.resize(static_cast<size_t>(config.max_rounds - printed));
    }
    if (!wanted.empty()) {
      std::vector<ReportInput> inputs;
      for (const auto& ref : wanted) inputs.push_back({ReportInput::Kind::kCfd, ref.path, {}});
      CFMO_ASSIGN_OR_RETURN(const Report report, build_report(inputs, options));
      for (const auto& row : report.deltas) {
        const auto found = find_violations(row, plan.thresholds);
        violations += found.size();
        emit(watch_row(row, found, plan.format, config.per_tensor));
        ++printed;
      }
    }
    if (config.max_rounds > 0 && printed >= config.max_rounds) break;
    if (!config.follow && wanted.empty() && watcher.finished()) break;
    if (timed_out() || stop()) break;
    // Sleep in short slices so a signal or the timeout ends the wait promptly.
    const auto wake = Clock::now() + std::chrono::duration<double>(plan.interval_s);
    while (Clock::now() < wake && !stop() && !timed_out()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CommandOutput out;
  if (violations > 0 && plan.format == OutputFormat::kTable) {
    out.summary =
        fmt::format("{} violation(s) in {} delta(s); limits: {}", violations, printed, describe(plan.thresholds));
  }
  out.status = violations > 0 ? static_cast<int>(ErrorKind::kCheckFailed) : 0;
  return out;
}

}  // namespace cfmo::diverge
