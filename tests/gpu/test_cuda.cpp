// The CUDA backend against the CPU path it mirrors: every kernel, the MLP and
// every optimizer give the CPU's numbers within float tolerance. Exits 77
// (skipped) where no CUDA device can be used, so CI without a GPU passes.
#include "comm/rendezvous.h"
#include "comm/ucx_communicator.h"
#include "core/rng.h"
#include "cuda/devices.h"
#include "cuda/mlp.h"
#include "cuda/nccl.h"
#include "cuda/optimizer.h"
#include "cuda/runtime.h"
#include "data/dataset.h"
#include "model/mlp.h"
#include "optim/optimizer.h"
#include "tensor/ops.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

namespace cfmo::cuda {
namespace {

std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed, 7);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(-scale, scale);
  return v;
}

/// Max |a - b| / (max |b| + tiny): one number per comparison, in messages too.
double relative_error(std::span<const float> a, std::span<const float> b) {
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return diff / ref;
}

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ctx = Context::create(0);
    ASSERT_TRUE(ctx) << ctx.error().message;
    ctx_ = std::move(*ctx);
  }
  template <typename T>
  DeviceArray<T> on_device(std::span<const T> host) {
    DeviceArray<T> d;
    EXPECT_TRUE(d.resize(host.size(), "test"));
    EXPECT_TRUE(d.upload(host, ctx_->stream(), "test"));
    return d;
  }
  template <typename T>
  std::vector<T> to_host(const DeviceArray<T>& d) {
    std::vector<T> h(d.size());
    EXPECT_TRUE(d.download(h, ctx_->stream(), "test"));
    EXPECT_TRUE(ctx_->synchronize("test"));
    return h;
  }
  std::unique_ptr<Context> ctx_;
};

TEST_F(Cuda, GemmMatchesTheCpuForEveryTranspose) {
  const int m = 67, n = 45, k = 129;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const int lda = ta ? m : k;
      const int ldb = tb ? k : n;
      const auto a = random_vector(static_cast<size_t>(m) * k, 1);
      const auto b = random_vector(static_cast<size_t>(k) * n, 2);
      auto c = random_vector(static_cast<size_t>(m) * n, 3);
      auto da = on_device<float>(a);
      auto db = on_device<float>(b);
      auto dc = on_device<float>(c);
      ASSERT_TRUE(gemm(*ctx_, ta ? Trans::kYes : Trans::kNo, tb ? Trans::kYes : Trans::kNo, m, n, k, 0.5f, da.data(),
                       lda, db.data(), ldb, 0.25f, dc.data(), n));
      tensor::ops::gemm(ta ? tensor::ops::Trans::kYes : tensor::ops::Trans::kNo,
                        tb ? tensor::ops::Trans::kYes : tensor::ops::Trans::kNo, m, n, k, 0.5f, a.data(), lda, b.data(),
                        ldb, 0.25f, c.data(), n);
      EXPECT_LT(relative_error(to_host(dc), c), 1e-5) << "trans_a " << ta << " trans_b " << tb;
    }
  }
}

struct Batch {
  std::vector<float> inputs;
  std::vector<int32_t> labels;
};

Batch random_batch(int batch, int features, int classes, uint64_t seed) {
  Batch b;
  b.inputs = random_vector(static_cast<size_t>(batch) * features, seed);
  Rng rng(seed, 9);
  for (int i = 0; i < batch; ++i) b.labels.push_back(static_cast<int32_t>(rng.uniform() * classes) % classes);
  return b;
}

