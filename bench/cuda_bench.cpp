// cuda-bench: the GPU backend's two targets, measured against the device's
// own ceilings in the same run (issue 7):
//   1. a training step of an MLP (forward, backward, AdamW) against the time
//      cuBLAS alone takes for that step's GEMMs: the step's share of cuBLAS's rate;
//   2. the fused AdamW update against the device's copy bandwidth.
// Prints one JSON object per measurement on stdout.
#include "core/rng.h"
#include "cuda/devices.h"
#include "cuda/kernels.h"
#include "cuda/mlp.h"
#include "cuda/optimizer.h"
#include "cuda/runtime.h"
#include "data/dataset.h"
#include "model/mlp.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

using namespace cfmo;
using namespace cfmo::cuda;

int fail(const Error& e) {
  std::fprintf(stderr, "cuda-bench: %s\n", e.message.c_str());
  return e.exit_status();
}

/// Milliseconds per call of `body`, the median of `reps` timings of `inner` calls each, by CUDA events.
template <typename F>
Result<double> time_ms(const Context& ctx, int reps, int inner, F&& body) {
  cudaEvent_t start = nullptr, stop = nullptr;
  CFMO_CUDA_TRY(cudaEventCreate(&start), "event");
  CFMO_CUDA_TRY(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 2; ++i) CFMO_TRY(body());  // warm-up
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    CFMO_CUDA_TRY(cudaEventRecord(start, ctx.stream()), "event");
    for (int i = 0; i < inner; ++i) CFMO_TRY(body());
    CFMO_CUDA_TRY(cudaEventRecord(stop, ctx.stream()), "event");
    CFMO_CUDA_TRY(cudaEventSynchronize(stop), "event");
    float ms = 0;
    CFMO_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop), "event");
    samples.push_back(ms / inner);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

Status bench_step(Context& ctx, const std::string& model_spec, int batch, int reps) {
  const data::DataSplit data = data::make_synthetic(1, std::max<int64_t>(batch, 1024) * 2, 16);
  CFMO_ASSIGN_OR_RETURN(model::MlpSpec spec,
                        model::MlpSpec::parse(model_spec, data.train.features, data.train.classes));
  model::Mlp host(spec);
  host.init(1);
  CFMO_ASSIGN_OR_RETURN(auto model, CudaMlp::create(ctx, host));
  optim::OptimizerConfig config;
  CFMO_ASSIGN_OR_RETURN(auto optimizer, CudaOptimizer::create(ctx, config, host.params(), host.num_params()));
  CFMO_ASSIGN_OR_RETURN(DeviceDataset train, DeviceDataset::upload(ctx, data.train, "train set"));
  const auto order = data::epoch_order(1, 0, data.train.count);
  const std::span<const int64_t> indices(order.data(), static_cast<size_t>(batch));
  CFMO_ASSIGN_OR_RETURN(const double step_ms, time_ms(ctx, reps, 10, [&]() -> Status {
                          CFMO_TRY(model->forward_backward(train, indices));
                          return optimizer->step(model->parameters(), model->gradients(), 1e-3f);
                        }));

  // The same step's GEMMs, cuBLAS alone, on scratch buffers of the same shapes.
  std::vector<int> widths = {spec.inputs};
  for (int h : spec.hidden) widths.push_back(h);
  widths.push_back(spec.classes);
  size_t widest = 0;
  for (int w : widths) widest = std::max(widest, static_cast<size_t>(w));
  DeviceArray<float> a, w, c;
  CFMO_TRY(a.resize(static_cast<size_t>(batch) * widest, "scratch"));
  CFMO_TRY(c.resize(static_cast<size_t>(batch) * widest, "scratch"));
  CFMO_TRY(w.resize(widest * widest, "scratch"));
  CFMO_TRY(a.zero(ctx.stream(), "scratch"));
  CFMO_TRY(c.zero(ctx.stream(), "scratch"));
  CFMO_TRY(w.zero(ctx.stream(), "scratch"));
  double flops = 0;
  const int layers = static_cast<int>(widths.size()) - 1;
  for (int l = 0; l < layers; ++l) {
    flops += 2.0 * batch * widths[l] * widths[l + 1] * (l == 0 ? 2 : 3);
  }
  CFMO_ASSIGN_OR_RETURN(
      const double gemm_ms, time_ms(ctx, reps, 10, [&]() -> Status {
        for (int l = 0; l < layers; ++l) {
          const int in = widths[l], out = widths[l + 1];
          CFMO_TRY(gemm(ctx, Trans::kNo, Trans::kYes, batch, out, in, 1, a.data(), in, w.data(), in, 0, c.data(), out));
          CFMO_TRY(gemm(ctx, Trans::kYes, Trans::kNo, out, in, batch, 1, c.data(), out, a.data(), in, 0, w.data(), in));
          if (l > 0) {
            CFMO_TRY(
                gemm(ctx, Trans::kNo, Trans::kNo, batch, in, out, 1, c.data(), out, w.data(), in, 0, a.data(), in));
          }
        }
        return {};
      }));
  fmt::print(
      "{{\"bench\": \"train_step\", \"model\": \"{}\", \"batch\": {}, \"parameters\": {}, \"step_ms\": {:.4f}, "
      "\"samples_per_s\": {:.0f}, \"step_tflops\": {:.2f}, \"cublas_gemm_ms\": {:.4f}, \"cublas_tflops\": {:.2f}, "
      "\"share_of_cublas\": {:.3f}}}\n",
      spec.to_string(), batch, host.num_trainable(), step_ms, batch / (step_ms * 1e-3), flops / (step_ms * 1e9),
      gemm_ms, flops / (gemm_ms * 1e9), gemm_ms / step_ms);
  return {};
}

