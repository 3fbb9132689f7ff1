// cfmo-train: parse flags and config, find or start the workers, run the
// library's trainer, report. The parts besides are in commands.h.
#include "../common/allocator.h"
#include "../common/stop_signals.h"
#include "../common/tool_main.h"
#include "comm/world.h"
#include "commands.h"
#include "console_observer.h"
#include "train/checkpoint.h"
#include "train/connect_run.h"
#include "train/memory_estimate.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <memory>
#include <optional>

namespace {

using cfmo::train_tool::CommandLine;
using cfmo::train_tool::ConsoleObserver;
using cfmo::train_tool::fail;

// The first SIGINT/SIGTERM asks the trainer to stop cleanly (checkpoint, summary).
std::atomic<bool>& g_stop = cfmo::tool::stop_requested();

int compare_modes(int argc, char** argv, const cfmo::train::TrainConfig& config, bool json) {
  return cfmo::train_tool::compare_modes(argc, argv, config, json, g_stop);
}

}  // namespace

static int run(int argc, char** argv) {
  const auto process_start = cfmo::train_tool::process_started();
  if (argc >= 2 && std::string_view(argv[1]) == "sample") return cfmo::train_tool::run_sample(argc - 1, argv + 1);
  if (argc >= 2 && std::string_view(argv[1]) == "simulate") return cfmo::train_tool::run_simulate(argc - 1, argv + 1);
  cfmo::train::TrainConfig config;
  cfmo::train::TrainOptions options;
  CommandLine line;
  if (auto done = parse_train_command_line(argc, argv, config, options, line)) return *done;
  const bool json = line.json;
  const bool compare = line.compare;

  cfmo::tool::catch_stop_signals();
  // A file-size limit (ulimit -f) makes a write fail with EFBIG, reported as
  // any failed write (exit 5, naming the file), not a crash by SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  if (config.expert_parallel) cfmo::tool::keep_exchange_buffers();
  if (compare) return compare_modes(argc, argv, config, json);

  auto world = cfmo::comm::world_from_environment();
  if (!world) return fail(world.error());
  const bool joining = !config.join.empty();  // a place in a run under way: no launcher, no lock of its own
  if (joining && !options.resume.empty()) {
    return fail(
        cfmo::make_error(cfmo::ErrorKind::kUsage, "--join: not with --resume (the run's state comes from its ranks)"));
  }
  const bool launched = joining || (world->has_value() && (*world)->launched);  // a worker of a run's own launcher
  // One run at a time in a run directory. The process that owns the run holds the lock for
  // all its ranks: this one alone, our launcher (its workers share the directory), or rank 0
  // under another launcher, before the rendezvous, so no rank of a second run gets to write.
  std::optional<cfmo::DirLock> run_lock;
  if (!config.out.empty() && !launched && (!world->has_value() || (*world)->rank == 0)) {
    auto lock = cfmo::train::lock_run_dir(config.out);
    if (!lock) return fail(lock.error());
    run_lock = std::move(*lock);
  }
  if (config.workers > 1 && !launched && (!world->has_value() || (*world)->size == 1)) {
    // One host, no launcher: start the workers here and relay their output, if they fit.
    if (auto fits = cfmo::train::check_workers_fit(config, config.workers); !fits) return fail(fits.error());
    auto status =
        cfmo::comm::launch_local(config.workers, argv, &g_stop, STDOUT_FILENO, STDERR_FILENO, config.peer_timeout);
    if (!status) return fail(status.error());
    return *status;
  }
  // Its data and model before it connects: a joiner is taken in ready, and
  // a --join (or a run alone) that cannot read its data fails here alone;
  // a launched rank passes the error to connect_run (train::preload).
  auto preloaded = cfmo::train::preload(config);
  if (preloaded) options.preloaded = *preloaded;
  const bool connects = joining || (world->has_value() && (*world)->size > 1);
  if (!preloaded && (joining || !connects)) return fail(preloaded.error());
  std::unique_ptr<cfmo::comm::Communicator> comm;
  if (connects) {
    auto connected = cfmo::train::connect_run(config, *world, options.config_toml, &options.first_world,
                                              preloaded ? cfmo::Status{} : cfmo::Status(preloaded.error()));
    if (!connected) return fail(connected.error());
    if (!connected->comm) {  // it came as the run ended: nothing to do, and nothing went wrong
      fmt::print(stderr, "{}\n", connected->too_late);
      return 0;
    }
    comm = std::move(connected->comm);
    options.comm = comm.get();
    options.local_rank = world->has_value() ? (*world)->local_rank : -1;
  }
  options.process_start = process_start;

  ConsoleObserver observer(::isatty(STDERR_FILENO) != 0, config.quiet);
  options.stop = &g_stop;
  options.observer = &observer;

  auto summary = cfmo::train::train(config, options);
  observer.clear_line();
  // The goodbye tells the other ranks why this one leaves: they then fail
  // with this root cause, and the run ends with its status.
  if (!summary && comm) comm->leave_with(summary.error());
  comm.reset();  // say goodbye to the other ranks before reporting
  if (!summary) return fail(summary.error());
  if (summary->rank != summary->keeper) return summary->stopped_by == "interrupt" ? cfmo::tool::stop_status() : 0;
  fmt::print("{}", json ? summary->to_json() + "\n" : cfmo::train::summary_text(*summary));
  return summary->stopped_by == "interrupt" ? cfmo::tool::stop_status() : 0;
}

int main(int argc, char** argv) {
  cfmo::tool::reexec_for_blas(argv);
  return cfmo::tool::guarded("cfmo-train", [&] { return run(argc, argv); });
}
