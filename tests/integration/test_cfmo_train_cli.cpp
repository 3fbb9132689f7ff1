#include <gtest/gtest.h>

TEST(TestCfmoTrainCli, Placeholder) {}
