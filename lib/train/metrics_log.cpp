#include "train/metrics_log.h"

#include "core/atomic_file.h"

#include <cerrno>
#include <cstring>
#include <string>

namespace cfmo::train {
namespace fs = std::filesystem;
namespace {

/// What the failed stream operation's system call said (the streams keep errno).
std::string reason() { return errno != 0 ? std::strerror(errno) : "unknown error"; }

/// A resumed run rewrites history from its checkpoint on: lines logged
/// after the checkpoint, by the run that was interrupted, are dropped.
Status truncate_after(const fs::path& path, int64_t step) {
  CFMO_ASSIGN_OR_RETURN(std::string text, read_file(path));
  std::string kept;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) break;  // a torn last line is dropped
    std::string_view line(text.data() + start, end - start);
    auto parsed = nlohmann::json::parse(line, nullptr, false);
    if (!parsed.is_discarded() && parsed.value("step", int64_t{0}) <= step) {
      kept.append(line);
      kept.push_back('\n');
    }
    start = end + 1;
  }
  return write_file_atomic(path, kept);
}

}  // namespace

Result<MetricsLog> MetricsLog::open(const fs::path& path, int64_t resume_step) {
  std::error_code ec;
  if (resume_step >= 0 && fs::exists(path, ec)) CFMO_TRY(truncate_after(path, resume_step));
  return open_stream(path, resume_step >= 0 ? std::ios::app : std::ios::trunc);
}

Result<MetricsLog> MetricsLog::append(const fs::path& path) { return open_stream(path, std::ios::app); }

Result<MetricsLog> MetricsLog::open_stream(const fs::path& path, std::ios::openmode mode) {
  MetricsLog log;
  errno = 0;
  log.out_ = std::make_unique<std::ofstream>(path, mode);
  if (!*log.out_) {
    return make_error(ErrorKind::kInternal, "Failed to open '{}' for writing: {}", path.string(), reason());
  }
  log.path_ = path;
  return log;
}

Status MetricsLog::write(const nlohmann::ordered_json& line) {
  if (!out_) return {};
  errno = 0;
  *out_ << line.dump() << '\n';
  out_->flush();
  if (!*out_) return make_error(ErrorKind::kInternal, "Failed to write '{}': {}", path_.string(), reason());
  return {};
}

}  // namespace cfmo::train
