// Several cfmo-train workers for real: the local launcher, the four modes,
// sync's equivalence with one worker on the doubled batch, a slow worker in
// cfmo, and a worker killed with SIGKILL in the middle of a run.
#include "integration/harness.h"
#include "integration/one_line_error.h"

#include "ckpt/cfd.h"
#include "ckpt/safetensors.h"
#include "comm/rendezvous.h"
#include "core/atomic_file.h"
#include "core/fd.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <sstream>
#include <thread>

namespace cfmo {
namespace {

using testing::Background;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;
namespace fs = std::filesystem;

std::string binary() { return testing::env_or("CFMO_TRAIN", "build/tools/cfmo-train"); }

std::vector<std::string> args(std::vector<std::string> extra) {
  std::vector<std::string> out = {binary(), "--data",  "synthetic:2048:256", "--model",
                                  "mlp:32", "--quiet", "--peer-timeout",     "5"};
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

nlohmann::json last_json(const std::string& out) {
  std::istringstream in(out);
  nlohmann::json j;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.front() == '{') j = nlohmann::json::parse(line);
  }
  return j;
}

std::vector<float> parameters(const fs::path& file) {
  auto st = ckpt::SafetensorsFile::read(file);
  EXPECT_TRUE(st) << (st ? "" : st.error().message);
  std::vector<float> all;
  if (!st) return all;
  for (const auto& e : st->tensors()) {
    auto bytes = st->bytes(e);
    const auto* f = reinterpret_cast<const float*>(bytes.data());
    all.insert(all.end(), f, f + bytes.size() / sizeof(float));
  }
  return all;
}

TEST(CfmoTrainWorkers, EveryModeTrainsWithTwoWorkersAndReports) {
  for (const char* mode : {"sync", "localsgd", "cfmo", "asgd"}) {
    SCOPED_TRACE(mode);
    // asgd with a tight staleness bound: unbounded, it is the unstable baseline the article describes.
    const std::string bound = std::string(mode) == "asgd" ? "1" : "4";
    const RunResult r =
        run(args({"--workers", "2", "--mode", mode, "--epochs", "3", "--max-staleness", bound, "--json"}), 300);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = last_json(r.out);
    ASSERT_FALSE(j.is_null()) << r.out;
    EXPECT_EQ(j["mode"], mode);
    EXPECT_EQ(j["workers"], 2);
    EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << r.out;  // chance is 0.1
    EXPECT_GT(j["efficiency"].get<double>(), 0.0);
    EXPECT_GE(j["samples"].get<int64_t>(), 3 * 2048 - 2 * 64 * 10);
    ASSERT_EQ(j["per_worker"].size(), 2u);
    for (const auto& w : j["per_worker"]) {
      for (const char* key : {"rank", "steps", "samples_per_s", "wait_s", "bytes_sent", "bytes_received",
                              "contributions_dropped", "staleness_histogram"}) {
        EXPECT_TRUE(w.contains(key)) << key;
      }
      EXPECT_GT(w["bytes_sent"].get<uint64_t>(), 0u);
    }
    EXPECT_TRUE(j["lost_ranks"].empty());
  }
}

TEST(CfmoTrainWorkers, FewerOwnersThanWorkersServeEveryShardAndTheOthersNone) {
  // --owners K < W: ranks K and up own no shard, and every contribution still
  // reaches an owner once; the model trains as with an owner per worker.
  for (const auto& [mode, owners] : {std::pair{"cfmo", 2}, std::pair{"asgd", 1}}) {
    // asgd with a tight staleness bound, as above.
    const std::string bound = std::string(mode) == "asgd" ? "1" : "4";
    const RunResult r = run(args({"--workers", "3", "--mode", mode, "--owners", std::to_string(owners), "--epochs", "3",
                                  "--sync-interval", "3", "--max-staleness", bound, "--json"}),
                            300);
    ASSERT_EQ(r.status, 0) << mode << ": " << r.err;
    const auto j = last_json(r.out);
    EXPECT_EQ(j["settings"]["owners"], owners) << mode;
    int64_t sent = 0;
    uint64_t received = 0;
    uint64_t applied = 0;
    uint64_t dropped = 0;
    for (const auto& w : j["per_worker"]) {
      const int rank = w["rank"].get<int>();
      if (rank >= owners) {
        EXPECT_EQ(w["contributions_received"].get<uint64_t>(), 0u) << mode << " rank " << rank;
      }
      sent += w["contributions_sent"].get<int64_t>();
      received += w["contributions_received"].get<uint64_t>();
      applied += w["contributions_applied"].get<uint64_t>();
      dropped += w["contributions_dropped"].get<uint64_t>();
    }
    EXPECT_GT(sent, 0) << mode;
    EXPECT_EQ(static_cast<uint64_t>(sent), received) << mode;
    EXPECT_EQ(received, applied + dropped) << mode;
    EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << mode;
  }
}

TEST(CfmoTrainWorkers, CfmoAppliesEveryContributionExactlyOnce) {
  // Three workers, lossy wire format, one slowed: every shard sent reaches its
  // owner once (applied or, past max_staleness, dropped and counted).
  const RunResult r = run(args({"--workers", "3", "--mode", "cfmo", "--epochs", "2", "--sync-interval", "3",
                                "--delta-dtype", "int8", "--slowdown", "2=3", "--json"}),
                          300);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = last_json(r.out);
  int64_t sent = 0;
  uint64_t received = 0;
  uint64_t applied = 0;
  uint64_t dropped = 0;
  for (const auto& w : j["per_worker"]) {
    sent += w["contributions_sent"].get<int64_t>();
    received += w["contributions_received"].get<uint64_t>();
    applied += w["contributions_applied"].get<uint64_t>();
    dropped += w["contributions_dropped"].get<uint64_t>();
  }
  EXPECT_GT(sent, 0);
  EXPECT_EQ(static_cast<uint64_t>(sent), received);
  EXPECT_EQ(received, applied + dropped);
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4);
}

TEST(CfmoTrainWorkers, ReconcilingModesWriteEachRanksDeltasForCfmoDiverge) {
  for (const char* mode : {"localsgd", "cfmo"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    const RunResult r =
        run(args({"--workers", "2", "--mode", mode, "--epochs", "2", "--json", "--out", (dir / "run").string()}), 300);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = last_json(r.out);
    for (int rank : {0, 1}) {
      const fs::path deltas = dir / "run" / "deltas" / ("rank-" + std::to_string(rank));
      ASSERT_TRUE(fs::is_directory(deltas));
      int files = 0;
      for (const auto& e : fs::directory_iterator(deltas)) {
        ++files;
        auto cfd = ckpt::CfdFile::open(e.path());
        ASSERT_TRUE(cfd) << cfd.error().message;
        EXPECT_EQ(cfd->info().rank, rank);
        EXPECT_GT(cfd->info().round, 0);
        EXPECT_EQ(cfd->tensors().size(), 4u);
      }
      EXPECT_GT(files, 0);
      EXPECT_EQ(files, j["per_worker"][static_cast<size_t>(rank)]["deltas_written"].get<int>());
    }
    // cfmo-diverge reads the run directory the trainer wrote.
    const std::string diverge = testing::env_or("CFMO_DIVERGE", "build/tools/cfmo-diverge");
    const RunResult report = run({diverge, "report", (dir / "run").string(), "--format", "json"}, 120);
    ASSERT_EQ(report.status, 0) << report.err;
    EXPECT_NE(report.out.find("\"rank\""), std::string::npos) << report.out.substr(0, 400);
    const RunResult check = run({diverge, "check", (dir / "run").string(), "--max-rel-l2", "1000%"}, 120);
    EXPECT_EQ(check.status, 0) << check.out << check.err;
  }
}

TEST(CfmoTrainWorkers, SyncWithTwoWorkersMatchesOneWorkerOnTheDoubledBatch) {
  TempDir dir;
  ASSERT_EQ(run(args({"--workers", "2", "--mode", "sync", "--batch-size", "32", "--steps", "40", "--out",
                      (dir / "two").string()}),
                300)
                .status,
            0);
  ASSERT_EQ(run(args({"--batch-size", "64", "--steps", "40", "--out", (dir / "one").string()}), 300).status, 0);
  const auto two = parameters(dir / "two" / "model.safetensors");
  const auto one = parameters(dir / "one" / "model.safetensors");
  ASSERT_EQ(two.size(), one.size());
  ASSERT_FALSE(one.empty());
  double worst = 0;
  for (size_t i = 0; i < one.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(two[i] - one[i])));
  // Only the order of float additions differs (the ring sums per-worker gradients).
  EXPECT_LT(worst, 1e-4);
  // Rank 1 keeps its own metrics beside rank 0's.
  EXPECT_TRUE(fs::exists(dir / "two" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir / "two" / "metrics-rank-1.jsonl"));
}

TEST(CfmoTrainWorkers, CfmoWithAVerySlowWorkerFinishesAndTheFastOneNeverWaits) {
  const RunResult r =
      run(args({"--workers", "2", "--mode", "cfmo", "--epochs", "2", "--slowdown", "1=5", "--json"}), 300);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = last_json(r.out);
  ASSERT_EQ(j["per_worker"].size(), 2u);
  const auto& fast = j["per_worker"][0];
  const auto& slow = j["per_worker"][1];
  EXPECT_EQ(fast["wait_s"].get<double>(), 0.0);  // cfmo has no blocking call in the loop
  EXPECT_EQ(slow["wait_s"].get<double>(), 0.0);
  // (Which worker took more steps depends on timing, including who started first: not asserted.)
  EXPECT_EQ(slow["slowdown"].get<double>(), 5.0);
  EXPECT_TRUE(j["simulation"]["simulated"].get<bool>());
}

struct Ranks {
  std::vector<Background> processes;
  ~Ranks() {
    for (auto& p : processes) p.reap();
  }
};

// Starts `world` ranks by hand, as an external launcher would.
Ranks start_ranks(const TempDir& dir, int world, const std::vector<std::string>& extra) {
  const std::string rendezvous = "CFMO_RENDEZVOUS=127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  for (int r = 0; r < world; ++r) {
    ranks.processes.push_back(
        testing::spawn(args(extra), {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), rendezvous},
                       (dir / ("out-" + std::to_string(r))).string(), (dir / ("err-" + std::to_string(r))).string()));
  }
  return ranks;
}

// Waits until a rank has logged a step, so the kill lands mid-run; false
// (at once) when any rank has already ended.
bool wait_for_progress(Ranks& ranks, const fs::path& metrics, double timeout_s) {
  return testing::wait_for_output(ranks.processes, metrics, timeout_s);
}

// Three lockstep ranks writing to DIR/run: rank 1 killed once it has logged
// a step; ranks 0 and 2 must exit 4 naming it.
void kill_rank_one_mid_run(Ranks& ranks, const TempDir& dir) {
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-1.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
  kill(ranks.processes[1].pid, SIGKILL);
  // Reaped at once, as a launcher does: UCX's shared-memory keepalive takes
  // an unreaped (zombie) process for a live one, and the others would only
  // find it by its silence, possibly after blaming a rank that waited on it.
  ASSERT_TRUE(ranks.processes[1].wait(10));
  for (int r : {0, 2}) {
    // Generous: the point is that it ends, with the right status and message.
    ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(60)) << "rank " << r << " hangs";
    EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 4) << slurp(dir / ("err-" + std::to_string(r)));
    EXPECT_NE(slurp(dir / ("err-" + std::to_string(r))).find("rank 1"), std::string::npos)
        << slurp(dir / ("err-" + std::to_string(r)));
  }
}

// Sync and localsgd without --elastic: a lost worker ends the run. (With
// --elastic they go on without it: below.)
TEST(CfmoTrainWorkers, LockstepWorkersExitFourNamingARankKilledMidRun) {
  for (const char* mode : {"sync", "localsgd"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    auto ranks = start_ranks(dir, 3,
                             {"--mode", mode, "--epochs", "0", "--time-limit", "5m", "--log-every", "1",
                              "--checkpoint-every", "5", "--out", (dir / "run").string()});
    kill_rank_one_mid_run(ranks, dir);
    // The checkpoint directory holds only whole checkpoints.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir / "run" / "checkpoints", ec)) {
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    }
  }
}

// The samples the workers' reports of a summary add up to.
int64_t reported_samples(const nlohmann::json& summary) {
  int64_t reported = 0;
  for (const auto& w : summary["per_worker"]) reported += w["samples"].get<int64_t>();
  return reported;
}

// The samples rank `rank` had trained (in a run not resumed) at the last
// step it logged in RUN's metrics that is a multiple of `every` (its last
// round's, where it reconciles every `every` steps); 0 if none. A line cut by
// a kill is skipped.
int64_t logged_samples_at_round(const fs::path& run, int rank, int every) {
  const fs::path file =
      run / (rank == 0 ? std::string("metrics.jsonl") : "metrics-rank-" + std::to_string(rank) + ".jsonl");
  int64_t samples = 0;
  for (const auto& line : testing::lines(slurp(file))) {
    const auto m = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (m.is_discarded() || m.value("type", "") != "step" || m["step"].get<int64_t>() % every != 0) continue;
    samples = m["samples"].get<int64_t>();
  }
  return samples;
}

