// Checkpoints: round trip of parameters, optimizer state and position;
// pruning; resolving a run directory; refusing mismatched checkpoints.
#include "train/checkpoint.h"

#include "core/atomic_file.h"
#include "integration/harness.h"

#include <gtest/gtest.h>

#include <numeric>

namespace cfmo {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

struct Fixture {
  explicit Fixture(const std::string& optimizer_name) : model(MlpSpec{6, {5}, 3}) {
    model.init(7);
    OptimizerConfig config;
    config.name = optimizer_name;
    optimizer = std::move(make_optimizer(config, model.params(), model.num_params())).value();
    // Give the state non-trivial values by taking two steps.
    std::vector<float> inputs(4 * 6);
    std::iota(inputs.begin(), inputs.end(), 0.0f);
    for (float& x : inputs) x = std::sin(x);
    const std::vector<int32_t> labels = {0, 1, 2, 1};
    for (int i = 0; i < 2; ++i) {
      model.forward_backward(inputs.data(), labels.data(), 4);
      optimizer->step(model.parameters(), model.gradients(), 0.01f);
    }
  }
  Mlp model;
  std::unique_ptr<Optimizer> optimizer;
};

TEST(Checkpoint, RoundTripRestoresParametersStateAndPosition) {
  for (const char* name : {"sgd", "adam", "adamw", "muon"}) {
    SCOPED_TRACE(name);
    TempDir dir;
    Fixture saved(name);
    const TrainPosition position{17, 2, 3, 1000, 1.5};
    auto path = save_checkpoint(dir.path(), saved.model, *saved.optimizer, position, "lr = 0.01\n", 3);
    ASSERT_TRUE(path) << path.error().message;
    EXPECT_EQ(path->filename(), "step-00000017");
    EXPECT_EQ(read_file(dir / "checkpoints/latest").value(), "step-00000017\n");
    EXPECT_EQ(read_file(*path / "config.toml").value(), "lr = 0.01\n");

    Fixture loaded(name);
    loaded.model.init(99);  // different parameters, to be overwritten
    auto restored = load_checkpoint(*path, loaded.model, *loaded.optimizer);
    ASSERT_TRUE(restored) << restored.error().message;
    EXPECT_EQ(restored->step, 17);
    EXPECT_EQ(restored->epoch, 2);
    EXPECT_EQ(restored->batch_in_epoch, 3);
    EXPECT_EQ(restored->samples, 1000);
    EXPECT_DOUBLE_EQ(restored->train_s, 1.5);
    EXPECT_EQ(loaded.optimizer->step_count(), saved.optimizer->step_count());
    const auto a = saved.model.parameters();
    const auto b = loaded.model.parameters();
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
    auto saved_state = saved.optimizer->state();
    auto loaded_state = loaded.optimizer->state();
    ASSERT_EQ(saved_state.size(), loaded_state.size());
    for (size_t i = 0; i < saved_state.size(); ++i) EXPECT_EQ(*saved_state[i].buffer, *loaded_state[i].buffer);
  }
}

TEST(Checkpoint, KeepsOnlyTheNewestAndLeavesNoTemporaries) {
  TempDir dir;
  Fixture f("adamw");
  for (int64_t step : {1, 2, 3, 4, 5}) {
    ASSERT_TRUE(save_checkpoint(dir.path(), f.model, *f.optimizer, {step, 0, step, step, 0}, "", 2));
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000004", "step-00000005"}));
  auto resolved = resolve_checkpoint(dir.path());
  ASSERT_TRUE(resolved);
  EXPECT_EQ(resolved->filename(), "step-00000005");
  EXPECT_EQ(resolve_checkpoint(*resolved).value(), *resolved);  // a checkpoint directory resolves to itself
  // A trailing slash or a relative path changes nothing: the result is absolute and normal.
  EXPECT_EQ(resolve_checkpoint(resolved->string() + "/").value(), *resolved);
  EXPECT_TRUE(resolved->is_absolute());
  EXPECT_EQ(run_dir_of(*resolved), fs::absolute(dir.path()).lexically_normal());
  EXPECT_EQ(run_dir_of(dir / "elsewhere" / "step-00000005"), fs::path());
}

TEST(Checkpoint, ResumingFromAnEarlierStepDropsTheAbandonedFuture) {
  TempDir dir;
  Fixture f("adamw");
  for (int64_t step : {1, 2, 3, 4, 5}) {
    ASSERT_TRUE(save_checkpoint(dir.path(), f.model, *f.optimizer, {step, 0, step, step, 0}, "", 10));
  }
  fs::create_directories(dir / "checkpoints/.step-00000009.tmp-12345");  // left by a crashed writer
  ASSERT_TRUE(save_checkpoint(dir.path(), f.model, *f.optimizer, {3, 0, 3, 3, 0}, "", 10));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000001", "step-00000002", "step-00000003"}));
}

TEST(Checkpoint, ResolveErrorsNameThePath) {
  TempDir dir;
  auto missing = resolve_checkpoint(dir / "nothing");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().kind, ErrorKind::kInput);
  EXPECT_NE(missing.error().message.find("nothing"), std::string::npos);
  fs::create_directories(dir / "run/checkpoints");
  ASSERT_TRUE(write_file_atomic(dir / "run/checkpoints/latest", "../../etc\n"));
  auto escaping = resolve_checkpoint(dir / "run");
  ASSERT_FALSE(escaping);
  EXPECT_EQ(escaping.error().kind, ErrorKind::kInput);
}

TEST(Checkpoint, RefusesAnotherOptimizerOrModel) {
  TempDir dir;
  Fixture f("adamw");
  auto path = save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1);
  ASSERT_TRUE(path);
  Fixture sgd("sgd");
  auto wrong_optimizer = load_checkpoint(*path, sgd.model, *sgd.optimizer);
  ASSERT_FALSE(wrong_optimizer);
  EXPECT_EQ(wrong_optimizer.error().kind, ErrorKind::kUsage);
  EXPECT_NE(wrong_optimizer.error().message.find("adamw"), std::string::npos);

  Mlp wider(MlpSpec{6, {7}, 3});
  OptimizerConfig config;
  auto optimizer = std::move(make_optimizer(config, wider.params(), wider.num_params())).value();
  auto wrong_shape = load_checkpoint(*path, wider, *optimizer);
  ASSERT_FALSE(wrong_shape);
  EXPECT_EQ(wrong_shape.error().kind, ErrorKind::kInput);
  EXPECT_NE(wrong_shape.error().message.find("layers.0.weight"), std::string::npos) << wrong_shape.error().message;
}

TEST(Checkpoint, CorruptStateIsAnInputError) {
  TempDir dir;
  Fixture f("sgd");
  auto path = save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1);
  ASSERT_TRUE(path);
  for (const std::string bad : {"{", "{\"format\": \"other\", \"version\": 1}", "[]",
                                "{\"format\": \"cfmo-checkpoint\", \"version\": 1, \"step\": \"x\"}"}) {
    ASSERT_TRUE(write_file_atomic(*path / "state.json", bad));
    auto loaded = load_checkpoint(*path, f.model, *f.optimizer);
    ASSERT_FALSE(loaded) << bad;
    EXPECT_EQ(loaded.error().kind, ErrorKind::kInput) << bad;
    EXPECT_NE(loaded.error().message.find("state.json"), std::string::npos) << loaded.error().message;
  }
}

}  // namespace
}  // namespace cfmo
