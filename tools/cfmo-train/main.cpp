// cfmo-train: parse flags and config, run the library's trainer, report.
#include "../common/stop_signals.h"
#include "../common/tool_main.h"
#include "comm/world.h"
#include "core/config.h"
#include "core/progress.h"
#include "tensor/device.h"
#include "train/checkpoint.h"
#include "train/memory_estimate.h"
#include "train/sample.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>

namespace {

constexpr int kInterruptedStatus = 130;  // 128 + SIGINT, as shells report it
// The first SIGINT/SIGTERM asks the trainer to stop cleanly (checkpoint, summary).
std::atomic<bool>& g_stop = cfmo::tool::stop_requested();

int fail(const cfmo::Error& error) { return cfmo::tool::fail("cfmo-train", error); }

/// Progress on stderr: a redrawn bar on a terminal, plain lines elsewhere.
class ConsoleObserver final : public cfmo::TrainObserver {
 public:
  ConsoleObserver(bool tty, bool quiet) : tty_(tty), quiet_(quiet) {}

  void on_step(const cfmo::StepEvent& e) override {
    if (quiet_) return;
    if (tty_) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_draw_ < std::chrono::milliseconds(100) && e.fraction < 1.0) return;
      last_draw_ = now;
      cfmo::ProgressState state{e.fraction, e.eta_s, fmt::format("epoch {} step {}", e.epoch + 1, e.step),
                                fmt::format("loss {:.4f}  {} samples/s", e.loss, cfmo::human_count(e.samples_per_s))};
      fmt::print(stderr, "\r\033[K{}", cfmo::render_progress(state, columns()));
      drawn_ = true;
    } else if (e.logged) {
      fmt::print(stderr, "step {}  epoch {}  loss {:.4f}  lr {:.3g}  {} samples/s\n", e.step, e.epoch + 1, e.loss, e.lr,
                 cfmo::human_count(e.samples_per_s));
    }
  }

  void on_eval(const cfmo::EvalEvent& e) override {
    if (quiet_) return;
    clear_line();
    fmt::print(stderr, "{} step {}: test accuracy {:.4f}  test loss {:.4f}  ({:.1f}s)\n",
               e.final ? "final" : fmt::format("epoch {:.0f}", e.epochs), e.step, e.test_accuracy, e.test_loss,
               e.elapsed_s);
  }

  void on_note(std::string_view text) override {
    if (quiet_) return;
    clear_line();
    fmt::print(stderr, "{}\n", text);
  }

  void on_warning(std::string_view text) override {
    clear_line();
    fmt::print(stderr, "{}\n", text);
  }

  void clear_line() {
    if (drawn_) fmt::print(stderr, "\r\033[K");
    drawn_ = false;
  }

 private:
  static int columns() {
    const char* env = std::getenv("COLUMNS");
    int n = env != nullptr ? std::atoi(env) : 0;
    return n > 20 ? n : 100;
  }

  bool tty_;
  bool quiet_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

void print_human_summary(const cfmo::TrainSummary& s) {
  // The rate is this invocation's samples over its training time (the longest worker's
  // loop), so the line shows both and the wall time beside them; a resumed run's totals
  // include the steps before the resume.
  int64_t run_samples = 0;
  for (const auto& w : s.per_worker) run_samples += w.samples;
  fmt::print(
      "{} on {} worker(s): {} steps, {} samples{} in {:.2f}s of training ({} samples/s), {:.2f}s in all, "
      "stopped by {}\n",
      s.mode, s.workers, s.steps, s.samples,
      run_samples != s.samples ? fmt::format(" ({} in this run)", run_samples) : "", s.train_s,
      cfmo::human_count(s.samples_per_s), s.wall_s, s.stopped_by);
  if (s.workers > 1) {
    fmt::print("efficiency {:.2f} (total samples/s over the sum of the workers' solo samples/s)\n", s.efficiency);
    for (const auto& w : s.per_worker) {
      fmt::print("  rank {}: {} steps, {} samples/s (solo {}), waited {:.2f}s, sent {} bytes, dropped {}{}\n", w.rank,
                 w.steps, cfmo::human_count(w.samples_per_s), cfmo::human_count(w.solo_samples_per_s), w.wait_s,
                 w.bytes_sent, w.contributions_dropped,
                 w.slowdown > 1 ? fmt::format(", simulated {}x slower", w.slowdown) : "");
    }
    for (int r : s.lost_ranks) fmt::print("  rank {}: lost during the run\n", r);
  }
  if (!s.slowdown.empty() || !s.straggler.empty()) {
    fmt::print("heterogeneity was simulated (sleeps after steps):{}{}\n",
               s.slowdown.empty() ? "" : fmt::format(" slowdown {}", fmt::join(s.slowdown, ",")),
               s.straggler.empty() ? "" : fmt::format(" straggler {}", s.straggler));
  }
  fmt::print("model {} ({} parameters), optimizer {}, data {}\n", s.model, s.parameters, s.optimizer, s.data);
  if (s.context > 0) {
    fmt::print("val loss {:.4f}, train loss {:.4f}, {} tokens ({} tokens/s, {:.1f} GFLOP/s)\n", s.val_loss,
               s.train_loss, s.tokens, cfmo::human_count(s.tokens_per_s), s.gflops_per_s);
    fmt::print("FLOPs per window: {} = {:.4g}\n", s.flops_formula, s.flops_per_example);
  } else {
    fmt::print("test accuracy {:.4f}, test loss {:.4f}\n", s.test_accuracy, s.test_loss);
  }
  if (!s.muon_tensors.empty()) {
    fmt::print("muon updates {}; adamw updates {}\n", fmt::join(s.muon_tensors, ", "),
               fmt::join(s.adamw_tensors, ", "));
  }
  if (!s.run_dir.empty()) fmt::print("run directory: {}\n", s.run_dir);
}

