#include <gtest/gtest.h>

TEST(TestOptimOptimizer, Placeholder) {}
