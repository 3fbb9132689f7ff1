#pragma once
/// The MLP of model/mlp.h on a CUDA device: the same flat layout (the CPU
/// model's ParamInfo offsets) for parameters and gradients, so a host copy of
/// either is exactly the CPU model's buffer, and checkpoints, deltas and the
/// modes see no difference. GEMMs through cuBLAS, the rest cuda/kernels.h.

#include "core/error.h"
#include "cuda/runtime.h"
#include "data/dataset.h"
#include "model/mlp.h"

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace cfmo::cuda {

/// A data set's bytes and labels on the device, uploaded once, so a step
/// sends only the batch's example indices.
class DeviceDataset {
 public:
  static Result<DeviceDataset> upload(const Context& ctx, const data::Dataset& data, std::string_view what);
  int64_t count() const { return count_; }
  int features() const { return features_; }
  const uint8_t* pixels() const { return pixels_.data(); }
  const int32_t* labels() const { return labels_.data(); }

 private:
  int64_t count_ = 0;
  int features_ = 0;
  DeviceArray<uint8_t> pixels_;
  DeviceArray<int32_t> labels_;
};

class CudaMlp {
 public:
  /// A model with `model`'s layout; its parameters are uploaded.
  static Result<std::unique_ptr<CudaMlp>> create(Context& ctx, const model::Mlp& model);

  size_t num_params() const { return size_; }
  float* parameters() { return parameters_.data(); }
  float* gradients() { return gradients_.data(); }
  const std::vector<model::ParamInfo>& params() const { return params_; }

  Status upload_parameters(std::span<const float> host);
  Status download_parameters(std::span<float> host);  ///< waits for the copy
  Status upload_gradients(std::span<const float> host);
  Status download_gradients(std::span<float> host);  ///< waits for the copy
  Status zero_gradients();

  /// Forward and backward over the examples `indices` of `data` (the device
  /// gathers and converts them); overwrites the gradients with
  /// d(mean loss)/d(params) and returns the mean loss (one 8-byte read back).
  Result<float> forward_backward(const DeviceDataset& data, std::span<const int64_t> indices);
  /// The same over a batch already in host memory (tests, other sources).
  Result<float> forward_backward(const float* inputs, const int32_t* labels, int batch);

  /// Loss and correct predictions over a whole data set, `chunk` rows at a time.
  Result<model::EvalResult> evaluate(const DeviceDataset& data, int chunk = 1000);

 private:
  CudaMlp(Context& ctx) : ctx_(ctx) {}
  int layers() const { return static_cast<int>(widths_.size()) - 1; }
  const float* weight(int l) const { return parameters_.data() + params_[2 * l].offset; }
  const float* bias(int l) const { return parameters_.data() + params_[2 * l + 1].offset; }
  Status ensure_workspace(int batch);
  Status forward(const float* inputs, int batch);
  Status backward(const float* inputs, const int32_t* labels, int batch);
  Result<double> read_loss();

  Context& ctx_;
  std::vector<int> widths_;
  std::vector<model::ParamInfo> params_;
  size_t size_ = 0;
  DeviceArray<float> parameters_;
  DeviceArray<float> gradients_;

  int workspace_batch_ = 0;
  std::vector<DeviceArray<float>> activations_;  ///< [layer] -> [batch, widths_[layer]] for layer >= 1
  DeviceArray<float> logits_;
  DeviceArray<float> grad_a_;
  DeviceArray<float> grad_z_;
  DeviceArray<float> ones_;  ///< [batch] of 1: column sums as one GEMV
  DeviceArray<float> inputs_;
  DeviceArray<int32_t> labels_;
  DeviceArray<int64_t> indices_;
  DeviceArray<double> loss_;                 ///< the batch's summed loss
  DeviceArray<unsigned long long> correct_;  ///< evaluation's correct predictions
};

}  // namespace cfmo::cuda
