// --expert-parallel's checkpoints: every rank's experts (parameters and
// optimizer state) gather on rank 0 into the model that holds them all, so a
// checkpoint and model.safetensors are those of one process holding every
// expert (a run resumes from them with or without --expert-parallel).
#include "train/training_run.h"

#include "ckpt/safetensors.h"
#include "model/factory.h"
#include "moe/dispatch.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <unordered_map>

namespace cfmo::train::detail {
namespace {

/// [u64 header bytes][header: a JSON array of tensor names][pad to 4][floats]:
/// per tensor its parameters, then each optimizer state in order.
std::vector<std::byte> pack_experts(const std::vector<model::ParamInfo>& layout, size_t replicated,
                                    std::span<const float> params,
                                    const std::vector<std::pair<std::string, tensor::FloatBuffer>>& state) {
  nlohmann::json names = nlohmann::json::array();
  std::vector<float> floats;
  for (const model::ParamInfo& p : layout) {
    if (p.offset < replicated) continue;
    names.push_back(p.name);
    const auto first = static_cast<ptrdiff_t>(p.offset);
    const auto last = first + static_cast<ptrdiff_t>(p.size);
    floats.insert(floats.end(), params.begin() + first, params.begin() + last);
    for (const auto& [name, buffer] : state) {
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

/// The expert index in a tensor's name ("h.0.mlp.experts.3.c_fc.weight": 3), -1 for a dense tensor.
int expert_of(const std::string& name) {
  constexpr std::string_view kTag = ".experts.";
  const auto at = name.find(kTag);
  if (at == std::string::npos) return -1;
  int e = 0;
  size_t i = at + kTag.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) e = e * 10 + (name[i] - '0');
  return e;
}

}  // namespace

std::vector<std::byte> TrainingRun::own_experts(const CheckpointData& part) const {
  return pack_experts(model_ptr->params(), replicated, part.params, part.optimizer_state);
}

Result<std::unique_ptr<model::Model>> TrainingRun::gather_whole_model(CheckpointData& part) {
  const auto ranks = static_cast<size_t>(world);
  std::vector<std::vector<std::byte>> send(ranks);
  std::vector<std::vector<std::byte>> received(ranks);
  // The sizes first, so that rank 0 can receive each rank's experts whole.
  const std::vector<std::byte> mine = own_experts(part);
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
  return assemble_whole_model(part, received);
}

Result<std::unique_ptr<model::Model>> TrainingRun::assemble_whole_model(
    CheckpointData& part, const std::vector<std::vector<std::byte>>& received) {
  const auto ranks = static_cast<size_t>(world);
  CFMO_ASSIGN_OR_RETURN(auto whole, model::make_model(config.model, source->shape(), moe_options(config)));
  std::unordered_map<std::string, const model::ParamInfo*> by_name;
  for (const model::ParamInfo& p : whole->params()) by_name.emplace(p.name, &p);
  const size_t states = part.optimizer_state.size();
  // An expert nobody sent (its rank was lost) keeps its initial values and a
  // fresh optimizer state, unless an earlier checkpoint has it.
  whole->init(static_cast<uint64_t>(config.seed));
  tensor::FloatBuffer params(whole->parameters().begin(), whole->parameters().end());
  std::vector<tensor::FloatBuffer> state(states, tensor::FloatBuffer(whole->num_params(), 0.0f));
  std::vector<int> missing;
  for (size_t r = 0; r < ranks; ++r) {
    if (r < received.size() && !received[r].empty()) continue;
    for (const int e : model_ptr->experts_held_by(static_cast<int>(r))) missing.push_back(e);
  }
  lost_experts_from.clear();
  if (!missing.empty()) CFMO_TRY(restore_missing_experts(*whole, missing, params, part, state));
  // The replicated prefix is laid out alike in both models.
  std::copy_n(part.params.begin(), replicated, params.begin());
  for (size_t s = 0; s < states; ++s) std::copy_n(part.optimizer_state[s].second.begin(), replicated, state[s].begin());
  for (size_t r = 0; r < ranks; ++r) {
    if (r >= received.size() || received[r].empty()) continue;
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
  if (!part.outer_round_sum.empty()) part.outer_round_sum.resize(whole->num_params(), 0.0f);
  return whole;
}

Status TrainingRun::restore_missing_experts(const model::Model& whole, const std::vector<int>& missing,
                                            tensor::FloatBuffer& params, const CheckpointData& part,
                                            std::vector<tensor::FloatBuffer>& state) {
  // The newest checkpoint there is: this run's latest, or the one it resumed from.
  std::filesystem::path from;
  if (!run_dir.empty()) {
    if (auto latest = resolve_checkpoint(run_dir)) from = *latest;
  }
  if (from.empty() && !options.resume.empty()) from = options.resume;
  lost_experts_from = "initial values";
  if (from.empty()) return {};
  auto is_missing = [&](const model::ParamInfo& p) {
    const int e = expert_of(p.name);
    return p.offset >= replicated && e >= 0 && std::find(missing.begin(), missing.end(), e) != missing.end();
  };
  CFMO_ASSIGN_OR_RETURN(auto saved, ckpt::SafetensorsFile::read(from / "model.safetensors"));
  CFMO_ASSIGN_OR_RETURN(auto saved_state, ckpt::SafetensorsFile::read(from / "optimizer.safetensors"));
  for (const model::ParamInfo& p : whole.params()) {
    if (!is_missing(p)) continue;
    CFMO_TRY(saved.read_f32(p.name, p.shape, std::span<float>(params).subspan(p.offset, p.size)));
    for (size_t s = 0; s < state.size(); ++s) {
      CFMO_TRY(saved_state.read_f32(p.name + "." + part.optimizer_state[s].first, p.shape,
                                    std::span<float>(state[s]).subspan(p.offset, p.size)));
    }
  }
  lost_experts_from = from.string();
  return {};
}

}  // namespace cfmo::train::detail
