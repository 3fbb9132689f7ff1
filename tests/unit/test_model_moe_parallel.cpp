// Expert parallelism (--expert-parallel): W ranks, each holding the experts
// e with e mod W == rank, over the in-process loopback transport (the real
// UCX path is tests/integration's), against one process holding them all.
#include "comm/loopback.h"
#include "model/factory.h"
#include "model/gpt.h"

#include "support/token_windows.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace cfmo::model {
namespace {

using testing::random_tokens;
using testing::windows;

GptSpec small_moe() {
  GptSpec spec;
  spec.layers = 2;
  spec.heads = 2;
  spec.dim = 8;
  spec.context = 6;
  spec.vocab = 11;
  spec.experts = 5;
  spec.top_k = 2;
  spec.expert_dim = 7;
  spec.moe_every = 1;
  return spec;
}

/// Dropless and without the load-balancing loss: capacity and f_i P_i are
/// taken per rank's batch, so only then is W ranks' step one process's step
/// on their batches together (the z-loss is a mean over tokens and averages).
MoeOptions exact_options(int rank, int ranks) {
  MoeOptions o;
  o.drop_policy = moe::DropPolicy::kDropless;
  o.aux_loss = 0;
  o.z_loss = 0.01;
  o.expert_rank = rank;
  o.expert_ranks = ranks;
  return o;
}

std::map<std::string, std::vector<float>> by_name(const Model& m, std::span<const float> flat) {
  std::map<std::string, std::vector<float>> out;
  for (const ParamInfo& p : m.params()) out[p.name].assign(flat.begin() + p.offset, flat.begin() + p.offset + p.size);
  return out;
}

/// W ranks of `spec` over `world`, sync or async dispatch (deadline_s as MoeOptions's).
std::vector<std::unique_ptr<Gpt>> dispatch_parts(const GptSpec& spec, comm::LoopbackWorld& world, uint64_t seed,
                                                 bool async, double deadline_s) {
  const auto ranks = static_cast<int>(world.ranks.size());
  std::vector<std::unique_ptr<Gpt>> parts;
  for (int r = 0; r < ranks; ++r) {
    MoeOptions o = exact_options(r, ranks);
    o.async_dispatch = async;
    o.dispatch_deadline_s = deadline_s;
    parts.push_back(std::make_unique<Gpt>(spec, o));
    parts.back()->init(seed);
    parts.back()->set_expert_parallel(world.ranks[static_cast<size_t>(r)].get());
  }
  return parts;
}

/// Each rank's model of `world`, initialised from `seed`, exchanging through its communicator (sync dispatch).
std::vector<std::unique_ptr<Gpt>> expert_parallel_parts(const GptSpec& spec, comm::LoopbackWorld& world,
                                                        uint64_t seed) {
  return dispatch_parts(spec, world, seed, /*async=*/false, -1);
}

TEST(TestModelMoeParallel, RanksHoldTheirStridedExpertsInitialisedAsInTheWholeModel) {
  const GptSpec spec = small_moe();
  Gpt whole(spec, exact_options(0, 1));
  whole.init(42);
  const auto all = by_name(whole, whole.parameters());
  for (int rank = 0; rank < 3; ++rank) {
    Gpt part(spec, exact_options(rank, 3));
    part.init(42);
    EXPECT_EQ(part.dense_size(), whole.dense_size());
    EXPECT_EQ(part.local_experts(), rank < 2 ? 2 : 1);  // 5 experts: {0, 3}, {1, 4}, {2}
    EXPECT_LT(part.num_params(), whole.num_params());
    for (const auto& [name, values] : by_name(part, part.parameters())) {
      ASSERT_TRUE(all.contains(name)) << name;
      EXPECT_EQ(values, all.at(name)) << name;
      const auto at = name.find(".experts.");
      if (at != std::string::npos) {
        EXPECT_EQ(std::stoi(name.substr(at + 9)) % 3, rank) << name;
      }
    }
  }
}

TEST(TestModelMoeParallel, SyncDispatchGivesTheLossAndGradientsOfOneProcessHoldingEveryExpert) {
  constexpr int kRanks = 3;
  constexpr int kBatch = 2;
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, kRanks * kBatch, 9);

  Gpt whole(spec, exact_options(0, 1));
  whole.init(7);
  const float whole_loss = whole.forward_backward(windows(tokens, kRanks * kBatch));
  const auto whole_grads = by_name(whole, whole.gradients());