// localsgd, and sync with --elastic: the workers left re-form their group
// without a worker killed mid-run (rank 0 too: the keeper moves), train on
// with W - 1 and exit 0. The summary counts the killed worker's samples up
// to its last completed sum (every step in sync, every H = 10 in localsgd)
// on top of the survivors' reports.
TEST(CfmoTrainWorkers, ElasticLockstepWorkersFinishWithoutARankKilledMidRun) {
  struct Case {
    std::vector<std::string> mode;
    int killed;
  };
  for (const Case& c : {Case{{"--mode", "sync", "--elastic", "--keep-global-batch"}, 1},
                        Case{{"--mode", "localsgd", "--elastic"}, 0}}) {
    SCOPED_TRACE(c.mode[1]);
    TempDir dir;
    std::vector<std::string> extra = c.mode;
    for (const char* a :
         {"--epochs", "0", "--time-limit", "6s", "--log-every", "1", "--checkpoint-every", "50", "--json", "--out"}) {
      extra.emplace_back(a);
    }
    extra.push_back((dir / "run").string());
    auto ranks = start_ranks(dir, 3, extra);
    ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-1.jsonl", 120))
        << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
    const int killed = c.killed;
    kill(ranks.processes[static_cast<size_t>(killed)].pid, SIGKILL);
    ASSERT_TRUE(ranks.processes[static_cast<size_t>(killed)].wait(10));  // reaped at once, as below
    const int keeper = killed == 0 ? 1 : 0;
    for (int r = 0; r < 3; ++r) {
      if (r == killed) continue;
      ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(60)) << "rank " << r << " hangs";
      const std::string err = slurp(dir / ("err-" + std::to_string(r)));
      EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 0) << err;
      EXPECT_NE(err.find("rank " + std::to_string(killed) + " lost ("), std::string::npos) << err;
    }
    const auto j = last_json(slurp(dir / ("out-" + std::to_string(keeper))));
    ASSERT_FALSE(j.is_null()) << slurp(dir / ("out-" + std::to_string(keeper)));
    EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({killed}));
    EXPECT_EQ(j["per_worker"].size(), 2u);
    EXPECT_EQ(j["stopped_by"], "time-limit");
    EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
    const int64_t lost_samples = logged_samples_at_round(dir / "run", killed, c.mode[1] == "sync" ? 1 : 10);
    // The killed leader logs its round once its sum is sent, which the kill
    // may stop short of the members: then that round was never made (the
    // survivors re-formed without it) and its samples are rightly not counted.
    const int64_t sum_in_flight = killed == 0 && c.mode[1] == "localsgd" ? 10 * 64 : 0;
    EXPECT_GE(j["samples"].get<int64_t>(), reported_samples(j) + lost_samples - sum_in_flight) << j.dump();
    if (c.mode[1] == "sync") {
      EXPECT_GT(lost_samples, 0);  // it had logged a step, each one a sum
      EXPECT_GT(j["samples"].get<int64_t>(), reported_samples(j)) << j.dump();
    }
  }
}

TEST(CfmoTrainWorkers, CfmoWorkersFinishWithoutARankKilledMidRun) {
  TempDir dir;
  auto ranks = start_ranks(
      dir, 3, {"--mode", "cfmo", "--epochs", "300", "--log-every", "1", "--json", "--out", (dir / "run").string()});
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-2.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
  kill(ranks.processes[2].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[2].wait(10));  // reaped at once, as above
  for (int r : {0, 1}) {
    ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(240)) << "rank " << r << " hangs";
    EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 0) << slurp(dir / ("err-" + std::to_string(r)));
  }
  const auto j = last_json(slurp(dir / "out-0"));
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({2}));
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  // The lost owner's shard moved to its backup, the next live rank: every survivor says so.
  for (int r : {0, 1}) {
    EXPECT_NE(slurp(dir / ("err-" + std::to_string(r))).find("rank 2 lost ("), std::string::npos);
    EXPECT_NE(slurp(dir / ("err-" + std::to_string(r))).find("; its shard is now served by rank 0"), std::string::npos)
        << slurp(dir / ("err-" + std::to_string(r)));
  }
  ASSERT_EQ(j["lost"].size(), 1u) << j.dump();
  EXPECT_EQ(j["lost"][0]["rank"], 2);
  EXPECT_EQ(j["lost"][0]["served_by"], 0);
}

// Rank 0 is not special: killed mid-run, it takes neither its shard nor the
// run with it. Its backup (rank 1) serves the shard, and, as the lowest live
// rank, keeps the budget, writes the summary and the final model.
TEST(CfmoTrainWorkers, CfmoWorkersFinishWithoutRankZeroAndTheNextRankKeepsTheRun) {
  TempDir dir;
  auto ranks = start_ranks(dir, 3,
                           {"--mode", "cfmo", "--epochs", "300", "--log-every", "1", "--checkpoint-every", "200",
                            "--json", "--out", (dir / "run").string()});
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
  kill(ranks.processes[0].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[0].wait(10));  // reaped at once, as above
  for (int r : {1, 2}) {
    ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(240)) << "rank " << r << " hangs";
    const std::string err = slurp(dir / ("err-" + std::to_string(r)));
    EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 0) << err;
    EXPECT_NE(err.find("rank 0 lost ("), std::string::npos) << err;
    EXPECT_NE(err.find("; its shard is now served by rank 1"), std::string::npos) << err;
  }
  const auto j = last_json(slurp(dir / "out-1"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-1");
  EXPECT_TRUE(last_json(slurp(dir / "out-2")).is_null());  // one summary, the keeper's
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({0}));
  ASSERT_EQ(j["lost"].size(), 1u) << j.dump();
  EXPECT_EQ(j["lost"][0]["served_by"], 1);
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  // The membership change is a line of the new keeper's metrics.
  bool membership = false;
  for (const auto& line : testing::lines(slurp(dir / "run" / "metrics-rank-1.jsonl"))) {
    const auto m = nlohmann::json::parse(line);
    if (m["type"] == "membership") membership = m["event"] == "lost" && m["lost_rank"] == 0 && m["served_by"] == 1;
  }
  EXPECT_TRUE(membership);
}

// Waits until `file` holds `text` (a process wrote a membership line); false
// at once when one of `processes` ends first, or after `timeout_s`.
bool wait_for_text(std::vector<Background>& processes, const fs::path& file, const std::string& text,
                   double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < timeout_s) {
    if (slurp(file).find(text) != std::string::npos) return true;
    for (auto& p : processes) {
      if (p.status < 0 && p.wait(0)) return false;
    }
    usleep(20000);
  }
  return false;
}

// Three ranks started by hand at `address` (DIR/out-K, DIR/err-K); rank 2
// killed once it logged a step, reaped at once as a launcher does, and
// restarted with the same variables (DIR/out-2b, DIR/err-2b; processes[3])
// once `before_restart` (if any) returned.
void start_three_and_restart_rank_two(Ranks& ranks, const TempDir& dir, const std::string& address,
                                      const std::vector<std::string>& run_flags,
                                      const std::function<void()>& before_restart = {}) {
  auto rank_env = [&](int r) {
    return std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address};
  };
  for (int r = 0; r < 3; ++r) {
    ranks.processes.push_back(testing::spawn(args(run_flags), rank_env(r),
                                             (dir / ("out-" + std::to_string(r))).string(),
                                             (dir / ("err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-2.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
  kill(ranks.processes[2].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[2].wait(10));
  if (before_restart) {
    ASSERT_NO_FATAL_FAILURE(before_restart());
  }
  ranks.processes.push_back(
      testing::spawn(args(run_flags), rank_env(2), (dir / "out-2b").string(), (dir / "err-2b").string()));
}

// The flags of a run whose rank 2 is restarted: `mode` (the mode's flags),
// a time limit, a JSON summary, metrics every step in DIR/run.
std::vector<std::string> rejoin_flags(std::vector<std::string> mode, const char* time_limit, const TempDir& dir) {
  for (const char* a : {"--epochs", "0", "--log-every", "1", "--json", "--time-limit"}) mode.emplace_back(a);
  mode.insert(mode.end(), {time_limit, "--out", (dir / "run").string()});
  return mode;
}

// After start_three_and_restart_rank_two: waits for ranks 0, 1 and the new
// rank 2 to succeed, and checks rank 0's summary lists the one join, with
// the joiner's first_step_s and report. Returns that summary (null on failure).
nlohmann::json summary_with_rank_two_rejoined(Ranks& ranks, const TempDir& dir) {
  for (const size_t p : {size_t{0}, size_t{1}, size_t{3}}) {
    EXPECT_TRUE(ranks.processes[p].wait(120)) << "process " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / "err-0") << slurp(dir / "err-2b");
  }
  const auto j = last_json(slurp(dir / "out-0"));
  EXPECT_FALSE(j.is_null()) << slurp(dir / "out-0");
  if (j.is_null() || j["joined"].size() != 1 || j["per_worker"].size() != 3) {
    ADD_FAILURE() << j.dump();
    return nullptr;
  }
  EXPECT_EQ(j["joined"][0]["rank"], 2);
  EXPECT_GT(j["joined"][0]["first_step_s"].get<double>(), 0.0);
  EXPECT_TRUE(j["per_worker"][2]["joined"].get<bool>());
  return j;
}

// The run's flags but another batch size, with --join `address`: refused
// before it is taken in (status 2, one line naming --batch-size).
void expect_join_with_another_batch_size_refused(std::vector<std::string> flags, const std::string& address) {
  flags.insert(flags.end(), {"--batch-size", "32", "--join", address});
  const RunResult refused = run(args(flags), 120);
  EXPECT_EQ(refused.status, 2) << refused.err;
  EXPECT_EQ(testing::lines(refused.err).size(), 1u) << refused.err;
  EXPECT_NE(refused.err.find("--batch-size"), std::string::npos) << refused.err;
}

// localsgd with --elastic: a worker killed mid-run and restarted with the
// same command is taken into the group at the end of a round (the global
// parameters before it, the outer momentum, the position) and every rank
// stops at the same step.
TEST(CfmoTrainWorkers, ElasticLocalSgdTakesAKilledWorkerBackAtARound) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(start_three_and_restart_rank_two(
      ranks, dir, address, rejoin_flags({"--mode", "localsgd", "--elastic"}, "12s", dir)));
  const auto j = summary_with_rank_two_rejoined(ranks, dir);
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["stopped_by"], "time-limit");
  // The killed process's samples up to its last round (if it took one) come on top of the reports.
  EXPECT_GE(j["samples"].get<int64_t>(), reported_samples(j)) << j.dump();
  EXPECT_NE(slurp(dir / "err-1").find("rank 2 joined"), std::string::npos) << slurp(dir / "err-1");
}

// sync with --elastic: a worker killed mid-run and restarted with the same
// command is taken in at a step (the leader's parameters and inner
// optimizer state after it), the group trains on with all three, and the
// summary counts the joiner's samples. A process whose flags differ is
// refused at once (status 2, one line naming the flag), the run untouched.
TEST(CfmoTrainWorkers, ElasticSyncTakesAKilledWorkerBackAtAStepAndRefusesAJoinWithOtherFlags) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const auto run_flags = rejoin_flags({"--mode", "sync", "--elastic"}, "15s", dir);
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(start_three_and_restart_rank_two(ranks, dir, address, run_flags));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "run" / "metrics-rank-2.jsonl", "\"event\":\"joined\"", 120))
      << slurp(dir / "err-2b") << slurp(dir / "err-0");
  expect_join_with_another_batch_size_refused(run_flags, address);
  const auto j = summary_with_rank_two_rejoined(ranks, dir);
  ASSERT_FALSE(j.is_null());
  EXPECT_GT(j["per_worker"][2]["samples"].get<int64_t>(), 0) << j.dump();
  // The killed process's samples up to its last sum come on top of the
  // reports: it had logged a step, and each step is a sum.
  EXPECT_GT(j["samples"].get<int64_t>(), reported_samples(j)) << j.dump();
  EXPECT_EQ(j["stopped_by"], "time-limit");
  // Every rank stopped at the same step, the joiner too: it was one of the group.
  EXPECT_EQ(j["per_worker"][2]["stopped_by"], "time-limit");
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_NE(slurp(dir / "err-1").find("rank 2 joined"), std::string::npos) << slurp(dir / "err-1");
}

// asgd: an owner killed mid-run and restarted with the same command serves
// its shard again, from the freshest copy the workers hold, takes the other
// owners' shards and trains; the run ends with every rank's status 0 and the
// samples of both processes in rank 2's place counted.
TEST(CfmoTrainWorkers, AsgdTakesAKilledOwnerBackWithTheFreshestCopyOfItsShard) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(
      start_three_and_restart_rank_two(ranks, dir, address, rejoin_flags({"--mode", "asgd"}, "15s", dir)));
  const auto j = summary_with_rank_two_rejoined(ranks, dir);
  ASSERT_FALSE(j.is_null());
  EXPECT_GT(j["per_worker"][2]["samples"].get<int64_t>(), 0) << j.dump();
  // The killed process's samples up to its last gradient come on top of the
  // reports (none, if it was killed before its first gradient was applied).
  EXPECT_GE(j["samples"].get<int64_t>(), reported_samples(j)) << j.dump();
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  EXPECT_NE(slurp(dir / "err-0").find("rank 2 joined (a new process in its place); it serves its shard again"),
            std::string::npos)
      << slurp(dir / "err-0");
  // The joiner's metrics say when its first step came.
  EXPECT_NE(slurp(dir / "run" / "metrics-rank-2.jsonl").find("\"first_step_s\""), std::string::npos);
}

