#pragma once
/// Writes each reconciliation's delta of this rank against its global base to
/// RUN/deltas/rank-K/round-RRRRRR.cfd on a thread of its own, so compression
/// never stalls the training loop. The queue is short: when the disk falls
/// behind, a round is skipped and counted rather than waited for.

#include "core/background_writer.h"
#include "core/error.h"
#include "model/model.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace cfmo::train {

class DeltaWriter {
 public:
  /// Rounds are written as `round_offset` + the mode's round number (a resumed
  /// run continues after last_round(), rather than overwrite its deltas).
  DeltaWriter(std::filesystem::path run_dir, int rank, std::vector<model::ParamInfo> layout, int64_t round_offset = 0);
  /// The highest round with a delta of `rank` in the run directory, or 0.
  static int64_t last_round(const std::filesystem::path& run_dir, int rank);
  DeltaWriter(const DeltaWriter&) = delete;
  DeltaWriter& operator=(const DeltaWriter&) = delete;
  /// Writes what is queued, then stops the thread.
  ~DeltaWriter();
  /// The same, now; afterwards submit() only counts skips.
  void close();

  /// Copies `base` and `delta` (flat, the model's layout) and queues them.
  void submit(int64_t round, int64_t step, int64_t base_version, std::span<const float> base,
              std::span<const float> delta);

  /// The first write error, if any (the tool reports it at the end).
  Status status() const { return writer_.status(); }
  int64_t written() const { return writer_.written(); }
  int64_t skipped() const { return writer_.skipped(); }

 private:
  struct Job {
    int64_t round = 0;
    int64_t step = 0;
    int64_t base_version = 0;
    tensor::FloatBuffer base;
    tensor::FloatBuffer delta;
  };
  Status write(Job& job);

  const std::filesystem::path run_dir_;
  const std::filesystem::path dir_;  ///< RUN/deltas/rank-K, as ckpt/cfd.h's delta_path names it
  const int rank_;
  const std::vector<model::ParamInfo> layout_;
  const int64_t round_offset_;
  BackgroundWriter<Job> writer_;  ///< last: its thread starts after, and stops before, the members it uses
};

}  // namespace cfmo::train
