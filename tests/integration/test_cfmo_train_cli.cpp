// Drives the real cfmo-train binary: flags, config files, exit statuses,
// outputs, checkpoints, resume and interruption.
#include "integration/harness.h"
#include "integration/man_page.h"

#include "ckpt/safetensors.h"
#include "core/atomic_file.h"
#include "core/dir_lock.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

namespace cfmo {
namespace {

using testing::lines;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;
namespace fs = std::filesystem;

std::string binary() { return testing::env_or("CFMO_TRAIN", "build/tools/cfmo-train"); }
fs::path source_root() { return testing::env_or("CFMO_SOURCE_ROOT", "."); }

// Small and quick: a few hundred synthetic examples, a narrow model.
std::vector<std::string> quick_args(std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {binary(), "--data", "synthetic:512:128", "--model", "mlp:32", "--epochs",
                                   "1",      "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::set<std::string> flags_in(const std::string& text, const std::regex& pattern) {
  std::set<std::string> flags;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it) {
    flags.insert((*it)[1]);
  }
  return flags;
}

// Every error is one line on stderr naming what was wrong.
void expect_one_line_error(const RunResult& r, int status, const std::string& needle) {
  EXPECT_EQ(r.status, status) << r.err;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(CfmoTrainCli, EveryToolSaysTheProjectsVersionAsItsManPageDoes) {
  // One version for the four tools, from meson.build; each man page's title line names it.
  const RunResult train = run({binary(), "--version"});
  ASSERT_EQ(train.status, 0) << train.err;
  const std::regex pattern(R"(^cfmo-train (\d+\.\d+\.\d+)\n$)");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(train.out, m, pattern)) << train.out;
  const std::string version = m[1];
  const fs::path tools = fs::path(binary()).parent_path();
  for (const char* tool : {"cfmo-diverge", "cfmo-pull", "cfmo-moe"}) {
    const RunResult r = run({(tools / tool).string(), "--version"});
    EXPECT_EQ(r.status, 0) << tool << ": " << r.err;
    EXPECT_EQ(r.out, fmt::format("{} {}\n", tool, version));
  }
  for (const char* page : {"cfmo-train", "cfmo-diverge", "cfmo-pull", "cfmo-moe"}) {
    const std::string scd = slurp(source_root() / "man" / fmt::format("{}.1.scd", page));
    EXPECT_NE(scd.find(fmt::format("\"cfmo {}\"", version)), std::string::npos) << page;
  }
}

TEST(CfmoTrainCli, HelpManPageAndConfigListTheSameOptions) {
  const RunResult help = run({binary(), "--help"});
  ASSERT_EQ(help.status, 0);
  const std::regex long_flag(R"((--[a-z][a-z0-9-]*))");
  std::set<std::string> help_flags = flags_in(help.out, long_flag);
  const std::string man = slurp(source_root() / "man/cfmo-train.1.scd");
  ASSERT_FALSE(man.empty()) << "man/cfmo-train.1.scd missing";
  std::set<std::string> man_flags = flags_in(man, std::regex(R"(\*(--[a-z][a-z0-9-]*)\*)"));
  for (const auto& f : help_flags) EXPECT_TRUE(man_flags.count(f)) << f << " is in --help but not in the man page";
  for (const auto& f : man_flags) EXPECT_TRUE(help_flags.count(f)) << f << " is in the man page but not in --help";

  // conf/train.toml sets every key --print-config knows.
  const RunResult printed = run({binary(), "--print-config"});
  ASSERT_EQ(printed.status, 0) << printed.err;
  const std::set<std::string> keys = flags_in(printed.out, std::regex(R"((?:^|\n)([a-z_0-9]+) = )"));
  const std::string conf = slurp(source_root() / "conf/train.toml");
  const std::set<std::string> conf_keys = flags_in(conf, std::regex(R"((?:^|\n)([a-z_0-9]+) = )"));
  EXPECT_EQ(keys, conf_keys);
  for (const char* file : {"conf/train.toml", "conf/demo.toml", "conf/gpt.toml", "conf/gpt-moe.toml"}) {
    const RunResult loaded = run({binary(), "--config", (source_root() / file).string(), "--print-config"});
    EXPECT_EQ(loaded.status, 0) << file << ": " << loaded.err;
  }
}

TEST(CfmoTrainCli, HelpAndManPageListTheModesOfTheTable) {
  // --help's --mode line is made from the modes' table (train/modes/table.cpp):
  // the man page's synopsis and --mode entry list the same modes, in its order,
  // each with a paragraph of its own, and --compare runs them in that order.
  const RunResult help = run({binary(), "--help"});
  ASSERT_EQ(help.status, 0);
  std::smatch line;
  ASSERT_TRUE(std::regex_search(help.out, line, std::regex(R"(--mode \S+ +how workers reconcile: ([^\n]*))")))
      << help.out;
  std::vector<std::string> modes;
  const std::string listed = line[1];
  const std::regex item(R"((?:^|, )([a-z]+) \()");
  for (auto it = std::sregex_iterator(listed.begin(), listed.end(), item); it != std::sregex_iterator(); ++it) {
    modes.push_back((*it)[1]);
  }
  ASSERT_GE(modes.size(), 4u) << listed;
  std::string joined;
  for (const auto& m : modes) joined += (joined.empty() ? "" : "|") + m;
  const std::string man = slurp(source_root() / "man/cfmo-train.1.scd");
  EXPECT_NE(man.find("*--mode* " + joined + " [_OPTIONS_]"), std::string::npos) << joined;
  EXPECT_NE(man.find("*--mode* " + joined + " [sync]"), std::string::npos) << joined;
  for (const auto& m : modes) EXPECT_NE(man.find("\t*" + m + "*: "), std::string::npos) << m;
  std::string order;
  for (const auto& m : modes) order += (order.empty() ? "" : ", ") + m;
  EXPECT_NE(help.out.find("in every mode (" + order + ")"), std::string::npos);
}

TEST(CfmoTrainCli, GeneratedManPageIsCurrent) {
  testing::expect_generated_man_page_current(source_root(), "cfmo-train");
}

TEST(CfmoTrainCli, FlagsOverrideConfigFileOverridesDefaults) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir / "c.toml", "lr = 0.5\nbatch_size = 32\noptimizer = \"sgd\"\n"));
  const RunResult r = run({binary(), "--config", (dir / "c.toml").string(), "--lr", "0.25", "--print-config"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\nlr = 0.25\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nbatch_size = 32\n"), std::string::npos);
  EXPECT_NE(r.out.find("\noptimizer = 'sgd'\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nepochs = 10\n"), std::string::npos);
}

TEST(CfmoTrainCli, UsageErrorsExitTwoNamingTheProblem) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir / "unknown.toml", "lr = 0.1\nlearning_rate = 0.1\n"));
  expect_one_line_error(run({binary(), "--config", (dir / "unknown.toml").string()}), 2, "learning_rate");
  ASSERT_TRUE(write_file_atomic(dir / "type.toml", "batch_size = \"big\"\n"));
  expect_one_line_error(run({binary(), "--config", (dir / "type.toml").string()}), 2, "batch_size");
  ASSERT_TRUE(write_file_atomic(dir / "syntax.toml", "lr = = 1\n"));
  expect_one_line_error(run({binary(), "--config", (dir / "syntax.toml").string()}), 2, "syntax.toml");
  expect_one_line_error(run({binary(), "--config", (dir / "missing.toml").string()}), 2, "missing.toml");
  expect_one_line_error(run(quick_args({"--lr", "-1"})), 2, "--lr");
  expect_one_line_error(run(quick_args({"--optimizer", "lion"})), 2, "lion");
  expect_one_line_error(run(quick_args({"--model", "mlp:12,x"})), 2, "--model");
  expect_one_line_error(run(quick_args({"--time-limit", "soon"})), 2, "soon");
  expect_one_line_error(run(quick_args({"--epochs", "0"})), 2, "--epochs");
  expect_one_line_error(run(quick_args({"--data", "synthetic:0"})), 2, "synthetic:0");
  expect_one_line_error(run(quick_args({"--device", "gpu"})), 2, "--device 'gpu'");
  expect_one_line_error(run(quick_args({"--device", "cuda:x"})), 2, "--device 'cuda:x'");
  expect_one_line_error(run(quick_args({"--keep-global-batch"})), 2, "--keep-global-batch");
  // CLI11's own parse errors add a hint line; the status is what scripts rely on.
  const RunResult bad_number = run(quick_args({"--batch-size", "lots"}));
  EXPECT_EQ(bad_number.status, 2);
  EXPECT_NE(bad_number.err.find("--batch-size"), std::string::npos) << bad_number.err;
  EXPECT_EQ(run(quick_args({"--no-such-flag"})).status, 2);
}

