// cfmo-train simulate, the built binary: its flags' errors, its JSON and
// plot, and its figures against the real runs it simulates. No timing is
// asserted: the simulation and the real run are compared with each other.
#include "integration/harness.h"
#include "integration/one_line_error.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace cfmo {
namespace {

using testing::expect_one_line_error;
using testing::lines;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;

std::string binary() { return testing::env_or("CFMO_TRAIN", "build/tools/cfmo-train"); }

RunResult simulate(std::vector<std::string> extra) {
  std::vector<std::string> args = {binary(), "simulate"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run(args);
}

TEST(CfmoTrainSimulate, BadFlagsExitTwoWithOneLineNamingTheFlag) {
  expect_one_line_error(simulate({"--workers", "0"}), 2, "--workers");
  expect_one_line_error(simulate({"--workers", "8,x"}), 2, "--workers");
  expect_one_line_error(simulate({"--mode", "ring"}), 2, "--mode");
  expect_one_line_error(simulate({"--mode", "sync", "--compare"}), 2, "--compare");
  expect_one_line_error(simulate({"--topology", "ring"}), 2, "--topology");
  expect_one_line_error(simulate({"--topology", "racks:4:0.5"}), 2, "--topology");
  expect_one_line_error(simulate({"--thermal", "0.5:2:1"}), 2, "--thermal");
  expect_one_line_error(simulate({"--speeds", "0.5:0.8"}), 2, "--speeds");
  expect_one_line_error(simulate({"--workers", "4", "--slowdown", "9=2"}), 2, "--slowdown");
  expect_one_line_error(simulate({"--straggler", "2:2"}), 2, "--straggler");
  expect_one_line_error(simulate({"--delta-dtype", "fp8"}), 2, "--delta-dtype");
  // A range the option table checks: its line, and a hint to --help.
  const RunResult owners = simulate({"--owners", "-1"});
  EXPECT_EQ(owners.status, 2);
  EXPECT_NE(owners.err.find("--owners"), std::string::npos) << owners.err;
  expect_one_line_error(simulate({"--step-time", "0.1", "--step-times", "x"}), 2, "--step-times");
  expect_one_line_error(simulate({"--step-times", "/nonexistent/metrics.jsonl"}), 3, "metrics.jsonl");
}

TEST(CfmoTrainSimulate, ASweepHasARowPerSizeAndModeInJsonAndAPlot) {
  TempDir dir;
  const auto plot = dir / "efficiency.svg";
  const RunResult r = simulate(
      {"--workers", "2,4", "--compare", "--steps", "20", "--topology", "racks:2:4", "--json", "--plot", plot.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto& runs = j["simulate"]["runs"];
  ASSERT_EQ(runs.size(), 8u);
  for (const auto& row : runs) {
    for (const char* key : {"mode", "workers", "samples_per_s", "efficiency", "wait_s", "links", "owners",
                            "staleness_histogram", "wall_s"}) {
      EXPECT_TRUE(row.contains(key)) << key;
    }
    EXPECT_GT(row["links"]["spine_up"]["max_bytes"].get<double>(), 0) << row.dump();
  }
  EXPECT_EQ(runs[7]["mode"], "cfmo");
  EXPECT_EQ(runs[7]["workers"], 4);
  EXPECT_EQ(runs[7]["owners"]["count"], 4);  // min(W, 16)
  EXPECT_EQ(runs[4]["owners"]["count"], 0);  // sync has none
  const std::string svg = slurp(plot);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  // The table otherwise, with what it runs on standard error.
  const RunResult table = simulate({"--workers", "4", "--steps", "10"});
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("efficiency"), std::string::npos);
  EXPECT_NE(table.err.find("sync on 4 workers"), std::string::npos);
}

// Real runs of 2 workers, and the simulations of the same jobs from their
// own metrics.jsonl's step times: samples/s and efficiency.
//
// The network of this host is not a switch of known links: the workers'
// all-reduce goes through UCX over shared memory on a shared, often loaded
// machine. So it is measured once, from the homogeneous sync run (its
// all-reduce seconds per step, the wait, give an effective bandwidth), and
// the other three runs (sync with a 2x slower worker, cfmo homogeneous and
// slowed) are predictions on that network.
//
// The bound is loose on purpose: a short run on a shared machine is noisy,
// and what the model leaves out (a waiting worker that still takes CPU
// from a computing one; the all-reduce's own CPU time) is larger here than
// on a cluster. The 10% figures are for bench/simulate_vs_real.sh on a
// quiet machine; this test catches a simulator wrong in kind: sync not
// waiting for its slow worker (efficiency 1 instead of about 2/3), cfmo
// waiting for it, or rates off by 2x.
struct Measured {
  nlohmann::json summary;
  std::filesystem::path metrics;
};

Measured run_real(const TempDir& dir, const std::string& name, const std::string& mode,
                  const std::vector<std::string>& slow) {
  std::vector<std::string> args = {binary(), "--workers",           "2",       "--mode",      mode,
                                   "--data", "synthetic:4096:256",  "--model", "mlp:256,256", "--steps",
                                   "150",    "--batch-size",        "64",      "--log-every", "1",
                                   "--out",  (dir / name).string(), "--quiet", "--json"};
  args.insert(args.end(), slow.begin(), slow.end());
  const RunResult r = run(args, 300);
  EXPECT_EQ(r.status, 0) << r.err;
  return {nlohmann::json::parse(lines(r.out).back()), dir / name / "metrics.jsonl"};
}

nlohmann::json run_simulated(const Measured& m, const std::string& mode, const std::vector<std::string>& slow,
                             double bandwidth_gbit) {
  std::vector<std::string> args = {"--workers",
                                   "2",
                                   "--mode",
                                   mode,
                                   "--steps",
                                   "150",
                                   "--batch-size",
                                   "64",
                                   "--params",
                                   std::to_string(m.summary["parameters"].get<int64_t>()),
                                   "--step-times",
                                   m.metrics.string(),
                                   "--link-bandwidth",
                                   fmt::format("{}", bandwidth_gbit),
                                   "--link-latency",
                                   "0",
                                   "--json"};
  args.insert(args.end(), slow.begin(), slow.end());
  const RunResult s = simulate(args);
  EXPECT_EQ(s.status, 0) << s.err;
  return nlohmann::json::parse(s.out)["simulate"]["runs"][0];
}

TEST(CfmoTrainSimulate, TwoWorkersAsSimulatedAndAsRun) {
  TempDir dir;
  const std::vector<std::string> slow = {"--slowdown", "1=2"};
  const Measured calibration = run_real(dir, "sync", "sync", {});
  // A ring of 2 sends (params + count + votes) floats each way per step, in wait_s / steps seconds.
  double wait = 0;
  for (const auto& w : calibration.summary["per_worker"]) wait += w["wait_s"].get<double>() / 2;
  const double floats = calibration.summary["parameters"].get<double>() + 3;
  const double bandwidth_gbit = 8 * floats * 4 / std::max(wait / 150, 1e-6) / 1e9;
  RecordProperty("effective_bandwidth_gbit", fmt::format("{:.2f}", bandwidth_gbit));
  for (const std::string mode : {"sync", "cfmo"}) {
    for (bool slowed : {false, true}) {
      const std::vector<std::string> flags = slowed ? slow : std::vector<std::string>{};
      const Measured real =
          mode == "sync" && !slowed ? calibration : run_real(dir, mode + (slowed ? "-slow" : ""), mode, flags);
      const auto sim = run_simulated(real, mode, flags, bandwidth_gbit);
      const double real_sps = real.summary["samples_per_s"].get<double>();
      const double real_eff = real.summary["efficiency"].get<double>();
      const double sim_sps = sim["samples_per_s"].get<double>();
      const double sim_eff = sim["efficiency"].get<double>();
      const std::string what = mode + (slowed ? " --slowdown 1=2" : " homogeneous");
      RecordProperty(
          what, fmt::format("real {:.0f}/s {:.2f}, simulated {:.0f}/s {:.2f}", real_sps, real_eff, sim_sps, sim_eff));
      EXPECT_NEAR(sim_eff, real_eff, 0.2) << what;
      EXPECT_GT(sim_sps, real_sps / 2) << what;
      EXPECT_LT(sim_sps, real_sps * 2) << what;
    }
  }
}

}  // namespace
}  // namespace cfmo
