// The workers' memory estimate: it grows with what a worker holds (data,
// model, optimizer state, the mode's copies), and the launcher's check
// refuses what cannot fit, naming both figures.
#include "train/memory_estimate.h"

#include "support/expect_error.h"

#include <gtest/gtest.h>

namespace cfmo::train {
namespace {

uint64_t estimate(const TrainConfig& config) {
  auto bytes = estimate_worker_bytes(config);
  EXPECT_TRUE(bytes) << bytes.error().message;
  return bytes ? *bytes : 0;
}

TEST(MemoryEstimate, FollowsTheDataTheModelTheOptimizerAndTheMode) {
  TrainConfig base;
  base.data = "synthetic:1000:100";
  base.model = "mlp:";  // a linear model: 784 x 10 weights and 10 biases
  base.optimizer = "sgd";
  const uint64_t small = estimate(base);

  // 1000 more examples of 784 pixel bytes and a 4-byte label.
  TrainConfig more_data = base;
  more_data.data = "synthetic:2000:100";
  EXPECT_EQ(estimate(more_data) - small, 1000u * (784 + 4));

  // Adam's two moments against SGD's one momentum buffer: one more copy of the 7850 parameters
  // (7856 floats in the flat buffer: the bias starts 64-byte aligned).
  TrainConfig adam = base;
  adam.optimizer = "adam";
  EXPECT_EQ(estimate(adam) - small, 1u * 7856 * sizeof(float));

  // A wider model costs its parameters several times over, and a mode's copies come on top.
  TrainConfig wide = base;
  wide.model = "mlp:1024";
  EXPECT_GT(estimate(wide) - small, 2u * sizeof(float) * 784 * 1024);  // parameters and gradients
  TrainConfig cfmo = wide;
  cfmo.workers = 4;
  cfmo.mode = "cfmo";
  EXPECT_GT(estimate(cfmo), estimate(wide));

  EXPECT_TRUE(fails_with(estimate_worker_bytes([&] {
                           TrainConfig bad = base;
                           bad.data = "synthetic:x";
                           return bad;
                         }()),
                         ErrorKind::kUsage, {"synthetic:x"}));
}

TEST(MemoryEstimate, WorkersThatCannotFitAreRefusedNamingTheEstimateAndWhatIsAvailable) {
  const auto available = available_memory();
  ASSERT_TRUE(available) << "no MemAvailable in /proc/meminfo";
  EXPECT_GT(*available, 0u);
  TrainConfig config;
  config.data = "synthetic:512:128";
  config.model = "mlp:32";
  config.workers = 2;
  EXPECT_TRUE(check_workers_fit(config, 2));
  // 20 million parameters, a thousand times: far beyond any host's memory.
  config.model = "mlp:4096,4096";
  config.workers = 1000;
  EXPECT_TRUE(fails_with(check_workers_fit(config, 1000), ErrorKind::kUsage, {"--workers 1000", "MemAvailable", "GB"}));
  // What cannot be estimated is left to the workers to report.
  config.data = "/no/such/data";
  EXPECT_TRUE(check_workers_fit(config, 1000));
}

}  // namespace
}  // namespace cfmo::train
