#pragma once
/// Where the experts live and what they compute: contiguous blocks of
/// experts per rank, seeded weights (the same wherever they are drawn, so a
/// single process can recompute any expert for the reference check), and
/// the expert FFN relu(x W1) W2 through the BLAS seam (tensor/ops.h).
///
/// The device seam for experts is ExpertDevice: the CUDA backend's is in
/// cuda/moe_experts.h.

#include "core/error.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace cfmo::moe {

/// Where experts live. Contiguous (cfmo-moe's): expert e lives on rank r
/// when first(r) <= e < first(r + 1), first(r) = E r / R. Strided
/// (cfmo-train's --expert-parallel): expert e lives on rank e mod R, so a
/// rank's experts are r, r + R, r + 2R, ... and every block of a model
/// spreads the same way.
struct ExpertPlacement {
  int experts = 1;
  int ranks = 1;
  bool strided = false;
  /// The first expert of `rank` in the contiguous form (first(ranks) = experts).
  int first(int rank) const { return static_cast<int>(int64_t{experts} * rank / ranks); }
  /// Experts on `rank`.
  int count(int rank) const {
    if (!strided) return first(rank + 1) - first(rank);
    return rank < experts ? (experts - rank + ranks - 1) / ranks : 0;
  }
  /// The `i`-th expert of `rank` (0 <= i < count(rank)).
  int expert(int rank, int i) const { return strided ? rank + i * ranks : first(rank) + i; }
  int owner(int expert) const;
  /// The place of `expert` among its owner's experts.
  int local_index(int expert) const { return strided ? expert / ranks : expert - first(owner(expert)); }
};

/// One rank's hidden states [tokens, hidden] for input batch `batch`: unit
/// variance, drawn from (seed, rank, batch).
void make_hidden_states(uint64_t seed, int rank, uint64_t batch, int64_t tokens, int hidden, float* out);

/// Where an expert's GEMMs run when not on the CPU (--device cuda): the
/// rows come from host memory and the results go back there.
class ExpertDevice {
 public:
  virtual ~ExpertDevice() = default;
  /// out[rows, hidden] = relu(x W1) W2, as ExpertFfn::forward.
  virtual Status forward(const float* x, int64_t rows, float* out) = 0;
};

/// One expert: W1 [hidden, ffn], W2 [ffn, hidden], drawn from (seed, expert).
class ExpertFfn {
 public:
  ExpertFfn(uint64_t seed, int expert, int hidden, int ffn);

  /// out[rows, hidden] = relu(x W1) W2 (ffn 0: out = x). `x` and `out` do not overlap.
  /// On a device, a failure is kept for status() (the engines check it each iteration).
  void forward(const float* x, int64_t rows, float* out);

  /// From now on forward() runs on `device` (made from this expert's weights).
  void attach(std::unique_ptr<ExpertDevice> device) { device_ = std::move(device); }
  bool on_device() const { return device_ != nullptr; }
  /// The first device failure since the last call, if any.
  Status take_status() { return std::exchange(status_, Status{}); }

  int expert() const { return expert_; }
  int hidden() const { return hidden_; }
  int ffn() const { return ffn_; }
  const tensor::FloatBuffer& w1() const { return w1_; }
  const tensor::FloatBuffer& w2() const { return w2_; }

 private:
  int expert_;
  int hidden_;
  int ffn_;
  tensor::FloatBuffer w1_;
  tensor::FloatBuffer w2_;
  tensor::FloatBuffer inner_;  ///< scratch [rows, ffn]
  std::unique_ptr<ExpertDevice> device_;
  Status status_;
};

}  // namespace cfmo::moe
