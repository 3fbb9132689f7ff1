#include <gtest/gtest.h>

TEST(TestDataDataset, Placeholder) {}
