#include "diverge/thresholds.h"

#include "unit/diverge_fixtures.h"

#include <gtest/gtest.h>

#include <limits>

namespace cfmo::diverge {
namespace {

namespace fs = std::filesystem;
using ThresholdsTest = testing::TempDirTest;

TEST(ParseFractionTest, PercentOrFraction) {
  EXPECT_DOUBLE_EQ(*parse_fraction("5%", "--x"), 0.05);
  EXPECT_DOUBLE_EQ(*parse_fraction("0.5 %", "--x"), 0.005);
  EXPECT_DOUBLE_EQ(*parse_fraction("0.05", "--x"), 0.05);
  EXPECT_DOUBLE_EQ(*parse_fraction("1", "--x"), 1.0);
  EXPECT_DOUBLE_EQ(*parse_fraction("150%", "--x"), 1.5);
  EXPECT_DOUBLE_EQ(*parse_fraction("0", "--x"), 0.0);
  for (const char* bad : {"5", "", "%", "five%", "-1%", "nan", "inf%", "5%%", "0.05x"}) {
    auto r = parse_fraction(bad, "--max-rel-l2");
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    EXPECT_NE(r.error().message.find("--max-rel-l2"), std::string::npos) << r.error().message;
  }
  EXPECT_NE(parse_fraction("5", "--f").error().message.find("5%"), std::string::npos);
}

class ViolationsTest : public ThresholdsTest {
 protected:
  Report report_with(const std::vector<std::vector<testing::NamedDelta>>& deltas) {
    std::vector<ReportInput> inputs;
    for (size_t i = 0; i < deltas.size(); ++i) {
      const fs::path file = ckpt::delta_path(dir_ / "run", static_cast<int>(i), 1);
      testing::write_run_delta(dir_ / "run", static_cast<int>(i), 1, deltas[i]);
      inputs.push_back(classify_path(file));
    }
    auto report = build_report(inputs, {});
    EXPECT_TRUE(report) << report.error().message;
    return std::move(report).value();
  }
};

TEST_F(ViolationsTest, EveryViolationIsListed) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Rank 0: 2% overall. Rank 1: 4.9% overall, "big" at 25% with a |delta| of 0.5 and a NaN, "rest" at 0.5%.
  const Report report = report_with({
      testing::scaled_delta(0.02f),
      {{"big", {4}, {1, 1, 1, 1}, {0.5f, 0.0f, nan, 0.0f}}, {"rest", {2}, {6, 8}, {0.03f, 0.04f}}},
  });
  Thresholds t;
  t.max_rel_l2 = 0.04;
  t.max_abs = 0.45;
  t.max_nonfinite = 0;
  auto found = find_violations(report, t);
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(found[0].metric, "rel_l2");
  EXPECT_EQ(found[0].delta->rank, 1);
  EXPECT_TRUE(found[0].tensor.empty());
  EXPECT_NE(found[0].message.find("rank 1, round 1 (step 10): relative L2"), std::string::npos) << found[0].message;
  EXPECT_NE(found[0].message.find("exceeds 4%"), std::string::npos) << found[0].message;
  EXPECT_EQ(found[1].metric, "max_abs");
  EXPECT_EQ(found[1].tensor, "big");
  EXPECT_EQ(found[1].value, 0.5);
  EXPECT_EQ(found[2].metric, "nonfinite");
  EXPECT_NE(found[2].message.find("1 in 'big'"), std::string::npos) << found[2].message;

  t.per_tensor = true;
  found = find_violations(report, t);
  ASSERT_EQ(found.size(), 4u);
  EXPECT_EQ(found[1].metric, "rel_l2");
  EXPECT_EQ(found[1].tensor, "big");

  // Without limits nothing is a violation; loose limits hold.
  EXPECT_TRUE(find_violations(report, {}).empty());
  EXPECT_TRUE(find_violations(report, {.max_rel_l2 = 0.2, .max_abs = 1.0, .max_nonfinite = 1}).empty());
  EXPECT_EQ(describe(t), "relative L2 4% (also per tensor), max |delta| 0.45, non-finite 0");
  EXPECT_EQ(describe(Thresholds{}), "no limits");
}

TEST_F(ViolationsTest, UndefinedRelativeL2IsNotHeldToTheLimit) {
  const Report report = report_with({{{"zero_init", {2}, {0, 0}, {0.1f, 0.1f}}, {"w", {2}, {3, 4}, {0, 0.01f}}}});
  Thresholds t;
  t.max_rel_l2 = 0.05;
  t.per_tensor = true;
  EXPECT_TRUE(find_violations(report, t).empty());
}

}  // namespace
}  // namespace cfmo::diverge
