// Faults injected into real runs through the local launcher (issue 19): a
// rank killed (SIGKILL), stopped (SIGSTOP), or cut off from its files (a
// file-size limit put on it mid-run: its next write fails, as on a full
// disk), in every mode of cfmo-train and in cfmo-moe. Every time the contract
// is checked: the documented exit status, a line naming the rank and the
// cause, no process left behind, no UCX shared memory left behind, no torn
// file, and a checkpoint that resumes.
//
// Repro.*: the reproductions of issue 19, one each (suite integration).
// FaultInjection.*: the seeded random campaign (suite slow);
// CFMO_FAULT_SEED and CFMO_FAULT_ROUNDS choose its seed and its length;
// CFMO_FAULT_ONLY (e.g. "asgd,cfmo cut") runs only the named modes or
// mode-fault pairs, with the same draws as the whole campaign.
#include "integration/harness.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>

namespace cfmo {
namespace {

using testing::RunResult;
using testing::slurp;
using testing::TempDir;
namespace fs = std::filesystem;

std::string train_binary() { return testing::env_or("CFMO_TRAIN", "build/tools/cfmo-train"); }
std::string moe_binary() { return testing::env_or("CFMO_MOE", "build/tools/cfmo-moe"); }

/// The launcher's ranks that have started (exec'd, so RANK is in their
/// environment), by rank.
std::map<int, pid_t> ranks_of(pid_t launcher) {
  std::map<int, pid_t> out;
  std::ifstream children(fmt::format("/proc/{}/task/{}/children", launcher, launcher));
  for (pid_t child = 0; children >> child;) {
    const std::string env = slurp(fmt::format("/proc/{}/environ", child));
    const std::string key("\0RANK=", 6);
    const size_t at = env.rfind(key);  // never the first entry: the launcher set it last
    if (at != std::string::npos) out[std::atoi(env.c_str() + at + key.size())] = child;
  }
  return out;
}

/// A process that exists and is not a zombie.
bool alive(pid_t pid) {
  const std::string stat = slurp(fmt::format("/proc/{}/stat", pid));
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

size_t file_size_or_zero(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  return ec ? 0 : static_cast<size_t>(size);
}

enum class Fault { kKill, kStop, kCut };
const char* name_of(Fault f) { return f == Fault::kKill ? "kill" : f == Fault::kStop ? "stop" : "cut"; }

struct Injection {
  Fault fault = Fault::kKill;
  int rank = 0;
  double delay_s = 0;  ///< after the rank showed progress
  fs::path progress;   ///< a file of the rank's that grows while it trains (empty: its start counts)
};

struct Outcome {
  RunResult result;
  pid_t launcher = -1;
  std::map<int, pid_t> ranks;  ///< every rank seen during the run
  bool injected = false;
};

/// Runs the launcher with `args`, injecting the fault once the rank shows
/// progress and `delay_s` more passed. Whatever is left of the run is killed
/// at the end, so a failing test leaves nothing behind either.
Outcome run_with_fault(const std::vector<std::string>& args, const Injection& f, double timeout_s = 120) {
  Outcome o;
  std::optional<double> ready_at;
  o.result = testing::run(args, timeout_s, {}, [&](pid_t launcher, double elapsed) {
    o.launcher = launcher;
    for (const auto& [rank, pid] : ranks_of(launcher)) o.ranks.emplace(rank, pid);
    if (o.injected || o.ranks.count(f.rank) == 0) return;
    if (!ready_at && (f.progress.empty() || file_size_or_zero(f.progress) > 0)) ready_at = elapsed;
    if (!ready_at || elapsed - *ready_at < f.delay_s) return;
    const pid_t pid = o.ranks[f.rank];
    o.injected = true;
    if (f.fault == Fault::kKill) {
      ::kill(pid, SIGKILL);
    } else if (f.fault == Fault::kStop) {
      ::kill(pid, SIGSTOP);
    } else {
      // No larger than the file is now: its next write fails whole (a
      // limit above its end would let a write through in part).
      const auto size = static_cast<rlim_t>(file_size_or_zero(f.progress));
      const rlimit limit{size, size};
      ::prlimit(pid, RLIMIT_FSIZE, &limit, nullptr);
    }
  });
  for (const auto& [rank, pid] : o.ranks) {
    if (alive(pid)) {
      ADD_FAILURE() << "rank " << rank << " (pid " << pid << ") outlived the launcher";
      ::kill(pid, SIGKILL);
    }
  }
  return o;
}

bool has_line(const std::string& text, const std::string& prefix, const std::string& needle = "") {
  for (const auto& line : testing::lines(text)) {
    if (line.starts_with(prefix) && line.find(needle) != std::string::npos) return true;
  }
  return false;
}

/// What every faulted run must satisfy, whatever the mode.
void expect_contract(const Outcome& o, const Injection& f, int status, const fs::path& run_dir) {
  const RunResult& r = o.result;
  SCOPED_TRACE(fmt::format("{} rank {} after {:.2f}s", name_of(f.fault), f.rank, f.delay_s));
  EXPECT_TRUE(o.injected) << r.err;
  EXPECT_FALSE(r.timed_out) << r.err;
  EXPECT_EQ(r.status, status) << r.err;
  const std::string rank = std::to_string(f.rank);
  if (f.fault == Fault::kKill) {
    EXPECT_TRUE(has_line(r.err, "[launcher] rank " + rank + " was killed by signal 9")) << r.err;
  } else if (f.fault == Fault::kStop) {
    EXPECT_TRUE(has_line(r.err, "[launcher] rank " + rank + " was stopped")) << r.err;
  } else {
    EXPECT_TRUE(has_line(r.err, "[rank " + rank + "] cfmo-train: ")) << r.err;
  }
  EXPECT_EQ(r.err.find("Assertion"), std::string::npos) << r.err;  // UCX's aborts
  // UCX's shared memory of the run went with it.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    EXPECT_FALSE(e.path().filename().string().starts_with(fmt::format("cfmo-ucx-{}-", o.launcher))) << e.path();
  }
  if (run_dir.empty()) return;
  // Every line of every metrics file is whole.
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("metrics")) continue;
    for (const auto& line : testing::lines(slurp(e.path()))) {
      EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded()) << name << ": " << line;
    }
  }
}

