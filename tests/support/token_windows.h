#pragma once
// Random token windows for a GPT's tests: `batch` windows of context + 1 tokens.
#include "core/rng.h"
#include "model/gpt.h"
#include "model/model.h"

#include <cstdint>
#include <vector>

namespace cfmo::testing {

inline std::vector<int32_t> random_tokens(const model::GptSpec& spec, int batch, uint64_t seed) {
  Rng rng(seed, /*stream=*/5);
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * static_cast<size_t>(spec.context + 1));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(spec.vocab)));
  return tokens;
}

inline model::Examples windows(const std::vector<int32_t>& tokens, int batch) {
  model::Examples e;
  e.count = batch;
  e.tokens = tokens.data();
  return e;
}

}  // namespace cfmo::testing
