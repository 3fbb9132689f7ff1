// The modes' protocols over the in-process loopback transport: W ranks in
// one process, a tiny parameter vector, no model. The asynchronous modes are
// driven step by step from one thread, with the network drained between
// steps (and links held to make a contribution stale), so every figure is
// exact; the blocking ones (sync, localsgd, every finish) run a thread per
// rank. No assertion on timing.
#include "comm/loopback.h"
#include "train/modes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <thread>

namespace cfmo::train {
namespace {

/// A Mode::join's outcome as a status: the run ending first is a failure here.
Status taken_in(const Result<Joined>& joined) {
  if (!joined) return joined.error();
  if (*joined != Joined::kTakenIn) return make_error(ErrorKind::kPeer, "the run ended before it was taken in");
  return {};
}

constexpr size_t kSize = 96;  // shards of 48 floats for 2 workers, 32 for 3 (16-float boundaries)

struct Cluster {
  Cluster(int workers, ModeSettings given, comm::LoopbackOptions options = {})
      : settings(std::move(given)), world(comm::make_loopback_world(workers, options)) {
    settings.delta_dtype = comm::WireDtype::kFp32;  // exact sums
    sgd.kind = optim::OptimizerKind::kSgd;
    sgd.momentum = 0.9;
    for (int r = 0; r < workers; ++r) {
      auto mode = make_mode(settings, world.ranks[static_cast<size_t>(r)].get(), layout, initial, sgd);
      EXPECT_TRUE(mode) << mode.error().message;
      modes.push_back(std::move(*mode));
      params.push_back(initial);
      optimizers.push_back(std::move(*optim::make_optimizer(sgd, layout, kSize)));
    }
  }
  ~Cluster() { modes.clear(); }  // before the communicators their handlers are on

  Mode& mode(int r) { return *modes[static_cast<size_t>(r)]; }
  std::vector<float>& param(int r) { return params[static_cast<size_t>(r)]; }

  /// after_step of rank r at `step`, with `samples` examples so far.
  Status step(int r, int64_t step, int64_t samples = 0) {
    TrainPosition position;
    position.step = step;
    position.samples = samples;
    return mode(r).after_step(position, param(r), *optimizers[static_cast<size_t>(r)]);
  }

  /// Runs body(r) on a thread per rank (for what blocks: collectives, finish).
  std::vector<Status> on_every_rank(const std::function<Status(int)>& body, const std::vector<int>& ranks = {}) {
    std::vector<int> who = ranks;
    if (who.empty()) {
      for (int r = 0; r < static_cast<int>(modes.size()); ++r) who.push_back(r);
    }
    std::vector<Status> out(modes.size());
    std::vector<std::thread> threads;
    for (int r : who) threads.emplace_back([&, r] { out[static_cast<size_t>(r)] = body(r); });
    for (auto& t : threads) t.join();
    return out;
  }

  Status finish(int r) { return mode(r).finish(param(r), *optimizers[static_cast<size_t>(r)]); }

  /// The keeper's (rank 0's unless told) snapshot of the owners' shards, after the network is quiet.
  std::optional<GlobalState> snapshot(int keeper = 0) {
    EXPECT_TRUE(mode(keeper).request_snapshot());
    EXPECT_TRUE(world.network->drain());
    return mode(keeper).take_snapshot();
  }