// Join: a worker killed mid-run and restarted with the same command (its
// launcher's variables) rejoins; after another is killed, a new process
// with --join takes its place; one whose flags differ from the run's is
// refused (status 2, one line naming the flag) and the run goes on as it
// was. Every survivor says who joined, the keeper's summary lists both
// joins with the joiners' own time from their start to their first step,
// and the run ends with every rank's status 0.
TEST(CfmoTrainWorkers, CfmoKilledWorkersRejoinAndAJoinWithOtherFlagsIsRefused) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const std::vector<std::string> run_flags = {"--mode",      "cfmo", "--epochs", "0",     "--time-limit",        "40s",
                                              "--log-every", "1",    "--json",   "--out", (dir / "run").string()};
  // A time limit, not a budget of samples: two losses found after
  // --peer-timeout each and two joins must fit in the run however fast the
  // machine trains (1500 epochs could end before the first join).
  Ranks ranks;
  // Rank 2 restarted with the same command: it rejoins as rank 2.
  ASSERT_NO_FATAL_FAILURE(start_three_and_restart_rank_two(ranks, dir, address, run_flags));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "run" / "metrics-rank-2.jsonl", "\"event\":\"joined\"", 120))
      << slurp(dir / "err-2b") << slurp(dir / "err-0");
  kill(ranks.processes[1].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[1].wait(10));
  expect_join_with_another_batch_size_refused(run_flags, address);
  // Once rank 1's loss is known (a join with none lost would grow the world
  // instead), a new process with the run's flags takes rank 1's place.
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 1 lost (", 60)) << slurp(dir / "err-0");
  std::vector<std::string> joiner = run_flags;
  joiner.insert(joiner.end(), {"--join", address});
  ranks.processes.push_back(testing::spawn(args(joiner), {}, (dir / "out-1b").string(), (dir / "err-1b").string()));
  for (const size_t p : {size_t{0}, size_t{3}, size_t{4}}) {
    ASSERT_TRUE(ranks.processes[p].wait(240)) << "process " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / "err-0") << slurp(dir / "err-2b") << slurp(dir / "err-1b");
  }
  const auto j = last_json(slurp(dir / "out-0"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-0");
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array()) << j.dump();
  ASSERT_EQ(j["lost"].size(), 2u) << j.dump();
  ASSERT_EQ(j["joined"].size(), 2u) << j.dump();
  EXPECT_EQ(j["joined"][0]["rank"], 2);
  EXPECT_EQ(j["joined"][1]["rank"], 1);
  for (const auto& joined : j["joined"]) EXPECT_GT(joined["first_step_s"].get<double>(), 0.0) << j.dump();
  ASSERT_EQ(j["per_worker"].size(), 3u) << j.dump();
  EXPECT_TRUE(j["per_worker"][1]["joined"].get<bool>());
  EXPECT_TRUE(j["per_worker"][2]["joined"].get<bool>());
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  const std::string err = slurp(dir / "err-0");
  EXPECT_NE(err.find("rank 2 joined"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 1 joined"), std::string::npos) << err;
}

// A process that joins a run under way takes the run's clock from the ranks
// there: its --time-limit ends with theirs, not a whole limit after its own
// start (the keeper then waited at the end for the joiner's shard, and
// failed). Rank 2 restarted halfway through the limit: its loop ends by the
// run's limit, it stopped by the time limit, and every rank exits 0.
TEST(CfmoTrainWorkers, AJoinerStopsWithTheRunAtItsTimeLimit) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const double limit = 24;
  const auto started = std::chrono::steady_clock::now();
  auto since_start = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
  double restarted_at = 0;
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(
      start_three_and_restart_rank_two(ranks, dir, address, rejoin_flags({"--mode", "cfmo"}, "24s", dir), [&] {
        ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 2 lost (", 60)) << slurp(dir / "err-0");
        while (since_start() < limit / 2) usleep(100000);
        restarted_at = since_start();
        ASSERT_LT(restarted_at, limit - 6) << "the machine is too slow for this test's timing";
      }));
  const auto j = summary_with_rank_two_rejoined(ranks, dir);
  ASSERT_FALSE(j.is_null());
  const auto& joiner = j["per_worker"][2];
  EXPECT_EQ(joiner["stopped_by"], "time-limit") << j.dump();
  // Its own limit would have let it train about `limit` seconds; the run's
  // leaves it what remained after its restart (3 s for the ranks' start).
  EXPECT_LT(joiner["loop_s"].get<double>(), limit - restarted_at + 3) << j.dump();
  EXPECT_LT(j["wall_s"].get<double>(), limit + 15) << j.dump();
}

// Rank 0 killed: the lowest live rank leads, and serves joins at the
// rendezvous address itself (one host: it listens there once rank 0's
// process is gone), so a `--join` of the address the run started with
// takes a rank killed after rank 0 back, through rank 1; and rank 0
// restarted with its own command (it cannot listen there) joins as well.
TEST(CfmoTrainWorkers, AfterRankZeroIsLostTheNextRankServesJoinsAndRankZeroRestartedComesBack) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const std::vector<std::string> run_flags = {"--mode",      "cfmo", "--epochs", "0",     "--time-limit",        "40s",
                                              "--log-every", "1",    "--json",   "--out", (dir / "run").string()};
  Ranks ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.processes.push_back(
        testing::spawn(args(run_flags), {"RANK=" + std::to_string(r), "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address},
                       (dir / ("out-" + std::to_string(r))).string(), (dir / ("err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-2.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
  kill(ranks.processes[0].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[0].wait(10));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-1", "rank 1 serves joins at " + address, 60))
      << slurp(dir / "err-1");
  kill(ranks.processes[2].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[2].wait(10));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-1", "rank 2 lost (", 60)) << slurp(dir / "err-1");
  std::vector<std::string> joiner = run_flags;
  joiner.insert(joiner.end(), {"--join", address});
  ranks.processes.push_back(testing::spawn(args(joiner), {}, (dir / "out-2b").string(), (dir / "err-2b").string()));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-1", "rank 2 joined (", 60)) << slurp(dir / "err-1");
  // Rank 0 restarted with its own command: rank 1 serves joins at its
  // address, no rank above rank 1 is free, so it comes back as a new rank 3.
  ranks.processes.push_back(testing::spawn(args(run_flags), {"RANK=0", "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address},
                                           (dir / "out-0b").string(), (dir / "err-0b").string()));
  for (const size_t p : {size_t{1}, size_t{3}, size_t{4}}) {
    ASSERT_TRUE(ranks.processes[p].wait(240)) << "process " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / "err-1") << slurp(dir / "err-2b") << slurp(dir / "err-0b");
  }
  const auto j = last_json(slurp(dir / "out-1"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-1");
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({0})) << j.dump();
  ASSERT_EQ(j["joined"].size(), 2u) << j.dump();
  EXPECT_EQ(j["joined"][0]["rank"], 2);
  EXPECT_EQ(j["joined"][1]["rank"], 3);
  for (const auto& joined : j["joined"]) EXPECT_GT(joined["first_step_s"].get<double>(), 0.0) << j.dump();
  ASSERT_EQ(j["per_worker"].size(), 3u) << j.dump();
  for (size_t w = 1; w < 3; ++w) {
    EXPECT_TRUE(j["per_worker"][w]["joined"].get<bool>()) << j.dump();
    EXPECT_GT(j["per_worker"][w]["samples"].get<int64_t>(), 0) << j.dump();
  }
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
}

// The samples of the last step line in metrics text `text`: a process's
// position when killed (a line cut by the kill is skipped).
int64_t last_logged_samples(const std::string& text) {
  int64_t samples = 0;
  for (const auto& line : testing::lines(text)) {
    const auto m = nlohmann::json::parse(line, nullptr, false);
    if (m.is_object() && m["type"] == "step") samples = m["samples"].get<int64_t>();
  }
  return samples;
}

// The keeper's standby (rank 1) killed and restarted with the same command,
// then the keeper (rank 0) killed once `before_keeper_killed` returned: the
// restarted rank 1 keeps the run and writes the summary. It counts what the
// killed rank 1 trained before its restart (the old keeper's count, which the
// standby now gets) and what rank 0 trained up to its last round, on top of
// the live ranks' reports. Its summary used to leave the killed rank 1's
// samples out: a fresh standby knew nothing of the processes replaced before
// it stood by.
void expect_the_replaced_processs_samples_counted(
    const std::function<void(Ranks&, const TempDir&)>& before_keeper_killed, int slack_rounds = 20) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const auto run_flags = rejoin_flags({"--mode", "cfmo"}, "40s", dir);
  auto rank_env = [&](int r) {
    return std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address};
  };
  Ranks ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.processes.push_back(testing::spawn(args(run_flags), rank_env(r),
                                             (dir / ("out-" + std::to_string(r))).string(),
                                             (dir / ("err-" + std::to_string(r))).string()));
  }
  const fs::path metrics1 = dir / "run" / "metrics-rank-1.jsonl";
  // Far more samples than the slack below.
  ASSERT_TRUE(wait_for_text(ranks.processes, metrics1, "\"step\":3000,", 120)) << slurp(dir / "err-1");
  kill(ranks.processes[1].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[1].wait(10));
  // What the killed process logged (a joiner that gets no position from the
  // keeper continues from step 0 in the same file).
  const int64_t killed_one = last_logged_samples(slurp(metrics1));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 1 lost (", 60)) << slurp(dir / "err-0");
  ranks.processes.push_back(
      testing::spawn(args(run_flags), rank_env(1), (dir / "out-1b").string(), (dir / "err-1b").string()));
  ASSERT_NO_FATAL_FAILURE(before_keeper_killed(ranks, dir));
  kill(ranks.processes[0].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[0].wait(10));
  for (const size_t p : {size_t{2}, size_t{3}}) {
    ASSERT_TRUE(ranks.processes[p].wait(240)) << "process " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / "err-1b") << slurp(dir / "err-2");
  }
  const auto j = last_json(slurp(dir / "out-1b"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-1b") << slurp(dir / "err-1b");
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({0})) << j.dump();
  // The restarted keeper noticed no join itself (its own came before it):
  // the join comes with the old keeper's list, which it got as the standby.
  ASSERT_EQ(j["joined"].size(), 1u) << j.dump();
  EXPECT_EQ(j["joined"][0]["rank"], 1) << j.dump();
  EXPECT_GT(j["joined"][0]["first_step_s"].get<double>(), 0.0) << j.dump();
  const int64_t killed_zero = last_logged_samples(slurp(dir / "run" / "metrics.jsonl"));
  ASSERT_GE(killed_one, 3000 * 32);  // (an epoch of the synthetic data ends in a short batch)
  // A lost process counts up to its last round that reached an owner (H = 10
  // steps of 64; rounds wait while a shard's last delta is in flight, and
  // this tiny model steps fast): say at most `slack_rounds` short each, far less
  // than the killed rank 1 trained; and not more than it trained (give or
  // take the steps between its last report and its last metrics line).
  const int64_t slack = slack_rounds * 10 * 64;
  const int64_t counted = j["samples"].get<int64_t>();
  const std::string logged =
      "killed rank 1 logged " + std::to_string(killed_one) + ", rank 0 " + std::to_string(killed_zero) + "; ";
  EXPECT_GE(counted, reported_samples(j) + killed_one + killed_zero - 2 * slack) << logged << j.dump();
  EXPECT_LE(counted, reported_samples(j) + killed_one + killed_zero + 4 * 64) << logged << j.dump();
}

TEST(CfmoTrainWorkers, CfmoCountsAReplacedProcesssSamplesWhenTheKeeperIsLostAfterIt) {
  expect_the_replaced_processs_samples_counted([](Ranks& ranks, const TempDir& dir) {
    ASSERT_TRUE(wait_for_text(ranks.processes, dir / "run" / "metrics-rank-1.jsonl", "\"first_step_s\"", 120))
        << slurp(dir / "err-1b");
    // The keeper's counts reach its standby each second.
    sleep(3);
  });
}

// The same with the keeper killed as soon as it took the restarted rank 1
// in: the joiner keeps the run from its first step, with the counts the
// keeper or the standby the join displaced sent it (the loopback's
// CfmoJoin.AJoinerThatKeepsTheRunTakesUpTheCountsOfAKeeperLostAsItCame and
// CfmoJoin.AStandbyDisplacedByAJoinerHandsItsCountsOn check each way
// exactly). On 5df4eec it fails by whole processes (14226176 samples
// counted, at least 14565888 expected). Disabled: the loss and the join
// land together, and in about 1 run of 7 the ranks stopped at once with a
// status other than 0 (not yet diagnosed: maybe the quorum check, which
// sees two of three ranks gone at one look), and in 2 of 7 the count was a
// few rounds (3456 and 5440 samples) beyond the slack below.
TEST(CfmoTrainWorkers, DISABLED_CfmoCountsAReplacedProcesssSamplesWhenTheKeeperIsLostAsItTakesTheJoinerIn) {
  // (40 rounds of slack: the lost keeper's count comes through the standby
  // the join displaced, as of its last report there; still far less than a
  // whole process, which is what went missing.)
  expect_the_replaced_processs_samples_counted(
      [](Ranks& ranks, const TempDir& dir) {
        ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 1 joined (", 120)) << slurp(dir / "err-0");
      },
      40);
}

// A member killed while a restarted rank sets up (reads its data, asks to be
// taken in, takes its shard back): the joiner finds it lost as the
// survivors do, and says so, naming it, in the order of --peer-timeout (5 s
// here), not a timeout of its own. It used to be taken in before it read
// its data and to notice nothing until it was done; bench/RESULTS.md has
// the measured times (no timing is asserted here but a bound far above).
TEST(CfmoTrainWorkers, AMemberKilledWhileAJoinerSetsUpIsFoundLostByTheJoinerToo) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  std::chrono::steady_clock::time_point killed;
  ASSERT_NO_FATAL_FAILURE(
      start_three_and_restart_rank_two(ranks, dir, address, rejoin_flags({"--mode", "cfmo"}, "30s", dir), [&] {
        ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 2 lost (", 60)) << slurp(dir / "err-0");
      }));
  kill(ranks.processes[1].pid, SIGKILL);
  killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(ranks.processes[1].wait(10));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-2b", "rank 1 lost (", 60)) << slurp(dir / "err-2b");
  const double noticed = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("the joiner said rank 1 lost %.2f s after the kill\n", noticed);
  EXPECT_LT(noticed, 5 + 25.0) << slurp(dir / "err-2b");
  for (const size_t p : {size_t{0}, size_t{3}}) {
    ASSERT_TRUE(ranks.processes[p].wait(120)) << "process " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / "err-0") << slurp(dir / "err-2b");
  }
  const auto j = last_json(slurp(dir / "out-0"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-0");
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({1})) << j.dump();
  ASSERT_EQ(j["joined"].size(), 1u) << j.dump();
  EXPECT_EQ(j["joined"][0]["rank"], 2) << j.dump();
}

// Two ranks started by hand at `address` (DIR/out-K, DIR/err-K); once rank 1
// logged a step (no rank lost), `joiners` processes with --join started at
// once (DIR/out-jN, DIR/err-jN; processes[2...]).
void start_two_and_join(Ranks& ranks, const TempDir& dir, const std::string& address,
                        const std::vector<std::string>& run_flags, int joiners) {
  for (int r = 0; r < 2; ++r) {
    ranks.processes.push_back(
        testing::spawn(args(run_flags), {"RANK=" + std::to_string(r), "WORLD_SIZE=2", "CFMO_RENDEZVOUS=" + address},
                       (dir / ("out-" + std::to_string(r))).string(), (dir / ("err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-1.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-1");
  std::vector<std::string> joiner = run_flags;
  joiner.insert(joiner.end(), {"--join", address});
  for (int n = 0; n < joiners; ++n) {
    // (Built by appending: GCC 12 warns falsely (-Wrestrict) about "j" + std::to_string(n).)
    std::string name = "j";
    name += std::to_string(n);
    ranks.processes.push_back(
        testing::spawn(args(joiner), {}, (dir / ("out-" + name)).string(), (dir / ("err-" + name)).string()));
  }
}

// After start_two_and_join: every process ends with status 0, and rank 0's
// summary has the world grown by the joiners, each with a rank of its own
// (2, 3, ...), its report and its first step's time (printed), nobody lost.
nlohmann::json summary_of_grown_run(Ranks& ranks, const TempDir& dir, int joiners) {
  for (size_t p = 0; p < ranks.processes.size(); ++p) {
    EXPECT_TRUE(ranks.processes[p].wait(240)) << "process " << p << " hangs";
  }
  std::string errs;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    if (e.path().filename().string().starts_with("err-"))
      errs += e.path().filename().string() + ":\n" + slurp(e.path());
  }
  for (auto& p : ranks.processes) EXPECT_EQ(p.status, 0) << errs;
  const auto j = last_json(slurp(dir / "out-0"));
  const size_t world = 2 + static_cast<size_t>(joiners);
  if (j.is_null() || j["joined"].size() != static_cast<size_t>(joiners) || j["per_worker"].size() != world) {
    ADD_FAILURE() << j.dump() << errs;
    return nullptr;
  }
  EXPECT_EQ(j["workers"], world);
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array()) << j.dump();
  std::vector<int> joined;
  for (const auto& entry : j["joined"]) {
    joined.push_back(entry["rank"].get<int>());
    EXPECT_GT(entry["first_step_s"].get<double>(), 0.0) << j.dump();
    std::printf("rank %d joined; its first step %.2f s after its start\n", joined.back(),
                entry["first_step_s"].get<double>());
  }
  std::sort(joined.begin(), joined.end());
  for (int n = 0; n < joiners; ++n) EXPECT_EQ(joined[static_cast<size_t>(n)], 2 + n) << j.dump();
  for (size_t r = 2; r < world; ++r) {
    EXPECT_TRUE(j["per_worker"][r]["joined"].get<bool>()) << j.dump();
    EXPECT_GT(j["per_worker"][r]["samples"].get<int64_t>(), 0) << j.dump();
  }
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << j.dump();
  EXPECT_NE(slurp(dir / "err-0").find("rank 2 joined (a new rank: the world has 3 ranks now)"), std::string::npos)
      << slurp(dir / "err-0");
  return j;
}

// Join with no rank lost: a 2-worker cfmo run takes a process started with
// --join as a new rank 2 (the world grows to 3); it gets the global state,
// trains its share, and the run ends with three live ranks.
TEST(CfmoTrainWorkers, CfmoGrowsByAJoinerWhenNoRankIsLost) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(start_two_and_join(ranks, dir, address, rejoin_flags({"--mode", "cfmo"}, "25s", dir), 1));
  const auto j = summary_of_grown_run(ranks, dir, 1);
  ASSERT_FALSE(j.is_null());
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
  bool membership = false;
  for (const auto& line : testing::lines(slurp(dir / "run" / "metrics.jsonl"))) {
    const auto m = nlohmann::json::parse(line);
    if (m["type"] == "membership") membership = m["event"] == "joined" && m["joined_rank"] == 2;
  }
  EXPECT_TRUE(membership);
}

// Two joins at once, none lost: each process gets a rank of its own (2 and
// 3, never the same), in cfmo and in localsgd with --elastic, and the runs
// end with four live ranks.
TEST(CfmoTrainWorkers, TwoJoinsAtOnceGrowTheWorldByTwoInCfmoAndLocalSgd) {
  for (const auto& mode : {std::vector<std::string>{"--mode", "cfmo"},
                           std::vector<std::string>{"--mode", "localsgd", "--elastic", "--sync-interval", "5"}}) {
    SCOPED_TRACE(mode[1]);
    TempDir dir;
    const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
    Ranks ranks;
    ASSERT_NO_FATAL_FAILURE(start_two_and_join(ranks, dir, address, rejoin_flags(mode, "30s", dir), 2));
    const auto j = summary_of_grown_run(ranks, dir, 2);
    ASSERT_FALSE(j.is_null());
    if (mode[1] == "localsgd") {
      // One group: every rank stopped at the same step, the joiners too.
      for (const auto& w : j["per_worker"]) EXPECT_EQ(w["stopped_by"], "time-limit") << j.dump();
    }
  }
}

// localsgd with --elastic, one join and none lost: taken into the group at a
// round's end as rank 2, the run ends with three live ranks.
TEST(CfmoTrainWorkers, ElasticLocalSgdGrowsByAJoinerWhenNoRankIsLost) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  Ranks ranks;
  ASSERT_NO_FATAL_FAILURE(start_two_and_join(
      ranks, dir, address, rejoin_flags({"--mode", "localsgd", "--elastic", "--sync-interval", "5"}, "25s", dir), 1));
  ASSERT_FALSE(summary_of_grown_run(ranks, dir, 1).is_null());
}

// The last step rank `rank` logged in RUN's metrics (a line cut short skipped); -1 if none.
int64_t last_logged_step(const fs::path& run, int rank) {
  const fs::path file =
      run / (rank == 0 ? std::string("metrics.jsonl") : "metrics-rank-" + std::to_string(rank) + ".jsonl");
  int64_t step = -1;
  for (const auto& line : testing::lines(slurp(file))) {
    const auto m = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!m.is_discarded() && m.value("type", "") == "step") step = m["step"].get<int64_t>();
  }
  return step;
}

// A lockstep run grown by a joiner stops by its --epochs budget as the
// starting ranks do: the joiner takes the group's cut of the epoch's batches
// from its welcome, the grown world's batches are taken up by every member
// at the same epoch's start, and the epochs left count them; so every rank
// logs the same last step, stops by "epochs", and exits 0 (none waits for a
// rank that left early, none is left behind). Rank 0 is slowed so that the
// join comes before the end.
TEST(CfmoTrainWorkers, ElasticLockstepRunsGrownByAJoinerStopAtTheirEpochsTogether) {
  for (const auto& mode : {std::vector<std::string>{"--mode", "localsgd", "--elastic", "--sync-interval", "5"},
                           std::vector<std::string>{"--mode", "sync", "--elastic"}}) {
    SCOPED_TRACE(mode[1]);
    TempDir dir;
    const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
    std::vector<std::string> flags = mode;
    for (const char* a : {"--epochs", "150", "--slowdown", "0=20", "--log-every", "1", "--json", "--out"}) {
      flags.emplace_back(a);
    }
    flags.push_back((dir / "run").string());
    Ranks ranks;
    ASSERT_NO_FATAL_FAILURE(start_two_and_join(ranks, dir, address, flags, 1));
    const auto j = summary_of_grown_run(ranks, dir, 1);
    ASSERT_FALSE(j.is_null());
    EXPECT_EQ(j["stopped_by"], "epochs") << j.dump();
    EXPECT_EQ(j["epochs_completed"], 150) << j.dump();
    for (const auto& w : j["per_worker"]) EXPECT_EQ(w["stopped_by"], "epochs") << j.dump();
    const int64_t last = last_logged_step(dir / "run", 0);
    EXPECT_GT(last, 0);
    for (int r : {1, 2}) EXPECT_EQ(last_logged_step(dir / "run", r), last) << "rank " << r;
  }
}

// The checkpoint directories of a run, oldest first (temporaries left out).
std::vector<fs::path> checkpoints_of(const fs::path& run) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run / "checkpoints", ec)) {
    if (e.is_directory() && e.path().filename().string().starts_with("step-")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Two ranks of `mode` for `time_limit` in DIR/run, checkpointing every 20
// steps, grown by a --join to three (summary_of_grown_run): the newest checkpoint.
fs::path grown_run_checkpoint(const TempDir& dir, const std::vector<std::string>& mode, const char* time_limit) {
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  std::vector<std::string> flags = rejoin_flags(mode, time_limit, dir);
  for (const char* a : {"--checkpoint-every", "20", "--keep-checkpoints", "1000"}) flags.emplace_back(a);
  Ranks ranks;
  start_two_and_join(ranks, dir, address, flags, 1);
  if (::testing::Test::HasFatalFailure() || summary_of_grown_run(ranks, dir, 1).is_null()) return {};
  const auto all = checkpoints_of(dir / "run");
  EXPECT_FALSE(all.empty());
  return all.empty() ? fs::path() : all.back();
}

// A run grown by a --join checkpoints every rank: cfmo of two, a joiner as
// the new rank 2, and the end's checkpoint records the three ranks' own
// inner states and positions and the world it started with; resumed with
// three workers (each from its own state) and with two (the shards
// redistributed, said in one line), both finish. (Over the loopback, with
// the bitwise resume of a grown localsgd run: test_train_grown.cpp.)
TEST(CfmoTrainWorkers, ACfmoRunGrownByAJoinCheckpointsEveryRankAndResumesWithThreeOrTwo) {
  TempDir dir;
  const fs::path end = grown_run_checkpoint(dir, {"--mode", "cfmo"}, "12s");
  ASSERT_FALSE(end.empty());
  const auto state = nlohmann::json::parse(slurp(end / "state.json"));
  EXPECT_EQ(state["workers"], 3) << state.dump();
  EXPECT_EQ(state["first_workers"], 2) << state.dump();
  ASSERT_EQ(state["ranks"].size(), 3u) << state.dump();
  EXPECT_GT(state["ranks"][2]["step"].get<int64_t>(), 0) << "the joiner's own position: " << state.dump();
  EXPECT_EQ(state["rank_optimizers"],
            nlohmann::json::array({"optimizer-rank-1.safetensors", "optimizer-rank-2.safetensors"}))
      << state.dump();
  EXPECT_NE(parameters(end / "optimizer-rank-2.safetensors"), parameters(end / "optimizer.safetensors"))
      << "rank 2's inner state is its own";

  for (const char* workers : {"3", "2"}) {
    SCOPED_TRACE(workers);
    const fs::path out = dir / (std::string("resumed-") + workers);
    const RunResult resumed = run(args({"--workers", workers, "--mode", "cfmo", "--epochs", "0", "--time-limit", "3s",
                                        "--resume", end.string(), "--out", out.string(), "--no-quiet"}),
                                  300);
    ASSERT_EQ(resumed.status, 0) << resumed.err;
    EXPECT_EQ(resumed.err.find("redistributed") != std::string::npos, std::string(workers) == "2") << resumed.err;
    if (std::string(workers) == "2") {
      EXPECT_NE(resumed.err.find("written by 3 worker(s) (a run grown from 2 by joins), resumed with 2"),
                std::string::npos)
          << resumed.err;
    }
    EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  }
}

// Each step's learning rate that `file` (a rank's metrics) logged, by step.
std::map<int64_t, double> logged_rates(const fs::path& file) {
  std::map<int64_t, double> out;
  for (const auto& line : testing::lines(slurp(file))) {
    const auto m = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!m.is_discarded() && m.value("type", "") == "step" && m.contains("lr")) {
      out[m["step"].get<int64_t>()] = m["lr"].get<double>();
    }
  }
  return out;
}

// A run grown from two ranks to three, checkpointed and resumed with three,
// grows again by a --join: the joiner plans the run's schedule for the
// world the run started with (two, from its ranks; the rendezvous knows only
// the three the resumed run started with), so its learning rate at each
// step is the members' there. localsgd with --elastic: the joiner takes the
// members' steps from its round on.
TEST(CfmoTrainWorkers, AJoinerOfAResumedGrownRunPlansForTheRunsFirstWorld) {
  TempDir dir;
  const std::vector<std::string> mode = {"--mode", "localsgd", "--elastic", "--sync-interval", "5"};
  const fs::path end = grown_run_checkpoint(dir, mode, "8s");
  ASSERT_FALSE(end.empty());
  const auto state = nlohmann::json::parse(slurp(end / "state.json"));
  ASSERT_EQ(state["workers"], 3) << state.dump();
  ASSERT_EQ(state["first_workers"], 2) << state.dump();

  // Resumed by hand with three ranks, for 150 epochs more on a cosine schedule
  // (rank 0 slowed, as above, so that the join comes before the end).
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  std::vector<std::string> flags = mode;
  const std::string epochs = std::to_string(state["epoch"].get<int64_t>() + 150);
  for (const char* a : {"--schedule", "cosine", "--warmup-steps", "10", "--slowdown", "0=20", "--log-every", "1"}) {
    flags.emplace_back(a);
  }
  flags.insert(flags.end(), {"--epochs", epochs, "--out", (dir / "resumed").string()});
  std::vector<std::string> resumed = flags;
  resumed.insert(resumed.end(), {"--resume", end.string()});
  Ranks ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.processes.push_back(testing::spawn(
        args(resumed), {"RANK=" + std::to_string(r), "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address},
        (dir / ("resumed-out-" + std::to_string(r))).string(), (dir / ("resumed-err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "resumed" / "metrics-rank-1.jsonl", 120))
      << slurp(dir / "resumed-err-0") << slurp(dir / "resumed-err-1");
  std::vector<std::string> joiner = flags;
  joiner.insert(joiner.end(), {"--join", address});
  ranks.processes.push_back(
      testing::spawn(args(joiner), {}, (dir / "resumed-out-j").string(), (dir / "resumed-err-j").string()));
  for (auto& p : ranks.processes) {
    ASSERT_TRUE(p.wait(240)) << "a process hangs";
    EXPECT_EQ(p.status, 0) << slurp(dir / "resumed-err-0") << slurp(dir / "resumed-err-j");
  }
  EXPECT_NE(slurp(dir / "resumed-err-0").find("rank 3 joined (a new rank: the world has 4 ranks now)"),
            std::string::npos)
      << slurp(dir / "resumed-err-0");
  const auto members = logged_rates(dir / "resumed" / "metrics.jsonl");
  const auto joined = logged_rates(dir / "resumed" / "metrics-rank-3.jsonl");
  ASSERT_GT(joined.size(), 5u) << slurp(dir / "resumed-err-j");
  for (const auto& [step, lr] : joined) {
    ASSERT_EQ(members.count(step), 1u) << "rank 0 logged no step " << step;
    EXPECT_DOUBLE_EQ(lr, members.at(step)) << "step " << step;
  }
}

// A process that joins in the last moments of a run in `mode`, at its time
// limit: taken in before the end it stops with the others; coming after it
// (localsgd and sync --elastic: after the group's last round; cfmo and asgd:
// after the keeper's end began), it is told the run ended and goes with one
// line; refused at the rendezvous as the leader shuts down, the same. Every
// way it did nothing wrong (status 0), nobody waits for it (the keeper
// neither for its report nor for its state: the whole run ends well within
// --peer-timeout of its time limit) and the summary is the run's. (Under
// load its start may take so long that every process of the run is gone
// when it asks: then it finds nobody, and after --join-timeout exits 4.)
void expect_a_joiner_at_the_very_end_to_end_with_the_run(const std::vector<std::string>& mode) {
  SCOPED_TRACE(mode[1]);
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  const double limit = 4;
  const auto flags = rejoin_flags(mode, "4s", dir);
  const auto started = std::chrono::steady_clock::now();
  auto since_start = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
  Ranks ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.processes.push_back(
        testing::spawn(args(flags), {"RANK=" + std::to_string(r), "WORLD_SIZE=2", "CFMO_RENDEZVOUS=" + address},
                       (dir / ("out-" + std::to_string(r))).string(), (dir / ("err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-1.jsonl", 120)) << slurp(dir / "err-0");
  // At the time limit (the ranks' clock starts a little after this one):
  // later, the run may be gone before the joiner reaches it.
  while (since_start() < limit - 0.1) usleep(10000);
  std::vector<std::string> joiner = flags;
  joiner.insert(joiner.end(), {"--join", address, "--join-timeout", "3"});
  ranks.processes.push_back(testing::spawn(args(joiner), {}, (dir / "out-j").string(), (dir / "err-j").string()));
  std::vector<double> ended;
  for (auto& p : ranks.processes) {
    ASSERT_TRUE(p.wait(120)) << "a process hangs";
    ended.push_back(since_start());
  }
  const std::string err = slurp(dir / "err-j");
  const bool gone = err.find("nobody answered at " + address) != std::string::npos;
  for (size_t p = 0; p < ranks.processes.size(); ++p) {
    EXPECT_EQ(ranks.processes[p].status, p == 2 && gone ? 4 : 0) << p << ": " << slurp(dir / "err-0") << err;
    // The peer timeout is 5 s: before, the keeper waited 2x that for a joiner's report (cfmo: 3x), the joiner 60 s.
    EXPECT_LT(ended[p], limit + 3 + (p == 2 && gone ? 3 : 0)) << "process " << p << " ended late";
  }
  const auto j = last_json(slurp(dir / "out-0"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "err-0");
  EXPECT_EQ(j["stopped_by"], "time-limit") << j.dump();
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array()) << j.dump();
  EXPECT_GE(j["samples"].get<int64_t>(), reported_samples(j)) << j.dump();
  EXPECT_TRUE(last_json(slurp(dir / "out-j")).is_null()) << "one summary, the keeper's";
  const bool too_late = err.find("joined as the run ended") != std::string::npos;
  const bool refused = err.find("was ending and took nobody in") != std::string::npos;
  if (too_late || gone) {
    EXPECT_EQ(testing::lines(err).size(), 1u) << err;
    EXPECT_NE(err.find("trained nothing"), std::string::npos) << err;
    EXPECT_EQ(j["per_worker"].size(), 2u) << j.dump();
    EXPECT_FALSE(fs::exists(dir / "run" / "metrics-rank-2.jsonl")) << "it wrote nothing";
  } else {
    // Taken in before the end: a member of the grown run, reported.
    EXPECT_EQ(j["per_worker"].size(), 3u) << j.dump() << err;
  }
  std::printf("%s: the members ended %.2f s and %.2f s, the joiner %.2f s after their start (limit %.0f s); %s\n",
              mode[1].c_str(), ended[0], ended[1], ended[2], limit,
              gone       ? "it found nobody"
              : refused  ? "the rendezvous refused it"
              : too_late ? "it came too late"
                         : "it was taken in");
}

TEST(CfmoTrainWorkers, AnElasticJoinerAtTheVeryEndOfARunEndsWithItAtOnce) {
  expect_a_joiner_at_the_very_end_to_end_with_the_run({"--mode", "localsgd", "--elastic", "--sync-interval", "5"});
  expect_a_joiner_at_the_very_end_to_end_with_the_run({"--mode", "sync", "--elastic"});
}

// cfmo and asgd: the keeper takes a joiner in by answering its request for
// the global state; once the keeper's end began it answers "run ended"
// instead, and waits for nothing of it. (Before, the members held the run
// about 15 s and the joiner exited 4.)
TEST(CfmoTrainWorkers, AJoinerAtTheVeryEndOfAnAsynchronousRunEndsWithItAtOnce) {
  expect_a_joiner_at_the_very_end_to_end_with_the_run({"--mode", "cfmo", "--sync-interval", "5"});
  expect_a_joiner_at_the_very_end_to_end_with_the_run({"--mode", "asgd"});
}

// A joiner that the rank serving joins refuses because the run is ending
// (it shuts down) came too late through no fault of its own: one line, no
// output, status 0, as one its mode turned away. (A stand-in for the
// leader refuses here: the real one does so only in the moment it shuts down.)
TEST(CfmoTrainWorkers, AJoinerRefusedAsTheRunEndsSaysSoAndEndsWithStatusZero) {
  TempDir dir;
  auto listener = comm::listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener) << listener.error().message;
  const Fd socket(listener->first);
  comm::JoinHooks hooks;
  hooks.decide = [](int, int) { return comm::JoinHooks::Decision{-1, "the run is ending", false, 0, /*ended=*/true}; };
  std::thread leader([&] {
    const Fd peer(::accept4(socket.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_GE(peer.get(), 0);
    EXPECT_TRUE(comm::serve_join(peer.get(), 2, 2, "", hooks, 10));
  });
  const std::string address = "127.0.0.1:" + std::to_string(listener->second);
  auto flags = rejoin_flags({"--mode", "cfmo"}, "4s", dir);
  flags.insert(flags.end(), {"--join", address});
  const RunResult late = run(args(flags), 120);
  leader.join();
  EXPECT_EQ(late.status, 0) << late.err;
  EXPECT_EQ(testing::lines(late.err).size(), 1u) << late.err;
  EXPECT_NE(late.err.find("joined as the run ended: the run at " + address + " was ending and took nobody in"),
            std::string::npos)
      << late.err;
  EXPECT_TRUE(late.out.empty()) << late.out;
  EXPECT_FALSE(fs::exists(dir / "run")) << "it wrote nothing";
}

// A joiner that finds nobody at the address (the run ended and every
// process is gone, or it has not started) asks for --join-timeout seconds,
// then exits 4 with one line naming the address and what it means.
TEST(CfmoTrainWorkers, AJoinerThatFindsNobodyAtTheAddressGivesUpAfterTheJoinTimeout) {
  TempDir dir;
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  auto flags = rejoin_flags({"--mode", "cfmo"}, "4s", dir);
  flags.insert(flags.end(), {"--join", address, "--join-timeout", "1"});
  const auto start = std::chrono::steady_clock::now();
  const RunResult alone = run(args(flags), 60);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(alone.status, 4) << alone.err;
  EXPECT_EQ(testing::lines(alone.err).size(), 1u) << alone.err;
  EXPECT_NE(alone.err.find("nobody answered at " + address + " within 1s"), std::string::npos) << alone.err;
  EXPECT_NE(alone.err.find("no run listens there (it ended, or has not started)"), std::string::npos) << alone.err;
  EXPECT_LT(took, 30.0) << "it asked for --join-timeout, not the default 60 s";
  EXPECT_FALSE(fs::exists(dir / "run")) << "it wrote nothing";
}

// A Fashion-MNIST-like directory of raw IDX files at `dir`: 512 training
// images of 4x4 pixels and 128 test ones, labels 0-9 (a data set the test
// can take away while a run uses it).
void write_small_image_set(const fs::path& dir) {
  fs::create_directories(dir);
  auto u32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  for (const auto& [stem, count] : {std::pair<std::string, uint32_t>{"train", 512}, {"t10k", 128}}) {
    std::string images = u32(0x803) + u32(count) + u32(4) + u32(4);
    std::string labels = u32(0x801) + u32(count);
    for (uint32_t i = 0; i < count; ++i) {
      const uint32_t label = i % 10;
      for (uint32_t p = 0; p < 16; ++p) images += static_cast<char>(p == label ? 255 : (i * 7 + p * 13) % 64);
      labels += static_cast<char>(label);
    }
    ASSERT_TRUE(write_file_atomic(dir / (stem + "-images-idx3-ubyte"), images));
    ASSERT_TRUE(write_file_atomic(dir / (stem + "-labels-idx1-ubyte"), labels));
  }
}

// A process that joins reads its data and builds its model before it asks
// to be taken in. One whose data cannot be read (the run's directory was
// taken away after the run's ranks read it) fails alone, before any rank
// counts it in, with one line naming the data and status 3: a rank
// restarted with its launcher's variables declines the place it is offered,
// a --join never connects. The run goes on as it was and its survivors end
// with status 0, rank 2 lost and nobody joined. (It used to be taken in,
// handed shards, and then leave with its error.)
TEST(CfmoTrainWorkers, AJoinerThatCannotReadItsDataFailsAloneBeforeTheRunTakesItIn) {
  TempDir dir;
  const fs::path data = dir / "images";
  ASSERT_NO_FATAL_FAILURE(write_small_image_set(data));
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  std::vector<std::string> flags = {binary(), "--data",  data.string(),    "--model",
                                    "mlp:32", "--quiet", "--peer-timeout", "5"};
  for (const auto& f : rejoin_flags({"--mode", "cfmo"}, "20s", dir)) flags.push_back(f);
  auto rank_env = [&](int r) {
    return std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=3", "CFMO_RENDEZVOUS=" + address};
  };
  Ranks ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.processes.push_back(testing::spawn(flags, rank_env(r), (dir / ("out-" + std::to_string(r))).string(),
                                             (dir / ("err-" + std::to_string(r))).string()));
  }
  ASSERT_TRUE(wait_for_progress(ranks, dir / "run" / "metrics-rank-2.jsonl", 120))
      << slurp(dir / "err-0") << slurp(dir / "err-2");
  fs::remove_all(data);
  kill(ranks.processes[2].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[2].wait(10));
  ASSERT_TRUE(wait_for_text(ranks.processes, dir / "err-0", "rank 2 lost (", 60)) << slurp(dir / "err-0");
  const RunResult restarted = run(flags, 60, rank_env(2));
  testing::expect_one_line_error(restarted, 3, data.string());
  std::vector<std::string> joiner = flags;
  joiner.insert(joiner.end(), {"--join", address});
  testing::expect_one_line_error(run(joiner, 60), 3, data.string());
  for (const size_t p : {size_t{0}, size_t{1}}) {
    ASSERT_TRUE(ranks.processes[p].wait(120)) << "rank " << p << " hangs";
    EXPECT_EQ(ranks.processes[p].status, 0) << slurp(dir / ("err-" + std::to_string(p)));
  }
  const auto j = last_json(slurp(dir / "out-0"));
  ASSERT_FALSE(j.is_null()) << slurp(dir / "out-0") << slurp(dir / "err-0");
  EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({2})) << j.dump();
  EXPECT_EQ(j["joined"], nlohmann::json::array()) << j.dump();
  EXPECT_EQ(slurp(dir / "err-0").find("rank 2 joined"), std::string::npos) << slurp(dir / "err-0");
}

// A checkpoint is whole: its state reads, and so does every file it names.
void expect_whole(const fs::path& checkpoint) {
  SCOPED_TRACE(checkpoint.string());
  nlohmann::json state;
  ASSERT_NO_THROW(state = nlohmann::json::parse(slurp(checkpoint / "state.json")));
  EXPECT_EQ(state["format"], "cfmo-checkpoint");
  std::vector<std::string> files = {"model.safetensors", "optimizer.safetensors"};
  if (state.contains("outer")) files.push_back(state["outer"]);
  for (const auto& file : files) {
    auto st = ckpt::SafetensorsFile::read(checkpoint / file);
    EXPECT_TRUE(st) << file << ": " << (st ? "" : st.error().message);
  }
  EXPECT_TRUE(fs::is_regular_file(checkpoint / "config.toml"));
}

TEST(CfmoTrainWorkers, LocalSgdResumedWithTheSameWorldEndsWithTheParametersOfAnUninterruptedRunBitForBit) {
  TempDir dir;
  const fs::path whole = dir / "whole";
  // Rounds every 5 steps, a checkpoint at step 20 (a round): the resumed run
  // continues from there with each rank's own inner optimizer state.
  const std::vector<std::string> job = {"--workers",       "2", "--mode",  "localsgd",
                                        "--sync-interval", "5", "--steps", "40"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = job;
    all.insert(all.end(), extra.begin(), extra.end());
    return args(all);
  };
  const RunResult first =
      run(with({"--checkpoint-every", "20", "--keep-checkpoints", "100", "--out", whole.string()}), 300);
  ASSERT_EQ(first.status, 0) << first.err;
  const fs::path at20 = whole / "checkpoints" / "step-00000020";
  const auto state = nlohmann::json::parse(slurp(at20 / "state.json"));
  EXPECT_EQ(state["rank_optimizers"], nlohmann::json::array({"optimizer-rank-1.safetensors"})) << state.dump();
  // The ranks' optimizers drifted apart: rank 1's state is its own, not rank 0's.
  EXPECT_NE(parameters(at20 / "optimizer-rank-1.safetensors"), parameters(at20 / "optimizer.safetensors"));

  const RunResult resumed = run(with({"--resume", at20.string(), "--out", (dir / "resumed").string()}), 300);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  const auto expected = parameters(whole / "model.safetensors");
  const auto got = parameters(dir / "resumed" / "model.safetensors");
  ASSERT_EQ(got.size(), expected.size());
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0)
      << "the resumed run's final parameters differ from the uninterrupted run's";

  // A checkpoint whose rank_optimizers names another file, or whose rank file
  // is gone, exits 3 naming what is wrong, before any training.
  const fs::path bad = dir / "bad";
  fs::copy(at20, bad);
  auto renamed = state;
  renamed["rank_optimizers"] = nlohmann::json::array({"optimizer-rank-7.safetensors"});
  ASSERT_TRUE(write_file_atomic(bad / "state.json", renamed.dump(2)));
  const RunResult misnamed = run(with({"--resume", bad.string(), "--out", (dir / "r1").string()}), 120);
  EXPECT_EQ(misnamed.status, 3) << misnamed.err;
  EXPECT_NE(misnamed.err.find("rank_optimizers"), std::string::npos) << misnamed.err;
  ASSERT_TRUE(write_file_atomic(bad / "state.json", state.dump(2)));
  fs::remove(bad / "optimizer-rank-1.safetensors");
  const RunResult missing = run(with({"--resume", bad.string(), "--out", (dir / "r2").string()}), 120);
  EXPECT_EQ(missing.status, 3) << missing.err;
  EXPECT_NE(missing.err.find("optimizer-rank-1.safetensors"), std::string::npos) << missing.err;
}

// cfmo with --deterministic: owners apply each round in rank order and
// workers wait for its replies, so a run is the same each time, and a
// checkpoint at a round's end holds every rank's own state (inner optimizer
// and its steps, error feedback of the bf16 wire, position) and the owners'
// (shards, versions, outer momentum and its pending round): resumed from it,
// the run ends bitwise where the uninterrupted one did. Three workers, an
// epoch of 14 global batches whose last is short (ranks 1 and 2 have no
// slice of it: their optimizer steps differ), checkpoints every 8 steps and at epoch ends (taken
// at the next round, every 4 steps).
TEST(CfmoTrainWorkers, DeterministicCfmoResumedFromAnyRoundEndsWithTheUninterruptedRunsParametersBitForBit) {
  TempDir dir;
  const std::vector<std::string> job = {"--data",
                                        "synthetic:2000:256",
                                        "--workers",
                                        "3",
                                        "--mode",
                                        "cfmo",
                                        "--deterministic",
                                        "--sync-interval",
                                        "4",
                                        "--steps",
                                        "30",
                                        "--batch-size",
                                        "50"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = job;
    all.insert(all.end(), extra.begin(), extra.end());
    return args(all);
  };
  const fs::path whole = dir / "whole";
  const RunResult first =
      run(with({"--checkpoint-every", "8", "--keep-checkpoints", "100", "--out", whole.string()}), 300);
  ASSERT_EQ(first.status, 0) << first.err;
  const RunResult again = run(with({"--out", (dir / "again").string()}), 300);
  ASSERT_EQ(again.status, 0) << again.err;
  const auto expected = parameters(whole / "model.safetensors");
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(parameters(dir / "again" / "model.safetensors"), expected) << "two runs of the same job differ";

  const fs::path at16 = whole / "checkpoints" / "step-00000016";  // the round after the epoch's end (14)
  const auto state = nlohmann::json::parse(slurp(at16 / "state.json"));
  EXPECT_EQ(state["rank_optimizers"],
            nlohmann::json::array({"optimizer-rank-1.safetensors", "optimizer-rank-2.safetensors"}));
  EXPECT_EQ(state["rank_optimizer_steps"], nlohmann::json::array({16, 15, 15})) << state.dump();
  EXPECT_EQ(state["wire_residuals"].size(), 3u);
  EXPECT_EQ(state["shard_versions"].size(), 3u);
  EXPECT_EQ(state["outer_in_round"], nlohmann::json::array({0, 0, 0}));
  EXPECT_EQ(state["ranks"][2]["samples"].get<int64_t>() + 50, state["ranks"][0]["samples"].get<int64_t>())
      << state.dump();

  for (const char* step : {"step-00000008", "step-00000016", "step-00000024"}) {
    const fs::path out = dir / (std::string("resumed-") + step);
    const RunResult resumed =
        run(with({"--resume", (whole / "checkpoints" / step).string(), "--out", out.string()}), 300);
    ASSERT_EQ(resumed.status, 0) << step << ": " << resumed.err;
    const auto got = parameters(out / "model.safetensors");
    ASSERT_EQ(got.size(), expected.size());
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0)
        << "resumed from " << step << ", the final parameters differ from the uninterrupted run's";
  }

  // asgd's owners apply each gradient as it arrives: no fixed order to offer.
  const RunResult asgd = run(args({"--workers", "2", "--mode", "asgd", "--deterministic", "--steps", "5"}), 60);
  EXPECT_EQ(asgd.status, 2) << asgd.err;
  EXPECT_NE(asgd.err.find("--deterministic: not in asgd"), std::string::npos) << asgd.err;
  // A time limit would stop each worker at its own step.
  const RunResult timed =
      run(args({"--workers", "2", "--mode", "cfmo", "--deterministic", "--epochs", "0", "--time-limit", "5s"}), 60);
  EXPECT_EQ(timed.status, 2) << timed.err;
  EXPECT_NE(timed.err.find("--deterministic: stops by --steps, --epochs or --tokens, not --time-limit"),
            std::string::npos)
      << timed.err;
}

// The files of a checkpoint, byte for byte, by name (state.json parsed, without its train_s).
std::map<std::string, std::string> checkpoint_files(const fs::path& checkpoint) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(checkpoint)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".safetensors")) out[name] = slurp(e.path());
  }
  return out;
}

// Resumed from checkpoint `at` with `job` (the run's arguments) and stopped
// before its first step, a run writes into `idle` a checkpoint equal to `at`
// file for file: every rank's state (and expert) was restored as saved.
void expect_restored_as_saved(std::vector<std::string> job, const fs::path& at, const fs::path& idle) {
  job.insert(job.end(), {"--resume", at.string(), "--time-limit", "1ms", "--out", idle.string(), "--json"});
  const RunResult stopped = run(job, 300);
  ASSERT_EQ(stopped.status, 0) << stopped.err;
  ASSERT_EQ(last_json(stopped.out)["steps"], 0) << "a step was taken: " << stopped.out;
  const fs::path again = idle / "checkpoints" / at.filename();
  ASSERT_TRUE(fs::exists(again / "state.json")) << again;
  EXPECT_TRUE(checkpoint_files(again) == checkpoint_files(at)) << "a rank's restored state differs from the saved one";
}

// The mean loss of the first `n` step lines of a run's metrics.jsonl (rank
// 0's): one batch's loss in an asynchronous run is too noisy to tell where a
// run is (asgd's swing by 0.4 from step to step).
double mean_first_step_loss(const fs::path& run_dir, size_t n = 5) {
  std::vector<double> losses;
  std::istringstream in(slurp(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line) && losses.size() < n;) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("type", "") == "step") losses.push_back(j["loss"].get<double>());
  }
  if (losses.empty()) return NAN;
  return std::accumulate(losses.begin(), losses.end(), 0.0) / static_cast<double>(losses.size());
}

// The test loss of a run's last evaluation: in cfmo and asgd the one at the
// end, of the gathered global parameters, which the end's checkpoint holds.
double final_test_loss(const fs::path& run_dir) {
  double loss = NAN;
  std::istringstream in(slurp(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("type", "") == "eval") loss = j["test_loss"].get<double>();
  }
  return loss;
}

// cfmo and asgd without --deterministic: the keeper's checkpoints hold each
// rank's own state, sent to it by message (inner optimizer state and steps:
// cfmo; error feedback of the bf16 wire and position: both), with the
// owners' (shards, versions, outer momentum and pending round; asgd's shard
// optimizer). A run resumed from one and stopped before its first step
// writes a checkpoint equal to it file for file (every rank's state was
// restored as saved); one that trains on starts at the checkpoint's loss
// (its parameters' in the first run's final evaluation), not the first run's
// initial one.
//
// Not rank 0's last training losses for the checkpoint's: those are of its
// own copy, which in both modes can be far from the gathered parameters on a
// loaded machine (a cfmo rank 0 given 17 of 190 steps ended at 1.8 while the
// global parameters were at 1.0; asgd's copies swing, below). And asgd runs
// with --max-staleness 0 here: at the default 4 a gradient is applied up to 4
// rounds late (more when the scheduler puts a rank aside), and AdamW at --lr
// 1e-3 then swings up to 3.8, above the start, so that in 4 of 15 runs under
// load rank 0's last losses, or the run's end itself, were at its start and
// the comparison said nothing about the resume. With 0, 12 of 12 ended near
// 0.4 and resumed there.
TEST(CfmoTrainWorkers, AsyncCheckpointsHoldEveryRanksOwnStateAndAResumedRunContinuesFromIt) {
  for (const char* mode : {"cfmo", "asgd"}) {
    SCOPED_TRACE(mode);
    const bool cfmo = std::string(mode) == "cfmo";
    TempDir dir;
    const fs::path whole = dir / "whole";
    std::vector<std::string> job = {"--workers", "3", "--mode", mode, "--steps", "60", "--log-every", "1"};
    if (!cfmo) job.insert(job.end(), {"--max-staleness", "0"});
    auto with = [&](std::vector<std::string> extra) {
      std::vector<std::string> all = job;
      all.insert(all.end(), extra.begin(), extra.end());
      return args(all);
    };
    const RunResult first = run(with({"--checkpoint-every", "10", "--keep-checkpoints", "100", "--slowdown", "0=2",
                                      "--slowdown", "1=2", "--slowdown", "2=2", "--out", whole.string(), "--json"}),
                                300);
    ASSERT_EQ(first.status, 0) << first.err;
    const auto saved = checkpoints_of(whole);
    ASSERT_FALSE(saved.empty());
    const fs::path at = saved.front();
    const auto state = nlohmann::json::parse(slurp(at / "state.json"));
    EXPECT_EQ(state["ranks"].size(), 3u) << state.dump();
    EXPECT_EQ(state["wire_residuals"].size(), 3u) << state.dump();
    if (cfmo) {
      EXPECT_EQ(state["rank_optimizers"],
                nlohmann::json::array({"optimizer-rank-1.safetensors", "optimizer-rank-2.safetensors"}));
      EXPECT_EQ(state["rank_optimizer_steps"].size(), 3u) << state.dump();
      EXPECT_EQ(state["outer_in_round"].size(), 3u) << state.dump();
    } else {
      EXPECT_FALSE(state.contains("rank_optimizers")) << "asgd's owners optimize: " << state.dump();
      EXPECT_EQ(state["shard_optimizer_steps"].size(), 3u) << state.dump();
    }
    // Every checkpoint holds each rank's own state, not the keeper's for every
    // rank: also one asked while an earlier one still waited for the ranks'
    // answers (once written with none: in 4 of 15 runs under load).
    for (const auto& c : saved) {
      SCOPED_TRACE(c.filename().string());
      for (const char* rank : {"1", "2"}) {
        if (cfmo) {
          EXPECT_NE(parameters(c / fmt::format("optimizer-rank-{}.safetensors", rank)),
                    parameters(c / "optimizer.safetensors"))
              << "rank " << rank;
        } else {
          // asgd's error feedback is a rank's own after its first push.
          const auto residual = parameters(c / fmt::format("wire-rank-{}.safetensors", rank));
          EXPECT_TRUE(std::any_of(residual.begin(), residual.end(), [](float v) { return v != 0; }))
              << "rank " << rank << "'s error feedback is missing";
        }
      }
    }

    // Restored as saved: no step taken, the end's checkpoint is the same one.
    const fs::path idle = dir / "idle";
    expect_restored_as_saved(with({}), at, idle);
    const fs::path again = idle / "checkpoints" / at.filename();
    auto positions = [](const fs::path& c) {
      auto j = nlohmann::json::parse(slurp(c / "state.json"));
      for (auto& r : j["ranks"]) r.erase("train_s");
      j.erase("train_s");
      return j;
    };
    EXPECT_EQ(positions(again), positions(at));

    // Trained on (a larger budget) from the end's checkpoint, the resumed run
    // starts at the loss the first one ended with.
    const fs::path on = dir / "on";
    std::vector<std::string> on_job = {"--workers", "3",           "--mode", mode,       "--steps",
                                       "120",       "--log-every", "1",      "--resume", whole.string(),
                                       "--out",     on.string(),   "--json"};
    if (!cfmo) on_job.insert(on_job.end(), {"--max-staleness", "0"});
    const RunResult resumed = run(args(on_job), 300);
    ASSERT_EQ(resumed.status, 0) << resumed.err;
    const double start = mean_first_step_loss(whole);
    const double continued = mean_first_step_loss(on);
    const double ended = final_test_loss(whole);
    EXPECT_LT(std::abs(continued - ended), std::abs(continued - start))
        << "the resumed run's first losses " << continued << " are nearer the first run's start (" << start
        << ") than its checkpoint's (" << ended << ")";

    // Fewer workers (and --owners 1) take it up too: the shards and positions redistributed, one line saying so.
    const RunResult two =
        run(args({"--workers", "2", "--mode", mode, "--owners", "1", "--steps", "120", "--slowdown", "0=1", "--resume",
                  at.string(), "--out", (dir / "two").string(), "--no-quiet", "--json"}),
            300);
    EXPECT_EQ(two.status, 0) << two.err;
    EXPECT_NE(two.err.find("written by 3 worker(s), resumed with 2: the global state is redistributed over 1 shard(s)"),
              std::string::npos)
        << two.err;
    EXPECT_EQ(last_json(two.out)["workers"], 2) << two.out;
  }
}

TEST(CfmoTrainWorkers, EveryModeCheckpointsTheGlobalParametersMidRunAndResumes) {
  for (const char* mode : {"sync", "localsgd", "cfmo", "asgd"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    const fs::path run_dir = dir / "run";
    // Slowed steps leave the owners' threads time to answer a checkpoint's request.
    const RunResult first = run(args({"--workers", "2", "--mode", mode, "--epochs", "6", "--max-staleness", "1",
                                      "--checkpoint-every", "8", "--keep-checkpoints", "100", "--slowdown", "0=2",
                                      "--slowdown", "1=2", "--out", run_dir.string(), "--json"}),
                                300);
    ASSERT_EQ(first.status, 0) << first.err;
    const auto saved = checkpoints_of(run_dir);
    ASSERT_GE(saved.size(), 2u) << "a checkpoint during the run and one at its end";
    for (const auto& c : saved) expect_whole(c);
    const auto state = nlohmann::json::parse(slurp(saved.front() / "state.json"));
    EXPECT_EQ(state["workers"], 2);
    EXPECT_EQ(state["mode"], mode);
    const bool async = std::string(mode) == "cfmo" || std::string(mode) == "asgd";
    EXPECT_EQ(state.contains("ranks"), async) << state.dump();
    if (async) {
      EXPECT_EQ(state["ranks"].size(), 2u);
    }
    EXPECT_EQ(std::string(mode) == "asgd", state.contains("shard_optimizer_steps"));
    EXPECT_EQ(std::string(mode) == "localsgd" || std::string(mode) == "cfmo", state.contains("outer")) << state.dump();

    // Every rank starts again from the global parameters and its position.
    const RunResult resumed = run(
        {binary(), "--resume", saved.front().string(), "--workers", "2", "--epochs", "7", "--no-quiet", "--json"}, 300);
    ASSERT_EQ(resumed.status, 0) << resumed.err;
    EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
    const auto j = last_json(resumed.out);
    EXPECT_EQ(j["resumed_from"], saved.front().string());
    EXPECT_EQ(j["stopped_by"], "epochs");
    EXPECT_GT(j["test_accuracy"].get<double>(), 0.4) << resumed.out;
    EXPECT_GT(checkpoints_of(run_dir).back().filename(), saved.front().filename());

    // Another world takes it up: the global state spread over its shards,
    // the positions recounted, and one line saying so.
    const RunResult three = run({binary(), "--resume", saved.front().string(), "--workers", "3", "--epochs", "7",
                                 "--out", (dir / "three").string(), "--no-quiet", "--json"},
                                300);
    EXPECT_EQ(three.status, 0) << three.err;
    EXPECT_NE(three.err.find("written by 2 worker(s), resumed with 3: the global state is redistributed over 3"),
              std::string::npos)
        << three.err;
    const auto t = last_json(three.out);
    EXPECT_EQ(t["workers"], 3) << three.out;
    EXPECT_EQ(t["stopped_by"], "epochs");
    EXPECT_GT(t["test_accuracy"].get<double>(), 0.4) << three.out;

    if (std::string(mode) == "cfmo") {
      // Another mode cannot take it up.
      const RunResult other =
          run({binary(), "--resume", saved.front().string(), "--workers", "2", "--mode", "sync"}, 120);
      EXPECT_EQ(other.status, 2) << other.err;
      EXPECT_NE(other.err.find("--mode cfmo"), std::string::npos) << other.err;
    }
  }
}

TEST(CfmoTrainWorkers, AKillDuringCheckpointingLeavesOnlyWholeCheckpoints) {
  // A checkpoint asked for at every step keeps rank 0's writer busy; rank 0
  // is killed while it writes (or between two writes: either way, what is
  // left must be whole checkpoints and, at most, a temporary directory).
  TempDir dir;
  const fs::path run_dir = dir / "run";
  auto ranks = start_ranks(dir, 3,
                           {"--mode", "cfmo", "--model", "mlp:256,128", "--epochs", "100", "--checkpoint-every", "1",
                            "--keep-checkpoints", "2", "--log-every", "1", "--out", run_dir.string()});
  const auto start = std::chrono::steady_clock::now();
  while (!fs::exists(run_dir / "checkpoints" / "latest") &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(120)) {
    usleep(2000);
  }
  ASSERT_TRUE(fs::exists(run_dir / "checkpoints" / "latest")) << slurp(dir / "err-0");
  usleep(30000);
  kill(ranks.processes[0].pid, SIGKILL);
  ASSERT_TRUE(ranks.processes[0].wait(10));  // reaped at once, as above
  for (int r : {1, 2}) {
    // The others lose the keeper, name it, and go on: rank 1 keeps the run
    // (and writes the checkpoints) from then on, and both finish (status 0).
    ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(240)) << "rank " << r << " hangs";
    EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 0) << slurp(dir / ("err-" + std::to_string(r)));
    EXPECT_NE(slurp(dir / ("err-" + std::to_string(r))).find("rank 0"), std::string::npos)
        << slurp(dir / ("err-" + std::to_string(r)));
  }
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name == "latest") continue;
    if (name.starts_with(".step-") && name.find(".tmp-") != std::string::npos) continue;  // unfinished, never read
    if (name.starts_with("latest.tmp.")) continue;  // the pointer's temporary file, killed before its rename
    ASSERT_TRUE(name.starts_with("step-")) << name;
    expect_whole(e.path());
  }
  std::string latest = slurp(run_dir / "checkpoints" / "latest");
  while (!latest.empty() && latest.back() == '\n') latest.pop_back();
  expect_whole(run_dir / "checkpoints" / latest);

  // The whole world resumes from the run directory's latest checkpoint.
  const auto state = nlohmann::json::parse(slurp(run_dir / "checkpoints" / latest / "state.json"));
  const std::string steps = std::to_string(state["step"].get<int64_t>() + 20);
  auto again = start_ranks(
      dir, 3, {"--resume", run_dir.string(), "--model", "mlp:256,128", "--epochs", "0", "--steps", steps, "--json"});
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(again.processes[static_cast<size_t>(r)].wait(240)) << "rank " << r << " hangs";
    EXPECT_EQ(again.processes[static_cast<size_t>(r)].status, 0) << slurp(dir / ("err-" + std::to_string(r)));
  }
  const auto j = last_json(slurp(dir / "out-0"));
  EXPECT_EQ(j["resumed_from"], (run_dir / "checkpoints" / latest).string());
  // The resumed run's checkpoints pruned what the killed writer left.
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  }
}

