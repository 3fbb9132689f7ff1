// Checkpoints: round trip of parameters, optimizer state and position;
// pruning; resolving a run directory; refusing mismatched checkpoints.
#include "train/checkpoint.h"

#include "core/atomic_file.h"
#include "integration/harness.h"
#include "model/mlp.h"
#include "support/expect_error.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <numeric>

namespace cfmo::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

struct Fixture {
  explicit Fixture(const std::string& optimizer_name) : model(model::MlpSpec{6, {5}, 3}) {
    model.init(7);
    optim::OptimizerConfig config;
    config.kind = optim::parse_optimizer_kind(optimizer_name).value();
    optimizer = std::move(optim::make_optimizer(config, model.params(), model.num_params())).value();
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
  model::Mlp model;
  std::unique_ptr<optim::Optimizer> optimizer;
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
  const pid_t dead = fork();  // a writer that crashed: its pid, reaped
  if (dead == 0) _exit(0);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  fs::create_directories(dir / fmt::format("checkpoints/.step-00000009.tmp-{}", dead));
  // Another live process writing (a second keeper of a split run): its write is its own.
  const std::string live = fmt::format(".step-00000010.tmp-{}", getppid());
  fs::create_directories(dir / "checkpoints" / live);
  ASSERT_TRUE(save_checkpoint(dir.path(), f.model, *f.optimizer, {3, 0, 3, 3, 0}, "", 10));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{live, "latest", "step-00000001", "step-00000002", "step-00000003"}));
}

TEST(Checkpoint, KeepsTheWorldAndTheOuterMomentumOfSeveralWorkers) {
  TempDir dir;
  Fixture f("adamw");
  CheckpointData data = checkpoint_data(f.model, *f.optimizer, {9, 1, 2, 640, 0.5});
  data.world.workers = 2;
  data.world.mode = "asgd";
  data.world.batch_size = 32;
  data.world.ranks = {{9, 1, 2, 640, 0.5}, {12, 1, 5, 832, 0.25}};
  data.world.shard_optimizer_steps = {20, 24};
  data.outer_momentum.assign(f.model.num_params(), 0.0f);
  for (size_t i = 0; i < data.outer_momentum.size(); ++i) data.outer_momentum[i] = static_cast<float>(i) * 0.5f;
  auto path = write_checkpoint(dir.path(), f.model.spec_string(), f.model.params(), data, "", 3);
  ASSERT_TRUE(path) << path.error().message;
  EXPECT_TRUE(fs::exists(*path / "outer.safetensors"));

  Fixture loaded("adamw");
  CheckpointWorld world;
  tensor::FloatBuffer outer;
  auto position = load_checkpoint(*path, loaded.model, *loaded.optimizer, &world, &outer);
  ASSERT_TRUE(position) << position.error().message;
  EXPECT_EQ(position->step, 9);
  EXPECT_EQ(world.workers, 2);
  EXPECT_EQ(world.mode, "asgd");
  EXPECT_EQ(world.batch_size, 32);
  ASSERT_EQ(world.ranks.size(), 2u);
  EXPECT_EQ(world.ranks[1].step, 12);
  EXPECT_EQ(world.ranks[1].batch_in_epoch, 5);
  EXPECT_EQ(world.ranks[1].samples, 832);
  EXPECT_EQ(world.shard_optimizer_steps, (std::vector<int64_t>{20, 24}));
  // The padding between tensors is not saved: compare the tensors.
  ASSERT_EQ(outer.size(), data.outer_momentum.size());
  for (const auto& p : f.model.params()) {
    for (size_t i = p.offset; i < p.offset + p.size; ++i) EXPECT_EQ(outer[i], data.outer_momentum[i]) << p.name;
  }

  // A single worker's checkpoint has neither.
  auto single = save_checkpoint(dir / "single", f.model, *f.optimizer, {3, 0, 3, 12, 0}, "", 1);
  ASSERT_TRUE(single);
  ASSERT_TRUE(load_checkpoint(*single, loaded.model, *loaded.optimizer, &world, &outer));
  EXPECT_EQ(world.workers, 1);
  EXPECT_TRUE(world.ranks.empty());
  EXPECT_TRUE(outer.empty());
}