TEST_F(Cuda, MlpForwardBackwardMatchesTheCpu) {
  auto spec = model::MlpSpec::parse("mlp:96,40", 130, 10);
  ASSERT_TRUE(spec);
  model::Mlp cpu(*spec);
  cpu.init(5);
  auto gpu = CudaMlp::create(*ctx_, cpu);
  ASSERT_TRUE(gpu) << gpu.error().message;
  const Batch b = random_batch(37, 130, 10, 11);
  const float cpu_loss = cpu.forward_backward(b.inputs.data(), b.labels.data(), 37);
  auto gpu_loss = (*gpu)->forward_backward(b.inputs.data(), b.labels.data(), 37);
  ASSERT_TRUE(gpu_loss) << gpu_loss.error().message;
  EXPECT_NEAR(*gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss));
  std::vector<float> grads(cpu.num_params());
  ASSERT_TRUE((*gpu)->download_gradients(grads));
  for (const auto& p : cpu.params()) {
    const auto g = std::span<const float>(grads).subspan(p.offset, p.size);
    const auto c = cpu.gradients().subspan(p.offset, p.size);
    EXPECT_LT(relative_error(g, c), 1e-4) << p.name;
  }
}

TEST_F(Cuda, DeviceDatasetBatchesAndEvaluationMatchTheCpu) {
  data::DataSplit data = data::make_synthetic(3, 600, 250);
  auto spec = model::MlpSpec::parse("mlp:64", data.train.features, data.train.classes);
  ASSERT_TRUE(spec);
  model::Mlp cpu(*spec);
  cpu.init(8);
  auto gpu = CudaMlp::create(*ctx_, cpu);
  ASSERT_TRUE(gpu) << gpu.error().message;
  auto train = DeviceDataset::upload(*ctx_, data.train, "train set");
  auto test = DeviceDataset::upload(*ctx_, data.test, "test set");
  ASSERT_TRUE(train && test);
  const auto order = data::epoch_order(3, 0, data.train.count);
  std::vector<float> inputs(static_cast<size_t>(50) * data.train.features);
  std::vector<int32_t> labels(50);
  data::gather_batch(data.train, order, 100, 50, inputs.data(), labels.data());
  const float cpu_loss = cpu.forward_backward(inputs.data(), labels.data(), 50);
  auto gpu_loss = (*gpu)->forward_backward(*train, std::span<const int64_t>(order).subspan(100, 50));
  ASSERT_TRUE(gpu_loss) << gpu_loss.error().message;
  EXPECT_NEAR(*gpu_loss, cpu_loss, 1e-5 * std::abs(cpu_loss));

  std::vector<float> test_inputs(static_cast<size_t>(data.test.count) * data.test.features);
  data.test.rows_to_float(0, data.test.count, test_inputs.data());
  const model::EvalResult want = cpu.evaluate(test_inputs.data(), data.test.labels.data(), data.test.count, 100);
  auto got = (*gpu)->evaluate(*test, 100);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got->count, want.count);
  EXPECT_EQ(got->correct, want.correct);
  EXPECT_NEAR(got->loss_sum, want.loss_sum, 1e-5 * want.loss_sum);
}

class CudaOptimizers : public Cuda, public ::testing::WithParamInterface<std::string> {};