TEST(CfmoTrainWorkers, LauncherPrefixesRanksAndReportsAKilledRank) {
  const RunResult r =
      run(args({"--workers", "2", "--mode", "sync", "--steps", "3", "--log-every", "1", "--no-quiet"}), 300);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("[rank 0] step 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[rank 1] step 1"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("sync on 2 worker(s)"), std::string::npos) << r.out;
}

TEST(CfmoTrainWorkers, TimeLimitAndCtrlCStopLockstepWorkersTogether) {
  for (const char* mode : {"sync", "localsgd"}) {
    SCOPED_TRACE(mode);
    const RunResult timed =
        run(args({"--workers", "3", "--mode", mode, "--epochs", "0", "--time-limit", "1s", "--json"}), 300);
    EXPECT_EQ(timed.status, 0) << timed.err;
    EXPECT_EQ(last_json(timed.out)["stopped_by"], "time-limit");
    TempDir dir;
    bool sent = false;
    const RunResult interrupted = run(args({"--workers", "3", "--mode", mode, "--epochs", "0", "--time-limit", "5m",
                                            "--log-every", "1", "--out", (dir / "run").string(), "--json"}),
                                      300, {}, [&](pid_t pid, double elapsed) {
                                        std::error_code ec;
                                        const auto size = fs::file_size(dir / "run" / "metrics-rank-2.jsonl", ec);
                                        if (!sent && ((!ec && size > 0) || elapsed > 120)) {
                                          kill(pid, SIGINT);  // what a terminal's Ctrl-C does to the launcher
                                          sent = true;
                                        }
                                      });
    EXPECT_TRUE(sent);
    EXPECT_FALSE(interrupted.timed_out);
    EXPECT_EQ(interrupted.status, 130) << interrupted.err;
    EXPECT_EQ(last_json(interrupted.out)["stopped_by"], "interrupt") << interrupted.out;
  }
}

