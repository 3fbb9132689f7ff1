// `cfmo-train simulate --workers N ...`: what the modes would do on N
// workers, from the modes' own protocols on a virtual clock (lib/sim).
#include "comm/codec.h"
#include "commands.h"
#include "core/atomic_file.h"
#include "sim/simulation.h"
#include "train/modes.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <charconv>
#include <string>

namespace cfmo::train_tool {
namespace {

/// "8,64,512": the sizes of a sweep.
Result<std::vector<int>> parse_workers(const std::string& text) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    int n = 0;
    auto [end, ec] = std::from_chars(text.data() + start, text.data() + comma, n);
    if (ec != std::errc() || end != text.data() + comma || n < 1 || n > (1 << 20)) {
      return make_error(ErrorKind::kUsage, "--workers '{}': expected N or N,N,... with each N from 1 to 1048576", text);
    }
    out.push_back(n);
    start = comma + 1;
  }
  return out;
}

}  // namespace

int run_simulate(int argc, char** argv) {
  CLI::App app{
      "Simulate the modes on N workers: their own protocol code on a virtual clock over a network model, with "
      "step times drawn from a measured run or given. Parameters are not computed."};
  app.name("cfmo-train simulate");
  sim::SimulateOptions options;
  std::string workers = "8";
  std::string mode = "sync";
  bool compare = false;
  bool json = false;
  std::string plot;
  std::string step_times;
  std::string topology = "switch";
  std::string delta_dtype = "bf16";
  std::string outer = "nesterov";
  double bandwidth_gbit = 100;
  double latency_us = 5;
  auto& s = options.settings;
  auto& t = options.step_times;
  app.add_option("--workers", workers, "simulated workers: N, or N,N,... for a sweep (one row per size and mode)");
  app.add_option("--mode", mode, "the mode to simulate: " + train::mode_names());
  app.add_flag("--compare", compare, "simulate every mode");
  app.add_option("--steps", options.steps, "steps per worker (the asynchronous modes share the same budget)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--batch-size", options.batch, "samples per step and worker")->check(CLI::Range(1, 1 << 24));
  app.add_option("--params", options.params, "the model's parameters: what each message would carry")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--step-time", t.step_time_s, "seconds of compute per step, when no --step-times")
      ->check(CLI::PositiveNumber);
  app.add_option("--step-times", step_times,
                 "a run's metrics.jsonl: its ranks' steps replayed in order (compute_s), other ranks draw rank 0's");
  app.add_option("--slowdown", t.slowdown, "RANK=FACTOR: that worker's steps take FACTOR times as long (repeatable)");
  app.add_option("--straggler", t.straggler, "P:FACTOR: any step takes FACTOR times as long with probability P");
  app.add_option("--thermal", t.thermal,
                 "P:X:S: in each stretch of S seconds a worker is throttled to speed X with probability P");
  app.add_option("--speeds", t.speeds, "SHARE:SPEED,...: shares of the workers (in rank order) at those speeds");
  app.add_option("--link-bandwidth", bandwidth_gbit, "each host's link, each way, in Gb/s")->check(CLI::PositiveNumber);
  app.add_option("--link-latency", latency_us, "one-way latency between two hosts of a switch, in microseconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--topology", topology, "switch, or racks:R:OVERSUB (R racks, their spine links oversubscribed)");
  app.add_option("--sync-interval", s.sync_interval, "H: local steps between reconciliations (localsgd, cfmo)")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--max-staleness", s.max_staleness, "rounds; older contributions are dropped (cfmo)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--owners", s.owners,
                 "cfmo, asgd: K, the ranks that own the K shards of the global parameters (0: min(workers, 16))")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--staleness-discount", s.staleness_discount, "beta: a stale contribution's weight is beta^s")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--delta-dtype", delta_dtype, "how deltas and gradient shards travel: fp32, bf16 or int8");
  app.add_option("--outer-optimizer", outer, "the outer step of localsgd and cfmo: avg or nesterov");
  app.add_option("--seed", t.seed, "seed of the drawn step times");
  app.add_flag("--math", options.math,
               "train for real: every worker computes its model, so staleness's effect on the loss shows (at most 64 "
               "workers)");
  app.add_option("--data", options.data, "--math: the data set (synthetic:TRAIN[:TEST] or a Fashion-MNIST directory)");
  app.add_option("--model", options.model, "--math: the model, an MLP (mlp:H1,H2,...)");
  app.add_option("--lr", options.lr, "--math: SGD's learning rate (momentum 0.9)")->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "print one JSON object");
  app.add_option("--plot", plot, "write an SVG of efficiency against workers to FILE");
  if (auto done = tool::parse_command_line(app, argc, argv, "cfmo-train simulate")) return *done;

  auto sizes = parse_workers(workers);
  if (!sizes) return fail(sizes.error());
  options.workers = *sizes;
  if (compare && app.count("--mode") > 0) {
    return fail(make_error(ErrorKind::kUsage, "--mode and --compare: choose one"));
  }
  options.modes.clear();
  if (compare) {
    for (const auto& m : train::mode_table()) options.modes.push_back(m.kind);
  } else {
    auto kind = train::parse_mode(mode);
    if (!kind) return fail(kind.error());
    options.modes.push_back(*kind);
  }
  if (!step_times.empty()) {
    if (app.count("--step-time") > 0) {
      return fail(make_error(ErrorKind::kUsage, "--step-time and --step-times: choose one"));
    }
    auto measured = sim::read_ranks_step_times(step_times);
    if (!measured) return fail(measured.error());
    t.measured = measured->front().compute;
    t.by_rank = std::move(*measured);
  }
  auto top = sim::parse_topology(topology);
  if (!top) return fail(top.error());
  options.network.topology = *top;
  options.network.bandwidth = bandwidth_gbit * 1e9 / 8;
  options.network.latency = latency_us * 1e-6;
  auto dtype = comm::parse_wire_dtype(delta_dtype);
  if (!dtype) return fail(make_error(ErrorKind::kUsage, "--delta-dtype: {}", dtype.error().message));
  s.delta_dtype = *dtype;
  auto outer_kind = train::parse_outer_kind(outer);
  if (!outer_kind) return fail(outer_kind.error());
  s.outer_optimizer = *outer_kind;

  auto rows = sim::simulate(options, [&](std::string_view m, int n) {
    if (!json) fmt::print(stderr, "simulate: {} on {} workers...\n", m, n);
  });
  if (!rows) return fail(rows.error());
  if (!plot.empty()) {
    if (auto written = write_file_atomic(plot, sim::simulate_svg(*rows)); !written) return fail(written.error());
  }
  fmt::print("{}", json ? sim::simulate_json(*rows, options).dump() + "\n" : sim::simulate_table(*rows));
  return 0;
}

}  // namespace cfmo::train_tool
