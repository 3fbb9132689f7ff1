// cfmo-pull: pulls container images from an OCI Distribution registry in
// bounded memory, hot layers first, cold ones now, later or never. Parses
// flags, calls lib/oci/commands.h, prints what comes back and maps the
// result to the shared exit status.
#include "../common/stop_signals.h"
#include "../common/tool_main.h"
#include "background.h"
#include "console_progress.h"
#include "oci/commands.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <array>
#include <cstdio>
#include <string>

namespace {

using cfmo::oci::PullCommand;
namespace oci = cfmo::oci;

constexpr const char* kTool = "cfmo-pull";

/// A failure is reported as itself, unless a signal caused it: then one line
/// says the run stopped and that nothing fetched is lost.
int fail(const cfmo::Error& error) {
  if (cfmo::tool::stop_requested().load()) {
    fmt::print(stderr, "{}: stopped by {}; what was fetched is kept, partial blobs too: the same command resumes\n",
               kTool, cfmo::tool::stop_signal_name());
    return cfmo::tool::stop_status();
  }
  return cfmo::tool::fail(kTool, error);
}

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

/// Prints what a subcommand produced and returns its exit status.
int finish(const oci::CommandResult& out) {
  if (!out) return fail(out.error());
  for (const auto& note : out->notes) fmt::print(stderr, "{}: {}\n", kTool, note);
  print(out->text);
  return out->status;
}

/// The subcommands, as a table (ninja's way): name, one line of help, positional arguments, body.
struct SubcommandEntry {
  PullCommand id;
  const char* description;
  const char* args_name;
  const char* args_help;
  oci::CommandResult (*run)(const oci::PullCommandLine&, const oci::PullPlan&, const oci::CommandHooks&);
};

constexpr const char* kRefHelp = "image reference: [registry[:port]/]name[:tag|@digest]";

constexpr std::array<SubcommandEntry, 9> kSubcommands = {{
    {PullCommand::kPull, "pull an image: hot layers first, cold ones now, later or never", "REF", kRefHelp,
     oci::run_pull},
    {PullCommand::kInspect, "print the manifest, config and layers, fetching no layer", "REF", kRefHelp,
     oci::run_inspect},
    {PullCommand::kFetch, "fetch the layers a lazy pull left (all, or those named), resuming partial blobs", "DIR",
     "the pull's directory, then layers (sha256:PREFIX, N, smallest:N, top:N, last:N)", oci::run_fetch},
    {PullCommand::kStatus, "show what a pull has fetched, what is pending, and its background fetch", "DIR",
     "the pull's directory", oci::run_status},
    {PullCommand::kMount, "present a pull's image as one overlay file system: hot layers from memory, cold from disk",
     "DIR MOUNTPOINT", "the pull's directory (with --lazy, or an image REF) and where to mount it", oci::run_mount},
    {PullCommand::kUmount, "unmount what cfmo-pull mount mounted (and drop its writes)", "MOUNTPOINT",
     "where it is mounted", oci::run_umount},
    {PullCommand::kIndex, "index a pull's gzip layers for seeking: file table, inflate checkpoints, span digests",
     "DIR", "the pull's directory", oci::run_index},
    {PullCommand::kRm, "remove a pull: its layout, its memory store in /dev/shm, its unpacked layers and cache", "DIR",
     "the pull's directory", oci::run_rm},
    {PullCommand::kPrune, "remove the memory stores whose layout is gone and the unused layouts of mount --lazy REF",
     "", "", oci::run_prune},
}};

int run(int argc, char** argv) {
  CLI::App app{
      "Pull container images from an OCI Distribution registry in bounded memory: hot layers first into a\n"
      "memory-backed store, cold layers now, later or never. Every option can also be set in a TOML file\n"
      "(--config); flags override the file."};
  app.name(kTool);
  app.set_version_flag("--version", "cfmo-pull " CFMO_VERSION);
  app.require_subcommand(1);
  app.get_formatter()->column_width(34);

  std::array<oci::PullCommandLine, kSubcommands.size()> lines;
  std::array<CLI::App*, kSubcommands.size()> apps{};
  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    const auto& entry = kSubcommands[i];
    apps[i] = app.add_subcommand(std::string(oci::to_string(entry.id)), entry.description);
    apps[i]->get_formatter()->column_width(34);
    lines[i].register_cli(*apps[i], entry.id, entry.args_name, entry.args_help);
  }
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, kTool, true)) return *done;

  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    oci::PullCommandLine& line = lines[i];
    if (!apps[i]->parsed()) continue;
    auto plan = line.plan();
    if (!plan) return fail(plan.error());
    if (line.print_config) {
      print(line.table.to_toml());
      return 0;
    }
    // What talks to a registry stops cleanly on SIGINT/SIGTERM; the rest is quick or must not stop halfway.
    if (line.id == PullCommand::kPull || line.id == PullCommand::kFetch || line.id == PullCommand::kInspect) {
      plan->pull.registry.stop = &cfmo::tool::stop_requested();
      plan->fetch.registry.stop = &cfmo::tool::stop_requested();
      cfmo::tool::catch_stop_signals();
    }
    using Progress = cfmo::pull_tool::ConsoleProgress;
    Progress progress(kTool, Progress::mode_for(plan->progress), !line.config.quiet);
    oci::CommandHooks hooks;
    hooks.progress = &progress;
    hooks.start_detached = cfmo::pull_tool::start_detached;
    hooks.serve_detached = cfmo::pull_tool::serve_detached;
    return finish(kSubcommands[i].run(line, *plan, hooks));
  }
  return static_cast<int>(cfmo::ErrorKind::kUsage);  // unreachable: CLI11 requires a subcommand
}

}  // namespace

int main(int argc, char** argv) {
  return cfmo::tool::guarded(kTool, [&] { return run(argc, argv); });
}
