#include "train/sample.h"

#include "ckpt/safetensors.h"
#include "core/rng.h"
#include "model/factory.h"
#include "model/gpt.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace cfmo::train {

Result<std::vector<int32_t>> sample_tokens(model::Model& model, std::vector<int32_t> prompt,
                                           const SampleOptions& options) {
  auto* gpt = dynamic_cast<model::Gpt*>(&model);
  if (gpt == nullptr) {
    return make_error(ErrorKind::kUsage, "sample: the model {} is not a language model", model.spec_string());
  }
  const int vocab = gpt->spec().vocab;
  const int context = gpt->spec().context;
  if (prompt.empty()) prompt.push_back(vocab == 256 ? '\n' : vocab - 1);
  for (int32_t t : prompt) {
    if (t < 0 || t >= vocab) return make_error(ErrorKind::kUsage, "sample: token {} is outside the vocabulary", t);
  }
  Rng rng(options.seed, /*stream=*/0x5a3);
  std::vector<int32_t> out = prompt;
  std::vector<double> weights(static_cast<size_t>(vocab));
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  for (int i = 0; i < options.tokens; ++i) {
    const size_t window = std::min(out.size(), static_cast<size_t>(context));
    const auto logits = gpt->next_token_logits(std::span<const int32_t>(out).last(window));
    const float max = *std::max_element(logits.begin(), logits.end());
    for (int j = 0; j < vocab; ++j) {
      weights[static_cast<size_t>(j)] = std::exp((logits[static_cast<size_t>(j)] - max) / options.temperature);
    }
    if (options.top_k > 0 && options.top_k < vocab) {
      std::iota(order.begin(), order.end(), 0);
      std::nth_element(order.begin(), order.begin() + options.top_k - 1, order.end(), [&](int32_t a, int32_t b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
      });
      const float cut = logits[static_cast<size_t>(order[static_cast<size_t>(options.top_k - 1)])];
      for (int j = 0; j < vocab; ++j) {
        if (logits[static_cast<size_t>(j)] < cut) weights[static_cast<size_t>(j)] = 0;
      }
    }
    const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
    double pick = rng.uniform() * total;
    int32_t token = vocab - 1;
    for (int j = 0; j < vocab; ++j) {
      pick -= weights[static_cast<size_t>(j)];
      if (pick < 0) {
        token = j;
        break;
      }
    }
    out.push_back(token);
  }
  out.erase(out.begin(), out.begin() + static_cast<ptrdiff_t>(prompt.size()));
  return out;
}

Result<std::unique_ptr<model::Model>> load_saved_model(const std::filesystem::path& dir) {
  const auto path = dir / "model.safetensors";
  CFMO_ASSIGN_OR_RETURN(auto file, ckpt::SafetensorsFile::read(path));
  const auto spec = file.metadata().find("cfmo.model");
  if (spec == file.metadata().end()) {
    return make_error(ErrorKind::kInput, "'{}': no cfmo.model in its metadata", path.string());
  }
  const auto* wte = file.find("wte.weight");
  if (wte == nullptr || wte->shape.size() != 2 || wte->shape[0] < 1 || wte->shape[0] > 1 << 24) {
    return make_error(ErrorKind::kInput, "'{}': no wte.weight [vocab, dim]: not a language model", path.string());
  }
  auto made = model::make_model(spec->second, {model::InputKind::kTokens, 0, static_cast<int>(wte->shape[0])});
  if (!made) return make_error(ErrorKind::kInput, "'{}': {}", path.string(), made.error().message);
  std::unique_ptr<model::Model> model = std::move(*made);
  for (const auto& p : model->params()) {
    CFMO_TRY(file.read_f32(p.name, p.shape, model->parameters().subspan(p.offset, p.size)));
  }
  return model;
}

Result<std::vector<int32_t>> text_to_tokens(const std::string& text, int vocab) {
  std::vector<int32_t> tokens;
  if (vocab == 256) {
    for (const char ch : text) tokens.push_back(static_cast<unsigned char>(ch));
    return tokens;
  }
  std::istringstream ids(text);
  for (int64_t id = 0; ids >> id;) tokens.push_back(static_cast<int32_t>(id));
  if (!ids.eof()) return make_error(ErrorKind::kUsage, "--prompt: give token ids separated by spaces");
  return tokens;
}

std::string tokens_to_text(const std::vector<int32_t>& tokens, int vocab) {
  std::string text;
  for (int32_t t : tokens) {
    if (vocab == 256) {
      text.push_back(static_cast<char>(t));
    } else {
      if (!text.empty()) text.push_back(' ');
      text += std::to_string(t);
    }
  }
  return text;
}

}  // namespace cfmo::train
