#pragma once
/// The message streams of the training modes and the trainer, over the
/// transport seam (comm/communicator.h), which knows none of them by name.

#include "comm/communicator.h"

namespace cfmo::train::channels {

inline constexpr comm::Channel kDeltaShard{1};  ///< cfmo: a delta shard for its owner
inline constexpr comm::Channel kFreshShard{2};  ///< cfmo/asgd: an owner's current shard, back to a worker
inline constexpr comm::Channel kGradShard{3};   ///< asgd: a gradient shard for its owner
inline constexpr comm::Channel kProgress{
    4};                                   ///< samples done, to the budget keeper (the lowest live rank) and its standby
inline constexpr comm::Channel kStop{5};  ///< the budget keeper's stop signal
inline constexpr comm::Channel kDone{6};  ///< a rank sent its last contribution
inline constexpr comm::Channel kGather{7};  ///< the final shards, for the budget keeper
inline constexpr comm::Channel kReport{9};  ///< a worker's end-of-run report, for rank 0
inline constexpr comm::Channel kCheckpoint{
    10};  ///< cfmo/asgd: a request for the owners' shards, and the shards, for a checkpoint
inline constexpr comm::Channel kReplica{
    11};  ///< cfmo: an owner's applied deltas (or whole state) for its shard's backup
inline constexpr comm::Channel kElastic{13};    ///< sync --elastic, localsgd: the group's sums and re-forming
inline constexpr comm::Channel kGathered{12};   ///< cfmo/asgd: the keeper holds every final shard: the others may leave
inline constexpr comm::Channel kRankState{20};  ///< cfmo/asgd: each rank's own state for the keeper's checkpoints
inline constexpr comm::Channel kRunClock{21};   ///< a joiner asks the run's seconds so far (run_clock.h)
inline constexpr comm::Channel kSampleCounts{
    22};  ///< cfmo/asgd: the keeper's counts of replaced processes' samples, to its standby
inline constexpr comm::Channel kJoins{23};  ///< each rank's list of the run's joins, to the keeper and its standby

}  // namespace cfmo::train::channels