// A cfmo checkpoint's owner and per-rank state: the shards' versions, the
// owners' pending rounds beside the momentum, and every rank's own
// optimizer state, steps and error feedback.
TEST(Checkpoint, KeepsTheOwnersPendingRoundsAndEveryRanksOwnState) {
  TempDir dir;
  Fixture f("adamw");
  CheckpointData data = checkpoint_data(f.model, *f.optimizer, {9, 1, 2, 640, 0.5});
  data.world.workers = 2;
  data.world.mode = "cfmo";
  data.world.ranks = {{9, 1, 2, 640, 0.5}, {9, 1, 2, 640, 0.25}};
  data.world.shard_versions = {14, 16};
  data.world.outer_in_round = {1, 0};
  data.world.rank_optimizer_steps = {2, 1};
  const size_t n = f.model.num_params();
  auto ramp = [n](float scale) {
    tensor::FloatBuffer v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * scale;
    return v;
  };
  data.outer_momentum = ramp(0.5f);
  data.outer_round_sum = ramp(-0.25f);
  auto other = data.optimizer_state;
  for (auto& [name, buffer] : other) std::fill(buffer.begin(), buffer.end(), 3.0f);
  data.rank_optimizer_state = {other};
  data.wire_residuals = {ramp(0.125f), ramp(-0.125f)};
  auto path = write_checkpoint(dir.path(), f.model.spec_string(), f.model.params(), data, "", 3);
  ASSERT_TRUE(path) << path.error().message;

  Fixture loaded("adamw");
  CheckpointWorld world;
  tensor::FloatBuffer outer;
  tensor::FloatBuffer round_sum;
  ASSERT_TRUE(load_checkpoint(*path, loaded.model, *loaded.optimizer, &world, &outer, &round_sum));
  EXPECT_EQ(world.shard_versions, (std::vector<int64_t>{14, 16}));
  EXPECT_EQ(world.outer_in_round, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(world.rank_optimizer_steps, (std::vector<int64_t>{2, 1}));
  auto residual = load_wire_residual(*path, loaded.model, 1);
  ASSERT_TRUE(residual) << residual.error().message;
  auto rank1 = load_rank_optimizer(*path, loaded.model, *loaded.optimizer, 1);
  ASSERT_TRUE(rank1 && *rank1);
  EXPECT_EQ(loaded.optimizer->step_count(), 1);  // rank 1's own count
  EXPECT_EQ((*loaded.optimizer->state()[0].buffer)[f.model.params()[0].offset], 3.0f);
  for (const auto& p : f.model.params()) {
    for (size_t i = p.offset; i < p.offset + p.size; ++i) {
      EXPECT_EQ(round_sum[i], data.outer_round_sum[i]) << p.name;
      EXPECT_EQ((*residual)[i], data.wire_residuals[1][i]) << p.name;
    }
  }
  auto none = load_wire_residual(*path, loaded.model, 2);  // no such rank: none
  ASSERT_TRUE(none);
  EXPECT_TRUE(none->empty());

  // Counts of another length than the workers, or residual files misnamed: input errors naming state.json.
  const std::string good = read_file(*path / "state.json").value();
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"wire-rank-1.safetensors\"", "\"wire-rank-7.safetensors\""},
           {"\"shard_versions\": [\n    14,", "\"shard_versions\": [\n    14, 15,"},
           {"\"outer_in_round\": [\n    1,", "\"outer_in_round\": [\n    -1,"}}) {
    std::string bad = good;
    const size_t at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from << " in " << good;
    bad.replace(at, from.size(), to);
    ASSERT_TRUE(write_file_atomic(*path / "state.json", bad));
    auto refused = load_checkpoint(*path, loaded.model, *loaded.optimizer, &world, &outer, &round_sum);
    ASSERT_FALSE(refused) << to;
    EXPECT_EQ(refused.error().kind, ErrorKind::kInput) << to;
    EXPECT_NE(refused.error().message.find("state.json"), std::string::npos) << refused.error().message;
  }
}

