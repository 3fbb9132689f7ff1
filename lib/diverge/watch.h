#pragma once
/// Follows a run directory while it trains: each poll returns the deltas that
/// appeared since the last one. Deltas are written whole (temporary file,
/// rename), so a file that is listed is complete.

#include "core/error.h"
#include "diverge/sources.h"

#include <filesystem>
#include <set>
#include <utility>
#include <vector>

namespace cfmo::diverge {

class RunWatcher {
 public:
  /// `run_dir` must exist; its deltas/ may appear later.
  static Result<RunWatcher> open(const std::filesystem::path& run_dir);

  /// Deltas not returned before, by round, then rank.
  Result<std::vector<DeltaFileRef>> poll();

  /// Training has finished: RUN/model.safetensors (written after the last
  /// round) exists and is not older than the newest delta seen.
  bool finished() const;

  const std::filesystem::path& run_dir() const { return run_dir_; }

 private:
  explicit RunWatcher(std::filesystem::path run_dir) : run_dir_(std::move(run_dir)) {}

  std::filesystem::path run_dir_;
  std::set<std::pair<int64_t, int>> seen_;  // (round, rank)
  // min(), not {}: libstdc++'s file clock counts from 2174, so {} lies in the future.
  std::filesystem::file_time_type newest_ = std::filesystem::file_time_type::min();
};

}  // namespace cfmo::diverge
