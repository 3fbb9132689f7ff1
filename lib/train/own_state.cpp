// cfmo and asgd without --deterministic: each rank's own state (its inner
// optimizer, error feedback and position; with --expert-parallel its experts)
// comes to the keeper by message for its checkpoints, since no collective may
// run mid-run. A checkpoint is then no consistent cut (each rank's state is
// where that rank was when it answered, the global parameters where the
// owners were), but a resumed run continues with every rank's own state.
#include "train/training_run.h"

#include "train/modes/wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

namespace cfmo::train::detail {

using modes::put;
using modes::put_bytes;
using modes::put_position;
using modes::put_vector;
using modes::take;
using modes::take_position;
using modes::take_vector;

namespace {

/// One rank's state as own_state packs it:
/// [i64 optimizer steps][position][u32 buffers][buffers x (u64 n, n floats)]
/// [u64 n][n floats: error feedback][u64 n][n bytes: packed experts]
struct OwnState {
  int64_t optimizer_steps = 0;
  TrainPosition position;
  std::vector<std::vector<float>> buffers;
  std::vector<float> residual;
  std::vector<std::byte> experts;
};

bool unpack(std::span<const std::byte> m, OwnState& s) {
  uint32_t buffers = 0;
  if (!take(m, s.optimizer_steps) || !take_position(m, s.position) || !take(m, buffers) || buffers > 64) return false;
  s.buffers.resize(buffers);
  for (auto& b : s.buffers) {
    if (!take_vector(m, b)) return false;
  }
  uint64_t n = 0;
  if (!take_vector(m, s.residual) || !take(m, n) || n != m.size()) return false;
  s.experts.assign(m.begin(), m.end());
  return true;
}

}  // namespace

Result<std::vector<std::byte>> TrainingRun::own_state() {
  CFMO_TRY(sync_host());
  std::vector<std::byte> out;
  put(out, optimizer->step_count());
  put_position(out, pos);
  // asgd's owners run the optimizer: a rank's own never steps.
  const auto state = traits.owners_optimize ? std::vector<optim::OptimizerState>{} : optimizer->state();
  put(out, static_cast<uint32_t>(state.size()));
  for (const auto& s : state) put_vector(out, std::span<const float>(*s.buffer).first(replicated));
  put_vector(out, mode->wire_residual());
  std::vector<std::byte> experts;
  if (expert_parallel) experts = own_experts(checkpoint_data(model(), *optimizer, pos));
  put(out, static_cast<uint64_t>(experts.size()));
  put_bytes(out, experts.data(), experts.size());
  return out;
}

Status TrainingRun::answer_state_request() {
  if (!rank_states) return {};
  const auto asked = rank_states->take_request();
  if (!asked) return {};
  CFMO_ASSIGN_OR_RETURN(auto state, own_state());
  rank_states->send(asked->first, asked->second, std::move(state));
  return {};
}

Status TrainingRun::submit_async_checkpoint() {
  if (!pending_global) pending_global = mode->take_snapshot();
  if (!pending_global) return {};
  // A snapshot asked while an earlier one still waited for the ranks' states
  // has no request of its own (the earlier one took those answers): it asks
  // now, or every rank's state in it would be the keeper's.
  if (rank_states && states_asked == 0) {
    states_asked = rank_states->request();
    states_asked_at = Clock::now();
    return {};
  }
  // The ranks' answers come at their next step's end: a slow rank's later,
  // a lost one's never (it keeps the keeper's state and its last position).
  if (rank_states && !rank_states->complete(states_asked, comm->lost_ranks()) &&
      seconds_since(states_asked_at) < 2 * config.peer_timeout) {
    return {};
  }
  CFMO_TRY(engine->host_optimizer());  // the keeper's optimizer state goes with the owners' shards
  CheckpointData data = checkpoint_of(pending_global->params, &*pending_global);
  pending_global.reset();
  if (rank_states) {
    CFMO_TRY(add_rank_states(data, rank_states->take(states_asked)));
    states_asked = 0;
  }
  checkpoint_writer->submit(std::move(data));
  whole_model.reset();  // the end gathers its own
  return {};
}

std::vector<std::vector<std::byte>> TrainingRun::await_states(uint64_t id, const std::vector<int>& from) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(2 * config.peer_timeout);
  for (;;) {
    // Who need not answer, anew each time: the world may grow meanwhile (a
    // joiner the transport has, not yet in the group, sent nothing).
    auto skip = comm->lost_ranks();
    for (int r = 0; r < comm->size() && !from.empty(); ++r) {
      if (std::find(from.begin(), from.end(), r) == from.end()) skip.push_back(r);
    }
    if (rank_states->complete(id, skip) || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return rank_states->take(id);
}

std::vector<std::vector<std::byte>> TrainingRun::final_rank_states() {
  // Sent before each rank's report, which the keeper has waited for already;
  // by the group's members only, in localsgd and sync with --elastic (a
  // joiner the group did not take in before the end has none).
  return await_states(RankStates::kFinal, mode->members());
}

std::vector<std::vector<std::byte>> TrainingRun::member_states() {
  if (at_end) return final_rank_states();
  // The members that made this round sent theirs at its step, before their
  // next round, which waits for this rank (the group's leader) anyway; a
  // rank taken in at it has nothing of it, a lost one never answers.
  return await_states(RankStates::at_step(pos.step), mode->round_members());
}

Status TrainingRun::add_rank_states(CheckpointData& data, std::vector<std::vector<std::byte>> states,
                                    const std::vector<int>& fresh) {
  // Every rank of the world now: one that grew by joins has more than it started with.
  const int ranks = data.world.workers;
  states.resize(static_cast<size_t>(ranks));
  CFMO_ASSIGN_OR_RETURN(states[static_cast<size_t>(rank)], own_state());
  std::vector<std::optional<OwnState>> got(static_cast<size_t>(ranks));
  std::vector<std::vector<std::byte>> experts(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const auto& bytes = states[static_cast<size_t>(r)];
    if (bytes.empty()) continue;
    OwnState s;
    if (!unpack(bytes, s) || s.buffers.size() != (traits.owners_optimize ? 0 : data.optimizer_state.size()) ||
        std::any_of(s.buffers.begin(), s.buffers.end(), [&](const auto& b) { return b.size() != replicated; }) ||
        s.residual.size() != mode->wire_residual().size()) {
      return make_error(ErrorKind::kPeer, "rank {}: its state for the checkpoint at step {} is malformed", r,
                        data.position.step);
    }
    experts[static_cast<size_t>(r)] = std::move(s.experts);
    got[static_cast<size_t>(r)] = std::move(s);
  }
  if (expert_parallel) {
    CFMO_ASSIGN_OR_RETURN(whole_model, assemble_whole_model(data, experts));
  }
  const size_t size = data.params.size();
  // The asynchronous modes' ranks each have a position of their own (a rank
  // the owners' snapshot did not know yet: the keeper's, until it answers);
  // a lockstep group's share the keeper's.
  if (async) data.world.ranks.resize(static_cast<size_t>(ranks), pos);
  if (!mode->wire_residual().empty())
    data.wire_residuals.assign(static_cast<size_t>(ranks), tensor::FloatBuffer(size, 0.0f));
  const bool own_optimizers = !traits.owners_optimize;
  if (own_optimizers) {
    // A rank that did not answer keeps the keeper's inner state (as before
    // these messages): the whole of it, experts included, is the base.
    data.rank_optimizer_state.assign(static_cast<size_t>(ranks - 1), data.optimizer_state);
    data.world.rank_optimizer_steps.assign(static_cast<size_t>(ranks), data.optimizer_steps);
  }
  for (const int r : fresh) {
    // Taken in at this round: its inner optimizer starts afresh (no steps, zero state).
    if (!own_optimizers || r <= 0 || r >= ranks || got[static_cast<size_t>(r)]) continue;
    for (auto& [name, buffer] : data.rank_optimizer_state[static_cast<size_t>(r) - 1]) {
      std::fill(buffer.begin(), buffer.end(), 0.0f);
    }
    data.world.rank_optimizer_steps[static_cast<size_t>(r)] = 0;
  }
  for (int r = 0; r < ranks; ++r) {
    const auto& s = got[static_cast<size_t>(r)];
    if (!s) continue;
    if (async) data.world.ranks[static_cast<size_t>(r)] = s->position;
    if (!data.wire_residuals.empty()) {
      std::copy(s->residual.begin(), s->residual.end(), data.wire_residuals[static_cast<size_t>(r)].begin());
    }
    if (!own_optimizers) continue;
    auto& state = r == 0 ? data.optimizer_state : data.rank_optimizer_state[static_cast<size_t>(r) - 1];
    for (size_t b = 0; b < state.size(); ++b)
      std::copy(s->buffers[b].begin(), s->buffers[b].end(), state[b].second.begin());
    data.world.rank_optimizer_steps[static_cast<size_t>(r)] = s->optimizer_steps;
    if (r == 0) data.optimizer_steps = s->optimizer_steps;
  }
  return {};
}

}  // namespace cfmo::train::detail
