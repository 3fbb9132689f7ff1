#pragma once
/// Each rank's own state for the keeper's checkpoints in cfmo and asgd
/// without --deterministic, where no collective may run mid-run: the keeper
/// asks every other rank on channels::kRankState, and each answers at the
/// end of its next step with what only it holds (TrainingRun::own_state: its
/// inner optimizer state and steps, its error feedback, its position; with
/// --expert-parallel its experts and their optimizer state). At the run's
/// end every rank sends its last state to the keeper unasked (id kFinal).
/// localsgd with --elastic, whose checkpoints fall at a round's end, the same
/// step on every member: each member sends its state there unasked (id
/// at_step(step)), and the keeper waits for the members of that round.
///
/// Messages:
///   [u32 0: request][u64 id]        the keeper to every other rank
///   [u32 1: state][u64 id][bytes]   a rank's answer
///
/// Threads: the handler runs on the communicator's progress thread; a mutex
/// guards what it shares with the training thread.

#include "comm/communicator.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace cfmo::train {

class RankStates {
 public:
  /// The id of a rank's last state, sent at the end without a request.
  static constexpr uint64_t kFinal = UINT64_MAX;
  /// The id of a state sent unasked at `step` (a lockstep group's checkpoint).
  static constexpr uint64_t at_step(int64_t step) { return kAtStep | static_cast<uint64_t>(step); }

  explicit RankStates(comm::Communicator& comm);
  RankStates(const RankStates&) = delete;
  RankStates& operator=(const RankStates&) = delete;
  ~RankStates();

  /// The keeper: asks every other rank for its state; returns the request's
  /// id. The answers to earlier requests are dropped.
  uint64_t request();
  /// The request this rank has not answered yet, once: who asked, and its id.
  std::optional<std::pair<int, uint64_t>> take_request();
  /// Sends this rank's state to `to` for request `id`.
  void send(int to, uint64_t id, std::vector<std::byte> state);
  /// The keeper: whether every rank but itself and `lost` has answered `id`.
  bool complete(uint64_t id, const std::vector<int>& lost) const;
  /// The keeper: the answers to `id`, by rank (empty where none came).
  std::vector<std::vector<std::byte>> take(uint64_t id);

 private:
  static constexpr uint64_t kAtStep = uint64_t{1} << 62;
  static bool is_at_step(uint64_t id) { return id != kFinal && (id & kAtStep) != 0; }
  static constexpr uint32_t kRequest = 0;
  static constexpr uint32_t kState = 1;

  void on_message(int from, std::span<const std::byte> m);

  comm::Communicator& comm_;
  mutable std::mutex mutex_;
  uint64_t current_ = 0;                                             ///< the keeper: its last request's id
  std::optional<std::pair<int, uint64_t>> asked_;                    ///< the request to answer
  std::map<uint64_t, std::vector<std::vector<std::byte>>> answers_;  ///< the keeper: by id, by rank
};

}  // namespace cfmo::train