  /// Kills `rank` (as a process dies) and waits until every other live rank found it lost.
  void kill(int rank, const std::vector<int>& survivors) {
    world.network->kill(rank);
    for (int r : survivors) {
      const auto& comm = *world.ranks[static_cast<size_t>(r)];
      for (;;) {
        const auto lost = comm.lost_ranks();
        if (std::find(lost.begin(), lost.end(), rank) != lost.end()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  /// A new process in killed `rank`'s place (LoopbackNetwork::join, as
  /// `cfmo-train --join`): the old mode and Communicator go, the new rank's
  /// mode comes, not yet joined (Mode::join is the caller's).
  void rejoin(int rank) {
    const auto r = static_cast<size_t>(rank);
    modes[r].reset();
    world.ranks[r].reset();
    auto joined = world.network->join(rank);
    ASSERT_TRUE(joined) << joined.error().message;
    world.ranks[r] = std::move(*joined);
    auto mode = make_mode(settings, world.ranks[r].get(), layout, initial, sgd);
    ASSERT_TRUE(mode) << mode.error().message;
    modes[r] = std::move(*mode);
    params[r].assign(kSize, 0.0f);  // nothing of the old process's
    optimizers[r] = std::move(*optim::make_optimizer(sgd, layout, kSize));
  }

  /// A new process joins with no rank lost (LoopbackNetwork::join of the
  /// world's size): the world grows by a rank, whose mode comes, not yet joined.
  void grow() {
    auto joined = world.network->join(static_cast<int>(modes.size()));
    ASSERT_TRUE(joined) << joined.error().message;
    world.ranks.push_back(std::move(*joined));
    auto mode = make_mode(settings, world.ranks.back().get(), layout, initial, sgd);
    ASSERT_TRUE(mode) << mode.error().message;
    modes.push_back(std::move(*mode));
    params.emplace_back(kSize, 0.0f);
    optimizers.push_back(std::move(*optim::make_optimizer(sgd, layout, kSize)));
  }

  /// The joiner's Mode::join: its parameters and position from the run.
  Status join(int rank, TrainPosition& position) {
    return taken_in(mode(rank).join(param(rank), *optimizers[static_cast<size_t>(rank)], position));
  }

  /// A round of the ranks in `who` at `step`: each adds `delta` to its
  /// parameters, then steps; the network is drained after.
  void round(const std::vector<int>& who, int64_t step, float delta, int64_t samples = 0) {
    for (int r : who) {
      for (auto& v : param(r)) v += delta;
      EXPECT_TRUE(step_ok(r, step, samples));
    }
    EXPECT_TRUE(world.network->drain());
  }
  bool step_ok(int r, int64_t at, int64_t samples) {
    const Status s = step(r, at, samples);
    return static_cast<bool>(s);
  }

  ModeSettings settings;
  optim::OptimizerConfig sgd;
  const std::vector<model::ParamInfo> layout = {{"w", {static_cast<int64_t>(kSize)}, 0, kSize}};
  std::vector<float> initial = std::vector<float>(kSize, 1.0f);
  comm::LoopbackWorld world;
  std::vector<std::unique_ptr<Mode>> modes;
  std::vector<std::vector<float>> params;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
};

ModeSettings settings_for(const char* name, int sync_interval = 1) {
  ModeSettings s;
  s.kind = *parse_mode(name);
  s.sync_interval = sync_interval;
  s.outer_optimizer = OuterKind::kAvg;  // plain averaging: the global is the mean of what arrived
  s.outer_lr = 1.0;
  s.peer_timeout_s = 5;  // only the finish's deadlines: nothing here waits that long
  // cfmo's owners answer each contribution at once: the protocol these tests
  // follow message by message. Answering by rounds (the default) is CfmoReplyHold's.
  s.hold_replies = false;
  return s;
}

// cfmo --deterministic with Nesterov's outer step: momentum carried across
// rounds, so a round applied in another order would show in every bit.
ModeSettings deterministic_nesterov_settings() {
  auto s = settings_for("cfmo");
  s.outer_optimizer = OuterKind::kNesterov;
  s.outer_lr = 0.7;
  s.outer_momentum = 0.9;
  s.deterministic = true;
  return s;
}

// A delta of worker k, element i: anything that differs.
float delta_of(int k, size_t i) { return 0.25f * static_cast<float>(k + 1) + 0.01f * static_cast<float>(i); }

TEST(SyncProtocol, GradientsBecomeTheirExampleWeightedMeanAndAStopVoteIsAgreed) {
  Cluster c(3, settings_for("sync"));
  std::vector<std::vector<float>> grads(3, std::vector<float>(kSize));
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < kSize; ++i) grads[static_cast<size_t>(k)][i] = delta_of(k, i);
  }
  const auto expected = [&](size_t i) {  // counts 1, 2, 3
    return (1 * delta_of(0, i) + 2 * delta_of(1, i) + 3 * delta_of(2, i)) / 6;
  };
  c.mode(1).want_stop("interrupt");
  auto results =
      c.on_every_rank([&](int r) { return c.mode(r).on_gradients(grads[static_cast<size_t>(r)], r + 1, 0.1f); });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    for (size_t i = 0; i < kSize; ++i) EXPECT_FLOAT_EQ(grads[static_cast<size_t>(r)][i], expected(i));
    EXPECT_TRUE(c.mode(r).stop_requested());
    EXPECT_EQ(c.mode(r).agreed_reason(), "interrupt");
  }
}

TEST(LocalSgdProtocol, ARoundOfAveragingLeavesEveryRankOnTheMean) {
  constexpr int kH = 3;
  Cluster c(3, settings_for("localsgd", kH));
  c.mode(2).want_stop("time-limit");
  auto results = c.on_every_rank([&](int r) -> Status {
    for (int step = 1; step <= kH; ++step) {
      for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
      CFMO_TRY(c.step(r, step));
      // Between rounds the parameters are the rank's own; at a round's end, the global ones.
      if (c.mode(r).params_are_global() != (step == kH)) return make_error(ErrorKind::kInternal, "params_are_global");
    }
    return {};
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    for (size_t i = 0; i < kSize; ++i) {
      const float mean = kH * (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3;
      EXPECT_NEAR(c.param(r)[i], 1.0f + mean, 1e-5f) << "rank " << r << " element " << i;
    }
    EXPECT_EQ(c.mode(r).stats().rounds, 1);
    EXPECT_TRUE(c.mode(r).stop_requested());
    EXPECT_EQ(c.mode(r).agreed_reason(), "time-limit");
  }
}

TEST(CfmoProtocol, DeltasReachTheirOwnersAndFreshShardsRebaseTheWorkers) {
  Cluster c(2, settings_for("cfmo"));
  for (int k = 0; k < 2; ++k) {
    for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += delta_of(k, i);
    ASSERT_TRUE(c.step(k, 1));
  }
  ASSERT_TRUE(c.world.network->drain());
  // Both deltas are in, fresh (staleness 0): each owner's shard is the mean.
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(global->params[i], 1.0f + (delta_of(0, i) + delta_of(1, i)) / 2, 1e-6f) << i;
  }
  EXPECT_EQ(global->versions, (std::vector<int64_t>{2, 2}));
  EXPECT_FALSE(c.mode(0).take_snapshot().has_value());  // a snapshot is taken once
  // Rank 1 trains on (adds E) before the replies are applied: the rebase
  // keeps that progress on top of the fresh shards.
  for (size_t i = 0; i < kSize; ++i) c.param(1)[i] += 0.5f;
  ASSERT_TRUE(c.mode(1).needs_params(TrainPosition{}));  // replies wait: the parameters are needed
  ASSERT_TRUE(c.step(1, 2));
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(c.param(1)[i], global->params[i] + 0.5f, 1e-6f) << i;
  const auto stats = c.mode(1).stats();
  EXPECT_EQ(stats.contributions_sent, 4u);  // two rounds, two owners
  EXPECT_EQ(stats.staleness_histogram[0], 2u);
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_EQ(c.mode(0).stats().contributions_applied, 3u);  // as owner of shard 0: round 1's two, rank 1's second
}

// --deterministic: an owner holds a round until every rank's delta is in
// and applies them in rank order, and every worker leaves its round on the
// global parameters: the order in which the deltas arrive changes no bit.
TEST(CfmoProtocol, DeterministicRoundsApplyInRankOrderWhateverTheArrivalOrder) {
  auto settings = deterministic_nesterov_settings();
  std::vector<std::vector<float>> globals;
  for (int first : {0, 1}) {
    Cluster c(2, settings);
    const int second = 1 - first;
    // The second rank's deltas wait on their links while the first's reach the owners.
    c.world.network->hold(second, 0);
    c.world.network->hold(second, 1);
    for (int k = 0; k < 2; ++k) {
      for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += 0.37f * delta_of(k, i) / static_cast<float>(i + 3);
    }
    std::thread releaser([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      c.world.network->release(second, 0);
      c.world.network->release(second, 1);
    });
    const auto done = c.on_every_rank([&](int r) { return c.step(r, 1); });  // each waits for its replies
    releaser.join();
    for (const Status& s : done) ASSERT_TRUE(s) << s.error().message;
    ASSERT_TRUE(c.world.network->drain());
    EXPECT_TRUE(c.mode(0).params_are_global());
    EXPECT_EQ(c.param(0), c.param(1)) << "the workers left the round on different parameters";
    auto global = c.snapshot();
    ASSERT_TRUE(global);
    EXPECT_EQ(global->params, c.param(0));
    EXPECT_EQ(global->outer_in_round, (std::vector<int64_t>{0, 0}));  // a whole round: its momentum step taken
    EXPECT_EQ(c.mode(0).stats().staleness_histogram[0], 2u);          // every contribution fresh
    globals.push_back(global->params);
  }
  EXPECT_EQ(globals[0], globals[1]);
}

// Without --deterministic a snapshot mid-round carries the owners' pending
// round (its contributions so far and their weighted sum), which a
// checkpoint keeps for the owner that resumes the shard.
TEST(CfmoProtocol, ASnapshotCarriesTheOwnersPendingRound) {
  auto settings = settings_for("cfmo");
  settings.outer_optimizer = OuterKind::kNesterov;
  Cluster c(2, settings);
  for (size_t i = 0; i < kSize; ++i) c.param(0)[i] += delta_of(0, i);
  ASSERT_TRUE(c.step(0, 1));  // rank 0's delta only: half a round on each shard
  ASSERT_TRUE(c.world.network->drain());
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  EXPECT_EQ(global->outer_in_round, (std::vector<int64_t>{1, 1}));
  ASSERT_EQ(global->outer_round_sum.size(), kSize);
  for (size_t i = 0; i < kSize; ++i) EXPECT_FLOAT_EQ(global->outer_round_sum[i], delta_of(0, i) / 2) << i;
  for (float m : global->outer_momentum) EXPECT_EQ(m, 0.0f);  // no momentum step yet
}

// Rank 1's delta to owner 0 is held while rank 0 makes four contributions
// to that shard: it arrives 4 / W = 2 rounds stale.
struct Stale {
  int max_staleness;
  bool applied;
};
class CfmoStaleness : public ::testing::TestWithParam<Stale> {};

TEST_P(CfmoStaleness, AStaleDeltaIsWeightedByBetaToTheStalenessOrDroppedBeyondTheLimit) {
  auto settings = settings_for("cfmo");
  settings.staleness_discount = 0.5;
  settings.max_staleness = GetParam().max_staleness;
  Cluster c(2, settings);
  c.world.network->hold(1, 0);
  const size_t shard0 = 48;                                   // shard 0 of two: [0, 48)
  for (size_t i = 0; i < shard0; ++i) c.param(1)[i] += 1.0f;  // rank 1's delta: ones on shard 0
  ASSERT_TRUE(c.step(1, 1));
  for (int step = 1; step <= 4; ++step) {  // rank 0's zero deltas: versions, no values
    ASSERT_TRUE(c.step(0, step));
    ASSERT_TRUE(c.world.network->drain());
  }
  // Rank 1's optimizer momentum on shard 0, to see it discounted by the rebase.
  auto& momentum = *c.optimizers[1]->state()[0].buffer;
  std::fill(momentum.begin(), momentum.end(), 1.0f);
  c.world.network->release(1, 0);
  ASSERT_TRUE(c.world.network->drain());
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  const float weight = GetParam().applied ? 0.25f / 2 : 0.0f;  // beta^2 / W
  for (size_t i = 0; i < shard0; ++i) EXPECT_FLOAT_EQ(global->params[i], 1.0f + weight) << i;
  ASSERT_TRUE(c.step(1, 2));  // takes the reply
  const auto stats = c.mode(1).stats();
  EXPECT_EQ(stats.staleness_histogram[std::min<size_t>(2, stats.staleness_histogram.size() - 1)], 1u);
  EXPECT_EQ(stats.contributions_dropped, GetParam().applied ? 0u : 1u);
  if (GetParam().applied) {
    // The reply is version 5, rank 1's base 0: (5 - 0 - 1) / W = 2 rounds behind, beta^2.
    EXPECT_FLOAT_EQ(momentum[0], 0.25f);
    EXPECT_FLOAT_EQ(c.param(1)[0], 1.0f + weight);  // the fresh shard; no progress since the send
  }
  EXPECT_FLOAT_EQ(momentum[shard0], 1.0f);  // shard 1 was fresh
}

INSTANTIATE_TEST_SUITE_P(Limits, CfmoStaleness, ::testing::Values(Stale{4, true}, Stale{1, false}),
                         [](const auto& info) { return info.param.applied ? "Applied" : "Dropped"; });

// --reply-hold round: the first worker's reply waits for the rest of its
// round, so both workers rebase on the shard with both deltas in it.
TEST(CfmoReplyHold, EveryWorkerOfARoundRebasesOnTheShardWithTheWholeRoundInIt) {
  auto settings = settings_for("cfmo", 2);
  settings.hold_replies = true;
  Cluster c(2, settings);
  TrainPosition next;
  next.step = 3;
  for (size_t i = 0; i < kSize; ++i) c.param(0)[i] += delta_of(0, i);
  ASSERT_TRUE(c.step(0, 1));
  ASSERT_TRUE(c.step(0, 2));  // its round
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_FALSE(c.mode(0).needs_params(next));  // no reply yet: held for rank 1's
  for (size_t i = 0; i < kSize; ++i) c.param(1)[i] += delta_of(1, i);
  ASSERT_TRUE(c.step(1, 1));
  ASSERT_TRUE(c.step(1, 2));
  ASSERT_TRUE(c.world.network->drain());
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(c.mode(k).needs_params(next)) << k;
    ASSERT_TRUE(c.step(k, 3));
  }
  for (size_t i = 0; i < kSize; ++i) {
    const float mean = 1.0f + (delta_of(0, i) + delta_of(1, i)) / 2;
    EXPECT_NEAR(c.param(0)[i], mean, 1e-6f) << i;
    EXPECT_NEAR(c.param(1)[i], mean, 1e-6f) << i;
  }
  for (int owner = 0; owner < 2; ++owner) {
    EXPECT_EQ(c.mode(owner).stats().replies_held, 1) << owner;  // rank 0's; rank 1's waited for nobody
    EXPECT_EQ(c.mode(owner).stats().reply_rounds_cut, 0) << owner;
  }
}

// A slow link (held) keeps rank 2's delta from owner 0: owner 0 answers the
// others after 2H of its own steps, and their rounds of shard 0 wait for that
// answer (deferred) instead of queueing behind it; the late delta, when it
// comes, is applied and starts the next round.
TEST(CfmoReplyHold, ASlowLinkCutsTheRoundAfterTwoRoundsOfTheOwnersStepsAndTheOthersDefer) {
  auto settings = settings_for("cfmo", 2);
  settings.hold_replies = true;
  // Rank 1's deferred shard 0 (nothing new in it) goes when its reply is in,
  // and may reach owner 0 before or after rank 2's released delta: that
  // order decides the latter's staleness, not what this test is about.
  settings.staleness_discount = 1.0;
  Cluster c(3, settings);
  c.world.network->hold(2, 0);
  c.round({0, 1, 2}, 1, 0.0f);
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += delta_of(k, i);
  }
  c.round({0, 1, 2}, 2, 0.0f);  // everyone's round; shard 0's lacks rank 2's
  for (int64_t step = 3; step <= 5; ++step) c.round({0, 1, 2}, step, 0.0f);
  EXPECT_EQ(c.mode(0).stats().reply_rounds_cut, 0);  // 3 steps since: still held
  const int64_t deferred_before = c.mode(1).stats().deferred;
  c.round({0, 1, 2}, 6, 0.0f);  // owner 0's 4th step since (2H): answered
  EXPECT_EQ(c.mode(0).stats().reply_rounds_cut, 1);
  EXPECT_EQ(c.mode(0).stats().replies_held, 2);
  EXPECT_GT(c.mode(1).stats().deferred, deferred_before);  // shard 0 waited at step 6
  ASSERT_TRUE(c.step(1, 7));
  for (size_t i = 0; i < 32; ++i) {  // shard 0 of three: ranks 0 and 1's deltas, a third each
    EXPECT_NEAR(c.param(1)[i], 1.0f + (delta_of(0, i) + delta_of(1, i)) / 3, 1e-6f) << i;
  }
  c.world.network->release(2, 0);
  ASSERT_TRUE(c.world.network->drain());
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < 32; ++i) {
    EXPECT_NEAR(global->params[i], 1.0f + (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3, 1e-5f) << i;
  }
}

TEST(CfmoProtocol, ASnapshotRequestSupersedesNoneStillBeingAnswered) {
  Cluster c(2, settings_for("cfmo"));
  c.world.network->hold(1, 0);  // owner 1's answer waits
  ASSERT_TRUE(c.mode(0).request_snapshot());
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_FALSE(c.mode(0).take_snapshot().has_value());  // not complete: owner 1 has not answered
  ASSERT_TRUE(c.mode(0).request_snapshot());            // covered by the one in progress
  c.world.network->release(1, 0);
  ASSERT_TRUE(c.world.network->drain());
  auto global = c.mode(0).take_snapshot();
  ASSERT_TRUE(global);
  EXPECT_EQ(global->params, c.initial);
  EXPECT_FALSE(c.mode(1).request_snapshot());  // only rank 0 asks
}

TEST(CfmoProtocol, TheBudgetKeeperStopsEveryRankOnceTheSamplesAreDone) {
  auto settings = settings_for("cfmo", 100);
  settings.sample_budget = 30;
  Cluster c(3, settings);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(c.step(r, 1, 8));
  ASSERT_TRUE(c.world.network->drain());
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(c.mode(r).stop_requested()) << r;  // 24 of 30
  ASSERT_TRUE(c.step(1, 2, 16));
  ASSERT_TRUE(c.world.network->drain());
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(c.mode(r).stop_requested()) << r;  // 32
}

TEST(CfmoProtocol, FinishSendsTheLastProgressAndLeavesTheGlobalParametersOnRankZero) {
  constexpr int kH = 4;
  Cluster c(3, settings_for("cfmo", kH));
  // Two steps of progress, no round yet (H = 4): finish's last round carries it.
  for (int r = 0; r < 3; ++r) {
    for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
    ASSERT_TRUE(c.step(r, 2));
  }
  auto results = c.on_every_rank([&](int r) { return c.finish(r); });
  for (int r = 0; r < 3; ++r)
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(c.param(0)[i], 1.0f + (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3, 1e-6f) << i;
  }
  auto final_state = c.mode(0).final_state();
  ASSERT_TRUE(final_state);
  EXPECT_EQ(final_state->params, c.param(0));
  EXPECT_EQ(final_state->ranks.size(), 3u);
  EXPECT_EQ(final_state->ranks[2].step, 2);
  EXPECT_FALSE(c.mode(1).final_state());
}

TEST(CfmoProtocol, ALostRankDoesNotStopTheOthers) {
  auto settings = settings_for("cfmo");
  settings.peer_timeout_s = 1;
  Cluster c(3, settings, {.peer_timeout_s = 0.05});
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(c.step(r, 1));
  ASSERT_TRUE(c.world.network->drain());
  c.world.network->silence(2);
  for (int r : {0, 1}) {
    while (c.world.ranks[static_cast<size_t>(r)]->lost_ranks().empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // The survivors go on: the lost owner's shard goes to its backup, and their deltas to the others still arrive.
  for (int step = 2; step <= 4; ++step) {
    for (int r : {0, 1}) {
      for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += 0.125f;
      ASSERT_TRUE(c.step(r, step));
    }
    ASSERT_TRUE(c.world.network->drain());
  }
  auto results = c.on_every_rank([&](int r) { return c.finish(r); }, {0, 1});
  ASSERT_TRUE(results[0]) << results[0].error().message;
  ASSERT_TRUE(results[1]) << results[1].error().message;
  auto final_state = c.mode(0).final_state();
  ASSERT_TRUE(final_state);
  // Shards 0 and 1 took three rounds of both survivors' +0.125, each round their mean (1 / W_live = 1 / 2).
  EXPECT_NEAR(final_state->params[0], 1.0f + 3 * 0.125f, 1e-5f);
  EXPECT_NEAR(final_state->params[40], 1.0f + 3 * 0.125f, 1e-5f);
  EXPECT_GT(c.mode(0).stats().contributions_sent, 0u);
}

// ---- Leaving: the lockstep modes' group (sync --elastic, localsgd) ----

ModeSettings elastic_sync() {
  auto s = settings_for("sync");
  s.elastic = true;
  return s;
}

TEST(ElasticSyncProtocol, WithoutAKilledRankTheOthersAverageTheirOwnGradients) {
  Cluster c(3, elastic_sync());
  EXPECT_TRUE(c.mode(0).survives_losses());
  std::vector<std::vector<float>> grads(3, std::vector<float>(kSize));
  auto fill = [&] {
    for (int k = 0; k < 3; ++k) {
      for (size_t i = 0; i < kSize; ++i) grads[static_cast<size_t>(k)][i] = delta_of(k, i);
    }
  };
  fill();
  auto results =
      c.on_every_rank([&](int r) { return c.mode(r).on_gradients(grads[static_cast<size_t>(r)], r + 1, 0.1f); });
  for (int r = 0; r < 3; ++r)
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_FLOAT_EQ(grads[1][i], (1 * delta_of(0, i) + 2 * delta_of(1, i) + 3 * delta_of(2, i)) / 6);
  }
  c.kill(0, {1, 2});  // the leader, and rank 0
  fill();
  results = c.on_every_rank([&](int r) { return c.mode(r).on_gradients(grads[static_cast<size_t>(r)], r + 1, 0.1f); },
                            {1, 2});
  for (int r : {1, 2}) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    // The global batch shrank to the survivors': counts 2 and 3.
    for (size_t i = 0; i < kSize; ++i) {
      EXPECT_FLOAT_EQ(grads[static_cast<size_t>(r)][i], (2 * delta_of(1, i) + 3 * delta_of(2, i)) / 5) << i;
    }
    EXPECT_EQ(c.mode(r).members(), (std::vector<int>{1, 2}));
    EXPECT_EQ(c.mode(r).keeper(), 1);
  }
}

// Each sum carries what every member had trained: after rank 0 (the
// leader) is killed, the survivors know its samples up to its last sum (what
// the run's summary adds for it), and each other's up to the newest.
TEST(ElasticSyncProtocol, TheSurvivorsKnowAKilledRanksSamplesUpToItsLastSum) {
  Cluster c(3, elastic_sync());
  std::vector<std::vector<float>> grads(3, std::vector<float>(kSize, 1.0f));
  auto sum = [&](const std::vector<int>& who) {
    auto results = c.on_every_rank(
        [&](int r) { return c.mode(r).on_gradients(grads[static_cast<size_t>(r)], 10 * (r + 1), 0.1f); }, who);
    for (int r : who) ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
  };
  ASSERT_NO_FATAL_FAILURE(sum({0, 1, 2}));
  ASSERT_NO_FATAL_FAILURE(sum({0, 1, 2}));
  for (int r = 0; r < 3; ++r) {
    for (int k = 0; k < 3; ++k) EXPECT_EQ(c.mode(r).reconciled_samples(k), 20 * (k + 1)) << r << " of " << k;
  }
  c.kill(0, {1, 2});
  ASSERT_NO_FATAL_FAILURE(sum({1, 2}));
  for (int r : {1, 2}) {
    EXPECT_EQ(c.mode(r).reconciled_samples(0), 20) << r;  // its last sum's
    EXPECT_EQ(c.mode(r).reconciled_samples(1), 60) << r;
    EXPECT_EQ(c.mode(r).reconciled_samples(2), 90) << r;
    for (int k = 0; k < 3; ++k) EXPECT_EQ(c.mode(r).retired_samples(k), 0) << r << " of " << k;
  }
}

TEST(ElasticSyncProtocol, ASurvivorThatMissedTheLastSumGetsItWhenTheGroupReforms) {
  Cluster c(3, elastic_sync());
  std::vector<std::vector<float>> grads(3, std::vector<float>(kSize));
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < kSize; ++i) grads[static_cast<size_t>(k)][i] = delta_of(k, i);
  }
  // The leader's sum to rank 2 is held: ranks 0 and 1 finish the step, rank 2 does not.
  c.world.network->hold(0, 2);
  std::thread behind([&] { EXPECT_TRUE(c.mode(2).on_gradients(grads[2], 1, 0.1f)); });
  auto results =
      c.on_every_rank([&](int r) { return c.mode(r).on_gradients(grads[static_cast<size_t>(r)], 1, 0.1f); }, {0, 1});
  ASSERT_TRUE(results[0]);
  ASSERT_TRUE(results[1]);
  c.kill(0, {1, 2});  // with the sum still on its way to rank 2
  // Rank 1 goes on to the next step; the group re-forms: rank 2 gets the
  // step it missed, then both take the next one together.
  std::vector<float> next1(kSize, 1.0f);
  std::thread ahead([&] { EXPECT_TRUE(c.mode(1).on_gradients(next1, 1, 0.1f)); });
  behind.join();
  for (size_t i = 0; i < kSize; ++i) EXPECT_FLOAT_EQ(grads[2][i], grads[1][i]) << i;
  std::vector<float> next2(kSize, 3.0f);
  ASSERT_TRUE(c.mode(2).on_gradients(next2, 1, 0.1f));
  ahead.join();
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_FLOAT_EQ(next1[i], 2.0f);
    EXPECT_FLOAT_EQ(next2[i], 2.0f);
  }
}