TEST(Checkpoint, ACheckpointOfTheSameStepIsSwappedInWhole) {
  TempDir dir;
  Fixture f("sgd");
  auto first = save_checkpoint(dir.path(), f.model, *f.optimizer, {4, 0, 4, 16, 0}, "a = 1\n", 3);
  ASSERT_TRUE(first);
  auto second = save_checkpoint(dir.path(), f.model, *f.optimizer, {4, 0, 4, 16, 0}, "a = 2\n", 3);
  ASSERT_TRUE(second);
  EXPECT_EQ(*first, *second);
  EXPECT_EQ(read_file(*second / "config.toml").value(), "a = 2\n");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000004"}));  // the old one is gone, no temporary left
}

TEST(CheckpointWriter, WritesInTheBackgroundAndANewerOneReplacesOneWaiting) {
  TempDir dir;
  Fixture f("adamw");
  int64_t accepted = 0;
  {
    CheckpointWriter writer(dir.path(), f.model.spec_string(), f.model.params(), "", 100);
    for (int64_t step = 1; step <= 20; ++step) {
      if (writer.submit(checkpoint_data(f.model, *f.optimizer, {step, 0, step, step, 0}))) ++accepted;
    }
    writer.close();
    ASSERT_TRUE(writer.status());
    EXPECT_EQ(writer.written() + writer.skipped(), 20);
    EXPECT_GE(writer.written(), 1);  // at least the last one submitted: it is never replaced
    EXPECT_EQ(writer.last_step(), 20);
    // Closed: nothing more is written.
    EXPECT_FALSE(writer.submit(checkpoint_data(f.model, *f.optimizer, {21, 0, 21, 21, 0})));
  }
  EXPECT_GE(accepted, 1);
  EXPECT_EQ(read_file(dir / "checkpoints/latest").value(), "step-00000020\n");
  for (const auto& e : fs::directory_iterator(dir / "checkpoints")) {
    if (!e.is_directory()) continue;
    Fixture loaded("adamw");
    EXPECT_TRUE(load_checkpoint(e.path(), loaded.model, *loaded.optimizer)) << e.path();
  }
}

TEST(Checkpoint, AWorldThatDisagreesWithItselfIsAnInputError) {
  TempDir dir;
  Fixture f("sgd");
  auto path = save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1);
  ASSERT_TRUE(path);
  const std::string good = read_file(*path / "state.json").value();
  const std::string end = "\n}";
  ASSERT_NE(good.rfind(end), std::string::npos);
  const std::string base = good.substr(0, good.rfind(end));
  const std::string one_rank =
      R"(, "ranks": [{"step": 1, "epoch": 0, "batch_in_epoch": 1, "samples": 4, "train_s": 0}])";
  for (const std::string& extra : std::vector<std::string>{R"(, "workers": 0)", R"(, "workers": 2)" + one_rank,
                                                           R"(, "workers": 1, "shard_optimizer_steps": [-1])",
                                                           R"(, "outer": "../../elsewhere")"}) {
    ASSERT_TRUE(write_file_atomic(*path / "state.json", base + extra + end));
    auto loaded = load_checkpoint(*path, f.model, *f.optimizer);
    ASSERT_FALSE(loaded) << extra;
    EXPECT_EQ(loaded.error().kind, ErrorKind::kInput) << extra;
    EXPECT_NE(loaded.error().message.find("state.json"), std::string::npos) << loaded.error().message;
  }
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

  model::Mlp wider(model::MlpSpec{6, {7}, 3});
  optim::OptimizerConfig config;
  auto optimizer = std::move(optim::make_optimizer(config, wider.params(), wider.num_params())).value();
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