// Where no GPU can be used (CI), --device cuda is one line and exit 2 before
// anything starts, with --workers too; where one can, the run trains there.
TEST(CfmoTrainCli, DeviceCudaTrainsOnTheGpuOrSaysThereIsNone) {
  const RunResult r = run(quick_args({"--device", "cuda", "--json"}));
  if (r.status == 2) {
    expect_one_line_error(r, 2, "no CUDA device");
    expect_one_line_error(run(quick_args({"--device", "cuda", "--workers", "2"})), 2, "no CUDA device");
    return;
  }
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_NE(j["device"].get<std::string>().find("cuda"), std::string::npos) << j["device"];
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.0);
}

TEST(CfmoTrainCli, BadDataExitsThreeNamingTheFile) {
  TempDir dir;
  expect_one_line_error(run({binary(), "--data", (dir / "nowhere").string(), "--quiet"}), 3, "nowhere");
  // A directory whose training images file is truncated after its header.
  fs::create_directories(dir / "fm");
  const std::string header("\x00\x00\x08\x03\x00\x00\x00\x02\x00\x00\x00\x1c\x00\x00\x00\x1c", 16);
  ASSERT_TRUE(write_file_atomic(dir / "fm" / "train-images-idx3-ubyte", header + std::string(100, '\x7f')));
  expect_one_line_error(run({binary(), "--data", (dir / "fm").string(), "--quiet"}), 3, "train-images-idx3-ubyte");
  ASSERT_TRUE(write_file_atomic(dir / "fm" / "train-images-idx3-ubyte", std::string("GIF89a") + std::string(40, 'x')));
  expect_one_line_error(run({binary(), "--data", (dir / "fm").string(), "--quiet"}), 3, "magic");
}

