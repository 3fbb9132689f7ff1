#include "diverge/watch.h"

namespace cfmo::diverge {
namespace fs = std::filesystem;

Result<RunWatcher> RunWatcher::open(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return make_error(ErrorKind::kInput, "'{}': no such directory", run_dir.string());
  return RunWatcher(run_dir);
}

Result<std::vector<DeltaFileRef>> RunWatcher::poll() {
  CFMO_ASSIGN_OR_RETURN(auto all, list_deltas(run_dir_, /*allow_missing=*/true));
  std::vector<DeltaFileRef> fresh;
  for (auto& ref : all) {
    if (!seen_.insert({ref.round, ref.rank}).second) continue;
    std::error_code ec;
    const auto time = fs::last_write_time(ref.path, ec);
    if (!ec && time > newest_) newest_ = time;
    fresh.push_back(std::move(ref));
  }
  return fresh;
}

bool RunWatcher::finished() const {
  std::error_code ec;
  const auto model_time = fs::last_write_time(run_dir_ / "model.safetensors", ec);
  return !ec && model_time >= newest_;
}

}  // namespace cfmo::diverge
