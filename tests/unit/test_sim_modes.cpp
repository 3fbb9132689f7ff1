// The modes' own protocols on the simulator: sync waits for the slowest
// worker, cfmo does not; localsgd waits once a round; the network charges
// what a real model would send; step times come from flags or a measured
// run. Virtual time only: nothing here depends on how fast the machine is.
#include "sim/simulation.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

namespace cfmo::sim {
namespace {

/// A network that costs (almost) nothing, so only the step times matter.
SimulateOptions quiet(train::ModeKind kind, int workers, int64_t steps) {
  SimulateOptions o;
  o.workers = {workers};
  o.modes = {kind};
  o.steps = steps;
  o.batch = 10;
  o.params = 1000;
  o.step_times.step_time_s = 0.1;
  o.network.bandwidth = 1e15;
  o.network.latency = 0;
  o.settings.sync_interval = 5;
  return o;
}

SimulateRow run(const SimulateOptions& o) {
  auto row = simulate_one(o, o.modes.front(), o.workers.front());
  EXPECT_TRUE(row) << row.error().message;
  return row ? *row : SimulateRow{};
}

TEST(SimModes, HomogeneousSyncOnAFreeNetworkIsFullyEfficient) {
  const auto row = run(quiet(train::ModeKind::kSync, 4, 50));
  EXPECT_EQ(row.steps, 200);
  EXPECT_EQ(row.samples, 2000);
  EXPECT_NEAR(row.virtual_s, 5.0, 1e-9);
  EXPECT_NEAR(row.efficiency, 1.0, 1e-9);
  EXPECT_EQ(row.rounds, 50);  // one all-reduce a step
}

TEST(SimModes, SyncWaitsForTheSlowestWorker) {
  auto o = quiet(train::ModeKind::kSync, 4, 50);
  o.step_times.slowdown = {"3=2"};
  const auto row = run(o);
  EXPECT_NEAR(row.virtual_s, 50 * 0.2, 1e-9);  // every step at the slow worker's pace
  // Three workers wait 0.1 s a step: a mean of 3/4 of 5 s.
  EXPECT_NEAR(row.wait_s_mean, 0.75 * 5.0, 1e-9);
  EXPECT_NEAR(row.wait_s_max, 5.0, 1e-9);
  // 2000 samples in 10 s against solo rates 3 x 100 + 50.
  EXPECT_NEAR(row.efficiency, 200.0 / 350.0, 1e-9);
}

TEST(SimModes, CfmoDoesNotWaitForTheSlowestWorker) {
  auto o = quiet(train::ModeKind::kCfmo, 4, 50);
  o.step_times.slowdown = {"3=2"};
  const auto row = run(o);
  // The fast workers take more of the shared budget and never wait in their loop.
  EXPECT_GT(row.efficiency, 0.9);
  EXPECT_LT(row.virtual_s, 50 * 0.2 * 0.7);
  EXPECT_NEAR(row.wait_s_max, 0.0, 1e-12);
  EXPECT_GE(row.samples, 2000);
  EXPECT_GT(row.owner_received_max, 0u);
  EXPECT_GT(row.keeper_messages, 0u);  // every step's progress, to the budget keeper
}

TEST(SimModes, LocalSgdWaitsOnceARound) {
  auto o = quiet(train::ModeKind::kLocalSgd, 4, 50);
  o.step_times.slowdown = {"3=2"};
  const auto row = run(o);
  EXPECT_EQ(row.rounds, 10);               // H = 5
  EXPECT_NEAR(row.virtual_s, 10.0, 1e-9);  // still the slow worker's pace, waiting every 5 steps
  EXPECT_NEAR(row.wait_s_max, 5.0, 1e-9);
}

TEST(SimModes, TheNetworkChargesWhatARealModelWouldSend) {
  auto o = quiet(train::ModeKind::kSync, 4, 10);
  o.params = 1'000'000;
  o.network.bandwidth = 1e9;  // bytes/s
  o.network.latency = 1e-5;
  const auto row = run(o);
  // A ring of 4: each host sends 2 * 3/4 of the (params + count + votes) floats a step.
  const double per_step = 2.0 * 3 / 4 * 1'000'003.0 * 4;
  EXPECT_NEAR(static_cast<double>(row.host_uplinks.max_bytes), 10 * per_step, 10 * 8.0);
  const double ring = 6 * (1e-5 + (1'000'003.0 * 4 / 4) / 1e9);
  EXPECT_NEAR(row.virtual_s, 10 * (0.1 + ring), 1e-6);
  EXPECT_LT(row.efficiency, 1.0);
}

TEST(SimModes, CfmoRepliesComeBackStaleWhenTheNetworkIsSlow) {
  auto o = quiet(train::ModeKind::kCfmo, 4, 100);
  o.settings.sync_interval = 1;
  o.params = 4'000'000;
  o.network.bandwidth = 1e8;  // a shard takes ~40 ms: replies arrive after the next rounds started
  const auto row = run(o);
  uint64_t stale = 0;
  for (size_t s = 1; s < row.staleness_histogram.size(); ++s) stale += row.staleness_histogram[s];
  EXPECT_GT(stale, 0u);
  EXPECT_GT(row.host_uplinks.max_bytes, 0u);
}

TEST(SimModes, AsgdOwnersApplyEveryGradient) {
  const auto row = run(quiet(train::ModeKind::kAsgd, 3, 20));
  EXPECT_GE(row.samples, 600);
  // Every push of every worker reached its owner: steps x owners contributions in all.
  EXPECT_NEAR(row.owner_received_mean * 3, static_cast<double>(row.steps) * 3, 1e-9);
}

TEST(SimModes, WithKOwnersARoundIsWorkersTimesKMessagesAndOnlyTheOwnersReceive) {
  // 64 workers, 4 owners: every round of every worker is 4 deltas, each
  // answered and passed on to the shard's backup; the 4 owners share the
  // contributions, ranks 4..63 receive none.
  auto o = quiet(train::ModeKind::kCfmo, 64, 20);
  o.settings.owners = 4;
  const auto row = run(o);
  const double contributions = row.owner_received_mean * 64;
  EXPECT_GE(row.rounds, 4);
  EXPECT_NEAR(static_cast<double>(row.owner_received_max), contributions / 4, 1.0);
  // Deltas, replies and replicas; two progress reports a step; done and
  // all-done, the gather and gathered, the stop (64 each).
  const double protocol = 3 * contributions + 2.0 * static_cast<double>(row.steps) + 5 * 64;
  EXPECT_NEAR(static_cast<double>(row.messages), protocol, 64.0);
  o.settings.owners = 64;
  EXPECT_GT(run(o).messages, 3u * 64 * 64 * 4);  // K = W: every rank owns a shard
}

TEST(SimModes, AsgdWorkersWaitingOnSlowOwnersWakeByTheirReplies) {
  // Owners on a slow network: asgd's workers wait (max_staleness rounds
  // unanswered) for whole seconds; each wakes when a reply reaches it, not
  // every 10 us, so the events are about the messages.
  auto o = quiet(train::ModeKind::kAsgd, 32, 20);
  o.settings.owners = 2;
  o.settings.max_staleness = 1;
  o.params = 10'000'000;
  o.network.bandwidth = 1e9;
  const auto row = run(o);
  EXPECT_GT(row.wait_s_mean, 1.0);
  EXPECT_LT(row.events, 4 * row.messages);
}

TEST(SimModes, TheSameSeedGivesTheSameRowAndASweepHasARowPerSizeAndMode) {
  auto o = quiet(train::ModeKind::kSync, 8, 30);
  o.step_times.straggler = "0.1:3";
  o.step_times.thermal = "0.25:0.5:1";
  o.step_times.speeds = "0.5:0.8,0.5:1.0";
  const auto a = run(o);
  const auto b = run(o);
  EXPECT_EQ(a.virtual_s, b.virtual_s);
  EXPECT_LT(a.efficiency, 0.9);
  o.workers = {2, 8};
  o.modes = {train::ModeKind::kSync, train::ModeKind::kCfmo};
  auto rows = simulate(o);
  ASSERT_TRUE(rows) << rows.error().message;
  ASSERT_EQ(rows->size(), 4u);
  EXPECT_EQ((*rows)[3].mode, "cfmo");
  EXPECT_EQ((*rows)[3].workers, 8);
  const std::string svg = simulate_svg(*rows);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find(">cfmo<"), std::string::npos);
  EXPECT_NE(simulate_table(*rows).find("efficiency"), std::string::npos);
  EXPECT_EQ(simulate_json(*rows, o)["simulate"]["runs"].size(), 4u);
}

TEST(SimStepTimes, AMeasuredRunsComputeTimesAreDrawnFrom) {
  const auto path = std::filesystem::temp_directory_path() / ("cfmo-sim-metrics-" + std::to_string(::getpid()));
  {
    std::ofstream out(path);
    out << R"({"type":"step","step":1,"compute_s":0.2})"
        << "\n"
        << R"({"type":"eval","step":1})"
        << "\n"
        << R"({"type":"step","step":2,"compute_s":0.4})"
        << "\n";
  }
  auto measured = read_step_times(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(measured) << measured.error().message;
  EXPECT_EQ(*measured, (std::vector<double>{0.2, 0.4}));
  StepTimeOptions o;
  o.measured = *measured;
  auto times = StepTimes::make(o, 2);
  ASSERT_TRUE(times);
  EXPECT_NEAR(times->natural_mean(), 0.3, 1e-12);
  for (int i = 0; i < 20; ++i) {
    const double t = times->draw(1, 0);
    EXPECT_TRUE(t == 0.2 || t == 0.4) << t;
  }
  auto missing = read_step_times("/nonexistent/metrics.jsonl");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().kind, ErrorKind::kInput);
}

// A rank the run had replays its own steps in order (metrics-rank-R.jsonl
// beside metrics.jsonl), with the trainer's own time between them: the
// next line's wall_s less its compute_s and wait_s. Ranks past the run's
// draw from rank 0's.
TEST(SimStepTimes, ARecordedRanksStepsAreReplayedInOrderWithTheTimeBetweenThem) {
  const auto dir = std::filesystem::temp_directory_path() / ("cfmo-sim-replay-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream zero(dir / "metrics.jsonl");
    zero << R"({"type":"step","step":1,"compute_s":0.1,"wait_s":0.0,"wall_s":1.0})"
         << "\n"
         << R"({"type":"step","step":2,"compute_s":0.2,"wait_s":0.05,"wall_s":1.3})"
         << "\n"
         << R"({"type":"step","step":3,"compute_s":0.3,"wait_s":0.0,"wall_s":1.6})"
         << "\n";
    std::ofstream one(dir / "metrics-rank-1.jsonl");
    one << R"({"type":"step","step":1,"compute_s":0.7})"
        << "\n"
        << R"({"type":"step","step":2,"compute_s":0.9})"
        << "\n";
  }
  auto ranks = read_ranks_step_times(dir / "metrics.jsonl");
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(ranks) << ranks.error().message;
  ASSERT_EQ(ranks->size(), 2u);
  StepTimeOptions o;
  o.measured = (*ranks)[0].compute;
  o.by_rank = *ranks;
  auto times = StepTimes::make(o, 3);
  ASSERT_TRUE(times);
  std::vector<double> zero;
  std::vector<double> between;
  for (int k = 0; k < 4; ++k) {
    zero.push_back(times->draw(0, 0));
    between.push_back(times->between(0));
  }
  EXPECT_EQ(zero, (std::vector<double>{0.1, 0.2, 0.3, 0.1}));
  ASSERT_EQ(between.size(), 4u);
  EXPECT_NEAR(between[0], 1.3 - 1.0 - 0.2 - 0.05, 1e-12);
  EXPECT_NEAR(between[1], 0.0, 1e-12);  // 1.6 - 1.3 - 0.3: none
  EXPECT_EQ(between[2], 0.0);           // the last step: nothing after it was recorded
  EXPECT_EQ(times->draw(1, 0), 0.7);
  EXPECT_EQ(times->draw(1, 0), 0.9);
  EXPECT_EQ(times->between(1), 0.0);  // no wait_s recorded: none
  for (int k = 0; k < 10; ++k) {
    const double t = times->draw(2, 0);  // not in the run: rank 0's, drawn
    EXPECT_TRUE(t == 0.1 || t == 0.2 || t == 0.3) << t;
  }
}

TEST(SimStepTimes, BadFlagsAreNamed) {
  for (auto [flag, set] : std::vector<std::pair<std::string, std::function<void(StepTimeOptions&)>>>{
           {"--thermal", [](StepTimeOptions& o) { o.thermal = "0.5:2:1"; }},
           {"--thermal", [](StepTimeOptions& o) { o.thermal = "0.5:0.5"; }},
           {"--speeds", [](StepTimeOptions& o) { o.speeds = "0.5:0.8,0.4:1"; }},
           {"--speeds", [](StepTimeOptions& o) { o.speeds = "1:0"; }},
           {"--slowdown", [](StepTimeOptions& o) { o.slowdown = {"9=2"}; }},
           {"--straggler", [](StepTimeOptions& o) { o.straggler = "2:2"; }},
       }) {
    StepTimeOptions o;
    set(o);
    auto t = StepTimes::make(o, 4);
    ASSERT_FALSE(t) << flag;
    EXPECT_EQ(t.error().kind, ErrorKind::kUsage);
    EXPECT_NE(t.error().message.find(flag), std::string::npos) << t.error().message;
  }
}

}  // namespace
}  // namespace cfmo::sim

namespace cfmo::sim {
namespace {

TEST(SimMath, WithMathTheWorkersTrainAndTheGlobalParametersAreEvaluated) {
  auto o = quiet(train::ModeKind::kSync, 4, 60);
  o.math = true;
  o.data = "synthetic:1024:256";
  o.model = "mlp:16";
  for (train::ModeKind kind : {train::ModeKind::kSync, train::ModeKind::kCfmo}) {
    o.modes = {kind};
    const auto row = run(o);
    EXPECT_GT(row.test_accuracy, 0.3) << row.mode;  // 10 classes: chance is 0.1
    EXPECT_GT(row.test_loss, 0) << row.mode;
    EXPECT_GT(row.host_uplinks.max_bytes, 0u) << row.mode;  // the model's own floats
  }
  o.workers = {kMaxMathWorkers + 1};
  auto refused = simulate_one(o, train::ModeKind::kSync, kMaxMathWorkers + 1);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().kind, ErrorKind::kUsage);
  EXPECT_NE(refused.error().message.find("--math"), std::string::npos);
}

}  // namespace
}  // namespace cfmo::sim
