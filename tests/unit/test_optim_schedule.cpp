#include <gtest/gtest.h>

TEST(TestOptimSchedule, Placeholder) {}
