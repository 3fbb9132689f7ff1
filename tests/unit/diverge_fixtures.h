#pragma once
// Run directories for the diverge tests, written with the trainer-independent
// .cfd writer, and a temporary directory per test.

#include "ckpt/cfd.h"
#include "diverge/sources.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::testing {

struct NamedDelta {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> base;
  std::vector<float> delta;
};

inline void write_delta_file(const std::filesystem::path& path, int rank, int64_t round,
                             const std::vector<NamedDelta>& tensors, int64_t step = -1,
                             const ckpt::CfdWriteOptions& options = {}) {
  std::vector<ckpt::CfdTensorInput> inputs;
  for (const auto& t : tensors) inputs.push_back({t.name, t.shape, t.base, t.delta});
  std::filesystem::create_directories(path.parent_path());
  const ckpt::CfdFileInfo info{rank, round, step >= 0 ? step : round * 10, round > 0 ? round - 1 : 0, {}};
  auto written = ckpt::write_cfd(path, info, inputs, options);
  ASSERT_TRUE(written) << written.error().message;
}

/// RUN/deltas/rank-K/round-RRRRRR.cfd, as the trainer lays it out.
inline void write_run_delta(const std::filesystem::path& run, int rank, int64_t round,
                            const std::vector<NamedDelta>& tensors, const ckpt::CfdWriteOptions& options = {}) {
  write_delta_file(ckpt::delta_path(run, rank, round), rank, round, tensors, -1, options);
}

/// Two tensors whose delta is `scale` times a fixed direction: the overall
/// relative L2 is `scale` (to float rounding) and every tensor's too.
inline std::vector<NamedDelta> scaled_delta(float scale) {
  NamedDelta w{"layers.0.weight", {2, 3}, {0.5f, -1.0f, 0.25f, 2.0f, -0.75f, 1.5f}, {}};
  NamedDelta b{"layers.0.bias", {2}, {1.0f, -2.0f}, {}};
  for (auto* t : {&w, &b}) {
    for (float v : t->base) t->delta.push_back(scale * v);
  }
  return {w, b};
}

class TempDirTest : public ::testing::Test {
 protected:
  TempDir temp_;
  const std::filesystem::path dir_ = temp_.path();
};

}  // namespace cfmo::testing