TEST(CfmoTrainCli, JsonSummaryHasTheDocumentedKeysAndNothingElseOnStdout) {
  const RunResult r = run(quick_args({"--json"}));
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(lines(r.out).size(), 1u) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"mode", "workers", "steps", "samples", "wall_s", "samples_per_s", "test_accuracy",
                          "test_loss", "bytes_sent", "per_worker", "device"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["workers"], 1);
  EXPECT_EQ(j["steps"], 8);  // 512 examples / 64 per batch
  EXPECT_EQ(j["samples"], 512);
  EXPECT_EQ(j["stopped_by"], "epochs");
  ASSERT_EQ(j["per_worker"].size(), 1u);
  for (const char* key : {"rank", "steps", "samples_per_s", "wait_s"}) EXPECT_TRUE(j["per_worker"][0].contains(key));
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.0);
}

TEST(CfmoTrainCli, HumanOutputWithoutJson) {
  const RunResult r = run(quick_args({"--steps", "3"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("test accuracy"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('{'), std::string::npos);
  const RunResult logged =
      run({binary(), "--data", "synthetic:512:128", "--model", "mlp:32", "--steps", "4", "--log-every", "2"});
  ASSERT_EQ(logged.status, 0) << logged.err;
  EXPECT_NE(logged.err.find("step 2 "), std::string::npos) << logged.err;  // plain lines when not a TTY
  EXPECT_EQ(logged.err.find('\r'), std::string::npos);
}

TEST(CfmoTrainCli, RunDirectoryHoldsMetricsCheckpointsAndModel) {
  TempDir dir;
  const fs::path out = dir / "run";
  const RunResult r = run(quick_args({"--epochs", "2", "--log-every", "3", "--out", out.string()}));
  ASSERT_EQ(r.status, 0) << r.err;
  int steps = 0;
  int evals = 0;
  for (const auto& line : lines(slurp(out / "metrics.jsonl"))) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      ++steps;
      for (const char* key : {"step", "epoch", "loss", "lr", "samples_per_s", "compute_s", "wall_s"})
        EXPECT_TRUE(j.contains(key));
    } else if (j["type"] == "eval") {
      ++evals;
      EXPECT_TRUE(j.contains("test_accuracy"));
    }
  }
  EXPECT_EQ(steps, 5);  // 16 steps, a line every 3
  EXPECT_EQ(evals, 2);  // one per epoch
  EXPECT_EQ(slurp(out / "checkpoints" / "latest"), "step-00000016\n");
  EXPECT_TRUE(fs::exists(out / "checkpoints" / "step-00000008" / "optimizer.safetensors"));
  auto model = ckpt::SafetensorsFile::read(out / "model.safetensors");
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->tensors().size(), 4u);
  EXPECT_EQ(model->metadata().at("format"), "pt");
  for (const auto& entry : fs::recursive_directory_iterator(out)) {
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

std::string tensor_bytes(const fs::path& file) {
  auto st = ckpt::SafetensorsFile::read(file);
  EXPECT_TRUE(st) << (st ? "" : st.error().message);
  if (!st) return {};
  std::string all;
  for (const auto& e : st->tensors()) {
    auto b = st->bytes(e);
    all.append(e.name);
    all.append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  return all;
}

TEST(CfmoTrainCli, ResumedRunEndsWithTheSameParametersAsAnUninterruptedOne) {
  TempDir dir;
  for (const char* optimizer : {"adamw", "muon"}) {
    SCOPED_TRACE(optimizer);
    const std::vector<std::string> common = {"--optimizer",    optimizer, "--schedule", "cosine",
                                             "--warmup-steps", "3",       "--epochs",   "3"};
    auto with = [&](std::vector<std::string> extra) {
      std::vector<std::string> args = common;
      args.insert(args.end(), extra.begin(), extra.end());
      return quick_args(args);
    };
    const fs::path whole = dir / (std::string(optimizer) + "-whole");
    const fs::path parts = dir / (std::string(optimizer) + "-parts");
    // The whole run also checkpoints mid-epoch, at step 13 of 24.
    ASSERT_EQ(run(with({"--out", whole.string(), "--checkpoint-every", "13", "--keep-checkpoints", "10"})).status, 0);
    const fs::path step13 = whole / "checkpoints" / "step-00000013";
    ASSERT_TRUE(fs::exists(step13 / "state.json"));
    const RunResult resumed =
        run({binary(), "--resume", step13.string(), "--out", parts.string(), "--quiet", "--json"});
    ASSERT_EQ(resumed.status, 0) << resumed.err;
    EXPECT_EQ(nlohmann::json::parse(resumed.out)["steps"], 24);
    EXPECT_TRUE(tensor_bytes(whole / "model.safetensors") == tensor_bytes(parts / "model.safetensors"))
        << "the resumed run's parameters differ from the uninterrupted run's";
    // Resuming from a checkpoint continues in the run directory it belongs to, however it is spelt.
    EXPECT_TRUE(fs::exists(parts / "model.safetensors"));
    const std::string before = tensor_bytes(whole / "model.safetensors");
    ASSERT_EQ(run({binary(), "--resume", step13.string() + "/", "--quiet"}).status, 0);
    EXPECT_FALSE(fs::exists(whole / "checkpoints" / "metrics.jsonl"));
    EXPECT_TRUE(tensor_bytes(whole / "model.safetensors") == before);
    // Resuming a run directory continues it in place, from its latest checkpoint.
    const fs::path in_place = dir / (std::string(optimizer) + "-in-place");
    ASSERT_EQ(run(with({"--out", in_place.string(), "--checkpoint-every", "13", "--keep-checkpoints", "10"})).status,
              0);
    fs::remove_all(in_place / "checkpoints" / "step-00000024");
    fs::remove_all(in_place / "checkpoints" / "step-00000016");
    ASSERT_TRUE(write_file_atomic(in_place / "checkpoints" / "latest", "step-00000013\n"));
    ASSERT_EQ(run({binary(), "--resume", in_place.string(), "--quiet"}).status, 0);
    EXPECT_TRUE(tensor_bytes(whole / "model.safetensors") == tensor_bytes(in_place / "model.safetensors"));
    const fs::path& parts_dir = in_place;
    // The resumed run's metrics continue the first part's without duplicates.
    std::set<int64_t> seen;
    for (const auto& line : lines(slurp(parts_dir / "metrics.jsonl"))) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") {
        EXPECT_TRUE(seen.insert(j["step"].get<int64_t>()).second) << line;
      }
    }
  }
}

TEST(CfmoTrainCli, BadCheckpointsExitThree) {
  TempDir dir;
  expect_one_line_error(run({binary(), "--resume", (dir / "none").string()}), 3, "none");
  const fs::path out = dir / "run";
  ASSERT_EQ(run(quick_args({"--out", out.string()})).status, 0);
  const fs::path model = out / "checkpoints" / "step-00000008" / "model.safetensors";
  std::string bytes = slurp(model);
  ASSERT_TRUE(write_file_atomic(model, bytes.substr(0, bytes.size() - 10)));
  expect_one_line_error(run({binary(), "--resume", out.string(), "--quiet"}), 3, "model.safetensors");
  ASSERT_TRUE(write_file_atomic(out / "checkpoints" / "latest", "step-00000099\n"));
  expect_one_line_error(run({binary(), "--resume", out.string(), "--quiet"}), 3, "step-00000099");
}

/// A run of unbounded length into `out`, sent `signal` once it has logged a step.
RunResult signalled_run(const fs::path& out, int signal) {
  bool sent = false;
  RunResult r = run({binary(), "--data", "synthetic:4096:128", "--model", "mlp:64", "--epochs", "0", "--time-limit",
                     "5m", "--log-every", "1", "--quiet", "--json", "--out", out.string()},
                    120, {}, [&](pid_t pid, double elapsed) {
                      std::error_code ec;
                      const auto size = fs::file_size(out / "metrics.jsonl", ec);
                      if (!sent && ((!ec && size > 0) || elapsed > 60)) {
                        kill(pid, signal);
                        sent = true;
                      }
                    });
  EXPECT_TRUE(sent);
  return r;
}

TEST(CfmoTrainCli, SigtermStopsCleanlyAndExits143) {
  TempDir dir;
  const fs::path out = dir / "run";
  const RunResult r = signalled_run(out, SIGTERM);
  EXPECT_EQ(r.status, 143) << r.err;
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(nlohmann::json::parse(r.out)["stopped_by"], "interrupt");
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

TEST(CfmoTrainCli, InterruptWritesACheckpointAndExits130) {
  TempDir dir;
  const fs::path out = dir / "run";
  const RunResult r = signalled_run(out, SIGINT);
  EXPECT_EQ(r.status, 130) << r.err;
  ASSERT_FALSE(r.out.empty());
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["stopped_by"], "interrupt");
  const std::string latest = slurp(out / "checkpoints" / "latest");
  EXPECT_EQ(latest, fmt::format("step-{:08}\n", j["steps"].get<int64_t>()));
}

TEST(CfmoTrainCli, ConfigThatIsADirectoryOrAFifoIsRefusedAtOnce) {
  TempDir dir;
  expect_one_line_error(run({binary(), "--config", dir.path().string()}), 2, "a directory");
  const fs::path fifo = dir / "config.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const RunResult r = run({binary(), "--config", fifo.string()}, 30);
  EXPECT_FALSE(r.timed_out) << "reading a FIFO as the configuration hung";
  expect_one_line_error(r, 2, "a FIFO");
}

TEST(CfmoTrainCli, OneRunAtATimeWritesIntoARunDirectory) {
  TempDir dir;
  const fs::path out = dir / "run";
  // A run of two workers holds the directory while its ranks share it...
  const std::vector<std::string> long_run = {binary(),    "--data",  "synthetic:4096:128", "--model", "mlp:64",
                                             "--epochs",  "0",       "--time-limit",       "5m",      "--log-every",
                                             "1",         "--quiet", "--workers",          "2",       "--out",
                                             out.string()};
  testing::Background first = testing::spawn(long_run, {}, (dir / "first.out").string(), (dir / "first.err").string());
  ASSERT_GT(first.pid, 0);
  for (int i = 0; i < 2400; ++i) {  // until its first step is logged (two minutes at most)
    std::error_code ec;
    const auto size = fs::file_size(out / "metrics.jsonl", ec);
    if (!ec && size > 0) break;
    if (first.wait(0.05)) break;
  }
  ASSERT_LT(first.status, 0) << slurp(dir / "first.err");
  // ...and a second run into it, of one worker or several, fresh or resumed, is refused naming the holder.
  const std::string holder = fmt::format("pid {}", first.pid);
  expect_one_line_error(run(quick_args({"--out", out.string()})), 2, holder);
  expect_one_line_error(run(quick_args({"--out", out.string(), "--workers", "2"})), 2, holder);
  kill(first.pid, SIGINT);
  ASSERT_TRUE(first.wait(120)) << slurp(dir / "first.err");
  first.reap();
  EXPECT_EQ(first.status, 130) << slurp(dir / "first.err");
  // The first run's metrics are its own, whole lines.
  for (const auto& line : lines(slurp(out / "metrics.jsonl"))) {
    EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded()) << line;
  }
  // Once it has ended the directory is free: its checkpoint resumes, but not while another process holds it.
  {
    auto lock = DirLock::acquire(out, ".cfmo-train.lock", "test", std::chrono::steady_clock::now());
    ASSERT_TRUE(lock) << lock.error().message;
    expect_one_line_error(run({binary(), "--resume", out.string(), "--steps", "1", "--quiet"}), 2,
                          fmt::format("pid {}", getpid()));
  }
  const RunResult resumed = run({binary(), "--resume", out.string(), "--time-limit", "0.1s", "--quiet"});
  EXPECT_EQ(resumed.status, 0) << resumed.err;
}