TEST_P(CudaOptimizers, StepsMatchTheCpu) {
  auto spec = model::MlpSpec::parse("mlp:48,24", 70, 10);
  ASSERT_TRUE(spec);
  model::Mlp model(*spec);
  model.init(2);
  optim::OptimizerConfig config;
  config.kind = optim::parse_optimizer_kind(GetParam()).value();
  config.weight_decay = 0.01;
  config.nesterov = config.kind == optim::OptimizerKind::kSgd;
  auto cpu = optim::make_optimizer(config, model.params(), model.num_params());
  ASSERT_TRUE(cpu);
  auto gpu = CudaOptimizer::create(*ctx_, config, model.params(), model.num_params());
  ASSERT_TRUE(gpu) << gpu.error().message;
  std::vector<float> cpu_params(model.parameters().begin(), model.parameters().end());
  auto params = on_device<float>(cpu_params);
  for (int step = 0; step < 5; ++step) {
    const auto grads = random_vector(model.num_params(), 100 + static_cast<uint64_t>(step), 0.1f);
    auto dgrads = on_device<float>(grads);
    (*cpu)->step(cpu_params, grads, 0.01f);
    ASSERT_TRUE((*gpu)->step(params.data(), dgrads.data(), 0.01f));
    if (step == 2) {
      (*cpu)->scale_first_moment(0.5f, 16, 500);
      ASSERT_TRUE((*gpu)->scale_first_moment(0.5f, 16, 500));
    }
  }
  EXPECT_LT(relative_error(to_host(params), cpu_params), 1e-4) << GetParam();
  auto mirror = optim::make_optimizer(config, model.params(), model.num_params());
  ASSERT_TRUE(mirror);
  ASSERT_TRUE((*gpu)->download_state(**mirror));
  EXPECT_EQ((*mirror)->step_count(), (*cpu)->step_count());
  auto want = (*cpu)->state();
  auto got = (*mirror)->state();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LT(relative_error(*got[i].buffer, *want[i].buffer), 1e-4) << want[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaOptimizers, ::testing::Values("sgd", "adam", "adamw", "muon"));

TEST_F(Cuda, ClipGradNormMatchesTheCpu) {
  auto grads = random_vector(10007, 4);
  auto d = on_device<float>(grads);
  DeviceArray<double> scratch;
  ASSERT_TRUE(clip_grad_norm(*ctx_, d.data(), d.size(), 3.0, scratch));
  cfmo::optim::clip_grad_norm(grads, 3.0);
  EXPECT_LT(relative_error(to_host(d), grads), 1e-6);
}

TEST_F(Cuda, NcclAllReduceOfOneRankIsTheIdentity) {
  auto listener = comm::listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener);
  comm::RendezvousConfig config;
  config.port = listener->second;
  config.listen_fd = listener->first;
  auto host = comm::connect_ucx(0, 1, config);
  ASSERT_TRUE(host) << host.error().message;
  auto nccl = NcclComm::create(*ctx_, **host, 30);
  ASSERT_TRUE(nccl) << nccl.error().message;
  const auto values = random_vector(1000, 6);
  auto d = on_device<float>(values);
  ASSERT_TRUE((*nccl)->all_reduce_sum(d.data(), d.size()));
  EXPECT_EQ(to_host(d), values);
}

// The whole trainer on the GPU against the same run on the CPU: the same
// data order and initialisation, FP32 arithmetic on both, so after 60 steps
// the losses and the test accuracy agree to float drift.
class CudaTrain : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaTrain, FollowsTheCpuRun) {
  train::TrainConfig config;
  config.data = "synthetic:2048:512";
  config.model = "mlp:64,32";
  config.epochs = 0;
  config.steps = 60;
  config.optimizer = GetParam();
  config.lr = config.optimizer == "sgd" ? 0.05 : 1e-3;
  config.clip_grad_norm = 1.0;
  config.quiet = true;
  auto cpu = train::train(config, {});
  ASSERT_TRUE(cpu) << cpu.error().message;
  config.device = "cuda";
  auto gpu = train::train(config, {});
  ASSERT_TRUE(gpu) << gpu.error().message;
  EXPECT_NE(gpu->device.find("cuda"), std::string::npos) << gpu->device;
  EXPECT_EQ(gpu->steps, cpu->steps);
  EXPECT_NEAR(gpu->final_train_loss, cpu->final_train_loss, 1e-3 * std::max(1.0, cpu->final_train_loss));
  EXPECT_NEAR(gpu->test_loss, cpu->test_loss, 1e-3 * std::max(1.0, cpu->test_loss));
  EXPECT_NEAR(gpu->test_accuracy, cpu->test_accuracy, 0.01);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CudaTrain, ::testing::Values("sgd", "adamw", "muon"));

}  // namespace
}  // namespace cfmo::cuda

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (cfmo::Status usable = cfmo::cuda::check_device(cfmo::tensor::Device{cfmo::tensor::DeviceKind::kCuda, 0});
      !usable) {
    std::printf("skipped: %s\n", usable.error().message.c_str());
    return 77;  // meson's "skipped"
  }
  std::printf("device: %s\n", cfmo::cuda::device_description({cfmo::tensor::DeviceKind::kCuda, 0}).c_str());
  return RUN_ALL_TESTS();
}