// ---- Joining: sync --elastic ----

/// A rank's loopback communicator as a join leaves it: the loopback cannot
/// lose a rank and let a new one in, so this view says rank 2 is lost while
/// `lost` and, once `joined`, that a new process took its place (rank 2's
/// own view: that it is that process). The messages are the loopback's.
class JoinView final : public comm::Communicator {
 public:
  struct Flags {
    std::atomic<bool> lost{false};
    std::atomic<bool> joined{false};
  };
  JoinView(comm::Communicator& inner, const Flags& flags) : inner_(inner), flags_(flags) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Status all_reduce_sum(std::span<float> data) override { return inner_.all_reduce_sum(data); }
  Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                      const std::vector<std::span<std::byte>>& recv) override {
    return inner_.all_to_all_v(send, recv);
  }
  Status barrier() override { return inner_.barrier(); }
  void post(int peer, comm::Channel channel, std::vector<std::byte> payload) override {
    inner_.post(peer, channel, std::move(payload));
  }
  void on_message(comm::Channel channel, Handler handler) override { inner_.on_message(channel, std::move(handler)); }
  std::vector<int> lost_ranks() const override {
    auto lost = inner_.lost_ranks();
    if (flags_.lost && rank() != 2) lost.push_back(2);
    return lost;
  }
  Status health() const override { return inner_.health(); }
  std::vector<int> joined_ranks() const override {
    return flags_.joined && rank() != 2 ? std::vector<int>{2} : std::vector<int>{};
  }
  bool joined() const override { return rank() == 2 && flags_.joined; }
  comm::CommStats stats() const override { return inner_.stats(); }

 private:
  comm::Communicator& inner_;
  const Flags& flags_;
};

