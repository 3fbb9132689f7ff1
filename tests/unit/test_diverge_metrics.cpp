#include "diverge/metrics.h"

#include <gtest/gtest.h>

#include <cmath>

namespace cfmo::diverge {
namespace {

ckpt::DeltaStats stats(double base_sq, double delta_sq, double dot) {
  ckpt::DeltaStats s;
  s.base_sq = base_sq;
  s.delta_sq = delta_sq;
  s.base_dot_delta = dot;
  return s;
}

TEST(DivergenceTest, RelativeL2AndCosineFromTheSums) {
  // base (3, 4), delta (0, 0.5): local (3, 4.5).
  const Divergence d = divergence(stats(25, 0.25, 2));
  EXPECT_DOUBLE_EQ(d.rel_l2, 0.1);
  EXPECT_DOUBLE_EQ(d.cosine, (9 + 18) / (5 * std::sqrt(9 + 20.25)));
  EXPECT_DOUBLE_EQ(d.delta_l2, 0.5);
  EXPECT_DOUBLE_EQ(d.base_l2, 5);
}

TEST(DivergenceTest, ParallelAntiParallelAndOrthogonal) {
  // delta = 0.2 base: same direction.
  EXPECT_DOUBLE_EQ(divergence(stats(4, 0.16, 0.8)).cosine, 1.0);
  // delta = -2 base: local = -base.
  EXPECT_DOUBLE_EQ(divergence(stats(4, 16, -8)).cosine, -1.0);
  EXPECT_DOUBLE_EQ(divergence(stats(4, 16, -8)).rel_l2, 2.0);
  // base (1, 0), delta (0, 1): 45 degrees.
  EXPECT_NEAR(divergence(stats(1, 1, 0)).cosine, std::sqrt(0.5), 1e-15);
}

TEST(DivergenceTest, UndefinedWhereTheBaseOrTheLocalParametersAreZero) {
  const Divergence nothing = divergence(stats(0, 0, 0));
  EXPECT_EQ(nothing.rel_l2, 0.0);
  EXPECT_TRUE(std::isnan(nothing.cosine));
  const Divergence from_zero = divergence(stats(0, 1, 0));
  EXPECT_TRUE(std::isnan(from_zero.rel_l2));
  EXPECT_TRUE(std::isnan(from_zero.cosine));
  // delta = -base: the local parameters are zero.
  EXPECT_TRUE(std::isnan(divergence(stats(4, 4, -4)).cosine));
  EXPECT_EQ(divergence(stats(4, 4, -4)).rel_l2, 1.0);
}

TEST(DivergenceTest, CountsAndMaximumPassThrough) {
  ckpt::DeltaStats s = stats(1, 1, 0);
  s.max_abs = 0.75;
  s.nonfinite = 3;
  s.base_nonfinite = 2;
  const Divergence d = divergence(s);
  EXPECT_EQ(d.max_abs, 0.75);
  EXPECT_EQ(d.nonfinite, 3);
  EXPECT_EQ(d.base_nonfinite, 2);
}

}  // namespace
}  // namespace cfmo::diverge
