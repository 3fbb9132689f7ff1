#pragma once
/// The message streams of the training modes and the trainer, over the
/// transport seam (comm/communicator.h), which knows none of them by name.

#include "comm/communicator.h"

namespace cfmo::channels {

inline constexpr Channel kDeltaShard{1};  ///< cfmo: a delta shard for its owner
inline constexpr Channel kFreshShard{2};  ///< cfmo/asgd: an owner's current shard, back to a worker
inline constexpr Channel kGradShard{3};   ///< asgd: a gradient shard for its owner
inline constexpr Channel kProgress{4};    ///< samples done, to the budget keeper (the lowest live rank) and its standby
inline constexpr Channel kStop{5};        ///< the budget keeper's stop signal
inline constexpr Channel kDone{6};        ///< a rank sent its last contribution
inline constexpr Channel kGather{7};      ///< the final shards, for the budget keeper
inline constexpr Channel kReport{9};      ///< a worker's end-of-run report, for rank 0
inline constexpr Channel kCheckpoint{
    10};  ///< cfmo/asgd: a request for the owners' shards, and the shards, for a checkpoint
inline constexpr Channel kReplica{11};   ///< cfmo: an owner's applied deltas (or whole state) for its shard's backup
inline constexpr Channel kElastic{13};   ///< sync --elastic, localsgd: the group's sums and re-forming
inline constexpr Channel kGathered{12};  ///< cfmo/asgd: the keeper holds every final shard: the others may leave

}  // namespace cfmo::channels