/// A sync --elastic worker driven as the trainer drives it: a gradient of
/// its own each step (one example), the all-reduce, SGD with momentum, after_step.
struct SyncWorker {
  SyncWorker(comm::Communicator& comm, std::span<const float> initial) : params(initial.begin(), initial.end()) {
    optim::OptimizerConfig sgd;
    sgd.kind = optim::OptimizerKind::kSgd;
    sgd.momentum = 0.9;
    const std::vector<model::ParamInfo> layout = {{"w", {static_cast<int64_t>(kSize)}, 0, kSize}};
    mode = std::move(*make_mode(elastic_sync(), &comm, layout, initial, sgd));
    optimizer = std::move(*optim::make_optimizer(sgd, layout, kSize));
  }
  Status step() {
    std::vector<float> grads(kSize);
    for (size_t i = 0; i < kSize; ++i) grads[i] = delta_of(comm_rank, i) * static_cast<float>(position.step % 7 + 1);
    CFMO_TRY(mode->on_gradients(grads, 1, 0.1f));
    optimizer->step(params, grads, 0.1f);
    ++position.step;
    return mode->after_step(position, mode->needs_params(position) ? std::span<float>(params) : std::span<float>(),
                            *optimizer);
  }
  /// Steps until the workers agree to stop (or `stop_after` steps from now, this one wants to).
  Status run(int64_t stop_after = -1, const std::atomic<bool>* give_up = nullptr) {
    const int64_t until = stop_after >= 0 ? position.step + stop_after : -1;
    while (!mode->stop_requested()) {
      if (position.step == until || (give_up != nullptr && *give_up)) mode->want_stop("time-limit");
      CFMO_TRY(step());
    }
    return {};
  }
  int comm_rank = 0;
  std::vector<float> params;
  std::unique_ptr<Mode> mode;
  std::unique_ptr<optim::Optimizer> optimizer;
  TrainPosition position;
};

/// Runs ranks 0 and 1 until the workers agree to stop, rank 2 leaving and
/// joining again as `rank_two` says; then every worker must be the same
/// replica: parameters, momentum and optimizer steps, bit for bit, and position.
void expect_rank_two_rejoins_as_a_replica(const std::function<void(JoinView::Flags&, comm::Communicator&)>& rank_two) {
  auto world = comm::make_loopback_world(3, {.peer_timeout_s = 5});
  JoinView::Flags flags;
  std::vector<std::unique_ptr<JoinView>> views;
  for (int r = 0; r < 3; ++r) views.push_back(std::make_unique<JoinView>(*world.ranks[static_cast<size_t>(r)], flags));
  const std::vector<float> initial(kSize, 1.0f);
  std::vector<std::unique_ptr<SyncWorker>> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(std::make_unique<SyncWorker>(*views[static_cast<size_t>(r)], initial));
    workers.back()->comm_rank = r;
  }
  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  std::atomic<bool> give_up{false};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { results[static_cast<size_t>(r)] = workers[static_cast<size_t>(r)]->run(-1, &give_up); });
  }
  rank_two(flags, *views[2]);
  // The new process in rank 2's place: taken in at a step, it wants to stop 5 steps later.
  SyncWorker joiner(*views[2], initial);
  joiner.comm_rank = 2;
  const Status joined = taken_in(joiner.mode->join(joiner.params, *joiner.optimizer, joiner.position));
  const Status ran = joined ? joiner.run(5) : joined;
  if (!joined) {
    // Not taken in: the others go on without rank 2, and stop, rather than wait for it.
    flags.joined = false;
    flags.lost = true;
    give_up = true;
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(ran) << ran.error().message;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    const SyncWorker& w = *workers[static_cast<size_t>(r)];
    EXPECT_EQ(w.mode->members(), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(w.position.step, joiner.position.step);
    EXPECT_EQ(w.params, joiner.params) << "rank " << r;
    EXPECT_EQ(*w.optimizer->state()[0].buffer, *joiner.optimizer->state()[0].buffer) << "rank " << r;
    EXPECT_EQ(w.optimizer->step_count(), joiner.optimizer->step_count());
  }
  EXPECT_GT(joiner.position.step, 5);
  EXPECT_EQ(joiner.mode->agreed_reason(), "time-limit");
  workers.clear();  // the modes before the communicators their handlers are on
}

// A rank lost from the start and let in again: the survivors re-form
// without it, then take the new process in at a step.
TEST(ElasticSyncProtocol, AJoinerIsWelcomedAfterAStepWithTheLeadersParametersAndOptimizerState) {
  expect_rank_two_rejoins_as_a_replica([](JoinView::Flags& flags, comm::Communicator&) {
    flags.lost = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // some steps without it
    flags.lost = false;
    flags.joined = true;
  });
}

// Rank 2's process ends and a new one joins in its place before the others
// see it lost (a restarted rank let in at once): the new one is no member,
// so the others re-form without it before they take it in.
TEST(ElasticSyncProtocol, AMemberReplacedBeforeItsLossWasSeenIsTakenInAgain) {
  expect_rank_two_rejoins_as_a_replica([](JoinView::Flags& flags, comm::Communicator& comm) {
    {
      SyncWorker old(comm, std::vector<float>(kSize, 1.0f));
      old.comm_rank = 2;
      for (int i = 0; i < 3; ++i) ASSERT_TRUE(old.step());
    }
    flags.joined = true;
  });
}