  comm::LoopbackWorld world = comm::make_loopback_world(kRanks);
  const auto parts = expert_parallel_parts(spec, world, 7);
  std::vector<float> losses(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      const size_t first = static_cast<size_t>(r * kBatch) * static_cast<size_t>(spec.context + 1);
      Examples batch;
      batch.count = kBatch;
      batch.tokens = tokens.data() + first;
      losses[static_cast<size_t>(r)] = parts[static_cast<size_t>(r)]->forward_backward(batch);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& p : parts) ASSERT_TRUE(p->take_status());

  float mean_loss = 0;
  for (float l : losses) mean_loss += l / kRanks;
  EXPECT_NEAR(mean_loss, whole_loss, 1e-5f);

  // The dense gradients as sync mode's all-reduce averages them; each expert's on its owner.
  std::map<std::string, std::vector<float>> ep_grads;
  for (const auto& part : parts) {
    for (const auto& [name, g] : by_name(*part, part->gradients())) {
      auto& target = ep_grads[name];
      if (name.find(".experts.") != std::string::npos) {
        target = g;
        continue;
      }
      target.resize(g.size(), 0.0f);
      for (size_t i = 0; i < g.size(); ++i) target[i] += g[i] / kRanks;
    }
  }
  ASSERT_EQ(ep_grads.size(), whole_grads.size());
  for (const auto& [name, expected] : whole_grads) {
    const auto& got = ep_grads.at(name);
    ASSERT_EQ(got.size(), expected.size()) << name;
    float scale = 1e-6f;
    for (float v : expected) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], expected[i], 1e-4f * scale + 1e-7f) << name << "[" << i << "]";
    }
  }
}

TEST(TestModelMoeParallel, EvaluationRoutesThroughTheOwnersToo) {
  constexpr int kRanks = 2;
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, 3, 4);
  Gpt whole(spec, exact_options(0, 1));
  whole.init(3);
  const EvalResult expected = whole.evaluate(windows(tokens, 3));

  comm::LoopbackWorld world = comm::make_loopback_world(kRanks);
  const auto parts = expert_parallel_parts(spec, world, 3);
  std::vector<EvalResult> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back(
        [&, r] { results[static_cast<size_t>(r)] = parts[static_cast<size_t>(r)]->evaluate(windows(tokens, 3)); });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) EXPECT_NEAR(r.loss(), expected.loss(), 1e-5);
}

TEST(TestModelMoeParallel, ALostPeerFailsThePassWithAPeerErrorAndTheTokensTakeTheResidual) {
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, 2, 5);
  comm::LoopbackWorld world = comm::make_loopback_world(2, {.peer_timeout_s = 0.2});
  Gpt part(spec, exact_options(0, 2));
  part.init(1);
  part.set_expert_parallel(world.ranks[0].get());
  world.network->kill(1);
  const float loss = part.forward_backward(windows(tokens, 2));
  EXPECT_TRUE(std::isfinite(loss));
  const Status status = part.take_status();
  ASSERT_FALSE(status);
  EXPECT_EQ(status.error().kind, ErrorKind::kPeer);
  EXPECT_TRUE(part.take_status());  // taken once
}

/// Runs `work(rank)` on one thread per rank and waits for them all.
template <typename Work>
void on_every_rank(int ranks, Work&& work) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { work(r); });
  for (auto& t : threads) t.join();
}