TEST(CfmoTrainCli, ACheckpointCopiedOutOfItsRunNeedsOut) {
  TempDir dir;
  const fs::path out = dir / "run";
  ASSERT_EQ(run(quick_args({"--out", out.string()})).status, 0);
  const fs::path copy = dir / "a" / "b" / "ck";
  fs::create_directories(copy.parent_path());
  fs::copy(out / "checkpoints" / "step-00000008", copy, fs::copy_options::recursive);
  const RunResult refused = run({binary(), "--resume", copy.string(), "--epochs", "2", "--quiet"});
  expect_one_line_error(refused, 2, "--out");
  EXPECT_NE(refused.err.find(copy.string()), std::string::npos) << refused.err;
  const fs::path elsewhere = dir / "elsewhere";
  ASSERT_EQ(run({binary(), "--resume", copy.string(), "--epochs", "2", "--quiet", "--out", elsewhere.string()}).status,
            0);
  EXPECT_EQ(slurp(elsewhere / "checkpoints" / "latest"), "step-00000016\n");
  EXPECT_EQ(slurp(out / "checkpoints" / "latest"), "step-00000008\n");  // the original run is untouched
}

TEST(CfmoTrainCli, ACorruptPositionInStateJsonExitsThreeNamingTheField) {
  TempDir dir;
  const fs::path out = dir / "run";
  ASSERT_EQ(run(quick_args({"--out", out.string(), "--epochs", "3"})).status, 0);
  const fs::path state = out / "checkpoints" / "step-00000024" / "state.json";
  const auto good = nlohmann::json::parse(slurp(state));
  auto corrupt = [&](const char* field, const nlohmann::json& value) {
    auto j = good;
    j[field] = value;
    EXPECT_TRUE(write_file_atomic(state, j.dump(2)));
  };
  corrupt("batch_in_epoch", int64_t{1'000'000'000'000});
  expect_one_line_error(run({binary(), "--resume", out.string(), "--epochs", "4", "--quiet"}), 3, "batch_in_epoch");
  corrupt("epoch", int64_t{1} << 62);
  expect_one_line_error(run({binary(), "--resume", out.string(), "--epochs", "4", "--quiet"}), 3, "epoch");
  corrupt("samples", 7);
  expect_one_line_error(run({binary(), "--resume", out.string(), "--epochs", "4", "--quiet"}), 3, "samples");
  // Nothing was trained or written from them; the intact state resumes.
  EXPECT_EQ(slurp(out / "checkpoints" / "latest"), "step-00000024\n");
  ASSERT_TRUE(write_file_atomic(state, good.dump(2)));
  const RunResult resumed = run({binary(), "--resume", out.string(), "--epochs", "4", "--quiet", "--json"});
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_EQ(nlohmann::json::parse(resumed.out)["steps"], 32);
}

