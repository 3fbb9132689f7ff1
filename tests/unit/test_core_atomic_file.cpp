#include <gtest/gtest.h>

TEST(TestCoreAtomicFile, Placeholder) {}