/// --compare: the same job once per mode, each a run of its own, then a table.
int compare_modes(int argc, char** argv, const cfmo::TrainConfig& config, bool json) {
  std::vector<std::string> base;
  for (int i = 0; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--compare") base.emplace_back(argv[i]);
  }
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  std::vector<std::string> rows;
  bool language_model = false;
  for (const char* mode : {"sync", "localsgd", "asgd", "cfmo"}) {
    if (g_stop.load()) return kInterruptedStatus;
    std::vector<std::string> args = base;
    for (const char* extra : {"--mode", mode, "--json", "--quiet"}) args.emplace_back(extra);
    if (!config.out.empty()) {
      args.emplace_back("--out");
      args.emplace_back((std::filesystem::path(config.out) / mode).string());
    }
    fmt::print(stderr, "compare: running {}...\n", mode);
    auto ran = cfmo::run_self(args);
    if (!ran) return fail(ran.error());
    const auto& [status, out] = *ran;
    // The summary is the run's last line on stdout.
    const auto last = out.rfind('\n', out.size() > 1 ? out.size() - 2 : 0);
    const auto summary =
        nlohmann::ordered_json::parse(out.substr(last == std::string::npos ? 0 : last + 1), nullptr, false);
    if (status != 0 || !summary.is_object()) {
      fmt::print(stderr, "cfmo-train: --compare: the {} run failed with status {}\n", mode, status);
      return status != 0 ? status : static_cast<int>(cfmo::ErrorKind::kInternal);
    }
    double wait = 0;
    for (const auto& w : summary["per_worker"]) wait = std::max(wait, w["wait_s"].get<double>());
    // A language model's column is its val_loss; the MLP's, its test accuracy.
    language_model = summary["val_loss"].is_number();
    rows.push_back(fmt::format("{:<9} {:>12.0f} {:>10.2f} {:>9.2f} {:>12} {:>9.4f}", mode,
                               summary["samples_per_s"].get<double>(), summary["efficiency"].get<double>(), wait,
                               summary["bytes_sent"].get<uint64_t>(),
                               summary[language_model ? "val_loss" : "test_accuracy"].get<double>()));
    results.push_back(summary);
  }
  if (json) {
    fmt::print("{}\n", nlohmann::ordered_json{{"compare", results}}.dump());
  } else {
    fmt::print("{:<9} {:>12} {:>10} {:>9} {:>12} {:>9}\n", "mode", "samples/s", "efficiency", "max wait", "bytes sent",
               language_model ? "val loss" : "test acc");
    for (const auto& row : rows) fmt::print("{}\n", row);
  }
  return 0;
}

