// cfmo-train's command line: flags over a TOML file over the defaults, the
// resumed run's directory and configuration, and the checks made before any
// worker starts.
#include "commands.h"
#include "core/config.h"
#include "cuda/devices.h"
#include "train/checkpoint.h"
#include "train/modes.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <string>

namespace cfmo::train_tool {

std::optional<int> parse_train_command_line(int argc, char** argv, train::TrainConfig& config,
                                            train::TrainOptions& options, CommandLine& line) {
  CLI::App app{
      "Train a model (an MLP on Fashion-MNIST, a GPT-2 on text or token files) with local-update optimizers.\n"
      "Every option can also be set in a TOML file (--config); flags override the file.\n"
      "cfmo-train sample RUN [--prompt TEXT] [--tokens N] [--temperature X] [--top-k K] [--seed S]\n"
      "prints text from a run's language model.\n"
      "cfmo-train simulate --workers N[,N...] [--mode M | --compare] [--steps N] [--params N]\n"
      "  [--step-time S | --step-times RUN/metrics.jsonl] [--slowdown R=F] [--straggler P:F] [--thermal P:X:S]\n"
      "  [--speeds SHARE:SPEED,...] [--link-bandwidth GBIT] [--link-latency US] [--topology switch|racks:R:OVER]\n"
      "  [--math] [--json] [--plot FILE] simulates the modes on N workers (cfmo-train simulate --help)."};
  app.name("cfmo-train");
  app.set_version_flag("--version", "cfmo-train " CFMO_VERSION);
  app.get_formatter()->column_width(34);

  OptionTable table;
  train::add_train_options(table, config);

  std::string config_file;
  std::string resume;
  bool print_config = false;
  app.add_option("--config", config_file, "TOML file with any of the options below")->group("General");
  app.add_flag("--print-config", print_config, "print the merged configuration as TOML and exit")->group("General");
  app.add_option("--resume", resume, "continue from a run directory's latest checkpoint, or a checkpoint directory")
      ->group("General");
  app.add_flag("--json", line.json, "print one JSON summary object on stdout at the end")->group("General");
  std::string every_mode;
  for (const auto& m : train::mode_table()) every_mode += (every_mode.empty() ? "" : ", ") + std::string(m.name);
  app.add_flag("--compare", line.compare, "run the same job in every mode (" + every_mode + ") and compare them")
      ->group("General");
  table.register_cli(app);

  if (auto done = tool::parse_command_line(app, argc, argv, "cfmo-train")) return done;

  if (!resume.empty()) {
    auto checkpoint = train::resolve_checkpoint(resume);
    if (!checkpoint) return fail(checkpoint.error());
    options.resume = *checkpoint;
    // A resumed run is the same run: its saved configuration is the base, flags still win.
    if (config_file.empty()) config_file = (options.resume / "config.toml").string();
  }
  if (!config_file.empty()) {
    if (auto loaded = table.load_toml(config_file); !loaded) return fail(loaded.error());
  }
  if (!options.resume.empty() && !table.given_on_cli("out")) {
    // It continues in the run directory the checkpoint lives in, wherever it was started
    // from. The saved configuration's out never counts: for a checkpoint copied out of its
    // run it is a relative path that would be resolved from wherever this run starts.
    const auto run_dir = train::run_dir_of(options.resume);
    if (run_dir.empty()) {
      return fail(make_error(ErrorKind::kUsage,
                             "--resume '{}': not in a run directory (RUN/checkpoints/step-N); say where this "
                             "run writes with --out",
                             options.resume.string()));
    }
    config.out = run_dir.string();
  }
  auto plan = train::make_plan(config);
  if (!plan) return fail(plan.error());
  options.config_toml = table.to_toml();
  if (print_config) {
    fmt::print("{}", options.config_toml);
    return 0;
  }

  // Before any worker starts: "no CUDA device" is one line and exit 2, from the launcher too.
  if (auto usable = cuda::check_device(plan->device); !usable) return fail(usable.error());
  return std::nullopt;
}

}  // namespace cfmo::train_tool