TEST(CfmoTrainWorkers, CompareRunsEveryMode) {
  const RunResult r = run(args({"--workers", "2", "--epochs", "1", "--compare", "--json"}), 600);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = last_json(r.out);
  ASSERT_EQ(j["compare"].size(), 4u);
  std::vector<std::string> modes;
  for (const auto& run : j["compare"]) modes.push_back(run["mode"]);
  EXPECT_EQ(modes, (std::vector<std::string>{"sync", "localsgd", "asgd", "cfmo"}));
  const RunResult table = run(args({"--workers", "2", "--epochs", "1", "--compare"}), 600);
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("efficiency"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("cfmo"), std::string::npos);
}

/// A small corpus and the arguments that train a Mixture-of-Experts GPT on it.
std::vector<std::string> moe_args(const fs::path& corpus, std::vector<std::string> extra) {
  if (!fs::exists(corpus)) {
    std::string text;
    for (int i = 0; i < 300; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    EXPECT_TRUE(write_file_atomic(corpus, text));
  }
  std::vector<std::string> out = {binary(),
                                  "--data",
                                  "text:" + corpus.string(),
                                  "--model",
                                  "gpt:layers=2,heads=2,dim=16,context=16,experts=4,top_k=2,expert_dim=16",
                                  "--quiet",
                                  "--peer-timeout",
                                  "5",
                                  "--batch-size",
                                  "4",
                                  "--epochs",
                                  "0",
                                  "--lr",
                                  "0.003"};
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

TEST(CfmoTrainWorkers, MixtureOfExpertsTrainsInEveryModeAndReportsItsExperts) {
  TempDir dir;
  for (const char* mode : {"sync", "localsgd", "cfmo", "asgd"}) {
    SCOPED_TRACE(mode);
    const fs::path run_dir = dir / mode;
    const RunResult r =
        run(moe_args(dir / "corpus.txt", {"--workers", "2", "--mode", mode, "--steps", "40", "--sync-interval", "5",
                                          "--log-every", "10", "--out", run_dir.string(), "--json"}),
            300);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = last_json(r.out);
    ASSERT_TRUE(j.contains("moe")) << r.out;
    EXPECT_GE(j["moe"]["aux_loss"].get<double>(), 1.0 - 1e-9);  // the balanced minimum
    ASSERT_EQ(j["moe"]["layers"].size(), 2u);
    // Every expert of a layer counted: 4 x 16 tokens x top-2 over 4 experts is 32 per expert on average.
    EXPECT_DOUBLE_EQ(j["moe"]["layers"][0]["load_mean"].get<double>(), 32.0);
    EXPECT_LT(j["val_loss"].get<double>(), std::log(256.0)) << r.out;  // better than uniform
    // Each step line carries the window's figures.
    std::istringstream lines(slurp(run_dir / "metrics.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(lines, line);) {
      const auto m = nlohmann::json::parse(line);
      if (m["type"] != "step") continue;
      ++steps;
      EXPECT_EQ(m["moe"]["passes"], 10) << line;
      EXPECT_TRUE(m["moe"]["layers"][1].contains("load_cv")) << line;
      EXPECT_TRUE(m["moe"]["layers"][1].contains("dropped_share")) << line;
    }
    // Lockstep modes: 40 steps each; cfmo and asgd share a budget, so rank 0's share varies.
    const bool lockstep = std::string(mode) == "sync" || std::string(mode) == "localsgd";
    if (lockstep) {
      EXPECT_EQ(steps, 4);
    } else {
      EXPECT_GE(steps, 1);
    }
    // The experts' tensors are in the model, by their names.
    auto st = ckpt::SafetensorsFile::read(run_dir / "model.safetensors");
    ASSERT_TRUE(st) << st.error().message;
    bool router = false, expert = false;
    for (const auto& e : st->tensors()) {
      router = router || e.name == "h.1.mlp.router.weight";
      expert = expert || e.name == "h.1.mlp.experts.3.c_proj.bias";
    }
    EXPECT_TRUE(router && expert);
    EXPECT_FALSE(fs::exists(run_dir / "config.json"));
  }
}

TEST(CfmoTrainWorkers, MixtureOfExpertsCheckpointsAndResumes) {
  TempDir dir;
  const fs::path run_dir = dir / "run";
  const RunResult first =
      run(moe_args(dir / "corpus.txt", {"--workers", "2", "--mode", "sync", "--steps", "20", "--checkpoint-every", "10",
                                        "--keep-checkpoints", "10", "--out", run_dir.string(), "--json"}),
          300);
  ASSERT_EQ(first.status, 0) << first.err;
  const auto saved = checkpoints_of(run_dir);
  ASSERT_GE(saved.size(), 2u);
  const auto finished = parameters(run_dir / "model.safetensors");
  ASSERT_FALSE(finished.empty());
  // Resumed from the step-10 checkpoint, the run repeats steps 11..20 exactly (sync is deterministic).
  const RunResult resumed =
      run({binary(), "--resume", saved.front().string(), "--workers", "2", "--steps", "20", "--json"}, 300);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_EQ(parameters(run_dir / "model.safetensors"), finished);
  EXPECT_EQ(last_json(resumed.out)["model"], last_json(first.out)["model"]);
}

std::map<std::string, std::vector<float>> tensors_of(const fs::path& file) {
  std::map<std::string, std::vector<float>> out;
  auto st = ckpt::SafetensorsFile::read(file);
  EXPECT_TRUE(st) << (st ? "" : st.error().message);
  if (!st) return out;
  for (const auto& e : st->tensors()) {
    auto bytes = st->bytes(e);
    const auto* f = reinterpret_cast<const float*>(bytes.data());
    out[e.name].assign(f, f + bytes.size() / sizeof(float));
  }
  return out;
}

// Dropless and without the load-balancing loss (taken per worker's batch),
// expert parallelism computes what data-parallel MoE computes: the same
// dense gradients and, for each expert, the mean over both workers' tokens.
TEST(CfmoTrainWorkers, ExpertParallelTrainsAsDataParallelMoeCheckpointsEveryExpertAndResumes) {
  TempDir dir;
  const std::vector<std::string> common = {
      "--workers",          "2",  "--mode", "sync", "--steps", "10", "--drop-policy", "dropless", "--aux-loss", "0",
      "--keep-checkpoints", "10", "--json"};
  auto with = [&](const fs::path& run_dir, std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), {"--out", run_dir.string()});
    a.insert(a.end(), extra.begin(), extra.end());
    return moe_args(dir / "corpus.txt", a);
  };
  const RunResult ep = run(with(dir / "ep", {"--expert-parallel", "--checkpoint-every", "5"}), 300);
  ASSERT_EQ(ep.status, 0) << ep.err;
  const RunResult dp = run(with(dir / "dp", {}), 300);
  ASSERT_EQ(dp.status, 0) << dp.err;
  const auto a = tensors_of(dir / "ep" / "model.safetensors");
  const auto b = tensors_of(dir / "dp" / "model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a.contains("h.0.mlp.experts.1.c_fc.weight") && a.contains("h.1.mlp.experts.2.c_proj.bias"));
  for (const auto& [name, values] : b) {
    ASSERT_TRUE(a.contains(name)) << name;
    ASSERT_EQ(a.at(name).size(), values.size()) << name;
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_NEAR(a.at(name)[i], values[i], 2e-4) << name << "[" << i << "]";
    }
  }
  EXPECT_NEAR(last_json(ep.out)["val_loss"].get<double>(), last_json(dp.out)["val_loss"].get<double>(), 1e-4);

  // Resumed from step 5, each rank takes its experts and their optimizer
  // state from the checkpoint, and steps 6..10 repeat exactly.
  const auto saved = checkpoints_of(dir / "ep");
  ASSERT_GE(saved.size(), 2u);
  EXPECT_EQ(tensors_of(saved.front() / "optimizer.safetensors").count("h.1.mlp.experts.3.c_fc.weight.exp_avg"), 1u);
  const RunResult resumed =
      run({binary(), "--resume", saved.front().string(), "--workers", "2", "--steps", "10", "--json"}, 300);
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_EQ(tensors_of(dir / "ep" / "model.safetensors"), a);
}

TEST(CfmoTrainWorkers, ExpertParallelWorkersExitFourNamingARankKilledMidRun) {
  TempDir dir;
  // The kill lands in a MoE block's exchange or in sync's all-reduce: either way the others fail with status 4.
  (void)moe_args(dir / "corpus.txt", {});
  auto ranks = start_ranks(dir, 3,
                           {"--data", "text:" + (dir / "corpus.txt").string(), "--model",
                            "gpt:layers=2,heads=2,dim=16,context=16,experts=4,top_k=2,expert_dim=16", "--batch-size",
                            "4", "--expert-parallel", "--epochs", "0", "--time-limit", "5m", "--log-every", "1",
                            "--out", (dir / "run").string()});
  kill_rank_one_mid_run(ranks, dir);
}

TEST(CfmoTrainWorkers, AsyncDispatchWithoutADeadlineTrainsAsSyncDispatchBitForBit) {
  TempDir dir;
  auto train = [&](const std::string& dispatch) {
    const fs::path run_dir = dir / dispatch;
    const RunResult r =
        run(moe_args(dir / "corpus.txt",
                     {"--workers", "3", "--mode", "sync", "--steps", "10", "--expert-parallel", "--dispatch", dispatch,
                      "--dispatch-deadline", "none", "--out", run_dir.string(), "--json"}),
            300);
    EXPECT_EQ(r.status, 0) << r.err;
    return r;
  };
  const RunResult sync = train("sync");
  const RunResult async = train("async");
  ASSERT_EQ(sync.status, 0);
  ASSERT_EQ(async.status, 0);
  EXPECT_EQ(tensors_of(dir / "async" / "model.safetensors"), tensors_of(dir / "sync" / "model.safetensors"));
  const auto j = last_json(async.out);
  EXPECT_EQ(j["val_loss"], last_json(sync.out)["val_loss"]);
  const auto& dispatch = j["moe"]["dispatch"];
  EXPECT_EQ(dispatch["late"].get<int64_t>(), 0);
  EXPECT_TRUE(dispatch["deadline_us"].is_null());
}

// A worker five times slower does not hold the others beyond the deadline:
// their rows it has not served in time take the residual path, counted.
TEST(CfmoTrainWorkers, AsyncDispatchWithAStragglerCountsLateTokensAndFinishes) {
  TempDir dir;
  const RunResult r =
      run(moe_args(dir / "corpus.txt",
                   {"--workers", "3", "--mode", "sync", "--steps", "20", "--expert-parallel", "--dispatch", "async",
                    "--dispatch-deadline", "1ms", "--slowdown", "1=5", "--out", (dir / "run").string(), "--json"}),
          300);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = last_json(r.out);
  EXPECT_TRUE(std::isfinite(j["val_loss"].get<double>()));
  const auto& dispatch = j["moe"]["dispatch"];
  EXPECT_GT(dispatch["late"].get<int64_t>(), 0) << dispatch.dump();
  EXPECT_GT(dispatch["late_share"].get<double>(), 0.0);
  EXPECT_LT(dispatch["late_share"].get<double>(), 1.0);  // rank 0's own experts are never late
  EXPECT_EQ(dispatch["deadline_us"].get<double>(), 1000.0);
  EXPECT_TRUE(dispatch["lost_experts"].empty());
  EXPECT_TRUE(fs::exists(dir / "run" / "model.safetensors"));
}

// cfmo with expert parallelism: the dense prefix reconciled by cfmo's
// owners, the experts never averaged, dispatched asynchronously; the end
// gathers every expert into model.safetensors.
TEST(CfmoTrainWorkers, CfmoWithExpertParallelismTrainsAndWritesEveryExpert) {
  TempDir dir;
  const RunResult r = run(moe_args(dir / "corpus.txt", {"--workers", "3", "--mode", "cfmo", "--steps", "60",
                                                        "--sync-interval", "5", "--expert-parallel", "--dispatch",
                                                        "async", "--out", (dir / "run").string(), "--json"}),
                          300);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = last_json(r.out);
  EXPECT_TRUE(std::isfinite(j["val_loss"].get<double>())) << j.dump();
  EXPECT_LT(j["val_loss"].get<double>(), 5.0) << j.dump();  // it learnt: ln 256 = 5.5 at the start
  EXPECT_TRUE(j["moe"].contains("dispatch")) << j.dump();
  const auto saved = tensors_of(dir / "run" / "model.safetensors");
  for (int e = 0; e < 4; ++e) {
    EXPECT_TRUE(saved.contains("h.1.mlp.experts." + std::to_string(e) + ".c_proj.weight")) << e;
  }
}

// A worker killed mid-run in cfmo: its experts' tokens take the residual
// path from then on, the others finish (status 0) and name the experts lost.
TEST(CfmoTrainWorkers, CfmoExpertParallelWorkersGoOnWithoutAKilledRankAndNameItsExperts) {
  // Killed at its first logged step (before any checkpoint, as a rule), and
  // again once a checkpoint was written: the model is still written, expert 1
  // at its initial values or as the newest checkpoint had it; the line and
  // the summary say which.
  for (const bool after_checkpoint : {false, true}) {
    SCOPED_TRACE(after_checkpoint ? "killed after a checkpoint" : "killed at once");
    TempDir dir;
    (void)moe_args(dir / "corpus.txt", {});
    std::vector<std::string> job = {"--data",
                                    "text:" + (dir / "corpus.txt").string(),
                                    "--model",
                                    "gpt:layers=2,heads=2,dim=16,context=16,experts=4,top_k=2,expert_dim=16",
                                    "--batch-size",
                                    "4",
                                    "--mode",
                                    "cfmo",
                                    "--expert-parallel",
                                    "--dispatch",
                                    "async",
                                    "--steps",
                                    "600",
                                    "--log-every",
                                    "1",
                                    "--keep-checkpoints",
                                    "1000",
                                    "--json",
                                    "--out",
                                    (dir / "run").string()};
    if (after_checkpoint) job.insert(job.end(), {"--checkpoint-every", "5"});
    auto ranks = start_ranks(dir, 3, job);
    const fs::path waited =
        after_checkpoint ? dir / "run" / "checkpoints" / "latest" : dir / "run" / "metrics-rank-1.jsonl";
    ASSERT_TRUE(wait_for_progress(ranks, waited, 120))
        << slurp(dir / "err-0") << slurp(dir / "err-1") << slurp(dir / "err-2");
    kill(ranks.processes[1].pid, SIGKILL);
    ASSERT_TRUE(ranks.processes[1].wait(10));  // reaped at once, as above
    for (int r : {0, 2}) {
      ASSERT_TRUE(ranks.processes[static_cast<size_t>(r)].wait(240)) << "rank " << r << " hangs";
      EXPECT_EQ(ranks.processes[static_cast<size_t>(r)].status, 0) << slurp(dir / ("err-" + std::to_string(r)));
    }
    const auto j = last_json(slurp(dir / "out-0"));
    ASSERT_FALSE(j.is_null()) << slurp(dir / "out-0") << slurp(dir / "err-0");
    EXPECT_EQ(j["lost_ranks"], nlohmann::json::array({1}));
    ASSERT_EQ(j["lost"].size(), 1u) << j.dump();
    EXPECT_EQ(j["lost"][0]["experts"], nlohmann::json::array({1}));  // 4 experts over 3 ranks: rank 1 held expert 1
    EXPECT_EQ(j["moe"]["dispatch"]["lost_experts"], nlohmann::json::array({1}));
    const std::string err = slurp(dir / "err-0");
    EXPECT_NE(err.find("experts 1 were lost with their workers: model.safetensors holds them "), std::string::npos)
        << err;
    ASSERT_TRUE(j["lost"][0]["experts_from"].is_string()) << j.dump();
    const std::string from = j["lost"][0]["experts_from"].get<std::string>();
    const auto model = tensors_of(dir / "run" / "model.safetensors");
    for (int e = 0; e < 4; ++e) {
      EXPECT_TRUE(model.contains("h.0.mlp.experts." + std::to_string(e) + ".c_fc.weight")) << e;
    }
    if (after_checkpoint) {
      ASSERT_NE(from.find("/checkpoints/step-"), std::string::npos) << from;
      EXPECT_NE(err.find("as checkpoint '" + from + "' had them"), std::string::npos) << err;
      EXPECT_EQ(model.at("h.0.mlp.experts.1.c_fc.weight"),
                tensors_of(fs::path(from) / "model.safetensors").at("h.0.mlp.experts.1.c_fc.weight"));
    } else if (from == "initial values") {
      EXPECT_NE(err.find("holds them at their initial values"), std::string::npos) << err;
    }
  }
}

// cfmo with expert parallelism writes checkpoints during the run too: each
// rank's experts (with their optimizer state) and its own inner state come to
// the keeper by message, which writes the whole model. Resumed from one and
// stopped before a step, the run writes the same checkpoint again: every
// rank took its experts back and sent them as they were.
TEST(CfmoTrainWorkers, CfmoExpertParallelCheckpointAndResumeRestoreEveryRanksExperts) {
  TempDir dir;
  const std::vector<std::string> job = {"--workers", "3", "--mode", "cfmo", "--expert-parallel", "--dispatch", "async"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = job;
    all.insert(all.end(), extra.begin(), extra.end());
    return moe_args(dir / "corpus.txt", all);
  };
  const fs::path run_dir = dir / "run";
  const RunResult first = run(with({"--steps", "60", "--checkpoint-every", "10", "--keep-checkpoints", "100",
                                    "--slowdown", "0=2", "--out", run_dir.string(), "--json"}),
                              300);
  ASSERT_EQ(first.status, 0) << first.err;
  const auto saved = checkpoints_of(run_dir);
  ASSERT_FALSE(saved.empty());
  const fs::path at = saved.front();
  const auto params = tensors_of(at / "model.safetensors");
  const auto state = tensors_of(at / "optimizer.safetensors");
  for (int e = 0; e < 4; ++e) {
    const std::string name = "h.1.mlp.experts." + std::to_string(e) + ".c_proj.weight";
    EXPECT_TRUE(params.contains(name)) << name;
    EXPECT_TRUE(state.contains(name + ".exp_avg")) << name;
  }
  EXPECT_EQ(nlohmann::json::parse(slurp(at / "state.json"))["rank_optimizers"].size(), 2u);

  const fs::path idle = dir / "idle";
  expect_restored_as_saved(with({}), at, idle);
  EXPECT_EQ(tensors_of(idle / "model.safetensors"), params);
}

TEST(CfmoTrainWorkers, BadExpertParallelSpecsAreUsageErrorsInOneLine) {
  TempDir dir;
  auto fails = [&](std::vector<std::string> extra, const std::string& says) {
    SCOPED_TRACE(says);
    const RunResult r = run(moe_args(dir / "corpus.txt", extra), 60);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  fails({"--workers", "4", "--expert-parallel", "--steps", "1", "--model",
         "gpt:layers=1,heads=2,dim=16,context=16,experts=3,top_k=2"},
        "experts 3, fewer than the 4 workers");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--mode", "cfmo"},
        "--mode cfmo needs --dispatch async");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--mode", "asgd"}, "--expert-parallel: needs --mode");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--mode", "cfmo", "--dispatch", "async",
         "--dispatch-deadline", "none"},
        "--dispatch-deadline: none needs a lockstep --mode");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--model", "gpt:layers=1,heads=2,dim=16,context=16"},
        "has no experts");
  fails({"--steps", "1", "--model", "gpt:layers=1,heads=2,dim=16,context=16,experts=3,top_k=4"},
        "top_k 4 is more than experts 3");
  fails({"--steps", "1", "--model", "gpt:layers=1,heads=2,dim=16,context=16,experts=3,expert_dim=0"}, "expert_dim");
  fails({"--workers", "2", "--steps", "1", "--dispatch", "async"}, "--dispatch: async needs --expert-parallel");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--dispatch", "eventual"},
        "--dispatch: 'eventual' is not sync or async");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--dispatch", "async", "--dispatch-deadline", "0"},
        "--dispatch-deadline: must be > 0");
  fails({"--workers", "2", "--expert-parallel", "--steps", "1", "--dispatch", "async", "--dispatch-deadline", "soon"},
        "--dispatch-deadline");
}

TEST(CfmoTrainWorkers, BadWorldsAreUsageErrors) {
  const RunResult no_rendezvous = run(args({"--epochs", "1"}), 60, {"RANK=0", "WORLD_SIZE=2"});
  EXPECT_EQ(no_rendezvous.status, 2) << no_rendezvous.err;
  EXPECT_NE(no_rendezvous.err.find("CFMO_RENDEZVOUS"), std::string::npos);
  const RunResult bad_rank = run(args({"--epochs", "1"}), 60, {"RANK=5", "WORLD_SIZE=2"});
  EXPECT_EQ(bad_rank.status, 2) << bad_rank.err;
  EXPECT_EQ(run(args({"--workers", "2", "--mode", "gossip"}), 60).status, 2);
  EXPECT_EQ(run(args({"--workers", "2", "--slowdown", "7=2"}), 60).status, 2);
  EXPECT_EQ(run(args({"--workers", "2", "--straggler", "2:5"}), 60).status, 2);
  EXPECT_EQ(run(args({"--workers", "2", "--mode", "asgd", "--optimizer", "muon"}), 60).status, 2);
}

}  // namespace
}  // namespace cfmo
