// cfmo-diverge: how far each worker's parameters drifted from the global ones,
// from a training run's compressed deltas. Parses flags, calls lib/diverge,
// prints, and maps the result to the shared exit status.
#include "../common/stop_signals.h"
#include "../common/tool_main.h"
#include "core/atomic_file.h"
#include "core/config.h"
#include "diverge/diverge_config.h"
#include "diverge/plot.h"
#include "diverge/report.h"
#include "diverge/thresholds.h"
#include "diverge/watch.h"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace {

using cfmo::Subcommand;
namespace fs = std::filesystem;

constexpr const char* kTool = "cfmo-diverge";
constexpr int kInterruptedStatus = 130;  // 128 + SIGINT, as shells report it

std::atomic<bool>& g_stop = cfmo::tool::stop_requested();

int fail(const cfmo::Error& error) { return cfmo::tool::fail(kTool, error); }

/// Everything one subcommand parsed; it stays in place because CLI11 and the
/// option table hold pointers into it.
struct Invocation {
  Subcommand id{};
  CLI::App* app = nullptr;
  cfmo::DivergeConfig config;
  cfmo::OptionTable table;
  std::string config_file;
  bool print_config = false;
  std::vector<std::string> paths;
  std::string run_dir;
  std::string base;
  std::string against;

  Invocation() = default;
  Invocation(const Invocation&) = delete;
  Invocation& operator=(const Invocation&) = delete;
};

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

void print_notes(const cfmo::Report& report) {
  for (const auto& note : report.notes) fmt::print(stderr, "{}: note: {}\n", kTool, note);
}

cfmo::ReportOptions report_options(const Invocation& inv, const cfmo::DivergePlan& plan) {
  cfmo::ReportOptions options;
  options.selection = plan.selection;
  options.threads = inv.config.threads;
  options.header_only = inv.config.header_only;
  return options;
}

/// The PATHs and --base/--against of report and check.
cfmo::Result<std::vector<cfmo::ReportInput>> inputs_of(const Invocation& inv) {
  std::vector<cfmo::ReportInput> inputs;
  for (const auto& path : inv.paths) {
    // Two checkpoints given as PATHs would each be read as a .cfd file and fail as "bad magic".
    if (path.ends_with(".safetensors")) {
      return cfmo::make_error(cfmo::ErrorKind::kUsage,
                              "'{}' is a checkpoint: compare two with --base GLOBAL --against LOCAL", path);
    }
    inputs.push_back(cfmo::classify_path(path));
  }
  if (inv.base.empty() != inv.against.empty()) {
    return cfmo::make_error(cfmo::ErrorKind::kUsage, "--base and --against go together: give both checkpoints");
  }
  if (!inv.base.empty()) {
    inputs.push_back({cfmo::ReportInput::Kind::kSafetensorsPair, inv.base, inv.against});
  }
  if (inputs.empty()) {
    return cfmo::make_error(cfmo::ErrorKind::kUsage,
                            "nothing to read: give a run directory, a .cfd file, or --base and --against");
  }
  return inputs;
}

int run_report(Invocation& inv, const cfmo::DivergePlan& plan) {
  auto inputs = inputs_of(inv);
  if (!inputs) return fail(inputs.error());
  auto report = cfmo::build_report(*inputs, report_options(inv, plan));
  if (!report) return fail(report.error());
  switch (plan.format) {
    case cfmo::OutputFormat::kJson:
      print(cfmo::format_json(*report));
      break;
    case cfmo::OutputFormat::kCsv:
      print(cfmo::format_csv(*report));
      break;
    default:
      print(cfmo::format_table(*report, inv.config.per_tensor));
  }
  print_notes(*report);
  return 0;
}