/// A run directory's latest checkpoint resumes: a short run from it succeeds.
void expect_resumes(const fs::path& run_dir) {
  if (!fs::exists(run_dir / "checkpoints" / "latest")) return;  // the fault came before the first one
  const RunResult r =
      testing::run({train_binary(), "--resume", run_dir.string(), "--time-limit", "1s", "--quiet"}, 120);
  EXPECT_EQ(r.status, 0) << r.err;
}

std::vector<std::string> train_args(const std::string& mode, const fs::path& run_dir, double time_limit_s,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> out = {train_binary(),
                                  "--data",
                                  "synthetic:2048:256",
                                  "--model",
                                  "mlp:32",
                                  "--quiet",
                                  "--workers",
                                  "3",
                                  "--mode",
                                  mode,
                                  "--peer-timeout",
                                  "2",
                                  "--epochs",
                                  "0",
                                  "--time-limit",
                                  fmt::format("{}s", time_limit_s),
                                  "--log-every",
                                  "1",
                                  "--checkpoint-every",
                                  "20",
                                  "--out",
                                  run_dir.string()};
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

fs::path metrics_of(const fs::path& run_dir, int rank) {
  return run_dir / (rank == 0 ? std::string("metrics.jsonl") : fmt::format("metrics-rank-{}.jsonl", rank));
}

std::vector<std::string> moe_args(std::vector<std::string> extra) {
  std::vector<std::string> out = {
      moe_binary(), "--tokens", "64",      "--hidden", "32",      "--ffn",   "48", "--experts",      "6",
      "--warmup",   "2",        "--iters", "1000000",  "--quiet", "--ranks", "3",  "--peer-timeout", "2"};
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

// ---- The reproductions of issue 19 ----

// Item 1: UCX aborted (SIGABRT in ucp_worker_destroy) in 3 of 7 diverged
// asgd runs and the launcher exited 4. A diverged run exits 1, every time.
TEST(Repro, ADivergedRunExitsOneInEveryModeEveryTime) {
  for (const char* mode : {"asgd", "asgd", "asgd", "sync", "localsgd", "cfmo"}) {
    SCOPED_TRACE(mode);
    const RunResult r = testing::run({train_binary(), "--data", "synthetic:8192:512", "--lr", "1e30", "--workers", "3",
                                      "--mode", mode, "--epochs", "2", "--quiet", "--peer-timeout", "5"},
                                     120);
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE(r.err.find("training diverged"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("killed by signal"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("Assertion"), std::string::npos) << r.err;
  }
}

// Item 5: a rank that cannot open its metrics file made the run exit 4
// ("barrier: rank 2 left the run"); the root cause's status is 5.
TEST(Repro, ARanksWriteFailureIsTheRunsStatusWithItsOwnMessage) {
  for (const char* mode : {"sync", "cfmo", "asgd"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    fs::create_directories(dir / "run" / "metrics-rank-2.jsonl");  // a directory: cannot be opened for writing
    const RunResult r = testing::run(train_args(mode, dir / "run", 30), 120);
    EXPECT_EQ(r.status, 5) << r.err;
    EXPECT_TRUE(has_line(r.err, "[rank 2] cfmo-train: ", "metrics-rank-2.jsonl")) << r.err;
    EXPECT_EQ(r.err.find("left the run"), std::string::npos) << r.err;
  }
}

// Item 2: a stopped rank was waited for forever by the launcher.
TEST(Repro, AStoppedRankIsEndedByTheLauncher) {
  for (const char* mode : {"sync", "cfmo"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    const Injection f{Fault::kStop, 2, 0.5, metrics_of(dir / "run", 2)};
    const Outcome o = run_with_fault(train_args(mode, dir / "run", 8), f);
    expect_contract(o, f, 4, dir / "run");
  }
  const Injection f{Fault::kStop, 2, 1.0, {}};
  const Outcome o = run_with_fault(moe_args({"--mode", "async"}), f);
  expect_contract(o, f, 4, {});
}

// Item 8: in cfmo a lost peer went unannounced, and the summary left out
// what it had trained.
TEST(Repro, CfmoSurvivorsAnnounceALostPeerAndCountItsSamples) {
  TempDir dir;
  // Rank 2 is stopped once it has taken 60 steps: six reconciliations at
  // --sync-interval 10 (after 30, its first round's delta was once still
  // unsent on a loaded machine: nothing of it counted).
  const fs::path metrics = metrics_of(dir / "run", 2);
  Outcome o;
  o.result = testing::run(train_args("cfmo", dir / "run", 8, {"--json"}), 120, {}, [&](pid_t launcher, double) {
    o.launcher = launcher;
    for (const auto& [rank, pid] : ranks_of(launcher)) o.ranks.emplace(rank, pid);
    if (o.injected || o.ranks.count(2) == 0 || testing::lines(slurp(metrics)).size() < 60) return;
    o.injected = true;
    ::kill(o.ranks[2], SIGSTOP);
  });
  ASSERT_TRUE(o.injected) << o.result.err;
  EXPECT_EQ(o.result.status, 4) << o.result.err;
  for (const char* survivor : {"[rank 0] ", "[rank 1] "}) {
    EXPECT_TRUE(has_line(o.result.err, survivor, "rank 2 lost (no message for")) << o.result.err;
  }
  nlohmann::json summary;
  for (const auto& line : testing::lines(o.result.out)) {
    if (line.starts_with("{")) summary = nlohmann::json::parse(line);
  }
  ASSERT_TRUE(summary.is_object()) << o.result.out;
  int64_t reported = 0;
  for (const auto& w : summary["per_worker"]) reported += w["samples"].get<int64_t>();
  EXPECT_EQ(summary["lost_ranks"], nlohmann::json::array({2}));
  // At least its first reconciliation's 10 steps: the stop lands after its
  // 60th metrics line, but on a loaded machine its progress thread may not
  // have sent the later rounds' deltas by then (seen in CI: 10 steps counted).
  EXPECT_GE(summary["samples"].get<int64_t>(), reported + 10 * 64) << summary.dump();
}

// ---- The seeded campaign ----

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

/// Whether CFMO_FAULT_ONLY (comma-separated modes or "mode fault" pairs; unset: all) names this case.
bool selected(const std::string& mode, Fault fault) {
  const char* only = std::getenv("CFMO_FAULT_ONLY");
  if (only == nullptr || *only == '\0') return true;
  std::istringstream in(only);
  for (std::string item; std::getline(in, item, ',');) {
    if (item == mode || item == mode + " " + name_of(fault)) return true;
  }
  return false;
}

TEST(FaultInjection, EveryModeKeepsTheContractUnderKillsStopsAndCuts) {
  std::mt19937 rng(static_cast<uint32_t>(env_int("CFMO_FAULT_SEED", 19)));
  const int rounds = env_int("CFMO_FAULT_ROUNDS", 1);
  std::map<std::string, int> outcomes;
  int runs = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < rounds; ++round) {
    for (const char* mode : {"sync", "localsgd", "cfmo", "asgd", "moe"}) {
      const bool moe = std::string(mode) == "moe";
      for (const Fault fault : {Fault::kKill, Fault::kStop, Fault::kCut}) {
        if (moe && fault == Fault::kCut) continue;  // cfmo-moe writes no file to cut
        TempDir dir;
        Injection f;
        f.fault = fault;
        f.rank = std::uniform_int_distribution<int>(0, 2)(rng);
        f.delay_s = std::uniform_real_distribution<double>(0.0, 1.5)(rng);
        const bool moe_async = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
        if (!moe) f.progress = metrics_of(dir / "run", f.rank);
        // cfmo-moe shows no progress: 2.5 s after its start a rank is past the
        // rendezvous, which waits 60 s for a rank stopped in it, not --peer-timeout.
        if (moe) f.delay_s += 2.5;
        if (!selected(mode, fault)) continue;  // after the draws: a case runs as in the whole campaign
        SCOPED_TRACE(fmt::format("round {} {}{} {} rank {} after {:.2f}s", round, mode,
                                 moe ? (moe_async ? " async" : " sync") : "", name_of(fault), f.rank, f.delay_s));
        const auto run_start = std::chrono::steady_clock::now();
        const Outcome o = run_with_fault(
            moe ? moe_args({"--mode", moe_async ? "async" : "sync"}) : train_args(mode, dir / "run", 7), f);
        ++runs;
        // A rank killed or stopped is a peer failure (4); a write that fails is the rank's own (5).
        expect_contract(o, f, fault == Fault::kCut ? 5 : 4, moe ? fs::path() : dir / "run");
        const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
        const bool resumable = !moe && fs::exists(dir / "run" / "checkpoints" / "latest");
        if (resumable) expect_resumes(dir / "run");
        std::printf("%s: exit %d after %.1f s%s\n",
                    fmt::format("{}{} {} rank {} at +{:.2f}s", mode, moe ? (moe_async ? " async" : " sync") : "",
                                name_of(fault), f.rank, f.delay_s)
                        .c_str(),
                    o.result.status, run_s, resumable ? ", its checkpoint resumed" : "");
        ++outcomes[fmt::format("{} {} -> {}", mode, name_of(fault), o.result.status)];
      }
    }
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string table;
  for (const auto& [what, n] : outcomes) table += fmt::format("  {}: {}\n", what, n);
  std::printf("fault injection: %d runs, %d faults in %.0f s\n%s", runs, runs, took, table.c_str());
}

}  // namespace
}  // namespace cfmo