// Positions of a run over 10 examples in batches of 4 a worker: 3 batches an epoch.
TEST(Checkpoint, PositionsTheDataCouldNotHaveGivenAreInputErrorsNamingTheField) {
  const fs::path dir = "/run/checkpoints/step-00000004";
  CheckpointWorld solo;
  // One worker: batches of 4, 4 and 2 examples; step 4 is epoch 1, batch 1.
  EXPECT_TRUE(check_positions(dir, {4, 1, 1, 14, 0.5}, solo, 4, 10, 4));
  EXPECT_TRUE(check_positions(dir, {3, 1, 0, 10, 0}, solo, 3, 10, 4));
  EXPECT_TRUE(check_positions(dir, {0, 0, 0, 0, 0}, solo, 0, 10, 4));
  auto fails = [&](const TrainPosition& p, const CheckpointWorld& world, int64_t optimizer_steps,
                   std::initializer_list<std::string> parts) {
    return fails_with(check_positions(dir, p, world, optimizer_steps, 10, 4), ErrorKind::kInput, parts);
  };
  EXPECT_TRUE(fails({4, 1, 1'000'000'000'000, 14, 0}, solo, 4, {"state.json", "batch_in_epoch 1000000000000"}));
  EXPECT_TRUE(fails({5, 1, 4, 14, 0}, solo, 4, {"batch_in_epoch 4"}));
  // The end of an epoch, as a rank of cfmo or asgd records it before turning to the next one.
  EXPECT_TRUE(check_positions(dir, {3, 0, 3, 10, 0}, solo, 3, 10, 4));
  const TrainPosition next = resume_position({3, 0, 3, 10, 0}, 3);
  EXPECT_EQ(next.epoch, 1);
  EXPECT_EQ(next.batch_in_epoch, 0);
  EXPECT_EQ(next.step, 3);
  EXPECT_EQ(resume_position({4, 1, 1, 14, 0}, 3).batch_in_epoch, 1);
  EXPECT_TRUE(fails({4, int64_t{1} << 62, 1, 14, 0}, solo, 4, {"epoch 4611686018427387904"}));
  EXPECT_TRUE(fails({4, 2, 1, 14, 0}, solo, 4, {"step 4", "epoch 2"}));
  EXPECT_TRUE(fails({5, 1, 1, 14, 0}, solo, 4, {"step 5"}));
  EXPECT_TRUE(fails({4, 1, 1, 15, 0}, solo, 4, {"samples 15"}));
  EXPECT_TRUE(fails({4, 1, 1, 13, 0}, solo, 4, {"samples 13"}));
  EXPECT_TRUE(fails({4, 1, 1, 14, -1}, solo, 4, {"train_s"}));
  EXPECT_TRUE(fails({4, 1, 1, 14, 0}, solo, 5, {"optimizer_steps 5"}));
  // A step count so large that epoch x an epoch's samples would overflow: refused, not wrapped.
  const int64_t huge = (int64_t{1} << 62) + 1;
  EXPECT_TRUE(fails({huge, huge / 3, huge % 3, 0, 0}, solo, 0, {"samples 0"}));

  // Two workers, batches of 4 each (8 a step): rank 0 takes examples 0-3 of an epoch's
  // first batch and 8-9 of its second, rank 1 examples 4-7 and none.
  CheckpointWorld two;
  two.workers = 2;
  two.ranks = {{3, 1, 1, 10, 0}, {2, 1, 0, 4, 0}};
  two.shard_optimizer_steps = {5, 5};
  EXPECT_TRUE(check_positions(dir, two.ranks[0], two, 5, 10, 4));
  CheckpointWorld bad_rank = two;
  bad_rank.ranks[1].batch_in_epoch = 7;
  EXPECT_TRUE(fails(two.ranks[0], bad_rank, 5, {"ranks[1].batch_in_epoch 7"}));
  bad_rank = two;
  bad_rank.ranks[1].samples = 5;
  EXPECT_TRUE(fails(two.ranks[0], bad_rank, 5, {"ranks[1].samples 5"}));
  // The ranks' positions lag their steps: the optimizer's are bounded by them and rank 0's own together.
  EXPECT_TRUE(check_positions(dir, two.ranks[0], two, 8, 10, 4));
  EXPECT_TRUE(fails(two.ranks[0], two, 9, {"optimizer_steps 9"}));
}