TEST(CfmoTrainCli, AFileThatCannotBeWrittenIsNamedWithTheReason) {
  TempDir dir;
  const fs::path out = dir / "run";
  fs::create_directories(out / "metrics.jsonl");  // in the way of the metrics file
  const RunResult r = run(quick_args({"--out", out.string()}));
  expect_one_line_error(r, 5, "metrics.jsonl");
  EXPECT_NE(r.err.find("Is a directory"), std::string::npos) << r.err;
}

TEST(CfmoTrainCli, WorkersThatCannotFitInMemoryAreRefusedBeforeAnyStarts) {
  // A thousand workers of a model of 20 million parameters: hundreds of gigabytes.
  const RunResult r = run({binary(), "--data", "synthetic:512:128", "--model", "mlp:4096,4096", "--workers", "1000",
                           "--epochs", "1", "--quiet"},
                          60);
  expect_one_line_error(r, 2, "--workers 1000");
  EXPECT_NE(r.err.find("MemAvailable"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GB"), std::string::npos) << r.err;
}

TEST(CfmoTrainCli, TheSummaryLineChecksOut) {
  // samples / seconds of training = samples/s, with the wall time beside them.
  const std::regex summary(
      R"(: (\d+) steps, (\d+) samples(?: \((\d+) in this run\))? in ([0-9.]+)s of training \(([0-9.]+)(k|M)? samples/s\), ([0-9.]+)s in all)");
  // Enough steps that the seconds of training, printed to 0.01 s, carry a few digits.
  for (const char* workers : {"1", "2"}) {
    const RunResult r = run({binary(), "--data", "synthetic:8192:128", "--model", "mlp:128", "--epochs", "1", "--quiet",
                             "--workers", workers});
    ASSERT_EQ(r.status, 0) << r.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, summary)) << r.out;
    const double samples = std::stod(m[3].matched ? m[3].str() : m[2].str());
    const double train_s = std::stod(m[4]);
    const double rate = std::stod(m[5]) * (m[6] == "k" ? 1e3 : m[6] == "M" ? 1e6 : 1);
    const double wall_s = std::stod(m[7]);
    EXPECT_LE(train_s, wall_s + 0.01) << r.out;
    // The printed figures are rounded (seconds to 0.01, the rate to 3-4 digits).
    if (train_s >= 0.05) {
      EXPECT_NEAR(samples / train_s, rate, rate * (0.005 + 0.0051 / train_s)) << r.out;
    }
  }
}

