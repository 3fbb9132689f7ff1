// The outer step the reconciling modes share: a cfmo owner's W contributions
// of a round move its shard as localsgd's one step on their mean does.
#include "train/modes.h"
#include "train/modes/outer_optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace cfmo::train {
namespace {

ModeSettings outer(const char* name, double lr, double mu) {
  ModeSettings s;
  s.outer_optimizer = *parse_outer_kind(name);
  s.outer_lr = lr;
  s.outer_momentum = mu;
  return s;
}

// Round r's delta of worker k, element i: anything that differs.
float delta_of(int round, int k, size_t i) {
  return std::sin(0.7f * static_cast<float>(round) + 1.3f * static_cast<float>(k) + 0.1f * static_cast<float>(i));
}

TEST(OuterOptimizer, ARoundOfWContributionsIsOneStepOnTheirMean) {
  constexpr int kWorkers = 4;
  constexpr size_t kSize = 5;
  for (const auto& settings : {outer("avg", 1.0, 0.9), outer("nesterov", 0.5, 0.8), outer("nesterov", 0.7, 0.9)}) {
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
        per_contribution.apply(b, d, 1.0f / kWorkers);
      }
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
