// The router, capacity and layout arithmetic against hand-computed cases.
#include "moe/dispatch.h"
#include "moe/moe_config.h"
#include "moe/router.h"
#include "moe/stats.h"

#include <gtest/gtest.h>

#include <cmath>

namespace cfmo::moe {
namespace {

// Weights sqrt(2) * [[1, 0, 0], [0, 1, 0]]: with the router's 1/sqrt(hidden)
// the logits of x = (a, b) are exactly (a, b, 0).
Router plain_router(int top_k, RoutingSkew skew = {}) {
  const float s = std::sqrt(2.0f);
  return Router({s, 0, 0, 0, s, 0}, 2, 3, top_k, skew);
}

TEST(MoeRouter, SoftmaxTopKWithRenormalisedGatesAndTies) {
  const float x[] = {std::log(2.0f),
                     std::log(4.0f),  // probabilities 2/7, 4/7, 1/7
                     0.0f,
                     0.0f,  // all 1/3: ties go to the lower expert
                     -std::log(2.0f),
                     0.0f};  // 1/5, 2/5, 2/5
  const Routing r = plain_router(2).route(x, 3, 0);
  ASSERT_EQ(r.expert.size(), 6u);
  EXPECT_EQ(r.expert[0], 1);
  EXPECT_EQ(r.expert[1], 0);
  EXPECT_NEAR(r.gate[0], 2.0 / 3.0, 1e-6);
  EXPECT_NEAR(r.gate[1], 1.0 / 3.0, 1e-6);
  EXPECT_EQ(r.expert[2], 0);
  EXPECT_EQ(r.expert[3], 1);
  EXPECT_NEAR(r.gate[2], 0.5, 1e-6);
  EXPECT_EQ(r.expert[4], 1);
  EXPECT_EQ(r.expert[5], 2);
  EXPECT_NEAR(r.gate[4], 0.5, 1e-6);
  EXPECT_EQ(r.load, (std::vector<int64_t>{2, 3, 1}));
  EXPECT_EQ(r.dropped, 0);
}

TEST(MoeRouter, ZipfBiasesTheLogits) {
  // x = 0: only the bias -ln(e+1) speaks; probabilities 6/11, 3/11, 2/11.
  const float x[] = {0, 0, 0, 0};
  const Routing r = plain_router(2, {RoutingSkew::Kind::kZipf, 1.0}).route(x, 2, 0);
  EXPECT_EQ(r.expert[0], 0);
  EXPECT_EQ(r.expert[1], 1);
  EXPECT_NEAR(r.gate[0], 2.0 / 3.0, 1e-6);
  EXPECT_NEAR(r.gate[1], 1.0 / 3.0, 1e-6);
}

TEST(MoeRouter, HotAndBalancedSkews) {
  std::vector<float> x(2 * 50);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7919) % 13) / 4.0f - 1.5f;
  const Routing hot = plain_router(1, {RoutingSkew::Kind::kHot, 1.0}).route(x.data(), 50, 3);
  for (int32_t e : hot.expert) EXPECT_EQ(e, 0);
  EXPECT_DOUBLE_EQ(load_imbalance(hot.load), 3.0);  // all on one of three experts
  // Round-robin: token t takes experts 2t and 2t+1 (mod 3).
  const Routing balanced = plain_router(2, {RoutingSkew::Kind::kBalanced, 0}).route(x.data(), 4, 0);
  EXPECT_EQ(balanced.expert, (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  EXPECT_EQ(balanced.load, (std::vector<int64_t>{3, 3, 2}));
}

TEST(MoeRouter, SeededRouterIsDeterministicAndRoughlyEven) {
  const Router a(7, 64, 8, 2, {});
  const Router b(7, 64, 8, 2, {});
  std::vector<float> x(64 * 4000);
  make_hidden_states(7, 0, 0, 4000, 64, x.data());
  const Routing ra = a.route(x.data(), 4000, 0);
  const Routing rb = b.route(x.data(), 4000, 0);
  EXPECT_EQ(ra.expert, rb.expert);
  EXPECT_EQ(ra.gate, rb.gate);
  EXPECT_LT(load_imbalance(ra.load), 2.0);
  std::vector<float> skewed(x);
  const Routing zipf = Router(7, 64, 8, 2, {RoutingSkew::Kind::kZipf, 2.0}).route(x.data(), 4000, 0);
  EXPECT_GT(load_imbalance(zipf.load), load_imbalance(ra.load));
}

TEST(MoeCapacity, SlotsPerExpertPerSourceRank) {
  EXPECT_EQ(expert_capacity(10, 2, 4, 1.25), 7);      // 6.25 -> 7
  EXPECT_EQ(expert_capacity(10, 1, 4, 1.0), 3);       // 2.5 -> 3
  EXPECT_EQ(expert_capacity(8, 2, 4, 1.0), 4);        // exactly 4
  EXPECT_EQ(expert_capacity(512, 2, 12, 1.25), 107);  // 106.67 -> 107
  EXPECT_EQ(expert_capacity(1, 1, 64, 0.01), 1);      // never below one slot
}

TEST(MoeCapacity, DropsInGShardOrder) {
  Routing r;
  r.tokens = 4;
  r.top_k = 2;
  r.experts = 3;
  r.expert = {0, 1, 0, 2, 0, 1, 1, 0};
  r.gate.assign(8, 0.5f);
  // First choices in token order: e0 e0 e0(full) e1; then second: e1 e2 e1(full) e0(full).
  apply_capacity(r, 2);
  EXPECT_EQ(r.kept, (std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 1, 0}));
  EXPECT_EQ(r.dropped, 3);
  apply_capacity(r, -1);
  EXPECT_EQ(r.dropped, 0);
}

TEST(MoePlacement, ContiguousBlocks) {
  const ExpertPlacement p{12, 5};
  EXPECT_EQ(p.first(0), 0);
  EXPECT_EQ(p.first(1), 2);
  EXPECT_EQ(p.first(2), 4);
  EXPECT_EQ(p.first(3), 7);
  EXPECT_EQ(p.first(4), 9);
  EXPECT_EQ(p.first(5), 12);
  EXPECT_EQ(p.owner(3), 1);
  EXPECT_EQ(p.owner(4), 2);
  EXPECT_EQ(p.owner(11), 4);
  const ExpertPlacement sparse{2, 4};  // fewer experts than ranks: ranks 0 and 2 hold none
  EXPECT_EQ(sparse.count(0), 0);
  EXPECT_EQ(sparse.owner(0), 1);
  EXPECT_EQ(sparse.owner(1), 3);
  for (int e = 0; e < 12; ++e) EXPECT_TRUE(p.first(p.owner(e)) <= e && e < p.first(p.owner(e) + 1));
}

TEST(MoePlacement, StridedExpertsLiveOnTheirNumberModuloTheRanks) {
  const ExpertPlacement p{12, 5, /*strided=*/true};
  EXPECT_EQ(p.count(0), 3);  // 0, 5, 10
  EXPECT_EQ(p.count(1), 3);  // 1, 6, 11
  EXPECT_EQ(p.count(2), 2);  // 2, 7
  EXPECT_EQ(p.count(4), 2);  // 4, 9
  int total = 0;
  for (int r = 0; r < 5; ++r) {
    total += p.count(r);
    for (int i = 0; i < p.count(r); ++i) {
      const int e = p.expert(r, i);
      EXPECT_EQ(e % 5, r);
      EXPECT_EQ(p.owner(e), r);
      EXPECT_EQ(p.local_index(e), i);
    }
  }
  EXPECT_EQ(total, 12);
  Routing r;
  r.tokens = 2;
  r.top_k = 2;
  r.experts = 4;
  r.expert = {3, 0, 2, 1};
  r.gate.assign(4, 0.5f);
  r.kept = {1, 1, 1, 1};
  const DispatchPlan plan = plan_dispatch(r, ExpertPlacement{4, 2, true});  // rank 0: experts 0, 2; rank 1: 1, 3
  EXPECT_EQ(plan.slots[0], (std::vector<int32_t>{1, 2}));             // e0: t0; e2: t1
  EXPECT_EQ(plan.counts[0], (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(plan.slots[1], (std::vector<int32_t>{3, 0}));  // e1: t1; e3: t0
  EXPECT_EQ(plan.counts[1], (std::vector<uint32_t>{1, 1}));
}

TEST(MoeDispatch, PlanGroupsByDestinationExpertThenToken) {
  Routing r;
  r.tokens = 3;
  r.top_k = 2;
  r.experts = 4;
  r.expert = {3, 0, 1, 3, 0, 2};
  r.gate.assign(6, 0.5f);
  r.kept = {1, 1, 1, 0, 1, 1};
  const DispatchPlan plan = plan_dispatch(r, ExpertPlacement{4, 2});  // rank 0: experts 0, 1; rank 1: 2, 3
  EXPECT_EQ(plan.slots[0], (std::vector<int32_t>{1, 4, 2}));          // e0: t0, t2; e1: t1
  EXPECT_EQ(plan.counts[0], (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ(plan.slots[1], (std::vector<int32_t>{5, 0}));  // e2: t2; e3: t0 (t1's was dropped)
  EXPECT_EQ(plan.counts[1], (std::vector<uint32_t>{1, 1}));
}

TEST(MoeDispatch, CombineAddsGatedResultsToTheResidual) {
  Routing r;
  r.tokens = 2;
  r.top_k = 2;
  r.experts = 2;
  r.expert = {0, 1, 1, 0};
  r.gate = {0.75f, 0.25f, 0.5f, 0.5f};
  const float x[] = {1, 2, 3, 4};
  const float a[] = {10, 20};
  const float b[] = {100, 200};
  const std::vector<const float*> rows = {a, b, nullptr, a};  // token 1's first result is late
  float y[4];
  combine(x, r, rows, 2, y);
  EXPECT_FLOAT_EQ(y[0], 1 + 7.5f + 25);
  EXPECT_FLOAT_EQ(y[1], 2 + 15 + 50);
  EXPECT_FLOAT_EQ(y[2], 3 + 5);
  EXPECT_FLOAT_EQ(y[3], 4 + 10);
}

TEST(MoeDispatch, RowsRoundTripInBf16) {
  const float x[] = {1.0f, 1.00390625f, -3.5f, 1e-3f};
  std::vector<std::byte> wire;
  const std::vector<int32_t> slots = {1, 0};  // token 1 then token 0 (top_k 1)
  encode_rows(x, 2, 1, slots, comm::WireDtype::kBf16, wire);
  ASSERT_EQ(wire.size(), 8u);
  std::vector<float> decoded(4);
  std::vector<const float*> rows(2, nullptr);
  locate_results(wire, slots, comm::WireDtype::kBf16, 2, decoded, rows);
  EXPECT_EQ(rows[1][0], -3.5f);
  EXPECT_NEAR(rows[1][1], 1e-3f, 1e-5f);
  EXPECT_EQ(rows[0][0], 1.0f);
}

TEST(MoeStats, PercentilesAreNearestRank) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);
  EXPECT_EQ(percentile(v, 0.5), 50);
  EXPECT_EQ(percentile(v, 0.99), 99);
  EXPECT_EQ(percentile({7}, 0.99), 7);
  EXPECT_EQ(percentile({}, 0.5), 0);
}

TEST(MoeConfig, ParsesSweepsAndRejectsBadValues) {
  EXPECT_EQ(*parse_sweep("64:512"), (std::vector<int64_t>{64, 128, 256, 512}));
  EXPECT_EQ(*parse_sweep("3,5"), (std::vector<int64_t>{3, 5}));
  for (const char* bad : {"", "0", "8:4", "a", "4,", ":4"}) EXPECT_FALSE(parse_sweep(bad)) << bad;
  for (const char* bad : {"zipf", "zipf:0", "hot:1.5", "hot:x", "normal"}) EXPECT_FALSE(parse_routing(bad)) << bad;
  MoeConfig c;
  EXPECT_TRUE(validate(c));
  c.top_k = 13;
  auto r = validate(c);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  EXPECT_NE(r.error().message.find("--top-k"), std::string::npos);
  c = MoeConfig{};
  c.deadline = "soon";
  EXPECT_FALSE(validate(c));
  c.deadline = "2ms";
  EXPECT_NEAR(validate(c)->deadline_s, 0.002, 1e-12);
}

}  // namespace
}  // namespace cfmo::moe