TEST(CfmoTrainCli, BadMixtureOfExpertsSpecsAndFlagsAreOneLineUsageErrors) {
  const std::string gpt = "gpt:layers=2,heads=2,dim=16,context=16";
  expect_one_line_error(run(quick_args({"--model", gpt + ",experts=2,top_k=3"})), 2, "top_k 3 is more than experts 2");
  expect_one_line_error(run(quick_args({"--model", gpt + ",experts=4,expert_dim=0"})), 2, "expert_dim");
  expect_one_line_error(run(quick_args({"--model", gpt + ",top_k=2"})), 2, "needs experts=E");
  expect_one_line_error(run(quick_args({"--model", gpt + ",experts=4,moe_every=3"})), 2, "moe_every 3");
  expect_one_line_error(run(quick_args({"--drop-policy", "drop"})), 2, "--drop-policy");
  expect_one_line_error(run(quick_args({"--capacity-factor", "0"})), 2, "--capacity-factor");
  expect_one_line_error(run(quick_args({"--aux-loss", "-1"})), 2, "--aux-loss");
  expect_one_line_error(run(quick_args({"--z-loss", "-0.5"})), 2, "--z-loss");
}

TEST(CfmoTrainCli, SampleEveryPrintsALanguageModelsTextOnOneLine) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox\njumps over the lazy dog\n";
  ASSERT_TRUE(write_file_atomic(dir / "corpus.txt", text));
  const std::vector<std::string> gpt = {binary(),
                                        "--data",
                                        "text:" + (dir / "corpus.txt").string(),
                                        "--model",
                                        "gpt:layers=1,heads=2,dim=16,context=16",
                                        "--steps",
                                        "4",
                                        "--epochs",
                                        "0",
                                        "--sample-every",
                                        "2"};
  const RunResult r = run(gpt);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("step 2 sample: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step 4 sample: "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 3 sample: "), std::string::npos) << r.err;
  // One line each, its 64 bytes at least (a sampled newline shows as \\n), no control byte in it.
  const auto at = r.err.find("step 2 sample: ");
  const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
  EXPECT_GE(line.size(), std::string("step 2 sample: ").size() + 64) << line;
  EXPECT_TRUE(std::none_of(line.begin(), line.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20; }));

  // Not a language model: one note, no samples, and the run goes on.
  const RunResult mlp =
      run({binary(), "--data", "synthetic:512:128", "--model", "mlp:32", "--epochs", "1", "--sample-every", "2"});
  ASSERT_EQ(mlp.status, 0) << mlp.err;
  EXPECT_NE(mlp.err.find("--sample-every: mlp:32 is not a language model"), std::string::npos) << mlp.err;
  expect_one_line_error(run(quick_args({"--sample-every", "-1"})), 2, "--sample-every");
}

}  // namespace
}  // namespace cfmo