// localsgd --elastic of three: a round of all (each adds delta_of; rank k
// at 10 (k + 1) samples), then rank 2 killed.
void elastic_round_then_kill_rank_two(Cluster& c) {
  auto results = c.on_every_rank([&](int r) -> Status {
    for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
    return c.step(r, 1, 10 * (r + 1));
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(results[static_cast<size_t>(r)]);
  c.kill(2, {0, 1});
}

TEST(LocalSgdProtocol, WithElasticAKilledWorkerLeavesTheRoundsToTheOthers) {
  auto settings = settings_for("localsgd", 1);
  settings.elastic = true;
  Cluster c(3, settings);
  ASSERT_NO_FATAL_FAILURE(elastic_round_then_kill_rank_two(c));
  auto results = c.on_every_rank(
      [&](int r) -> Status {
        for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += 0.5f * static_cast<float>(r + 1);
        return c.step(r, 2, 25 * (r + 1));
      },
      {0, 1});
  for (int r : {0, 1}) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    // What each trained up to its last round: rank 2's from the round before its loss.
    EXPECT_EQ(c.mode(r).reconciled_samples(0), 25) << r;
    EXPECT_EQ(c.mode(r).reconciled_samples(1), 50) << r;
    EXPECT_EQ(c.mode(r).reconciled_samples(2), 30) << r;
    for (size_t i = 0; i < kSize; ++i) {
      const float round1 = (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3;
      EXPECT_NEAR(c.param(r)[i], 1.0f + round1 + (0.5f + 1.0f) / 2, 1e-5f) << i;  // the mean of the two left
    }
    EXPECT_EQ(c.mode(r).members(), (std::vector<int>{0, 1}));
  }
}

// ---- Leaving: the owners' failover (cfmo) ----

// Every rank adds delta_of(k, i) in round 1, then the survivors of each later
// round add `later` each: with plain averaging (lr 1) and no staleness, every
// element of the global parameters is the start plus the mean of round 1 plus
// `later` for each later round (its survivors' mean: each weighs 1 / W_live),
// wherever its shard is served.
float expected_global(size_t i, int w, int later_rounds, float later) {
  float round1 = 0;
  for (int k = 0; k < w; ++k) round1 += delta_of(k, i);
  return 1.0f + round1 / static_cast<float>(w) + static_cast<float>(later_rounds) * later;
}

void first_round(Cluster& c, int w, int64_t samples = 0) {
  for (int k = 0; k < w; ++k) {
    for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += delta_of(k, i);
    ASSERT_TRUE(c.step(k, 1, samples));
  }
  ASSERT_TRUE(c.world.network->drain());
}

TEST(CfmoFailover, AKilledOwnersShardIsServedByItsBackupWithEveryAppliedDelta) {
  auto settings = settings_for("cfmo");
  Cluster c(3, settings);
  first_round(c, 3);
  c.kill(2, {0, 1});
  EXPECT_EQ(c.mode(0).shard_served_by(2), 0);  // the next live rank after 2, cyclically
  EXPECT_EQ(c.mode(1).shard_served_by(2), 0);  // every survivor computes the same
  c.round({0, 1}, 2, 0.125f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);  // whole: shard 2 has an owner again
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(global->params[i], expected_global(i, 3, 1, 0.125f), 1e-5f) << i;
  // Shard 2 kept its version: round 1's three contributions, then the survivors' two.
  EXPECT_EQ(global->versions, (std::vector<int64_t>{5, 5, 5}));
}

// After a loss a round of the outer step is one contribution of each
// survivor, each weighing 1 / W_live: with Nesterov's momentum the round of
// the two survivors completes (its momentum step taken) at their second
// contribution, not at a third that never comes.
TEST(CfmoFailover, AfterALossTheSurvivorsDeltasWeighOneOverTheLiveRanks) {
  auto settings = settings_for("cfmo");
  settings.outer_optimizer = OuterKind::kNesterov;
  settings.outer_momentum = 0.5;
  settings.outer_warmup = 0;  // the figures below are the plain Nesterov step's
  Cluster c(3, settings);
  first_round(c, 3);
  c.kill(2, {0, 1});
  c.round({0, 1}, 2, 0.125f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  const float mu = 0.5f;
  for (size_t i = 0; i < kSize; ++i) {
    const float mean1 = (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3;
    // Round 1: the mean, then lr mu m with m = the mean. Round 2: the
    // survivors' mean, then lr mu m with m = mu mean1 + 0.125.
    const float expected = 1.0f + mean1 + mu * mean1 + 0.125f + mu * (mu * mean1 + 0.125f);
    EXPECT_NEAR(global->params[i], expected, 1e-5f) << i;
    EXPECT_NEAR(global->outer_momentum[i], mu * mean1 + 0.125f, 1e-5f) << i;
  }
}

TEST(CfmoFailover, ALossDuringARoundCostsNoDeltaThatDidNotArrive) {
  Cluster c(3, settings_for("cfmo"));
  first_round(c, 3);
  // Round 2's deltas to owner 2 are in flight when it dies: they never arrive.
  c.world.network->hold(0, 2);
  c.world.network->hold(1, 2);
  c.round({0, 1}, 2, 0.125f);
  c.kill(2, {0, 1});
  // Round 3 sends each survivor's whole progress on shard 2 since its last
  // fresh copy (both rounds) to the new owner.
  c.round({0, 1}, 3, 0.125f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) {
    // Shards 0 and 1: round 2's two deltas while rank 2 lived (1 / 3 each),
    // round 3's after (1 / 2 each). Shard 2: both rounds at once, after.
    const float later = i < 64 ? 2 * 0.125f / 3 + 0.125f : 2 * 0.125f;
    EXPECT_NEAR(global->params[i], expected_global(i, 3, 0, 0) + later, 1e-5f) << i;
  }
}

TEST(CfmoFailover, RankZerosShardBudgetAndFinalModelMoveToTheLowestLiveRank) {
  auto settings = settings_for("cfmo");
  settings.sample_budget = 1000;
  Cluster c(3, settings);
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += delta_of(k, i);
    ASSERT_TRUE(c.step(k, 1, 300));
  }
  ASSERT_TRUE(c.world.network->drain());
  c.kill(0, {1, 2});
  EXPECT_EQ(c.mode(1).keeper(), 1);
  EXPECT_EQ(c.mode(2).keeper(), 1);
  EXPECT_EQ(c.mode(2).shard_served_by(0), 1);
  c.round({1, 2}, 2, 0.125f, 300);
  EXPECT_FALSE(c.mode(2).stop_requested());  // 900 of 1000, rank 0's 300 included
  ASSERT_TRUE(c.step(1, 3, 400));            // 1000: the new keeper stops the run
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_TRUE(c.mode(2).stop_requested());
  auto results = c.on_every_rank([&](int r) { return c.finish(r); }, {1, 2});
  ASSERT_TRUE(results[1]) << results[1].error().message;
  ASSERT_TRUE(results[2]) << results[2].error().message;
  auto final_state = c.mode(1).final_state();
  ASSERT_TRUE(final_state);
  EXPECT_FALSE(c.mode(2).final_state());
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(final_state->params[i], expected_global(i, 3, 1, 0.125f), 1e-5f) << i;
  }
  EXPECT_EQ(final_state->params, c.param(1));
  EXPECT_EQ(final_state->ranks[0].samples, 300);  // the lost rank's last report
  EXPECT_EQ(c.mode(1).reconciled_samples(0), 300);
}

TEST(CfmoFailover, TwoLossesOneAfterTheOtherLoseNoShard) {
  Cluster c(4, settings_for("cfmo"));
  first_round(c, 4);
  c.kill(3, {0, 1, 2});
  c.round({0, 1, 2}, 2, 0.125f);
  c.kill(0, {1, 2});
  EXPECT_EQ(c.mode(1).shard_served_by(0), 1);
  EXPECT_EQ(c.mode(2).shard_served_by(3), 1);  // it had moved to rank 0, whose backup was rank 1
  c.round({1, 2}, 3, 0.125f);
  auto results = c.on_every_rank([&](int r) { return c.finish(r); }, {1, 2});
  ASSERT_TRUE(results[1]) << results[1].error().message;
  ASSERT_TRUE(results[2]) << results[2].error().message;
  auto final_state = c.mode(1).final_state();
  ASSERT_TRUE(final_state);
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(final_state->params[i], expected_global(i, 4, 2, 0.125f), 1e-5f) << i;
  }
}

// ---- Joining, over the loopback transport (with real processes: test_cfmo_train_workers.cpp) ----

// Three cfmo ranks step once (10 samples each), rank 2 is killed, the
// others take a round, and a new process comes in rank 2's place (not yet
// joined): the global state is then expected_global(i, 3, 1, 0.125f).
void step_kill_rank_two_and_rejoin(Cluster& c) {
  ASSERT_NO_FATAL_FAILURE(first_round(c, 3, 10));
  c.kill(2, {0, 1});
  c.round({0, 1}, 2, 0.125f);
  ASSERT_NO_FATAL_FAILURE(c.rejoin(2));
}

// A process in a killed owner's place: the rank that served its shard
// meanwhile hands it back whole, the joiner starts from the global
// parameters and its place's last position, and the next round of all three
// moves every shard by their mean, each contribution weighing 1 / 3 again.
TEST(CfmoJoin, AJoinerInAKilledOwnersPlaceGetsTheGlobalStateAndItsShardBack) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(step_kill_rank_two_and_rejoin(c));
  TrainPosition position;
  const Status joined = c.join(2, position);
  ASSERT_TRUE(joined) << joined.error().message;
  EXPECT_EQ(position.step, 1);  // the killed process's last report
  EXPECT_EQ(position.samples, 10);
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(c.param(2)[i], expected_global(i, 3, 1, 0.125f), 1e-5f) << i;
  for (int r = 0; r < 3; ++r) EXPECT_EQ(c.mode(r).shard_served_by(2), 2) << r;
  c.round({0, 1, 2}, 3, 0.25f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(global->params[i], expected_global(i, 3, 1, 0.125f) + 0.25f, 1e-5f) << i;
  }
}