// A run grown from two ranks to three by a join: state.json records the
// first world and each position's cut of its epoch, and the reader checks
// them (the cut within the two worlds, and only where the world grew).
TEST(Checkpoint, AGrownWorldKeepsItsFirstWorldAndEachPositionsCut) {
  TempDir dir;
  Fixture f("adamw");
  TrainPosition keeper{20, 1, 4, 640, 0.5};
  keeper.data_world = 3;
  CheckpointData data = checkpoint_data(f.model, *f.optimizer, keeper);
  data.world.workers = 3;
  data.world.first_workers = 2;
  data.world.mode = "cfmo";
  data.world.batch_size = 32;
  TrainPosition joiner{7, 0, 7, 224, 0.1};
  joiner.data_world = 3;
  TrainPosition behind{14, 0, 14, 448, 0.3};
  behind.data_world = 2;  // still in the epoch it was in when the world grew
  data.world.ranks = {keeper, behind, joiner};
  auto path = write_checkpoint(dir.path(), f.model.spec_string(), f.model.params(), data, "", 3);
  ASSERT_TRUE(path) << path.error().message;
  const std::string good = read_file(*path / "state.json").value();
  Fixture loaded("adamw");
  CheckpointWorld world;
  auto position = load_checkpoint(*path, loaded.model, *loaded.optimizer, &world);
  ASSERT_TRUE(position) << position.error().message;
  EXPECT_EQ(position->data_world, 3);
  EXPECT_EQ(world.workers, 3);
  EXPECT_EQ(world.first_workers, 2);
  ASSERT_EQ(world.ranks.size(), 3u);
  EXPECT_EQ(world.ranks[1].data_world, 2);
  // 1024 examples, batches of 32: 16 global batches an epoch of two ranks, 11 of three.
  EXPECT_TRUE(check_positions(*path, *position, world, 20, 1024, 32));
  auto fails = [&](const TrainPosition& p, const CheckpointWorld& w, std::initializer_list<std::string> parts) {
    return fails_with(check_positions(*path, p, w, 0, 1024, 32), ErrorKind::kInput, parts);
  };
  TrainPosition past = behind;
  past.batch_in_epoch = 12;
  past.step = 12;
  past.data_world = 3;  // 11 batches of three ranks
  EXPECT_TRUE(fails(past, world, {"state.json", "batch_in_epoch 12"}));
  TrainPosition short_epoch{12, 1, 2, 0, 0};  // an epoch of 10 batches: fewer than three ranks' 11
  short_epoch.data_world = 3;
  EXPECT_TRUE(fails(short_epoch, world, {"step 12", "grew from 2 to 3"}));
  TrainPosition long_epoch{20, 1, 2, 0, 0};  // an epoch of 18: more than two ranks' 16
  long_epoch.data_world = 3;
  EXPECT_TRUE(fails(long_epoch, world, {"step 20"}));
  TrainPosition too_many = keeper;
  too_many.samples = 20 * 32 + 1;
  EXPECT_TRUE(fails(too_many, world, {"samples 641"}));

  // A cut without a grown world, or outside its two worlds, and a first world above the last: refused.
  for (const auto& [from, to] :
       std::vector<std::pair<std::string, std::string>>{{R"("first_workers": 2)", R"("first_workers": 3)"},
                                                        {R"("first_workers": 2)", R"("first_workers": 4)"},
                                                        {R"("data_world": 3)", R"("data_world": 1)"},
                                                        {R"("data_world": 3)", R"("data_world": 4)"}}) {
    std::string bad = good;
    const auto at = bad.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bad.replace(at, from.size(), to);
    ASSERT_TRUE(write_file_atomic(*path / "state.json", bad));
    auto refused = load_checkpoint(*path, loaded.model, *loaded.optimizer, &world);
    ASSERT_FALSE(refused) << to;
    EXPECT_EQ(refused.error().kind, ErrorKind::kInput) << to;
    EXPECT_NE(refused.error().message.find("first_workers"), std::string::npos) << refused.error().message;
  }
  ASSERT_TRUE(write_file_atomic(*path / "state.json", good));
  // A world that never grew writes neither.
  data.world.first_workers = 3;
  auto same = write_checkpoint(dir / "same", f.model.spec_string(), f.model.params(), data, "", 3);
  ASSERT_TRUE(same);
  const std::string plain = read_file(*same / "state.json").value();
  EXPECT_EQ(plain.find("first_workers"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("data_world"), std::string::npos) << plain;
}

TEST(Checkpoint, AFailedWriteLeavesNoTemporaryDirectoryBehind) {
  TempDir dir;
  Fixture f("adamw");
  // A disk that fills up: files may not grow past 64 bytes, so the first
  // write fails (EFBIG, as ENOSPC would), without filling a real file system.
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit tiny = old;
  tiny.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &tiny), 0);
  auto written = save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1);
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().kind, ErrorKind::kInternal) << written.error().message;
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(dir / "checkpoints")) left.push_back(entry.path().filename());
  EXPECT_TRUE(left.empty()) << left.front();
  // And the next one, with room, is written whole.
  ASSERT_TRUE(save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1));
}

