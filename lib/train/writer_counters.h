#pragma once
/// What a writer thread reports (its first error, how many items it wrote
/// and skipped), with the mutex that guards it and the writer's own queue.
/// CheckpointWriter and DeltaWriter derive from it.

#include "core/error.h"

#include <cstdint>
#include <mutex>

namespace cfmo {

class WriterCounters {
 public:
  /// The first write error, if any (the tool reports it at the end).
  Status status() const {
    std::lock_guard lock(mutex_);
    return status_;
  }
  int64_t written() const {
    std::lock_guard lock(mutex_);
    return written_;
  }
  int64_t skipped() const {
    std::lock_guard lock(mutex_);
    return skipped_;
  }

 protected:
  mutable std::mutex mutex_;  ///< guards these and the derived writer's queue and flags
  Status status_;
  int64_t written_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace cfmo
