#pragma once
/// metrics.jsonl (and metrics-rank-K.jsonl): one JSON object per line, as
/// FORMATS.md describes them.

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>

namespace cfmo::train {

/// metrics.jsonl: one JSON object per line, flushed as written so a reader
/// (cfmo-diverge watch, tail -f) sees each line whole. A default-constructed
/// log writes nothing (a run without a run directory).
class MetricsLog {
 public:
  /// `resume_step` >= 0: a resumed run appends, after dropping the lines
  /// logged after that step; else the file starts empty.
  static Result<MetricsLog> open(const std::filesystem::path& path, int64_t resume_step);
  /// A joiner's: appends, dropping nothing. The lines there are the history
  /// of the processes that held its rank before, whatever position it
  /// continues from (none at all where the keeper was lost before it told).
  static Result<MetricsLog> append(const std::filesystem::path& path);
  Status write(const nlohmann::ordered_json& line);

 private:
  static Result<MetricsLog> open_stream(const std::filesystem::path& path, std::ios::openmode mode);
  std::unique_ptr<std::ofstream> out_;
  std::filesystem::path path_;
};

}  // namespace cfmo::train
