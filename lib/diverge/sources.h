#pragma once
/// What a cfmo-diverge PATH names, and which deltas and tensors a report
/// covers. A run directory holds the trainer's deltas as
///
///   RUN/deltas/rank-K/round-RRRRRR.cfd     (RRRRRR: the round, 6 digits or more)
///
/// and finishes with RUN/model.safetensors, written after the last round.

#include "ckpt/cfd.h"
#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::diverge {

/// One delta file of a run directory, named by its path.
struct DeltaFileRef {
  std::filesystem::path path;
  int rank = 0;
  int64_t round = 0;
  bool operator==(const DeltaFileRef&) const = default;
};

/// The deltas of a run directory (delta_path, in ckpt/cfd.h, names each), ordered by round, then rank. `dir` may be
/// RUN, RUN/deltas or RUN/deltas/rank-K. Files whose names do not match
/// (temporary files of a writer, anything else) are ignored. A missing
/// deltas directory is an empty list when `allow_missing`, else an input error.
Result<std::vector<DeltaFileRef>> list_deltas(const std::filesystem::path& dir, bool allow_missing = false);

/// The rank and round a delta's path names, when it follows the layout.
std::optional<DeltaFileRef> parse_delta_path(const std::filesystem::path& path);

/// A closed range of rounds; `last` is INT64_MAX for "A..".
struct RoundRange {
  int64_t first = 0;
  int64_t last = 0;
};

/// Which deltas and tensors to report.
struct Selection {
  std::vector<std::string> tensor_globs;  ///< shell patterns (fnmatch); empty: every tensor
  std::vector<int> ranks;                 ///< empty: every rank
  std::vector<RoundRange> rounds;         ///< empty: every round
  int64_t last = 0;                       ///< > 0: only the last N rounds (after the filters above)

  bool wants_tensor(std::string_view name) const;
  bool wants(int rank, int64_t round) const;
};

/// True when `name` matches the shell pattern `glob` (fnmatch(3), no flags).
bool glob_matches(const std::string& glob, const std::string& name);

/// Parses --rank values ("0", "0,2,3") and --round values ("7", "5..9",
/// "5..", "..9", comma lists); errors are usage errors naming the flag.
Result<std::vector<int>> parse_ranks(const std::vector<std::string>& values);
Result<std::vector<RoundRange>> parse_rounds(const std::vector<std::string>& values);

/// Applies ranks, rounds and `last` to a run's deltas (ordered as list_deltas orders them).
std::vector<DeltaFileRef> select_deltas(const std::vector<DeltaFileRef>& deltas, const Selection& selection);

}  // namespace cfmo::diverge
