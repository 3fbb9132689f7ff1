#include <gtest/gtest.h>

TEST(TestTrainCheckpoint, Placeholder) {}