// The keeper's counts for its standby (what each process it replaced had
// trained), sent as a process joined in the standby's place, reach the
// joiner only after the keeper was lost: the joiner keeps the run by then,
// and takes them up all the same (it has none of its own yet), so that its
// summary still counts the process it replaced. With UCX a joiner's mode,
// and its handler, come about 0.1 s after it is taken in: counts that came
// before wait for it, and a keeper killed meanwhile left them dropped.
TEST(CfmoJoin, AJoinerThatKeepsTheRunTakesUpTheCountsOfAKeeperLostAsItCame) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(first_round(c, 3, 10));
  c.kill(1, {0, 2});
  c.round({0, 2}, 2, 0.125f, 20);
  ASSERT_NO_FATAL_FAILURE(c.rejoin(1));
  TrainPosition position;
  const Status joined = c.join(1, position);
  ASSERT_TRUE(joined) << joined.error().message;
  c.world.network->set_delay(0, 1, 0.3);
  ASSERT_TRUE(c.step(0, 3, 30));  // the keeper's counts to its new standby, late
  const int64_t retired = c.mode(0).retired_samples(1);
  ASSERT_GT(retired, 0);
  c.kill(0, {1, 2});
  EXPECT_EQ(c.mode(1).keeper(), 1);
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_EQ(c.mode(1).retired_samples(1), retired);
}

// As above, but nothing of the keeper's reaches the joiner before the
// keeper is lost: the standby the join displaced (rank 2, which had the
// keeper's counts and every rank's reports) hands its counts to the
// joiner, which keeps the run with them: the replaced process's samples
// and the lost keeper's own up to its last report.
TEST(CfmoJoin, AStandbyDisplacedByAJoinerHandsItsCountsOn) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(first_round(c, 3, 10));
  c.kill(1, {0, 2});
  c.round({0, 2}, 2, 0.125f, 20);
  c.round({0, 2}, 3, 0.125f, 30);  // the keeper's counts to its standby, rank 2
  ASSERT_NO_FATAL_FAILURE(c.rejoin(1));
  TrainPosition position;
  const Status joined = c.join(1, position);
  ASSERT_TRUE(joined) << joined.error().message;
  const int64_t retired = c.mode(2).retired_samples(1);
  const int64_t keepers = c.mode(2).reconciled_samples(0);
  ASSERT_GT(retired, 0);
  ASSERT_GT(keepers, 0);
  c.world.network->hold(0, 1);  // nothing of the keeper's reaches the joiner
  c.kill(0, {1, 2});
  ASSERT_TRUE(c.step(2, 4, 40));  // rank 2 finds rank 1 its keeper's standby now
  ASSERT_TRUE(c.world.network->drain());
  EXPECT_EQ(c.mode(1).keeper(), 1);
  EXPECT_EQ(c.mode(1).retired_samples(1), retired);
  EXPECT_EQ(c.mode(1).reconciled_samples(0), keepers);
}

// An owner lost while a process joins in the place of its backup: the
// joiner holds the owner's replica (sent when it came) and serves the shard
// from it, so its own wait for the global state ends (it had waited for a
// shard it owned but would not take up until it had joined).
TEST(CfmoJoin, AnOwnerLostWhileItsBackupJoinsHasItsShardServedByTheJoiner) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(step_kill_rank_two_and_rejoin(c));
  // The others take the join up (a snapshot's request makes them look): rank
  // 0 hands shard 2 back, rank 1 sends its backup-to-be the whole of shard 1.
  ASSERT_TRUE(c.mode(0).request_snapshot());
  ASSERT_TRUE(c.world.network->drain());
  c.kill(1, {0, 2});
  TrainPosition position;
  const Status joined = c.join(2, position);
  ASSERT_TRUE(joined) << joined.error().message;
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(c.param(2)[i], expected_global(i, 3, 1, 0.125f), 1e-5f) << i;
  for (int r : {0, 2}) EXPECT_EQ(c.mode(r).shard_served_by(1), 2) << r;
  c.round({0, 2}, 3, 0.25f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(global->params[i], expected_global(i, 3, 1, 0.125f) + 0.25f, 1e-5f) << i;
  }
}

// As above, but the owner's whole state never reaches the joiner: it went
// while the joiner was still loading its data, before it took any message,
// and the owner died before the joiner took it (a large message needs its
// sender alive until then). bench/elastic.sh met it on a loaded machine:
// the joiner waited for a shard it owned and held nothing of, 25 s, and
// exited 4. It now asks every rank for its copy and serves the freshest.
TEST(CfmoJoin, AnOwnerLostBeforeItsReplicaReachedItsJoiningBackupHasItsShardServedFromACopy) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(step_kill_rank_two_and_rejoin(c));
  c.world.network->hold(1, 2);  // rank 1's whole shard 1, for its backup-to-be, never arrives
  ASSERT_TRUE(c.mode(0).request_snapshot());
  ASSERT_TRUE(c.world.network->drain());
  c.kill(1, {0, 2});
  TrainPosition position;
  const Status joined = c.join(2, position);
  ASSERT_TRUE(joined) << joined.error().message;
  // Shard 1 as rank 0 last had it, with its own round-2 delta: rank 1's own,
  // applied after its reply to rank 0 went, was lost with rank 1 and the
  // replica that never came (0.125 / 2 live ranks).
  const auto bounds = shard_bounds(kSize, 3);
  const auto expected = [&](size_t i) {
    return expected_global(i, 3, 1, 0.125f) - (i >= bounds[1] && i < bounds[2] ? 0.0625f : 0.0f);
  };
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(c.param(2)[i], expected(i), 1e-5f) << i;
  for (int r : {0, 2}) EXPECT_EQ(c.mode(r).shard_served_by(1), 2) << r;
  c.round({0, 2}, 3, 0.25f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(global->params[i], expected(i) + 0.25f, 1e-5f) << i;
}

// An owner whose answers reach the joiner later than the joiner asks again
// (500 ms; under load an owner's answer waited behind its stream of replica
// deltas to the joiner, its backup): the joiner keeps the shards in so far
// and takes the late answers. A new request each time dropped every late
// answer, and the join failed after 2 x --peer-timeout + 5 s.
TEST(CfmoJoin, AJoinerTakesAnOwnersAnswerThatComesAfterItAskedAgain) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(step_kill_rank_two_and_rejoin(c));
  c.world.network->set_delay(0, 2, 0.8);
  TrainPosition position;
  const Status joined = c.join(2, position);
  ASSERT_TRUE(joined) << joined.error().message;
  EXPECT_EQ(position.samples, 10);
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(c.param(2)[i], expected_global(i, 3, 1, 0.125f), 1e-5f) << i;
}

// A process in a killed owner's place that asks for the global state only
// after the keeper's end began (it was still loading, say) is told the run
// ended; the shard handed back to it as it came (rank 0 served it
// meanwhile) is one the keeper's end still needs, so it hands it in, in the
// end's gather, and the final model holds that shard's fresh values, not
// the keeper's own, which missed rank 1's last round.
TEST(CfmoJoin, AJoinerTurnedAwayAsTheRunEndsHandsTheKeeperTheShardHandedBackToIt) {
  Cluster c(3, settings_for("cfmo"));
  ASSERT_NO_FATAL_FAILURE(first_round(c, 3, 10));
  c.kill(2, {0, 1});
  c.round({0, 1}, 2, 0.125f);
  c.round({1}, 3, 0.25f);  // rank 1 alone (weighing 1 / 2): rank 0 never rebases on it
  ASSERT_NO_FATAL_FAILURE(c.rejoin(2));
  const auto fresh = [](size_t i) { return expected_global(i, 3, 1, 0.125f) + 0.25f / 2; };
  const auto bounds = shard_bounds(kSize, 3);
  ASSERT_GT(std::abs(c.param(0)[bounds[2]] - fresh(bounds[2])), 0.1f);  // the keeper's own values are stale
  std::vector<Status> ended(2);
  std::vector<std::thread> members;
  for (int r = 0; r < 2; ++r) members.emplace_back([&, r] { ended[static_cast<size_t>(r)] = c.finish(r); });
  // The keeper's end began (it waits for the joiner, live again, to be done).
  while (c.mode(0).members().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  TrainPosition position;
  const auto joined = c.mode(2).join(c.param(2), *c.optimizers[2], position);
  for (auto& t : members) t.join();
  ASSERT_TRUE(joined) << joined.error().message;
  EXPECT_EQ(*joined, Joined::kRunEnded);
  EXPECT_EQ(position.samples, 10);  // the killed process's last report
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ended[static_cast<size_t>(r)]) << ended[static_cast<size_t>(r)].error().message;
  }
  EXPECT_EQ(c.mode(0).members(), (std::vector<int>{0, 1}));  // nothing of the joiner's waited for, but its shard
  auto final_state = c.mode(0).final_state();
  ASSERT_TRUE(final_state);
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(final_state->params[i], fresh(i), 1e-5f) << i;
  EXPECT_EQ(final_state->ranks[2].samples, 10);
  EXPECT_FALSE(c.mode(2).final_state());
}

