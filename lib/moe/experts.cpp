#include "moe/experts.h"

#include "core/rng.h"
#include "tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace cfmo::moe {

int ExpertPlacement::owner(int expert) const {
  if (strided) return expert % ranks;
  // first(r) <= expert < first(r + 1); first is monotone, so search.
  int low = 0;
  int high = ranks - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (first(mid) <= expert) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

void make_hidden_states(uint64_t seed, int rank, uint64_t batch, int64_t tokens, int hidden, float* out) {
  Rng rng(seed ^ 0x48494444454EULL, (static_cast<uint64_t>(rank) << 32) ^ batch);  // "HIDDEN"
  const size_t n = static_cast<size_t>(tokens) * static_cast<size_t>(hidden);
  // Uniform with unit variance: as good as normal for routing, and cheap to draw.
  for (size_t i = 0; i < n; ++i) out[i] = rng.uniform(-1.7320508f, 1.7320508f);
}

ExpertFfn::ExpertFfn(uint64_t seed, int expert, int hidden, int ffn) : expert_(expert), hidden_(hidden), ffn_(ffn) {
  if (ffn == 0) return;
  Rng rng(seed ^ 0x455850455254ULL, static_cast<uint64_t>(expert));  // "EXPERT"
  w1_.resize(static_cast<size_t>(hidden) * static_cast<size_t>(ffn));
  w2_.resize(static_cast<size_t>(ffn) * static_cast<size_t>(hidden));
  // He-style scales keep activations of order one through relu and back.
  const float a1 = std::sqrt(6.0f / static_cast<float>(hidden));
  const float a2 = std::sqrt(3.0f / static_cast<float>(ffn));
  for (float& w : w1_) w = rng.uniform(-a1, a1);
  for (float& w : w2_) w = rng.uniform(-a2, a2);
}

void ExpertFfn::forward(const float* x, int64_t rows, float* out) {
  if (rows == 0) return;
  if (device_ != nullptr && ffn_ > 0) {
    if (Status s = device_->forward(x, rows, out); !s && status_) status_ = std::move(s);
    return;
  }
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(hidden_);
  if (ffn_ == 0) {
    std::memcpy(out, x, n * sizeof(float));
    return;
  }
  const size_t inner = static_cast<size_t>(rows) * static_cast<size_t>(ffn_);
  if (inner_.size() < inner) inner_.resize(inner);
  const int m = static_cast<int>(rows);
  tensor::ops::gemm(tensor::ops::Trans::kNo, tensor::ops::Trans::kNo, m, ffn_, hidden_, 1.0f, x, hidden_, w1_.data(),
                    ffn_, 0.0f, inner_.data(), ffn_);
  for (size_t i = 0; i < inner; ++i) inner_[i] = std::max(inner_[i], 0.0f);
  tensor::ops::gemm(tensor::ops::Trans::kNo, tensor::ops::Trans::kNo, m, hidden_, ffn_, 1.0f, inner_.data(), ffn_,
                    w2_.data(), hidden_, 0.0f, out, hidden_);
}

}  // namespace cfmo::moe
