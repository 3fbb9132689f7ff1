#pragma once
// The check of a tool's refusal: its status, and one line on stderr naming
// what was wrong, nothing on stdout. (test_cfmo_train_cli.cpp and
// test_cfmo_diverge_cli.cpp still have copies of their own.)

#include "integration/harness.h"

#include <gtest/gtest.h>

#include <string>

namespace cfmo::testing {

inline void expect_one_line_error(const RunResult& r, int status, const std::string& needle) {
  EXPECT_EQ(r.status, status) << r.err;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

}  // namespace cfmo::testing