// localsgd --elastic: ranks 0 and 1 take rounds from step 2 on (`round(r,
// step)`) while the process of rank 2 joins, until the group has grown to
// three (both see it at the same sum; at most 20000 rounds of at least 1 ms,
// both stopping at the same one: a failed join must not hang the test).
// Returns each rank's last step (the joiner's: its welcome's position).
std::vector<int64_t> rounds_while_rank_two_joins(Cluster& c, const std::function<Status(int, int64_t)>& round) {
  std::vector<int64_t> last(3, 0);
  const auto results = c.on_every_rank([&](int r) -> Status {
    if (r == 2) {
      TrainPosition position;
      CFMO_TRY(c.join(2, position));
      last[2] = position.step;
      return {};
    }
    int64_t step = 2;
    do {
      CFMO_TRY(round(r, step));
      last[static_cast<size_t>(r)] = step++;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } while (c.mode(r).members().size() < 3 && step < 20000);
    return {};
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
  }
  return last;
}

// localsgd --elastic: the leader takes a joiner in at the end of a round; it
// gets the global parameters before that round, the outer momentum and the
// round's sum, takes the outer step itself and so holds the members' bits;
// the next round is the mean of all three.
TEST(LocalSgdJoin, WithElasticAJoinerIsTakenInAtARoundsEndWithTheMembersBits) {
  auto settings = settings_for("localsgd", 1);
  settings.elastic = true;
  Cluster c(3, settings);
  ASSERT_NO_FATAL_FAILURE(elastic_round_then_kill_rank_two(c));
  std::vector<Status> results;
  ASSERT_NO_FATAL_FAILURE(c.rejoin(2));
  // (The first round of the two re-forms the group without rank 2.)
  const std::vector<int64_t> last = rounds_while_rank_two_joins(c, [&](int r, int64_t step) {
    for (auto& v : c.param(r)) v += 0.5f;
    return c.step(r, step);
  });
  EXPECT_EQ(last[0], last[1]);
  EXPECT_EQ(last[2], last[0]);
  EXPECT_EQ(c.param(2), c.param(0));
  EXPECT_EQ(c.param(1), c.param(0));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(c.mode(r).members(), (std::vector<int>{0, 1, 2})) << r;
  const std::vector<float> before = c.param(0);
  // The killed process's samples up to its round are counted apart, by every member, the joiner too.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(c.mode(r).retired_samples(2), 30) << r;
  results = c.on_every_rank([&](int r) -> Status {
    for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
    return c.step(r, last[0] + 1, 7);  // the joiner's own count starts at its welcome's position (0 here)
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(results[static_cast<size_t>(r)]);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(c.mode(r).reconciled_samples(2), 7) << r;
    EXPECT_EQ(c.mode(r).retired_samples(2), 30) << r;
  }
  for (size_t i = 0; i < kSize; ++i) {
    const float mean = (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3;
    for (int r = 0; r < 3; ++r) EXPECT_NEAR(c.param(r)[i], before[i] + mean, 1e-5f) << r << " " << i;
  }
}

// localsgd --elastic of two, and a process joining with none lost: the
// world grows to three (the loopback's join of a new rank, as UCX's), the
// leader takes the new rank 2 in at a round's end with the members' bits, and
// the next round is the mean of all three, each member knowing the others' samples.
TEST(LocalSgdJoin, WithElasticANewRankGrowsTheGroupAtARoundsEnd) {
  auto settings = settings_for("localsgd", 1);
  settings.elastic = true;
  Cluster c(2, settings);
  auto results = c.on_every_rank([&](int r) -> Status {
    for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
    return c.step(r, 1, 10);
  });
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[static_cast<size_t>(r)]);
  ASSERT_NO_FATAL_FAILURE(c.grow());
  const std::vector<int64_t> last =
      rounds_while_rank_two_joins(c, [&](int r, int64_t step) { return c.step(r, step, 10 * step); });
  EXPECT_EQ(last[2], last[0]);
  EXPECT_EQ(last[1], last[0]);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(c.mode(r).members(), (std::vector<int>{0, 1, 2})) << r;
    EXPECT_EQ(c.param(r), c.param(0)) << r;
  }
  const std::vector<float> before = c.param(0);
  results = c.on_every_rank([&](int r) -> Status {
    for (size_t i = 0; i < kSize; ++i) c.param(r)[i] += delta_of(r, i);
    return c.step(r, last[0] + 1, 10 * (last[0] + 1));
  });
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(results[static_cast<size_t>(r)]);
  for (size_t i = 0; i < kSize; ++i) {
    const float mean = (delta_of(0, i) + delta_of(1, i) + delta_of(2, i)) / 3;
    for (int r = 0; r < 3; ++r) EXPECT_NEAR(c.param(r)[i], before[i] + mean, 1e-5f) << r << " " << i;
  }
  // The joiner's own samples count from its welcome's position: one step's 10.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(c.mode(r).reconciled_samples(2), 10) << r;
}

// A rank cut off (silenced: it finds every other rank lost, as they find it)
// must not go on as a run of its own: only a majority goes on, or half with
// the lowest rank.
TEST(CfmoFailover, ARankCutOffFromTheOthersStopsAndTheMajorityGoesOn) {
  auto settings = settings_for("cfmo");
  Cluster c(3, settings, {.peer_timeout_s = 0.05});
  first_round(c, 3);
  c.world.network->silence(2);
  for (int r : {0, 1, 2}) {
    while (c.world.ranks[static_cast<size_t>(r)]->lost_ranks().size() < (r == 2 ? 2u : 1u)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  const Status alone = c.step(2, 2);
  ASSERT_FALSE(alone);
  EXPECT_EQ(alone.error().kind, ErrorKind::kPeer);
  EXPECT_NE(alone.error().message.find("rank 2 is cut off: 2 of the 3 ranks"), std::string::npos)
      << alone.error().message;
  // Each loss's reason: every peer silent at once is what a rank that could not hear finds.
  EXPECT_NE(alone.error().message.find("; rank 0 lost: no message for "), std::string::npos) << alone.error().message;
  EXPECT_TRUE(c.step(0, 2));
  EXPECT_TRUE(c.step(1, 2));
}

// A rank that stops (cut off, or its run failed) says so in its goodbye: it
// goes on nowhere, so it is no other side of a split. Of ranks 0 and 2 left
// after rank 1's loss, rank 0 leaving so made rank 2, half of {0, 2} without
// the lowest, stop too ("cut off"), and no rank was left to finish the run.
TEST(CfmoFailover, TheLastSurvivorGoesOnWhenTheOtherLeavesWithItsRunFailed) {
  Cluster c(3, settings_for("cfmo"), {.peer_timeout_s = 0.05});
  first_round(c, 3);
  c.kill(1, {0, 2});
  ASSERT_TRUE(c.step(0, 2));
  ASSERT_TRUE(c.step(2, 2));
  c.world.ranks[0]->leave_with(Error{ErrorKind::kPeer, "rank 0 is cut off"});
  c.modes[0].reset();
  c.world.ranks[0].reset();  // its goodbye, with its failure
  while (!c.world.ranks[2]->is_lost_rank(0)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(c.world.ranks[2]->said_goodbye(0));
  const Status goes_on = c.step(2, 3);
  EXPECT_TRUE(goes_on) << goes_on.error().message;
  EXPECT_EQ(c.mode(2).keeper(), 2);
}

TEST(CfmoFailover, OfTwoWorkersRankZeroGoesOnAlone) {
  Cluster c(2, settings_for("cfmo"), {.peer_timeout_s = 0.05});
  first_round(c, 2);
  c.world.network->silence(1);
  for (int r : {0, 1}) {
    while (c.world.ranks[static_cast<size_t>(r)]->lost_ranks().empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_TRUE(c.step(0, 2));
  EXPECT_FALSE(c.step(1, 2));
}

TEST(ElasticSyncProtocol, ARankCutOffFromTheOthersStops) {
  Cluster c(3, elastic_sync(), {.peer_timeout_s = 0.05});
  c.world.network->silence(0);
  while (c.world.ranks[0]->lost_ranks().size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::vector<float> grads(kSize, 1.0f);
  const Status alone = c.mode(0).on_gradients(grads, 1, 0.1f);
  ASSERT_FALSE(alone);
  EXPECT_NE(alone.error().message.find("rank 0 is cut off"), std::string::npos) << alone.error().message;
}

TEST(AsgdProtocol, OwnersApplyEveryGradientAndWorkersTakeTheFreshShards) {
  Cluster c(2, settings_for("asgd"));
  std::vector<std::vector<float>> grads(2, std::vector<float>(kSize));
  for (int k = 0; k < 2; ++k) {
    for (size_t i = 0; i < kSize; ++i) grads[static_cast<size_t>(k)][i] = delta_of(k, i);
  }
  EXPECT_TRUE(c.mode(0).owns_update());
  // Rank 0 pushes first, and its replies arrive before rank 1 pushes.
  ASSERT_TRUE(c.mode(0).on_gradients(grads[0], 4, 0.1f));
  ASSERT_TRUE(c.world.network->drain());
  ASSERT_TRUE(c.mode(1).on_gradients(grads[1], 4, 0.1f));
  ASSERT_TRUE(c.world.network->drain());
  ASSERT_TRUE(c.mode(0).needs_params(TrainPosition{}));
  ASSERT_TRUE(c.step(0, 1));
  ASSERT_TRUE(c.step(1, 1));
  // The owners' SGD (momentum 0.9, first step: the gradient itself) saw rank
  // 0's gradient, then rank 1's: rank 0 holds the first, rank 1 both.
  for (size_t i = 0; i < kSize; ++i) {
    EXPECT_NEAR(c.param(0)[i], 1.0f - 0.1f * delta_of(0, i), 1e-6f) << i;
  }
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) EXPECT_FLOAT_EQ(c.param(1)[i], global->params[i]) << i;
  EXPECT_EQ(c.mode(0).stats().contributions_applied, 2u);  // as owner of shard 0: both gradients
}

// asgd: an owner killed near the end, whose new process comes after the
// others took their last step: they send it their copies of its shard
// while they end (the keeper only once its end began), not only at steps
// they no longer take, so it serves the freshest at once, is told the run
// ended, and hands that shard in; every rank ends. Before, the joiner
// waited 2 x --peer-timeout + 5 s for copies that never came and failed,
// and the members waited as long for it.
TEST(AsgdJoin, AnOwnerRestartedAsTheRunEndsServesTheFreshestCopyAndHandsItIn) {
  Cluster c(3, settings_for("asgd"));
  std::vector<float> grad(kSize);
  for (size_t i = 0; i < kSize; ++i) grad[i] = delta_of(0, i);
  // Owner 2 applies rank 0's gradient, then rank 1's: rank 1's copy of shard 2 is the fresher.
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(c.mode(k).on_gradients(grad, 4, 0.1f));
    ASSERT_TRUE(c.world.network->drain());
  }
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(c.step(k, 1, 10));
  ASSERT_TRUE(c.world.network->drain());
  const auto bounds = shard_bounds(kSize, 3);
  const auto shard_two = [&](const std::vector<float>& v) {
    return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(bounds[2]), v.end());
  };
  const std::vector<float> freshest = shard_two(c.param(1));
  ASSERT_NE(freshest, shard_two(c.param(0)));
  c.kill(2, {0, 1});
  ASSERT_NO_FATAL_FAILURE(c.rejoin(2));
  std::vector<Status> ended(2);
  std::vector<std::thread> members;
  for (int r = 0; r < 2; ++r) members.emplace_back([&, r] { ended[static_cast<size_t>(r)] = c.finish(r); });
  TrainPosition position;
  const auto joined = c.mode(2).join(c.param(2), *c.optimizers[2], position);
  for (auto& t : members) t.join();
  ASSERT_TRUE(joined) << joined.error().message;
  EXPECT_EQ(*joined, Joined::kRunEnded);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(ended[static_cast<size_t>(r)]) << ended[static_cast<size_t>(r)].error().message;
  }
  auto final_state = c.mode(0).final_state();
  ASSERT_TRUE(final_state);
  EXPECT_EQ(shard_two(final_state->params), freshest);
  EXPECT_EQ(final_state->ranks[2].samples, 10);  // the lost process's last report: the joiner trained nothing
}

// ---- K owners (--owners): fewer shards than ranks ----

TEST(OwnersProtocol, DefaultIsEveryRankUpToSixteenThenSixteen) {
  ModeSettings s;
  EXPECT_EQ(owner_count(s, 3), 3);
  EXPECT_EQ(owner_count(s, 4096), kDefaultOwners);
  s.owners = 2;
  EXPECT_EQ(owner_count(s, 4), 2);
  s.owners = 9;
  EXPECT_EQ(owner_count(s, 4), 4);  // never more shards than ranks
}

TEST(OwnersProtocol, CfmoWithTwoOwnersOfFourRanksGivesTheSameGlobalParametersAsFour) {
  // Round 1 of four ranks, then a finish: with K = 2 the two owners hold
  // everything (versions count every rank's contribution), the others none,
  // and the global parameters are those of K = 4.
  std::vector<std::vector<float>> finals;
  for (int owners : {4, 2}) {
    auto settings = settings_for("cfmo");
    settings.owners = owners;
    Cluster c(4, settings);
    first_round(c, 4);
    auto global = c.snapshot();
    ASSERT_TRUE(global);
    EXPECT_EQ(global->versions, std::vector<int64_t>(static_cast<size_t>(owners), 4)) << owners;
    for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(global->params[i], expected_global(i, 4, {}, 0), 1e-5f) << i;
    EXPECT_EQ(c.mode(3).shard_served_by(3), owners == 4 ? 3 : -1);
    EXPECT_EQ(c.mode(3).stats().contributions_received, owners == 4 ? 4u : 0u);
    EXPECT_EQ(c.mode(3).stats().contributions_sent, static_cast<uint64_t>(owners));
    auto results = c.on_every_rank([&](int r) { return c.finish(r); });
    for (int r = 0; r < 4; ++r)
      ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    auto final_state = c.mode(0).final_state();
    ASSERT_TRUE(final_state);
    EXPECT_EQ(final_state->ranks.size(), 4u);
    EXPECT_EQ(final_state->versions.size(), static_cast<size_t>(owners));
    finals.push_back(final_state->params);
  }
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(finals[0][i], finals[1][i], 1e-5f) << i;
}

// --deterministic with K < W: an owner holds a shard's round until every
// live rank's delta to it is in (not K of them), and applies it in rank
// order, so the global parameters are those of K = W bit for bit.
TEST(OwnersProtocol, DeterministicRoundsOfFewerOwnersWaitForEveryRankAndMatchEveryRankOwning) {
  auto settings = deterministic_nesterov_settings();
  std::vector<std::vector<float>> globals;
  for (int owners : {3, 1}) {
    settings.owners = owners;
    Cluster c(3, settings);
    // Rank 2's delta to rank 0 waits on its link while the others' reach it.
    c.world.network->hold(2, 0);
    for (int k = 0; k < 3; ++k) {
      for (size_t i = 0; i < kSize; ++i) c.param(k)[i] += 0.37f * delta_of(k, i) / static_cast<float>(i + 3);
    }
    std::thread releaser([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      c.world.network->release(2, 0);
    });
    const auto done = c.on_every_rank([&](int r) { return c.step(r, 1); });
    releaser.join();
    for (const Status& s : done) ASSERT_TRUE(s) << s.error().message;
    ASSERT_TRUE(c.world.network->drain());
    EXPECT_EQ(c.param(0), c.param(1)) << owners;
    EXPECT_EQ(c.param(0), c.param(2)) << owners;
    auto global = c.snapshot();
    ASSERT_TRUE(global);
    EXPECT_EQ(global->params, c.param(0)) << owners;
    EXPECT_EQ(global->versions, std::vector<int64_t>(static_cast<size_t>(owners), 3)) << owners;
    EXPECT_EQ(global->outer_in_round, std::vector<int64_t>(static_cast<size_t>(owners), 0)) << owners;
    globals.push_back(global->params);
  }
  EXPECT_EQ(globals[0], globals[1]);
}

TEST(OwnersProtocol, ALostOwnersShardMovesToItsBackupThoughThatOwnsNone) {
  auto settings = settings_for("cfmo");
  settings.owners = 2;
  Cluster c(4, settings);
  first_round(c, 4);
  c.kill(1, {0, 2, 3});
  EXPECT_EQ(c.mode(0).shard_served_by(1), 2);  // rank 2 kept shard 1's replica
  c.round({0, 2, 3}, 2, 0.125f);
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(global->params[i], expected_global(i, 4, 1, 0.125f), 1e-5f) << i;
  EXPECT_EQ(global->versions, (std::vector<int64_t>{7, 7}));
}

TEST(OwnersProtocol, AsgdWithOneOwnerAppliesEveryRanksGradient) {
  auto settings = settings_for("asgd");
  settings.owners = 1;
  Cluster c(3, settings);
  std::vector<float> grad(kSize, 1.0f);
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(c.mode(k).on_gradients(grad, 4, 0.1f));
    ASSERT_TRUE(c.world.network->drain());
  }
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(c.step(k, 1));
  EXPECT_EQ(c.mode(0).stats().contributions_applied, 3u);
  EXPECT_EQ(c.mode(1).stats().contributions_applied, 0u);
  EXPECT_EQ(c.mode(2).stats().contributions_sent, 1u);  // one shard, to rank 0
  auto global = c.snapshot();
  ASSERT_TRUE(global);
  // SGD with momentum 0.9 on a constant gradient: v = 1, 1.9, 2.71.
  for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(global->params[i], 1.0f - 0.1f * (1.0f + 1.9f + 2.71f), 1e-5f) << i;
  for (size_t i = 0; i < kSize; ++i) EXPECT_FLOAT_EQ(c.param(2)[i], global->params[i]) << i;
}

}  // namespace
}  // namespace cfmo::train
