#pragma once
/// The run's joins as the summary lists them (`joined`), whoever writes it.
/// Each rank notices the joins made while it is in the run
/// (Communicator::joined_ranks); the keeper that writes the summary may be a
/// rank that joined late, or a new process in rank 0's place, which noticed
/// none before its own start. So each rank sends its list to the keeper and
/// the keeper's standby (the next live rank) when the list, the keeper or the
/// standby changed, and every rank merges what it receives: the keeper's
/// list, or the standby's that outlived it, holds every join of the run.
///
/// Two lists merge into their union (merge_joins): an entry of one is one
/// of the other where the same rank joined within kSameJoinS of the other's
/// time (when each rank's transport took the join in, on the run's clock,
/// which a joiner takes from the others: within the leader's admission of
/// it; two joins of one rank need a loss and a new process between them),
/// in the order of their times.
///
/// Messages on channels::kJoins:
///   [u32 n] n x [i32 rank][i64 step][f64 wall_s][f64 first_step_s]
///
/// Threads: the handler runs on the communicator's thread and queues the
/// lists; the training thread merges them (merge_received).

#include "comm/communicator.h"
#include "train/report.h"

#include <mutex>
#include <vector>

namespace cfmo::train {

/// Two ranks' times of one join lie at most this far apart (seconds of the run's clock).
inline constexpr double kSameJoinS = 2.0;

/// `a` and `b` as one list: every join of either once (at its first
/// notice, a first_step_s known in either kept), ordered by wall_s.
std::vector<JoinedRank> merge_joins(const std::vector<JoinedRank>& a, const std::vector<JoinedRank>& b);

class JoinLog {
 public:
  explicit JoinLog(comm::Communicator& comm);
  JoinLog(const JoinLog&) = delete;
  JoinLog& operator=(const JoinLog&) = delete;
  ~JoinLog();

  /// Sends `joins` to `keeper` and `standby` (not to itself; -1: none) when
  /// the list grew or either changed since the last time.
  void share(const std::vector<JoinedRank>& joins, int keeper, int standby);
  /// `joins` merged with every list received since the last call.
  void merge_received(std::vector<JoinedRank>& joins);

 private:
  void on_message(std::span<const std::byte> m);

  comm::Communicator& comm_;
  size_t shared_size_ = 0;  ///< training thread: the list last sent, and to whom
  int shared_keeper_ = -1;
  int shared_standby_ = -1;
  std::mutex mutex_;
  std::vector<std::vector<JoinedRank>> received_;  ///< under mutex_
};

}  // namespace cfmo::train
