#pragma once
/// Reads deltas (a run directory, .cfd files, or two safetensors checkpoints)
/// into per-tensor and per-delta divergence figures, and renders them as a
/// table for people or JSON/CSV for scripts. Reading and reducing runs on
/// several threads, over every frame of every selected tensor at once.

#include "ckpt/delta_stats.h"
#include "core/error.h"
#include "diverge/metrics.h"
#include "diverge/sources.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace cfmo::diverge {

/// One PATH of a report.
struct ReportInput {
  enum class Kind {
    kRunDir,           ///< a run directory (or its deltas/ or deltas/rank-K)
    kCfd,              ///< one .cfd file
    kSafetensorsPair,  ///< `path` is the base (global) checkpoint, `against` the local one
  };
  Kind kind = Kind::kCfd;
  std::filesystem::path path;
  std::filesystem::path against;
};

/// A directory is a run directory; anything else is read as a .cfd file.
ReportInput classify_path(const std::filesystem::path& path);

struct TensorRow {
  std::string name;
  std::vector<int64_t> shape;
  ckpt::DeltaStats stats;
  Divergence divergence;
};

/// One delta: a .cfd file, or the difference between two checkpoints.
struct DeltaRow {
  std::string source;       ///< the .cfd file, or the local checkpoint of a pair
  std::string base_source;  ///< the base checkpoint of a pair; empty for a .cfd file
  std::optional<int> rank;  ///< from the .cfd header; none for a pair
  std::optional<int64_t> round;
  std::optional<int64_t> step;
  std::optional<int64_t> base_version;
  std::vector<TensorRow> tensors;  ///< the selected tensors, in file order
  ckpt::DeltaStats total;          ///< over the selected tensors
  Divergence overall;
};

struct Report {
  std::vector<DeltaRow> deltas;    ///< per input in order; a run's by round, then rank
  std::vector<std::string> notes;  ///< things worth telling the user (tensors skipped)
  bool verified = false;           ///< payloads were decoded and checked against the headers
};

struct ReportOptions {
  Selection selection{};
  int threads = 0;           ///< 0: all cores
  bool header_only = false;  ///< trust .cfd headers: no decompression, no checksums
  /// Files read at once; keeps the number of open descriptors bounded.
  size_t batch_files = 64;
};

/// Reads every input. Unreadable or corrupt input is an input error naming
/// the file and tensor; a selection that matches nothing is a usage error;
/// a run directory without deltas is an input error.
Result<Report> build_report(std::span<const ReportInput> inputs, const ReportOptions& options);

/// Figures over a whole report.
struct ReportSummary {
  size_t deltas = 0;
  size_t tensors = 0;
  std::vector<int> ranks;
  std::optional<int64_t> first_round;
  std::optional<int64_t> last_round;
  const DeltaRow* worst = nullptr;          ///< largest overall relative L2
  const DeltaRow* least_aligned = nullptr;  ///< smallest overall cosine
  double max_abs = 0;
  int64_t nonfinite = 0;
  int64_t base_nonfinite = 0;
};
ReportSummary summarize(const Report& report);

/// "1.23%", "0.0456%", "-" for an undefined (NaN) value.
std::string format_percent(double fraction);
/// "rank 1, round 17" for a .cfd delta; the file name for a pair.
std::string describe(const DeltaRow& row);

/// A table for people. One delta: a row per tensor and the overall figures;
/// several: a row per delta (with `per_tensor`, its tensors below it) and a
/// summary line.
std::string format_table(const Report& report, bool per_tensor);
/// The table's header and one delta's row, for printing rows as they come.
std::string format_table_header();
std::string format_table_row(const DeltaRow& row, bool per_tensor);

/// One JSON document: "tensors" (every tensor of every delta, flat, each with
/// name, rel_l2, cosine, max_abs, nonfinite, rank, round, ...), "deltas" (the
/// overall figures of each delta) and "summary". Undefined values are null.
std::string format_json(const Report& report);
/// One delta as one line of JSON (its overall figures and its "tensors").
std::string format_json_line(const DeltaRow& row);

/// CSV (RFC 4180 quoting, one line per record ending in LF) with a header line: a "delta" row per delta and a "tensor"
/// row per tensor. Undefined values are empty.
std::string format_csv(const Report& report);
std::string format_csv_header();
std::string format_csv_rows(const DeltaRow& row);

}  // namespace cfmo::diverge
