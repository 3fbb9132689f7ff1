#include "optim/schedule.h"

#include <gtest/gtest.h>

#include <string>

namespace cfmo::optim {
namespace {

Schedule make_schedule(Schedule::Kind kind, double base_lr, double min_lr, int64_t warmup, int64_t total) {
  Schedule s;
  s.kind = kind;
  s.base_lr = base_lr;
  s.min_lr = min_lr;
  s.warmup_steps = warmup;
  s.total_steps = total;
  return s;
}

TEST(TestOptimSchedule, ConstantWithoutWarmupIsBaseEverywhere) {
  const auto s = make_schedule(Schedule::Kind::kConstant, 0.1, 0.0, 0, 100);
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(50), 0.1);
  EXPECT_DOUBLE_EQ(s.at(100), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1000000), 0.1);  // constant needs no total
}

// Warmup ramps linearly so the first update already moves (lr = base / warmup,
// never 0) and the last warmup update uses the full base rate.
TEST(TestOptimSchedule, WarmupRampsLinearlyToBase) {
  const auto s = make_schedule(Schedule::Kind::kConstant, 0.1, 0.0, 4, 0);
  EXPECT_DOUBLE_EQ(s.at(0), 0.025);
  EXPECT_DOUBLE_EQ(s.at(1), 0.05);
  EXPECT_DOUBLE_EQ(s.at(2), 0.075);
  EXPECT_DOUBLE_EQ(s.at(3), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.1);
  EXPECT_DOUBLE_EQ(s.at(40), 0.1);
}

TEST(TestOptimSchedule, WarmupOfOneStepIsNoWarmup) {
  const auto s = make_schedule(Schedule::Kind::kConstant, 0.3, 0.0, 1, 0);
  EXPECT_DOUBLE_EQ(s.at(0), 0.3);
  EXPECT_DOUBLE_EQ(s.at(1), 0.3);
}

// Expected values: min + (base - min) * (1 + cos(pi * t / T)) / 2 worked out
// by hand (cos(pi/4) = 0.70710678118654752, cos(3pi/4) = -cos(pi/4)).
TEST(TestOptimSchedule, CosineEndpointsAndMidpoints) {
  const auto s = make_schedule(Schedule::Kind::kCosine, 1.0, 0.1, 0, 8);
  EXPECT_DOUBLE_EQ(s.at(0), 1.0);
  EXPECT_NEAR(s.at(2), 0.1 + 0.9 * 0.85355339059327376, 1e-12);
  EXPECT_NEAR(s.at(4), 0.55, 1e-12);
  EXPECT_NEAR(s.at(6), 0.1 + 0.9 * 0.14644660940672624, 1e-12);
  EXPECT_NEAR(s.at(8), 0.1, 1e-12);
  // Past the end the rate stays at the floor instead of rising again.
  EXPECT_NEAR(s.at(9), 0.1, 1e-12);
  EXPECT_NEAR(s.at(1000), 0.1, 1e-12);
}

TEST(TestOptimSchedule, CosineStartsAfterWarmup) {
  const auto s = make_schedule(Schedule::Kind::kCosine, 2.0, 0.0, 2, 12);
  EXPECT_DOUBLE_EQ(s.at(0), 1.0);
  EXPECT_DOUBLE_EQ(s.at(1), 2.0);
  EXPECT_DOUBLE_EQ(s.at(2), 2.0);  // the decay begins where warmup ends
  EXPECT_NEAR(s.at(7), 1.0, 1e-12);
  EXPECT_NEAR(s.at(12), 0.0, 1e-12);
  EXPECT_NEAR(s.at(13), 0.0, 1e-12);
}

TEST(TestOptimSchedule, CosineDecreasesMonotonicallyAfterWarmup) {
  const auto s = make_schedule(Schedule::Kind::kCosine, 0.01, 0.001, 10, 110);
  double previous = s.at(10);
  EXPECT_DOUBLE_EQ(previous, 0.01);
  for (int64_t step = 11; step <= 120; ++step) {
    const double lr = s.at(step);
    EXPECT_LE(lr, previous) << "step " << step;
    EXPECT_GE(lr, 0.001 - 1e-15) << "step " << step;
    previous = lr;
  }
}

// A total no longer than the warmup leaves a cosine of zero length: the rate
// must drop to the floor rather than divide by zero.
TEST(TestOptimSchedule, CosineWithTotalWithinWarmupIsFinite) {
  const auto s = make_schedule(Schedule::Kind::kCosine, 1.0, 0.2, 5, 5);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_DOUBLE_EQ(s.at(5), 1.0);
  EXPECT_NEAR(s.at(6), 0.2, 1e-12);
  const auto no_total = make_schedule(Schedule::Kind::kCosine, 1.0, 0.0, 0, 0);
  EXPECT_DOUBLE_EQ(no_total.at(0), 1.0);
  EXPECT_NEAR(no_total.at(1), 0.0, 1e-12);
}

TEST(TestOptimSchedule, ParseKindAcceptsKnownNames) {
  auto constant = Schedule::parse_kind("constant");
  ASSERT_TRUE(constant);
  EXPECT_EQ(*constant, Schedule::Kind::kConstant);
  auto cosine = Schedule::parse_kind("cosine");
  ASSERT_TRUE(cosine);
  EXPECT_EQ(*cosine, Schedule::Kind::kCosine);
}

TEST(TestOptimSchedule, ParseKindRejectsOthersAsUsageErrors) {
  for (const std::string text : {"", "linear", "Cosine", " cosine", "cosine ", "const"}) {
    auto kind = Schedule::parse_kind(text);
    ASSERT_FALSE(kind) << "'" << text << "'";
    EXPECT_EQ(kind.error().kind, ErrorKind::kUsage);
    EXPECT_NE(kind.error().message.find("'" + text + "'"), std::string::npos) << kind.error().message;
  }
}

}  // namespace
}  // namespace cfmo::optim
