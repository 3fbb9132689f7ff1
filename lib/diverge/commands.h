#pragma once
/// The four subcommands of cfmo-diverge as library calls: what each reads,
/// computes and renders, so the tool only parses flags, prints what comes
/// back and maps it to an exit status.

#include "core/config.h"
#include "core/error.h"
#include "diverge/diverge_config.h"

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace cfmo::diverge {

/// The paths a subcommand was given: PATHs (report, check), RUNDIR (plot,
/// watch), and the checkpoint pair of --base/--against.
struct CommandPaths {
  std::vector<std::string> paths;
  std::string run_dir;
  std::string base;
  std::string against;
};

/// Everything one subcommand's command line holds. It stays in place once
/// registered: CLI11 and the option table keep pointers into it.
struct DivergeCommandLine {
  DivergeConfig config;
  OptionTable table;
  std::string config_file;
  bool print_config = false;
  CommandPaths paths;

  DivergeCommandLine() = default;
  DivergeCommandLine(const DivergeCommandLine&) = delete;
  DivergeCommandLine& operator=(const DivergeCommandLine&) = delete;

  /// Adds the subcommand's paths, the General flags and its options to `app`.
  void register_cli(CLI::App& app, Subcommand subcommand, const char* paths_help);
};

/// What a subcommand produced: `text` for stdout, `notes` (things a reader
/// should know, e.g. an unverified header-only read) and `summary` (a closing
/// line for stderr), and `status`: 0, or kCheckFailed when a limit was exceeded.
struct CommandOutput {
  std::string text;
  std::vector<std::string> notes;
  std::string summary;
  int status = 0;
};

/// report: the figures of every input in the plan's format.
Result<CommandOutput> run_report(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths);

/// check: every violation of the plan's limits, and status 1 if there is any.
Result<CommandOutput> run_check(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths);

/// plot: the SVG (written to --output unless it is "-", then in `text`) or
/// sparklines `columns` wide.
Result<CommandOutput> run_plot(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths,
                               int columns);

/// watch: polls the run every --interval and hands each new delta's output
/// to `emit` as it lands, until the run finishes, --max-rounds, --timeout, or
/// `stop` returns true.
Result<CommandOutput> run_watch(const DivergeConfig& config, const DivergePlan& plan, const CommandPaths& paths,
                                const std::function<void(std::string_view)>& emit, const std::function<bool()>& stop);

}  // namespace cfmo::diverge
