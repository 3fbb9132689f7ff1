// The outer step the reconciling modes share: a cfmo owner's W contributions
// of a round move its shard as localsgd's one step on their mean does.
#include "train/modes.h"
#include "train/modes/outer_optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace cfmo::train {
namespace {

ModeSettings outer(const char* name, double lr, double mu, int warmup = 0) {
  ModeSettings s;
  s.outer_optimizer = *parse_outer_kind(name);
  s.outer_lr = lr;
  s.outer_momentum = mu;
  s.outer_warmup = warmup;
  return s;
}

// Round r's delta of worker k, element i: anything that differs.
float delta_of(int round, int k, size_t i) {
  return std::sin(0.7f * static_cast<float>(round) + 1.3f * static_cast<float>(k) + 0.1f * static_cast<float>(i));
}

TEST(OuterOptimizer, ARoundOfWContributionsIsOneStepOnTheirMean) {
  constexpr int kWorkers = 4;
  constexpr size_t kSize = 5;
  for (const auto& settings : {outer("avg", 1.0, 0.9), outer("nesterov", 0.5, 0.8), outer("nesterov", 0.7, 0.9),
                               outer("nesterov", 0.5, 0.8, 4)}) {
    SCOPED_TRACE(std::string(to_string(settings.outer_optimizer)) + " " + std::to_string(settings.outer_lr));
    OuterOptimizer per_round(settings, kSize, 1);                // localsgd: the sum, weighted 1/W
    OuterOptimizer per_contribution(settings, kSize, kWorkers);  // a cfmo owner
    std::vector<float> a(kSize, 0.5f);
    std::vector<float> b = a;
    for (int round = 0; round < 6; ++round) {
      std::vector<float> sum(kSize, 0.0f);
      for (int k = 0; k < kWorkers; ++k) {
        std::vector<float> d(kSize);
        for (size_t i = 0; i < kSize; ++i) {
          d[i] = delta_of(round, k, i);
          sum[i] += d[i];
        }
        // A cfmo owner's round: the shard's version / W, the same for the W contributions.
        per_contribution.set_round((round * kWorkers + k) / kWorkers);
        per_contribution.apply(b, d, 1.0f / kWorkers);
      }
      per_round.set_round(round);
      per_round.apply(a, sum, 1.0f / kWorkers);
      for (size_t i = 0; i < kSize; ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << "round " << round << " element " << i;
    }
  }
}

TEST(OuterOptimizer, NesterovIsDiLoCosStepAndAvgKeepsNoState) {
  // One element, a constant mean delta D: m_r = mu m_{r-1} + D, global += lr (D + mu m_r).
  const double lr = 0.7;
  const double mu = 0.9;
  OuterOptimizer nesterov(outer("nesterov", lr, mu), 1, 3);
  std::vector<float> global = {0.0f};
  double expected = 0;
  double m = 0;
  for (int round = 0; round < 20; ++round) {
    for (int k = 0; k < 3; ++k) nesterov.apply(global, std::vector<float>{1.0f}, 1.0f / 3);
    m = mu * m + 1.0;
    expected += lr * (1.0 + mu * m);
    EXPECT_NEAR(global[0], expected, 1e-3 * expected) << "round " << round;
  }
  // The momentum tends to D / (1 - mu): a round moves by at most lr (1 + mu / (1 - mu)) D, not ~W times that.
  EXPECT_NEAR(nesterov.momentum()[0], m, 1e-3 * m);
  EXPECT_LT(m, 1.0 / (1 - mu));
  OuterOptimizer avg(outer("avg", 1.0, 0.9), 3, 3);
  EXPECT_TRUE(avg.momentum().empty());
}

TEST(OuterOptimizer, NesterovWarmsUpFromPlainAveraging) {
  // --outer-warmup 4: round r < 4 takes lr 1 + (lr - 1) r / 4 and momentum mu r / 4.
  const double lr = 0.5;
  const double mu = 0.8;
  constexpr int kWarmup = 4;
  OuterOptimizer warm(outer("nesterov", lr, mu, kWarmup), 1, 1);
  std::vector<float> global = {0.0f};
  double expected = 0;
  double m = 0;
  for (int round = 0; round < 8; ++round) {
    const double ramp = std::min(1.0, static_cast<double>(round) / kWarmup);
    const double lr_r = 1 + (lr - 1) * ramp;
    const double mu_r = mu * ramp;
    warm.set_round(round);
    warm.apply(global, std::vector<float>{1.0f}, 1.0f);
    m = mu_r * m + 1.0;
    expected += lr_r * (1.0 + mu_r * m);
    EXPECT_NEAR(global[0], expected, 1e-5 * expected) << "round " << round;
    // The first round is plain averaging: the mean delta, once.
    if (round == 0) {
      EXPECT_FLOAT_EQ(global[0], 1.0f);
    }
  }
  // avg has nothing to warm up: lr as given from the first round.
  OuterOptimizer avg(outer("avg", 1.5, 0.9, kWarmup), 1, 1);
  std::vector<float> a = {0.0f};
  avg.set_round(0);
  avg.apply(a, std::vector<float>{1.0f}, 1.0f);
  EXPECT_FLOAT_EQ(a[0], 1.5f);
}

TEST(ModeTable, RowsAreInModeKindOrderAndTheirNamesParseBack) {
  const auto table = mode_table();
  ASSERT_EQ(table.size(), 4u);
  for (size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(table[i].kind), i) << table[i].name;
    EXPECT_EQ(&mode_entry(table[i].kind), &table[i]);
    auto parsed = parse_mode(table[i].name);
    ASSERT_TRUE(parsed) << table[i].name;
    EXPECT_EQ(*parsed, table[i].kind);
    EXPECT_FALSE(table[i].summary.empty());
    EXPECT_NE(table[i].make, nullptr);
    // Asynchronous modes decide their stops alone; lockstep ones together.
    EXPECT_NE(table[i].traits.lockstep, table[i].traits.asynchronous) << table[i].name;
  }
  EXPECT_EQ(mode_names(), "sync, localsgd, asgd or cfmo");
  auto bad = parse_mode("nope");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kUsage);
  EXPECT_EQ(bad.error().message, "--mode: 'nope' is not sync, localsgd, asgd or cfmo");
}

TEST(ModeTable, OneWorkerTrainsAloneWhateverTheMode) {
  const std::vector<float> initial(40, 0.5f);
  optim::OptimizerConfig optimizer;
  for (const auto& entry : mode_table()) {
    ModeSettings settings;
    settings.kind = entry.kind;
    auto mode = make_mode(settings, nullptr, {}, initial, optimizer);
    ASSERT_TRUE(mode) << entry.name;
    EXPECT_EQ((*mode)->name(), entry.name);
    EXPECT_FALSE((*mode)->lockstep());
    EXPECT_TRUE((*mode)->params_are_global());
  }
}

}  // namespace
}  // namespace cfmo::train