TEST(Checkpoint, TheModelFieldMustBeTheModels) {
  TempDir dir;
  Fixture f("sgd");
  auto path = save_checkpoint(dir.path(), f.model, *f.optimizer, {2, 0, 2, 8, 0}, "", 1);
  ASSERT_TRUE(path);
  std::string text = read_file(*path / "state.json").value();
  const std::string model = "\"" + f.model.spec().to_string() + "\"";
  ASSERT_NE(text.find(model), std::string::npos);
  text.replace(text.find(model), model.size(), "\"mlp:999\"");
  ASSERT_TRUE(write_file_atomic(*path / "state.json", text));
  EXPECT_TRUE(fails_with(load_checkpoint(*path, f.model, *f.optimizer), ErrorKind::kInput, {"state.json", "mlp:999"}));
}

TEST(Checkpoint, TheRunDirectoryIsLockedAgainstASecondRun) {
  TempDir dir;
  const fs::path run = dir / "a" / "run";
  auto lock = lock_run_dir(run);
  ASSERT_TRUE(lock) << lock.error().message;
  EXPECT_TRUE(fs::is_directory(run));
  const pid_t child = fork();
  if (child == 0) {
    // Another process is refused at once, with the holder's pid.
    auto second = lock_run_dir(run);
    _exit(!second && second.error().kind == ErrorKind::kUsage &&
                  second.error().message.find(fmt::format("pid {}", getppid())) != std::string::npos &&
                  second.error().message.find(run.string()) != std::string::npos
              ? 0
              : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  lock->release();
  EXPECT_TRUE(lock_run_dir(run));
  ASSERT_TRUE(write_file_atomic(dir / "file", "x"));
  EXPECT_TRUE(fails_with(lock_run_dir(dir / "file" / "run"), ErrorKind::kUsage, {"--out", "file"}));
}

TEST(Checkpoint, OnlyACheckpointInRunCheckpointsBelongsToARun) {
  EXPECT_EQ(run_dir_of("/x/run/checkpoints/step-00000003"), fs::path("/x/run"));
  EXPECT_EQ(run_dir_of("/x/a/b/ck"), fs::path());
  EXPECT_EQ(run_dir_of("/x/a/checkpoints/ck"), fs::path());
  EXPECT_EQ(run_dir_of("/x/run/saved/step-00000003"), fs::path());
}

}  // namespace
}  // namespace cfmo::train
