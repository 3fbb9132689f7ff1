#pragma once
/// Where the experts live and what they compute: contiguous blocks of
/// experts per rank, seeded weights (the same wherever they are drawn, so a
/// single process can recompute any expert for the reference check), and
/// the expert FFN relu(x W1) W2 through the BLAS seam (tensor/ops.h).
///
/// The device seam for experts is ExpertFfn::forward: a CUDA build (the GPU
/// issue's --device cuda) adds a cuBLAS implementation beside this one.

#include "tensor/buffer.h"

#include <cstdint>
#include <vector>

namespace cfmo::moe {

/// Expert e lives on rank r when first(r) <= e < first(r + 1), first(r) = E r / R.
struct Placement {
  int experts = 1;
  int ranks = 1;
  int first(int rank) const { return static_cast<int>(int64_t{experts} * rank / ranks); }
  int count(int rank) const { return first(rank + 1) - first(rank); }
  int owner(int expert) const;
};

/// One rank's hidden states [tokens, hidden] for input batch `batch`: unit
/// variance, drawn from (seed, rank, batch).
void make_hidden_states(uint64_t seed, int rank, uint64_t batch, int64_t tokens, int hidden, float* out);

/// One expert: W1 [hidden, ffn], W2 [ffn, hidden], drawn from (seed, expert).
class ExpertFfn {
 public:
  ExpertFfn(uint64_t seed, int expert, int hidden, int ffn);

  /// out[rows, hidden] = relu(x W1) W2 (ffn 0: out = x). `x` and `out` do not overlap.
  void forward(const float* x, int64_t rows, float* out);

  int expert() const { return expert_; }

 private:
  int expert_;
  int hidden_;
  int ffn_;
  FloatBuffer w1_;
  FloatBuffer w2_;
  FloatBuffer inner_;  ///< scratch [rows, ffn]
};

}  // namespace cfmo::moe
