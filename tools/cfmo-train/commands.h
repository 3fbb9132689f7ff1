#pragma once
// cfmo-train's parts besides the run itself, one file each: the command
// line (command_line.cpp), --compare (compare.cpp) and the sample and
// simulate subcommands (sample_command.cpp, simulate_command.cpp), and
// the process's start (process_start.cpp).

#include "../common/tool_main.h"
#include "train/trainer.h"

#include <atomic>
#include <chrono>
#include <optional>
#include <string>

namespace cfmo::train_tool {

constexpr int kInterruptedStatus = 130;  // 128 + SIGINT, as shells report it

inline int fail(const Error& error) { return tool::fail("cfmo-train", error); }

/// What the command line asks for besides the configuration.
struct CommandLine {
  bool json = false;
  bool compare = false;
};

/// Parses flags and the TOML file (--config, or a resumed checkpoint's
/// config.toml) into `config`, resolves --resume into `options` with the
/// merged configuration as TOML, and checks the whole and the device: the
/// exit status when the tool is done already (--help, --version,
/// --print-config, an error), else nothing.
std::optional<int> parse_train_command_line(int argc, char** argv, train::TrainConfig& config,
                                            train::TrainOptions& options, CommandLine& line);

/// --compare: the same job once per mode, each a run of its own, then a table.
int compare_modes(int argc, char** argv, const train::TrainConfig& config, bool json, const std::atomic<bool>& stop);

/// `cfmo-train sample RUN ...`: text from a run's (or a checkpoint's) model.
int run_sample(int argc, char** argv);

/// `cfmo-train simulate --workers N ...`: the modes on N simulated workers (lib/sim).
int run_simulate(int argc, char** argv);

/// When this process started (before the dynamic loader and the BLAS
/// re-exec, which a joiner's start-up includes): /proc/self/stat's start
/// time against /proc/uptime; now where they cannot be read.
std::chrono::steady_clock::time_point process_started();

}  // namespace cfmo::train_tool
