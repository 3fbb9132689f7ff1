#include <gtest/gtest.h>

TEST(TestTrainTrainer, Placeholder) {}
