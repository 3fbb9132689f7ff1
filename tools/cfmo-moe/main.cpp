// cfmo-moe: parse flags and config, find or start the ranks, run the
// library's MoE dispatch benchmark, print the report.
#include "../common/tool_main.h"
#include "comm/world.h"
#include "core/config.h"
#include "cuda/devices.h"
#include "cuda/moe_experts.h"
#include "moe/benchmark.h"
#include "moe/moe_config.h"
#include "tensor/ops.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace {

std::atomic<bool> g_stop{false};

// In the launcher: pass one SIGINT on to the ranks (launch_local does), then
// let a second one end the launcher at once.
void on_signal(int signal_number) {
  g_stop.store(true);
  std::signal(signal_number, SIG_DFL);
}

int fail(const cfmo::Error& error) { return cfmo::tool::fail("cfmo-moe", error); }

}  // namespace

static int run(int argc, char** argv) {
  CLI::App app{
      "Benchmark Mixture-of-Experts token dispatch and combine across ranks, synchronous and asynchronous.\n"
      "Every option can also be set in a TOML file (--config); flags override the file."};
  app.name("cfmo-moe");
  app.set_version_flag("--version", "cfmo-moe " CFMO_VERSION);
  app.get_formatter()->column_width(34);

  cfmo::moe::MoeConfig config;
  cfmo::OptionTable table;
  cfmo::moe::add_moe_options(table, config);
  std::string config_file;
  bool print_config = false;
  app.add_option("--config", config_file, "TOML file with any of the options below")->group("General");
  app.add_flag("--print-config", print_config, "print the merged configuration as TOML and exit")->group("General");
  table.register_cli(app);

  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-moe")) return *done;
  if (!config_file.empty()) {
    if (auto loaded = table.load_toml(config_file); !loaded) return fail(loaded.error());
  }
  auto plan = cfmo::moe::validate(config);
  if (!plan) return fail(plan.error());
  // Before any rank starts: "no CUDA device" is one line and exit 2, from the launcher too.
  if (auto usable = cfmo::cuda::check_device(plan->device); !usable) return fail(usable.error());
  // --slowdown and --straggler are checked against --ranks here; under a launcher, again against its world.
  if (auto simulated = cfmo::moe::simulation_for(config, 0, config.ranks); !simulated) return fail(simulated.error());
  if (print_config) {
    fmt::print("{}", table.to_toml());
    return 0;
  }

  auto world = cfmo::comm::world_from_environment();
  if (!world) return fail(world.error());
  const bool launched = world->has_value() && (*world)->launched;  // a rank of our own launcher
  if (config.ranks > 1 && !launched && (!world->has_value() || (*world)->size == 1)) {
    // One host, no launcher: start the ranks here and relay their output.
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    auto status =
        cfmo::comm::launch_local(config.ranks, argv, &g_stop, STDOUT_FILENO, STDERR_FILENO, config.peer_timeout);
    if (!status) return fail(status.error());
    return *status;
  }

  cfmo::comm::WorldOptions connect{config.rendezvous, config.peer_timeout};
  connect.fifos = true;  // a lost rank ends the benchmark
  auto connected = cfmo::comm::connect_world(*world, connect);
  if (!connected) return fail(connected.error());
  std::unique_ptr<cfmo::comm::Communicator> comm = std::move(*connected);
  const int rank = comm->rank();
  const int ranks = comm->size();

  auto simulation = cfmo::moe::simulation_for(config, rank, ranks);
  if (!simulation) return fail(simulation.error());
  cfmo::tensor::ops::set_num_threads(config.threads);

  cfmo::moe::BenchmarkOptions options;
  options.comm = comm.get();
  if (world->has_value()) options.local_rank = (*world)->local_rank;
  options.simulation = *simulation;
  options.place_experts = cfmo::cuda::place_experts;
  if (rank == 0 && !config.quiet) options.note = [](const std::string& text) { fmt::print(stderr, "{}\n", text); };
  auto summaries = cfmo::moe::run_benchmark(config, *plan, options);
  // The goodbye carries why this rank leaves: the others fail with this root cause.
  if (!summaries) comm->leave_with(summaries.error());
  comm.reset();  // say goodbye to the other ranks before reporting
  if (!summaries) return fail(summaries.error());
  bool failed = false;
  for (const auto& s : *summaries) failed |= s.check == "fail";
  if (rank == 0) {
    if (config.format == "json") {
      fmt::print("{}", cfmo::moe::render_json(*summaries));
    } else if (config.format == "csv") {
      fmt::print("{}", cfmo::moe::render_csv(*summaries));
    } else {
      fmt::print("{}", cfmo::moe::render_table(*summaries));
    }
    std::fflush(stdout);
    if (failed) fmt::print(stderr, "cfmo-moe: check failed: the output differs from the single-process reference\n");
  }
  return failed ? static_cast<int>(cfmo::ErrorKind::kCheckFailed) : 0;
}

int main(int argc, char** argv) {
  cfmo::tool::reexec_for_blas(argv);
  return cfmo::tool::guarded("cfmo-moe", [&] { return run(argc, argv); });
}