TEST(TestModelMoeParallel, AsyncDispatchWithoutADeadlineEqualsSyncBitForBit) {
  constexpr int kRanks = 3;
  constexpr int kBatch = 2;
  constexpr int kSteps = 3;
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, kRanks * kBatch * kSteps, 21);
  const auto eval_tokens = random_tokens(spec, 2, 22);

  // Per rank and step: the loss, the gradients, the evaluation loss; the parameters at the end.
  struct Trace {
    std::vector<float> losses;
    std::vector<std::vector<float>> grads;
    std::vector<double> evals;
    std::vector<float> params;
  };
  auto train = [&](bool async) {
    comm::LoopbackWorld world = comm::make_loopback_world(kRanks);
    auto parts = dispatch_parts(spec, world, 5, async, ExpertExchange::kNoDeadline);
    std::vector<Trace> traces(kRanks);
    on_every_rank(kRanks, [&](int r) {
      Gpt& m = *parts[static_cast<size_t>(r)];
      Trace& trace = traces[static_cast<size_t>(r)];
      // As the trainer does; only the async side, so an effect would show.
      if (async) m.prepare(kBatch);
      for (int step = 0; step < kSteps; ++step) {
        const size_t first = static_cast<size_t>((step * kRanks + r) * kBatch) * static_cast<size_t>(spec.context + 1);
        Examples batch;
        batch.count = kBatch;
        batch.tokens = tokens.data() + first;
        trace.losses.push_back(m.forward_backward(batch));
        auto g = m.gradients();
        trace.grads.emplace_back(g.begin(), g.end());
        // A plain step on every tensor, so the next pass runs on parameters
        // each rank changed: a chunk served a pass early or late would show.
        auto p = m.parameters();
        for (size_t i = 0; i < p.size(); ++i) p[i] -= 0.5f * g[i];
        trace.evals.push_back(m.evaluate(windows(eval_tokens, 2)).loss());
      }
      ASSERT_TRUE(m.finish_exchanges());
      auto p = m.parameters();
      trace.params.assign(p.begin(), p.end());
    });
    for (auto& part : parts) EXPECT_TRUE(part->take_status());
    return traces;
  };
  const auto sync = train(false);
  const auto async = train(true);
  for (int r = 0; r < kRanks; ++r) {
    const auto& a = async[static_cast<size_t>(r)];
    const auto& s = sync[static_cast<size_t>(r)];
    EXPECT_EQ(a.losses, s.losses) << "rank " << r;
    EXPECT_EQ(a.evals, s.evals) << "rank " << r;
    ASSERT_EQ(a.grads.size(), s.grads.size());
    for (size_t step = 0; step < a.grads.size(); ++step) {
      EXPECT_TRUE(a.grads[step] == s.grads[step]) << "rank " << r << " step " << step;
    }
    EXPECT_TRUE(a.params == s.params) << "rank " << r;
  }
}

TEST(TestModelMoeParallel, ALateResultTakesTheResidualPathAndItsGradientIsSkipped) {
  constexpr int kRanks = 2;
  constexpr int kBatch = 2;
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, kRanks * kBatch, 31);

  // What rank 0 should see: one process holding every expert, rank 1's
  // experts (odd ones) giving zero (the residual path), on rank 0's batch.
  Gpt reference(spec, exact_options(0, 1));
  reference.init(8);
  for (const ParamInfo& p : reference.params()) {
    const auto at = p.name.find(".experts.");
    if (at == std::string::npos || std::stoi(p.name.substr(at + 9)) % 2 == 0) continue;
    if (p.name.find("c_proj") == std::string::npos) continue;
    auto params = reference.parameters();
    std::fill(params.begin() + static_cast<ptrdiff_t>(p.offset),
              params.begin() + static_cast<ptrdiff_t>(p.offset + p.size), 0.0f);
  }
  const float expected_loss = reference.forward_backward(windows(tokens, kBatch));
  const auto expected = by_name(reference, reference.gradients());

  comm::LoopbackWorld world = comm::make_loopback_world(kRanks);
  world.network->hold(1, 0);  // rank 1's results never reach rank 0 in time
  auto parts = dispatch_parts(spec, world, 8, /*async=*/true, /*deadline_s=*/0.05);
  std::vector<float> losses(kRanks);
  on_every_rank(kRanks, [&](int r) {
    const size_t first = static_cast<size_t>(r * kBatch) * static_cast<size_t>(spec.context + 1);
    Examples batch;
    batch.count = kBatch;
    batch.tokens = tokens.data() + first;
    losses[static_cast<size_t>(r)] = parts[static_cast<size_t>(r)]->forward_backward(batch);
  });
  world.network->release(1, 0);
  on_every_rank(kRanks, [&](int r) { ASSERT_TRUE(parts[static_cast<size_t>(r)]->finish_exchanges()); });

  Gpt& rank0 = *parts[0];
  EXPECT_TRUE(rank0.take_status());  // late is not a failure
  EXPECT_NEAR(losses[0], expected_loss, 1e-5f);
  const auto got = by_name(rank0, rank0.gradients());
  for (const auto& [name, g] : got) {
    if (name.find(".experts.") != std::string::npos) continue;  // rank 1's tokens add to rank 0's experts
    const auto& want = expected.at(name);
    for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], want[i], 1e-5f) << name << "[" << i << "]";
  }
  // Counted: every assignment rank 0 sent rank 1 was late.
  const nlohmann::ordered_json metrics = rank0.run_metrics();
  const auto& dispatch = metrics.at("dispatch");
  EXPECT_GT(dispatch.at("late").get<int64_t>(), 0);
  EXPECT_GT(dispatch.at("late_share").get<double>(), 0.0);
  EXPECT_LT(dispatch.at("late_share").get<double>(), 1.0);  // its own experts' are never late
  EXPECT_NEAR(dispatch.at("deadline_us").get<double>(), 5e4, 1);
}

