// --expert-parallel's checkpoints: every rank's experts (parameters and
// optimizer state) gather on rank 0 into the model that holds them all, so a
// checkpoint and model.safetensors are those of one process holding every
// expert (a run resumes from them with or without --expert-parallel).
#include "train/training_run.h"

#include "model/factory.h"
#include "moe/dispatch.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <unordered_map>

namespace cfmo::train::detail {
namespace {

/// [u64 header bytes][header: a JSON array of tensor names][pad to 4][floats]:
/// per tensor its parameters, then each optimizer state in order.
std::vector<std::byte> pack_experts(const std::vector<model::ParamInfo>& layout, size_t replicated,
                                    const CheckpointData& part) {
  nlohmann::json names = nlohmann::json::array();
  std::vector<float> floats;
  for (const model::ParamInfo& p : layout) {
    if (p.offset < replicated) continue;
    names.push_back(p.name);
    const auto first = static_cast<ptrdiff_t>(p.offset);
    const auto last = first + static_cast<ptrdiff_t>(p.size);
    floats.insert(floats.end(), part.params.begin() + first, part.params.begin() + last);
    for (const auto& [name, buffer] : part.optimizer_state) {
      floats.insert(floats.end(), buffer.begin() + first, buffer.begin() + last);
    }
  }
  const std::string header = names.dump();
  const uint64_t header_bytes = (header.size() + 3) / 4 * 4;
  std::vector<std::byte> out(sizeof(uint64_t) + header_bytes + floats.size() * sizeof(float));
  std::memcpy(out.data(), &header_bytes, sizeof header_bytes);
  std::memcpy(out.data() + sizeof header_bytes, header.data(), header.size());
  for (size_t i = header.size(); i < header_bytes; ++i) out[sizeof header_bytes + i] = std::byte{' '};
  if (!floats.empty()) {
    std::memcpy(out.data() + sizeof header_bytes + header_bytes, floats.data(), floats.size() * sizeof(float));
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<model::Model>> TrainingRun::gather_whole_model(CheckpointData& part) {
  const auto ranks = static_cast<size_t>(world);
  std::vector<std::vector<std::byte>> send(ranks);
  std::vector<std::vector<std::byte>> received(ranks);
  // The sizes first, so that rank 0 can receive each rank's experts whole.
  const std::vector<std::byte> mine = pack_experts(model().params(), replicated, part);
  const uint64_t size = mine.size();
  send[0].resize(sizeof size);
  std::memcpy(send[0].data(), &size, sizeof size);
  for (auto& r : received) r.resize(rank == 0 ? sizeof size : 0);
  CFMO_TRY(moe::exchange_buffers(comm, send, received));
  send[0] = mine;
  for (auto& r : received) {
    uint64_t n = 0;
    if (rank == 0) std::memcpy(&n, r.data(), sizeof n);
    r.assign(n, std::byte{0});
  }
  CFMO_TRY(moe::exchange_buffers(comm, send, received));
  if (rank != 0) return std::unique_ptr<model::Model>();

  CFMO_ASSIGN_OR_RETURN(auto whole, model::make_model(config.model, source->shape(), moe_options(config)));
  std::unordered_map<std::string, const model::ParamInfo*> by_name;
  for (const model::ParamInfo& p : whole->params()) by_name.emplace(p.name, &p);
  const size_t states = part.optimizer_state.size();
  tensor::FloatBuffer params(whole->num_params(), 0.0f);
  std::vector<tensor::FloatBuffer> state(states, tensor::FloatBuffer(whole->num_params(), 0.0f));
  // The replicated prefix is laid out alike in both models.
  std::copy_n(part.params.begin(), replicated, params.begin());
  for (size_t s = 0; s < states; ++s) std::copy_n(part.optimizer_state[s].second.begin(), replicated, state[s].begin());
  for (size_t r = 0; r < ranks; ++r) {
    const auto& bytes = received[r];
    auto bad = [&] { return make_error(ErrorKind::kPeer, "rank {}: its experts for the checkpoint are malformed", r); };
    uint64_t header_bytes = 0;
    if (bytes.size() < sizeof header_bytes) return bad();
    std::memcpy(&header_bytes, bytes.data(), sizeof header_bytes);
    if (header_bytes > bytes.size() - sizeof header_bytes) return bad();
    const auto names = nlohmann::json::parse(
        std::string_view(reinterpret_cast<const char*>(bytes.data()) + sizeof header_bytes, header_bytes), nullptr,
        false);
    if (!names.is_array()) return bad();
    size_t at = sizeof header_bytes + header_bytes;
    for (const auto& name : names) {
      if (!name.is_string()) return bad();
      const auto found = by_name.find(name.get<std::string>());
      if (found == by_name.end()) return bad();
      const model::ParamInfo& p = *found->second;
      if (at + (1 + states) * p.size * sizeof(float) > bytes.size()) return bad();
      std::memcpy(params.data() + p.offset, bytes.data() + at, p.size * sizeof(float));
      at += p.size * sizeof(float);
      for (size_t s = 0; s < states; ++s) {
        std::memcpy(state[s].data() + p.offset, bytes.data() + at, p.size * sizeof(float));
        at += p.size * sizeof(float);
      }
    }
  }
  std::copy(params.begin(), params.end(), whole->parameters().begin());
  part.params = std::move(params);
  for (size_t s = 0; s < states; ++s) part.optimizer_state[s].second = std::move(state[s]);
  // The experts have no outer optimizer: their outer momentum is zero.
  if (!part.outer_momentum.empty()) part.outer_momentum.resize(whole->num_params(), 0.0f);
  return whole;
}

}  // namespace cfmo::train::detail