/// `cfmo-train sample RUN ...`: text from a run's (or a checkpoint's) model.
int run_sample(int argc, char** argv) {
  CLI::App app{"Print text generated by a run's language model (RUN/model.safetensors, or a checkpoint's)."};
  app.name("cfmo-train sample");
  std::string dir;
  std::string prompt;
  cfmo::SampleOptions options;
  uint64_t seed = 1;
  app.add_option("RUN", dir, "run directory or checkpoint directory")->required();
  app.add_option("--prompt", prompt, "text to continue (bytes for a byte-level model, else token ids)");
  app.add_option("--tokens", options.tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  app.add_option("--temperature", options.temperature, "divides the logits (> 0)")->check(CLI::PositiveNumber);
  app.add_option("--top-k", options.top_k, "draw among the k likeliest tokens only (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "seed of the draws");
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-train sample")) return *done;
  options.seed = seed;
  auto model = cfmo::load_saved_model(dir);
  if (!model) return fail(model.error());
  const int vocab = static_cast<int>((*model)->params().front().shape[0]);
  auto tokens = cfmo::text_to_tokens(prompt, vocab);
  if (!tokens) return fail(tokens.error());
  auto sampled = cfmo::sample_tokens(**model, *tokens, options);
  if (!sampled) return fail(sampled.error());
  fmt::print("{}{}\n", prompt, cfmo::tokens_to_text(*sampled, vocab));
  return 0;
}

}  // namespace

static int run(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "sample") return run_sample(argc - 1, argv + 1);
  CLI::App app{
      "Train a model (an MLP on Fashion-MNIST, a GPT-2 on text or token files) with local-update optimizers.\n"
      "Every option can also be set in a TOML file (--config); flags override the file.\n"
      "cfmo-train sample RUN [--prompt TEXT] [--tokens N] [--temperature X] [--top-k K] [--seed S]\n"
      "prints text from a run's language model."};
  app.name("cfmo-train");
  app.set_version_flag("--version", "cfmo-train " CFMO_VERSION);
  app.get_formatter()->column_width(34);

  cfmo::TrainConfig config;
  cfmo::OptionTable table;
  cfmo::add_train_options(table, config);

  std::string config_file;
  std::string resume;
  bool print_config = false;
  bool json = false;
  bool compare = false;
  app.add_option("--config", config_file, "TOML file with any of the options below")->group("General");
  app.add_flag("--print-config", print_config, "print the merged configuration as TOML and exit")->group("General");
  app.add_option("--resume", resume, "continue from a run directory's latest checkpoint, or a checkpoint directory")
      ->group("General");
  app.add_flag("--json", json, "print one JSON summary object on stdout at the end")->group("General");
  app.add_flag("--compare", compare, "run the same job in every mode (sync, localsgd, asgd, cfmo) and compare them")
      ->group("General");
  table.register_cli(app);

  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-train")) return *done;

  cfmo::TrainOptions options;
  if (!resume.empty()) {
    auto checkpoint = cfmo::resolve_checkpoint(resume);
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
    const auto run_dir = cfmo::run_dir_of(options.resume);
    if (run_dir.empty()) {
      return fail(cfmo::make_error(cfmo::ErrorKind::kUsage,
                                   "--resume '{}': not in a run directory (RUN/checkpoints/step-N); say where this "
                                   "run writes with --out",
                                   options.resume.string()));
    }
    config.out = run_dir.string();
  }
  if (auto valid = cfmo::validate(config); !valid) return fail(valid.error());
  options.config_toml = table.to_toml();
  if (print_config) {
    fmt::print("{}", options.config_toml);
    return 0;
  }

  // Before any worker starts: "no CUDA device" is one line and exit 2, from the launcher too.
  if (auto device = cfmo::parse_device(config.device); !device) {
    return fail(device.error());
  } else if (auto usable = cfmo::check_device(*device); !usable) {
    return fail(usable.error());
  }

  cfmo::tool::catch_stop_signals();
  // A file-size limit (ulimit -f) makes a write fail with EFBIG, reported as
  // any failed write (exit 5, naming the file), not a crash by SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  if (compare) return compare_modes(argc, argv, config, json);

  auto world = cfmo::world_from_environment();
  if (!world) return fail(world.error());
  const bool launched = world->has_value() && (*world)->launched;  // a worker of our own launcher
  // One run at a time in a run directory. The process that owns the run holds the lock for
  // all its ranks: this one alone, our launcher (its workers share the directory), or rank 0
  // under another launcher, before the rendezvous, so no rank of a second run gets to write.
  std::optional<cfmo::DirLock> run_lock;
  if (!config.out.empty() && !launched && (!world->has_value() || (*world)->rank == 0)) {
    auto lock = cfmo::lock_run_dir(config.out);
    if (!lock) return fail(lock.error());
    run_lock = std::move(*lock);
  }
  if (config.workers > 1 && !launched && (!world->has_value() || (*world)->size == 1)) {
    // One host, no launcher: start the workers here and relay their output, if they fit.
    if (auto fits = cfmo::check_workers_fit(config, config.workers); !fits) return fail(fits.error());
    auto status = cfmo::launch_local(config.workers, argv, &g_stop, STDOUT_FILENO, STDERR_FILENO, config.peer_timeout);
    if (!status) return fail(status.error());
    return *status;
  }
  std::unique_ptr<cfmo::Communicator> comm;
  if (world->has_value() && (*world)->size > 1) {
    auto connected = cfmo::connect_world(*world, {config.rendezvous, config.peer_timeout});
    if (!connected) return fail(connected.error());
    comm = std::move(*connected);
    options.comm = comm.get();
    options.local_rank = (*world)->local_rank;
  }

  ConsoleObserver observer(::isatty(STDERR_FILENO) != 0, config.quiet);
  options.stop = &g_stop;
  options.observer = &observer;

  auto summary = cfmo::train(config, options);
  observer.clear_line();
  // The goodbye tells the other ranks why this one leaves: they then fail
  // with this root cause, and the run ends with its status.
  if (!summary && comm) comm->leave_with(summary.error());
  comm.reset();  // say goodbye to the other ranks before reporting
  if (!summary) return fail(summary.error());
  if (summary->rank != 0) return summary->stopped_by == "interrupt" ? kInterruptedStatus : 0;
  if (json) {
    fmt::print("{}\n", summary->to_json());
  } else {
    print_human_summary(*summary);
  }
  return summary->stopped_by == "interrupt" ? kInterruptedStatus : 0;
}

int main(int argc, char** argv) {
  cfmo::tool::reexec_for_blas(argv);
  return cfmo::tool::guarded("cfmo-train", [&] { return run(argc, argv); });
}
