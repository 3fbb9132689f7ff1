#include <gtest/gtest.h>

TEST(TestCoreProgress, Placeholder) {}
