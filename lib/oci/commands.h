#pragma once
/// The subcommands of cfmo-pull as library calls: each takes its command
/// line and checked plan and returns what to print (the JSON report built
/// here) and the exit status, so the tool only parses flags, prints what
/// comes back and maps errors to the shared exit status. What only a tool
/// may do (start a detached process, fork the lazy mount's daemon, draw
/// progress on the terminal) comes in through `CommandHooks`.

#include "core/config.h"
#include "core/error.h"
#include "oci/pull.h"
#include "oci/pull_config.h"

#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace cfmo::oci {

class LazyMount;

/// Everything one subcommand's command line holds. It stays in place once
/// registered: CLI11 and the option table keep pointers into it.
struct PullCommandLine {
  PullCommand id{};
  PullConfig config;
  OptionTable table;
  std::string config_file;
  bool print_config = false;
  std::vector<std::string> args;  ///< the positional arguments

  PullCommandLine() = default;
  PullCommandLine(const PullCommandLine&) = delete;
  PullCommandLine& operator=(const PullCommandLine&) = delete;

  /// Adds the positional arguments (none when `args_name` is empty), the
  /// General flags and the options of `id` to `app`.
  void register_cli(CLI::App& app, PullCommand id, const char* args_name, const char* args_help);

  /// After parsing: loads --config, lets REF (pull, inspect) win over the
  /// file's image, and validates. Errors are usage errors naming the flag.
  Result<PullPlan> plan();
};

/// What a subcommand produced: `text` for stdout, `notes` for stderr (one
/// line each, after the tool's name), and the exit status.
struct CommandOutput {
  std::string text;
  std::vector<std::string> notes;
  int status = 0;
};

/// What the tool lends the subcommands.
struct CommandHooks {
  PullSink* progress = nullptr;  ///< the progress of pull, fetch and inspect (a sink of theirs); may be null
  /// Starts `argv` (this program again) detached, its output appended to
  /// `log`; returns its pid (pull and mount --background).
  std::function<Result<int>(const std::vector<std::string>& argv, const std::string& log)> start_detached;
  /// Mounts `mount` in a process that stays and serves it; returns its pid.
  std::function<Result<int>(LazyMount& mount)> serve_detached;
};

using CommandResult = Result<CommandOutput>;

CommandResult run_pull(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_inspect(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_fetch(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_status(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_mount(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_umount(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_index(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_rm(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);
CommandResult run_prune(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks);

}  // namespace cfmo::oci