std::string violations_json(const cfmo::Report& report, const std::vector<cfmo::Violation>& violations,
                            const cfmo::Thresholds& thresholds) {
  using Json = nlohmann::ordered_json;
  auto optional = [](const auto& v) { return v ? Json(*v) : Json(nullptr); };
  Json j;
  j["ok"] = violations.empty();
  j["limits"] = {{"max_rel_l2", optional(thresholds.max_rel_l2)},
                 {"max_abs", optional(thresholds.max_abs)},
                 {"max_nonfinite", optional(thresholds.max_nonfinite)},
                 {"per_tensor", thresholds.per_tensor}};
  j["violations"] = Json::array();
  for (const auto& v : violations) {
    j["violations"].push_back({{"source", v.delta->source},
                               {"rank", optional(v.delta->rank)},
                               {"round", optional(v.delta->round)},
                               {"step", optional(v.delta->step)},
                               {"tensor", v.tensor.empty() ? Json(nullptr) : Json(v.tensor)},
                               {"metric", v.metric},
                               {"value", v.value},
                               {"limit", v.limit},
                               {"message", v.message}});
  }
  const auto summary = cfmo::summarize(report);
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

std::string violations_csv(const std::vector<cfmo::Violation>& violations) {
  std::string out = "source,rank,round,step,tensor,metric,value,limit\n";
  auto optional = [](const auto& v) { return v ? fmt::format("{}", *v) : std::string(); };
  for (const auto& v : violations) {
    out +=
        fmt::format("{},{},{},{},{},{},{},{}\n", csv_field(v.delta->source), optional(v.delta->rank),
                    optional(v.delta->round), optional(v.delta->step), csv_field(v.tensor), v.metric, v.value, v.limit);
  }
  return out;
}

int run_check(Invocation& inv, const cfmo::DivergePlan& plan) {
  auto inputs = inputs_of(inv);
  if (!inputs) return fail(inputs.error());
  auto report = cfmo::build_report(*inputs, report_options(inv, plan));
  if (!report) return fail(report.error());
  const auto violations = cfmo::find_violations(*report, plan.thresholds);
  switch (plan.format) {
    case cfmo::OutputFormat::kJson:
      print(violations_json(*report, violations, plan.thresholds));
      break;
    case cfmo::OutputFormat::kCsv:
      print(violations_csv(violations));
      break;
    default: {
      std::string out;
      for (const auto& v : violations) out += v.message + "\n";
      const auto s = cfmo::summarize(*report);
      const std::string largest =
          s.worst ? fmt::format("; largest relative L2 {} ({})", cfmo::format_percent(s.worst->overall.rel_l2),
                                cfmo::describe(*s.worst))
                  : "";
      if (!violations.empty()) {
        out += fmt::format("{} violation(s) in {} delta(s); limits: {}{}\n", violations.size(), s.deltas,
                           cfmo::describe(plan.thresholds), largest);
      } else if (!inv.config.quiet) {
        out +=
            fmt::format("ok: {} delta(s) within limits ({}){}\n", s.deltas, cfmo::describe(plan.thresholds), largest);
      }
      print(out);
    }
  }
  if (!inv.config.quiet) print_notes(*report);
  return violations.empty() ? 0 : static_cast<int>(cfmo::ErrorKind::kCheckFailed);
}

int terminal_columns() {
  if (const char* env = std::getenv("COLUMNS")) {
    const int n = std::atoi(env);
    if (n > 20) return n;
  }
  winsize size{};
  if (::isatty(STDOUT_FILENO) != 0 && ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 20) {
    return size.ws_col;
  }
  return 100;
}

int run_plot(Invocation& inv, const cfmo::DivergePlan& plan) {
  if (inv.run_dir.empty()) return fail(cfmo::make_error(cfmo::ErrorKind::kUsage, "plot: which run directory?"));
  const cfmo::ReportInput input = cfmo::classify_path(inv.run_dir);
  if (input.kind != cfmo::ReportInput::Kind::kRunDir) {
    return fail(cfmo::make_error(cfmo::ErrorKind::kInput, "'{}': not a run directory", inv.run_dir));
  }
  auto report = cfmo::build_report(std::span(&input, 1), report_options(inv, plan));
  if (!report) return fail(report.error());
  const auto series = cfmo::rel_l2_series(*report);
  if (plan.format == cfmo::OutputFormat::kSparkline) {
    print(cfmo::render_sparklines(series, plan.thresholds.max_rel_l2, terminal_columns()));
    return 0;
  }
  cfmo::SvgOptions options;
  options.threshold = plan.thresholds.max_rel_l2;
  options.width = inv.config.width;
  options.height = inv.config.height;
  options.subtitle = inv.run_dir;
  const std::string svg = cfmo::render_svg(series, options);
  if (inv.config.output == "-") {
    print(svg);
  } else if (auto written = cfmo::write_file_atomic(inv.config.output, svg); !written) {
    return fail(written.error());
  }
  return 0;
}

int run_watch(Invocation& inv, const cfmo::DivergePlan& plan) {
  if (inv.run_dir.empty()) return fail(cfmo::make_error(cfmo::ErrorKind::kUsage, "watch: which run directory?"));
  auto watcher = cfmo::RunWatcher::open(inv.run_dir);
  if (!watcher) return fail(watcher.error());
  cfmo::tool::catch_stop_signals();

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto timed_out = [&] {
    return plan.timeout_s && std::chrono::duration<double>(Clock::now() - start).count() >= *plan.timeout_s;
  };
  cfmo::ReportOptions options = report_options(inv, plan);
  cfmo::Selection backlog = options.selection;  // --last applies to what is there at the start
  options.selection.last = 0;
  bool first_poll = true;
  int64_t printed = 0;
  size_t violations = 0;
  if (plan.format == cfmo::OutputFormat::kTable) print(cfmo::format_table_header());
  if (plan.format == cfmo::OutputFormat::kCsv) print(cfmo::format_csv_header());

  for (;;) {
    auto fresh = watcher->poll();
    if (!fresh) return fail(fresh.error());
    auto wanted = cfmo::select_deltas(*fresh, first_poll ? backlog : options.selection);
    first_poll = false;
    if (inv.config.max_rounds > 0 && static_cast<int64_t>(wanted.size()) > inv.config.max_rounds - printed) {
      wanted.resize(static_cast<size_t>(inv.config.max_rounds - printed));
    }
    if (!wanted.empty()) {
      std::vector<cfmo::ReportInput> inputs;
      for (const auto& ref : wanted) inputs.push_back({cfmo::ReportInput::Kind::kCfd, ref.path, {}});
      auto report = cfmo::build_report(inputs, options);
      if (!report) return fail(report.error());
      for (const auto& row : report->deltas) {
        const auto found = cfmo::find_violations(row, plan.thresholds);
        violations += found.size();
        std::string out;
        if (plan.format == cfmo::OutputFormat::kJson) {
          auto line = nlohmann::ordered_json::parse(cfmo::format_json_line(row));
          line["violations"] = nlohmann::ordered_json::array();
          for (const auto& v : found) line["violations"].push_back(v.message);
          out = line.dump() + "\n";
        } else if (plan.format == cfmo::OutputFormat::kCsv) {
          out = cfmo::format_csv_rows(row);
        } else {
          out = cfmo::format_table_row(row, inv.config.per_tensor);
          for (const auto& v : found) out += fmt::format("  ! {}\n", v.message);
        }
        print(out);
        ++printed;
      }
    }
    if (inv.config.max_rounds > 0 && printed >= inv.config.max_rounds) break;
    if (!inv.config.follow && wanted.empty() && watcher->finished()) break;
    if (timed_out() || g_stop.load()) break;
    // Sleep in short slices so a signal or the timeout ends the wait promptly.
    const auto wake = Clock::now() + std::chrono::duration<double>(plan.interval_s);
    while (Clock::now() < wake && !g_stop.load() && !timed_out()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (violations > 0 && plan.format == cfmo::OutputFormat::kTable) {
    fmt::print(stderr, "{}: {} violation(s) in {} delta(s); limits: {}\n", kTool, violations, printed,
               cfmo::describe(plan.thresholds));
  }
  if (g_stop.load()) return kInterruptedStatus;
  return violations > 0 ? static_cast<int>(cfmo::ErrorKind::kCheckFailed) : 0;
}

/// The subcommands, as a table (ninja's way): name, one line of help, body.
struct SubcommandEntry {
  Subcommand id;
  const char* description;
  const char* paths_help;
  int (*run)(Invocation&, const cfmo::DivergePlan&);
};

constexpr std::array<SubcommandEntry, 4> kSubcommands = {{
    {Subcommand::kReport, "relative L2, cosine, max |delta| and non-finite values per tensor and per delta",
     "run directories, .cfd files", run_report},
    {Subcommand::kCheck, "exit 1 when a delta exceeds a limit (for cron jobs and CI)", "run directories, .cfd files",
     run_check},
    {Subcommand::kPlot, "relative L2 per rank over rounds, as SVG or terminal sparklines", "the run directory",
     run_plot},
    {Subcommand::kWatch, "follow a training run, printing each new delta as it lands", "the run directory", run_watch},
}};

int run(int argc, char** argv) {
  CLI::App app{
      "Inspect the parameter deltas of a cfmo training run: how far each worker's parameters drifted from the\n"
      "global ones. Every option can also be set in a TOML file (--config); flags override the file."};
  app.name(kTool);
  app.set_version_flag("--version", "cfmo-diverge " CFMO_VERSION);
  app.require_subcommand(1);
  app.get_formatter()->column_width(34);

  std::array<Invocation, kSubcommands.size()> invocations;
  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    const auto& entry = kSubcommands[i];
    Invocation& inv = invocations[i];
    inv.id = entry.id;
    inv.app = app.add_subcommand(std::string(cfmo::to_string(entry.id)), entry.description);
    inv.app->get_formatter()->column_width(34);
    const bool many = entry.id == Subcommand::kReport || entry.id == Subcommand::kCheck;
    // Checked by the subcommand, not CLI11, so that --print-config needs no path.
    if (many) {
      inv.app->add_option("PATH", inv.paths, entry.paths_help);
    } else {
      inv.app->add_option("RUNDIR", inv.run_dir, entry.paths_help);
    }
    inv.app->add_option("--config", inv.config_file, "TOML file with any of the options below")->group("General");
    inv.app->add_flag("--print-config", inv.print_config, "print the merged configuration as TOML and exit")
        ->group("General");
    if (many) {
      inv.app->add_option("--base", inv.base, "the global checkpoint (.safetensors) to compare --against")
          ->group("General");
      inv.app->add_option("--against", inv.against, "the local checkpoint (.safetensors) compared with --base")
          ->group("General");
    }
    cfmo::add_diverge_options(inv.table, inv.config, entry.id);
    inv.table.register_cli(*inv.app);
    // One value per occurrence (--tensor a --tensor b), so that a list flag
    // does not swallow the PATHs after it.
    for (const char* list : {"--tensor", "--rank", "--round"}) inv.app->get_option(list)->allow_extra_args(false);
  }

  // The top level has no options that take a value, so the first word that is not an option names
  // the subcommand; CLI11 alone would say only that a subcommand is required, not which word it took for one.
  for (int i = 1; i < argc; ++i) {
    const std::string_view word(argv[i]);
    if (word.starts_with("-")) continue;
    if (std::none_of(kSubcommands.begin(), kSubcommands.end(),
                     [&](const auto& entry) { return cfmo::to_string(entry.id) == word; })) {
      fmt::print(stderr, "{}: unknown subcommand '{}': expected report, check, plot or watch (see --help)\n", kTool,
                 word);
      return static_cast<int>(cfmo::ErrorKind::kUsage);
    }
    break;
  }
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-diverge", true)) return *done;

  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    Invocation& inv = invocations[i];
    if (!inv.app->parsed()) continue;
    if (!inv.config_file.empty()) {
      if (auto loaded = cfmo::load_diverge_config(inv.table, inv.config_file, inv.id); !loaded) {
        return fail(loaded.error());
      }
    }
    auto plan = cfmo::validate(inv.config, inv.id);
    if (!plan) return fail(plan.error());
    if (inv.print_config) {
      print(cfmo::diverge_config_toml(inv.table, inv.id));
      return 0;
    }
    return kSubcommands[i].run(inv, *plan);
  }
  return static_cast<int>(cfmo::ErrorKind::kUsage);  // unreachable: CLI11 requires a subcommand
}

}  // namespace

int main(int argc, char** argv) {
  return cfmo::tool::guarded(kTool, [&] { return run(argc, argv); });
}
