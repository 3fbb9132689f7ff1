// cfmo-diverge: how far each worker's parameters drifted from the global ones,
// from a training run's compressed deltas. Parses flags, calls lib/diverge,
// prints, and maps the result to the shared exit status.
#include "../common/stop_signals.h"
#include "../common/terminal.h"
#include "../common/tool_main.h"
#include "core/config.h"
#include "diverge/commands.h"
#include "diverge/diverge_config.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>

namespace {

using cfmo::diverge::Subcommand;

constexpr const char* kTool = "cfmo-diverge";
constexpr int kInterruptedStatus = 130;  // 128 + SIGINT, as shells report it

std::atomic<bool>& g_stop = cfmo::tool::stop_requested();

int fail(const cfmo::Error& error) { return cfmo::tool::fail(kTool, error); }

/// One subcommand's command line, and its CLI11 app.
struct Invocation : cfmo::diverge::DivergeCommandLine {
  Subcommand id{};
  CLI::App* app = nullptr;
};

void print(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

/// Prints what a subcommand produced and returns its exit status.
int finish(const cfmo::Result<cfmo::diverge::CommandOutput>& out) {
  if (!out) return fail(out.error());
  print(out->text);
  for (const auto& note : out->notes) fmt::print(stderr, "{}: note: {}\n", kTool, note);
  if (!out->summary.empty()) fmt::print(stderr, "{}: {}\n", kTool, out->summary);
  return out->status;
}

using Output = cfmo::Result<cfmo::diverge::CommandOutput>;

/// The subcommands, as a table (ninja's way): name, one line of help, body.
struct SubcommandEntry {
  Subcommand id;
  const char* description;
  const char* paths_help;
  Output (*run)(const Invocation&, const cfmo::diverge::DivergePlan&);
};

constexpr std::array<SubcommandEntry, 4> kSubcommands = {{
    {Subcommand::kReport, "relative L2, cosine, max |delta| and non-finite values per tensor and per delta",
     "run directories, .cfd files",
     [](const Invocation& inv, const cfmo::diverge::DivergePlan& plan) {
       return cfmo::diverge::run_report(inv.config, plan, inv.paths);
     }},
    {Subcommand::kCheck, "exit 1 when a delta exceeds a limit (for cron jobs and CI)",
     "run directories, .cfd files",
     [](const Invocation& inv, const cfmo::diverge::DivergePlan& plan) {
       return cfmo::diverge::run_check(inv.config, plan, inv.paths);
     }},
    {Subcommand::kPlot, "relative L2 per rank over rounds, as SVG or terminal sparklines", "the run directory",
     [](const Invocation& inv, const cfmo::diverge::DivergePlan& plan) {
       return cfmo::diverge::run_plot(inv.config, plan, inv.paths, cfmo::tool::terminal_columns(STDOUT_FILENO));
     }},
    {Subcommand::kWatch, "follow a training run, printing each new delta as it lands", "the run directory",
     [](const Invocation& inv, const cfmo::diverge::DivergePlan& plan) {
       cfmo::tool::catch_stop_signals();
       return cfmo::diverge::run_watch(inv.config, plan, inv.paths, print, [] { return g_stop.load(); });
     }},
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
    inv.app = app.add_subcommand(std::string(cfmo::diverge::to_string(entry.id)), entry.description);
    inv.app->get_formatter()->column_width(34);
    inv.register_cli(*inv.app, entry.id, entry.paths_help);
  }

  std::array<std::string_view, kSubcommands.size()> names;
  for (size_t i = 0; i < names.size(); ++i) names[i] = cfmo::diverge::to_string(kSubcommands[i].id);
  if (auto done = cfmo::tool::check_subcommand_word(argc, argv, names, kTool)) return *done;
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-diverge", true)) return *done;

  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    Invocation& inv = invocations[i];
    if (!inv.app->parsed()) continue;
    if (!inv.config_file.empty()) {
      if (auto loaded = cfmo::diverge::load_diverge_config(inv.table, inv.config_file, inv.id); !loaded) {
        return fail(loaded.error());
      }
    }
    auto plan = cfmo::diverge::validate(inv.config, inv.id);
    if (!plan) return fail(plan.error());
    if (inv.print_config) {
      print(cfmo::diverge::diverge_config_toml(inv.table, inv.id));
      return 0;
    }
    const Output out = kSubcommands[i].run(inv, *plan);
    const int status = finish(out);
    return out && g_stop.load() ? kInterruptedStatus : status;
  }
  return static_cast<int>(cfmo::ErrorKind::kUsage);  // unreachable: CLI11 requires a subcommand
}

}  // namespace

int main(int argc, char** argv) {
  return cfmo::tool::guarded(kTool, [&] { return run(argc, argv); });
}
