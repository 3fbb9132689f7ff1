#pragma once
/// Text from a trained language model: `cfmo-train sample RUN` and
/// `--sample-every`. Byte-level models (vocabulary 256) read and write bytes.

#include "core/error.h"
#include "model/model.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace cfmo::train {

struct SampleOptions {
  int tokens = 200;          ///< tokens to generate
  double temperature = 1.0;  ///< > 0: logits are divided by it
  int top_k = 0;             ///< > 0: draw among the k likeliest tokens only
  uint64_t seed = 1;
};

/// Continues `prompt` (an empty one starts from '\n' for bytes, or the last
/// token, GPT-2's <|endoftext|>) by `options.tokens` tokens, each drawn from
/// the model's next-token distribution over at most its context. kUsage when
/// `model` is not a language model.
Result<std::vector<int32_t>> sample_tokens(model::Model& model, std::vector<int32_t> prompt,
                                           const SampleOptions& options);

/// The model a run (or checkpoint) directory holds: its model.safetensors
/// and the spec recorded in it. kInput naming the file when it is unreadable.
Result<std::unique_ptr<model::Model>> load_saved_model(const std::filesystem::path& dir);

/// Token ids as text: bytes for a byte-level vocabulary, else ids separated by spaces.
std::string tokens_to_text(const std::vector<int32_t>& tokens, int vocab);

/// The inverse, for a prompt: bytes for a byte-level vocabulary, else ids
/// separated by spaces (kUsage naming --prompt when they are not).
Result<std::vector<int32_t>> text_to_tokens(const std::string& text, int vocab);

}  // namespace cfmo::train