// The owner serves a peer's rows on its exchange's own thread, with the
// copy of its experts taken at its pass's start: while its training thread
// is busy elsewhere (here writing its parameters, as an optimizer step
// does, for longer than the peer's deadline) the peer's results still come
// in time. Under -Db_sanitize=thread this is also the check that the server
// never reads the parameters the training thread writes.
TEST(TestModelMoeParallel, ARankBusyComputingStillServesItsPeersRowsWithinTheDeadline) {
  constexpr int kRanks = 2;
  constexpr int kBatch = 2;
  constexpr double kDeadlineS = 1.0;
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, kRanks * kBatch * 2, 41);
  comm::LoopbackWorld world = comm::make_loopback_world(kRanks);
  auto parts = dispatch_parts(spec, world, 9, /*async=*/true, kDeadlineS);
  auto batch_of = [&](int step, int r) {
    Examples batch;
    batch.count = kBatch;
    batch.tokens =
        tokens.data() + static_cast<size_t>((step * kRanks + r) * kBatch) * static_cast<size_t>(spec.context + 1);
    return batch;
  };
  on_every_rank(kRanks, [&](int r) { parts[static_cast<size_t>(r)]->forward_backward(batch_of(0, r)); });
  on_every_rank(kRanks, [&](int r) {
    Gpt& m = *parts[static_cast<size_t>(r)];
    if (r == 1) {
      // Busy for 3 deadlines, never in an exchange, writing every parameter.
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(3 * kDeadlineS);
      auto p = m.parameters();
      volatile float* values = p.data();
      while (std::chrono::steady_clock::now() < until) {
        for (size_t i = 0; i < p.size(); ++i) values[i] = values[i];
      }
    }
    m.forward_backward(batch_of(1, r));
    ASSERT_TRUE(m.finish_exchanges());
  });
  for (int r = 0; r < kRanks; ++r) {
    Gpt& m = *parts[static_cast<size_t>(r)];
    EXPECT_TRUE(m.take_status());
    const nlohmann::ordered_json metrics = m.run_metrics();
    const auto& dispatch = metrics.at("dispatch");
    EXPECT_EQ(dispatch.at("late").get<int64_t>(), 0) << "rank " << r << ": " << dispatch.dump();
    EXPECT_EQ(dispatch.at("skipped_chunks").get<int64_t>(), 0) << "rank " << r;
    EXPECT_NEAR(dispatch.at("deadline_us").get<double>(), kDeadlineS * 1e6, 1);
  }
}

TEST(TestModelMoeParallel, AsyncDispatchGoesOnWithoutALostRankAndNamesItsExperts) {
  const GptSpec spec = small_moe();
  const auto tokens = random_tokens(spec, 2, 5);
  comm::LoopbackWorld world = comm::make_loopback_world(2, {.peer_timeout_s = 0.2});
  MoeOptions o = exact_options(0, 2);
  o.async_dispatch = true;
  o.dispatch_deadline_s = ExpertExchange::kNoDeadline;  // only the loss ends the wait
  Gpt part(spec, o);
  part.init(1);
  part.set_expert_parallel(world.ranks[0].get());
  world.network->kill(1);
  const float loss = part.forward_backward(windows(tokens, 2));
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_TRUE(part.take_status());
  EXPECT_EQ(part.lost_experts(), (std::vector<int>{1, 3}));
  EXPECT_EQ(part.run_metrics().at("dispatch").at("lost_experts"), nlohmann::ordered_json({1, 3}));
  EXPECT_TRUE(part.finish_exchanges());
}

TEST(TestModelMoeParallel, MakeModelRefusesFewerExpertsThanRanksInOneLine) {
  MoeOptions o;
  o.expert_rank = 0;
  o.expert_ranks = 4;
  const DataShape tokens{InputKind::kTokens, 0, 11};
  auto few = make_model("gpt:layers=1,heads=2,dim=8,context=4,experts=3,top_k=2", tokens, o);
  ASSERT_FALSE(few);
  EXPECT_EQ(few.error().kind, ErrorKind::kUsage);
  EXPECT_NE(few.error().message.find("experts 3"), std::string::npos) << few.error().message;
  EXPECT_EQ(few.error().message.find('\n'), std::string::npos);
  auto dense = make_model("gpt:layers=1,heads=2,dim=8,context=4", tokens, o);
  ASSERT_FALSE(dense);
  EXPECT_EQ(dense.error().kind, ErrorKind::kUsage);
  EXPECT_TRUE(make_model("gpt:layers=1,heads=2,dim=8,context=4,experts=4,top_k=2", tokens, o));
}

}  // namespace
}  // namespace cfmo::model
