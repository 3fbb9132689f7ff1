// The training loop as a library: it learns, it stops when told, it reports
// through the observer, and it fails cleanly.
#include "train/trainer.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cfmo {
namespace {

using testing::TempDir;

TrainConfig small_config() {
  TrainConfig c;
  c.data = "synthetic:1024:256";
  c.model = "mlp:32";
  c.epochs = 2;
  c.quiet = true;
  return c;
}

class Recorder final : public TrainObserver {
 public:
  void on_step(const StepEvent& e) override { steps.push_back(e); }
  void on_eval(const EvalEvent& e) override { evals.push_back(e); }
  std::vector<StepEvent> steps;
  std::vector<EvalEvent> evals;
};

TEST(Trainer, LearnsTheSyntheticTaskWithEveryOptimizer) {
  for (const char* optimizer : {"sgd", "adam", "adamw", "muon"}) {
    SCOPED_TRACE(optimizer);
    TrainConfig c = small_config();
    c.optimizer = optimizer;
    c.lr = std::string(optimizer) == "sgd" ? 0.05 : 1e-3;
    c.epochs = 3;
    auto summary = train(c, {});
    ASSERT_TRUE(summary) << summary.error().message;
    EXPECT_GT(summary->test_accuracy, 0.6);  // chance is 0.1
    EXPECT_EQ(summary->steps, 48);
    EXPECT_EQ(summary->samples, 3 * 1024);
    EXPECT_EQ(summary->stopped_by, "epochs");
  }
}

TEST(Trainer, SameSeedSameResult) {
  auto a = train(small_config(), {});
  auto b = train(small_config(), {});
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->test_loss, b->test_loss);
  TrainConfig other = small_config();
  other.seed = 2;
  auto c = train(other, {});
  ASSERT_TRUE(c);
  EXPECT_NE(a->test_loss, c->test_loss);
}

TEST(Trainer, ReportsStepsAndEvaluationsToTheObserver) {
  Recorder recorder;
  TrainConfig c = small_config();
  c.log_every = 5;
  TrainOptions options;
  options.observer = &recorder;
  auto summary = train(c, options);
  ASSERT_TRUE(summary);
  ASSERT_EQ(recorder.steps.size(), 32u);
  EXPECT_EQ(std::count_if(recorder.steps.begin(), recorder.steps.end(), [](const StepEvent& e) { return e.logged; }),
            6);
  EXPECT_DOUBLE_EQ(recorder.steps.back().fraction, 1.0);
  // One per epoch end; the run ended on an epoch boundary, so no extra final evaluation.
  ASSERT_EQ(recorder.evals.size(), 2u);
  EXPECT_DOUBLE_EQ(recorder.evals[0].epochs, 1.0);
  EXPECT_DOUBLE_EQ(recorder.evals[1].epochs, 2.0);
  EXPECT_EQ(recorder.evals[1].test_accuracy, summary->test_accuracy);
  // A run that stops mid-epoch evaluates once more, marked final.
  Recorder mid;
  c.steps = 20;
  options.observer = &mid;
  ASSERT_TRUE(train(c, options));
  ASSERT_EQ(mid.evals.size(), 2u);
  EXPECT_TRUE(mid.evals.back().final);
  EXPECT_DOUBLE_EQ(mid.evals.back().epochs, 1.25);
}

TEST(Trainer, StopsOnStepsTimeLimitAndRequest) {
  TrainConfig c = small_config();
  c.steps = 5;
  auto by_steps = train(c, {});
  ASSERT_TRUE(by_steps);
  EXPECT_EQ(by_steps->steps, 5);
  EXPECT_EQ(by_steps->stopped_by, "steps");

  c.steps = 0;
  c.epochs = 0;
  c.time_limit = "1ms";
  auto by_time = train(c, {});
  ASSERT_TRUE(by_time);
  EXPECT_EQ(by_time->stopped_by, "time-limit");

  std::atomic<bool> stop{true};
  TrainOptions options;
  options.stop = &stop;
  c.time_limit = "1h";
  auto by_request = train(c, options);
  ASSERT_TRUE(by_request);
  EXPECT_EQ(by_request->stopped_by, "interrupt");
  EXPECT_EQ(by_request->steps, 0);
}

TEST(Trainer, DivergenceIsACheckFailure) {
  TrainConfig c = small_config();
  c.optimizer = "sgd";
  c.lr = 1e6;
  auto summary = train(c, {});
  ASSERT_FALSE(summary);
  EXPECT_EQ(summary.error().kind, ErrorKind::kCheckFailed);
  EXPECT_NE(summary.error().message.find("diverged"), std::string::npos);
}

TEST(Trainer, InvalidConfigurationIsAUsageError) {
  TrainConfig c = small_config();
  c.batch_size = 0;
  auto summary = train(c, {});
  ASSERT_FALSE(summary);
  EXPECT_EQ(summary.error().kind, ErrorKind::kUsage);
  EXPECT_NE(summary.error().message.find("--batch-size"), std::string::npos);
  c = small_config();
  c.schedule = "cosine";
  c.epochs = 0;
  c.time_limit = "10s";
  EXPECT_EQ(train(c, {}).error().kind, ErrorKind::kUsage);
}

TEST(Trainer, SummaryJsonHasTheDocumentedKeys) {
  auto summary = train(small_config(), {});
  ASSERT_TRUE(summary);
  const auto j = nlohmann::json::parse(summary->to_json());
  for (const char* key : {"mode", "workers", "steps", "samples", "wall_s", "samples_per_s", "test_accuracy",
                          "test_loss", "bytes_sent", "per_worker"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["per_worker"][0]["rank"], 0);
  EXPECT_TRUE(j["run_dir"].is_null());
  EXPECT_EQ(j["parameters"], 784 * 32 + 32 + 32 * 10 + 10);  // trainable parameters, no padding
}

TEST(Trainer, RunDirectoryGetsMetricsAndModel) {
  TempDir dir;
  TrainConfig c = small_config();
  c.out = (dir / "run").string();
  c.log_every = 4;
  auto summary = train(c, {});
  ASSERT_TRUE(summary) << summary.error().message;
  EXPECT_TRUE(std::filesystem::exists(dir / "run/metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(dir / "run/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/step-00000032/state.json"));
}

}  // namespace
}  // namespace cfmo