Status bench_adamw(Context& ctx, size_t n, int reps) {
  DeviceArray<float> p, g, m, v, copy;
  for (auto* d : {&p, &g, &m, &v, &copy}) {
    CFMO_TRY(d->resize(n, "AdamW buffers"));
    CFMO_TRY(d->zero(ctx.stream(), "AdamW buffers"));
  }
  CFMO_ASSIGN_OR_RETURN(const double adam_ms, time_ms(ctx, reps, 5, [&]() -> Status {
                          CFMO_CUDA_TRY(kernels::adam_step(p.data(), g.data(), m.data(), v.data(), n, 0.9f, 0.999f,
                                                           1e-3f, 1.0f, 1e-8f, 0.0f, 0.99999f, ctx.stream()),
                                        "AdamW");
                          return {};
                        }));
  CFMO_ASSIGN_OR_RETURN(
      const double copy_ms, time_ms(ctx, reps, 5, [&]() -> Status {
        CFMO_CUDA_TRY(cudaMemcpyAsync(copy.data(), p.data(), n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream()),
                      "copy");
        return {};
      }));
  const double adam_gbps = 28.0 * static_cast<double>(n) / (adam_ms * 1e6);  // reads p, g, m, v; writes p, m, v
  const double copy_gbps = 8.0 * static_cast<double>(n) / (copy_ms * 1e6);   // reads and writes n floats
  fmt::print(
      "{{\"bench\": \"adamw_update\", \"parameters\": {}, \"adamw_ms\": {:.4f}, \"adamw_gbps\": {:.1f}, "
      "\"copy_gbps\": {:.1f}, \"share_of_copy_bandwidth\": {:.3f}}}\n",
      n, adam_ms, adam_gbps, copy_gbps, adam_gbps / copy_gbps);
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuda-bench: the CUDA backend's training step and optimizer update against cuBLAS and copy bandwidth"};
  std::vector<std::string> models = {"mlp:256,128", "mlp:4096,4096,4096"};
  std::vector<int> batches = {64, 4096};
  int64_t adam_params = 256LL << 20;
  int reps = 7;
  int device = 0;
  app.add_option("--model", models, "models to time, e.g. mlp:4096,4096 (repeatable)");
  app.add_option("--batch", batches, "batch sizes, one per model");
  app.add_option("--adamw-params", adam_params, "parameters in the AdamW bandwidth measurement");
  app.add_option("--reps", reps, "timed repetitions (the median is printed)");
  app.add_option("--cuda", device, "CUDA device ordinal");
  CLI11_PARSE(app, argc, argv);
  if (batches.size() != models.size()) {
    std::fprintf(stderr, "cuda-bench: --batch: give one batch size per --model\n");
    return 2;
  }
  auto ctx = Context::create(device);
  if (!ctx) return fail(ctx.error());
  std::fprintf(stderr, "cuda-bench: %s\n", cuda::device_description({tensor::DeviceKind::kCuda, device}).c_str());
  for (size_t i = 0; i < models.size(); ++i) {
    if (Status s = bench_step(**ctx, models[i], batches[i], reps); !s) return fail(s.error());
  }
  if (Status s = bench_adamw(**ctx, static_cast<size_t>(adam_params), reps); !s) return fail(s.error());
  return 0;
}
