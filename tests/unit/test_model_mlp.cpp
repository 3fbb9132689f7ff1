#include <gtest/gtest.h>

TEST(TestModelMlp, Placeholder) {}
