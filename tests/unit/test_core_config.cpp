#include <gtest/gtest.h>

TEST(TestCoreConfig, Placeholder) {}
