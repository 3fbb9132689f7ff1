#include "oci/cleanup.h"

#include "core/atomic_file.h"
#include "core/dir_lock.h"
#include "oci/mount.h"
#include "oci/pull_state.h"

#include <sys/stat.h>

#include <fstream>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kStorePrefix = "cfmo-pull-";

fs::path absolute_path(const fs::path& path) {
  std::error_code ec;
  fs::path out = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return out.empty() ? path : out;
}

std::string store_owner(const fs::path& store) {
  std::ifstream in(store / kStoreOwnerFile);
  std::string line;
  std::getline(in, line);
  return line;
}

void remove_counted(const fs::path& path, CleanupReport& report) {
  const int64_t bytes = tree_bytes(path);
  detach_unused_uppers(path);  // a dead --writable mount's tmpfs would keep its directory
  remove_tree(path);
  report.removed.push_back({path, bytes});
  report.bytes += bytes;
}

}  // namespace

int64_t tree_bytes(const fs::path& root) {
  int64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0) total += static_cast<int64_t>(st.st_blocks) * 512;
  }
  return total;
}

void remove_tree(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return;
  fs::remove_all(path, ec);
  if (!ec) return;
  for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_directory(ec) && !it->is_symlink(ec)) ::chmod(it->path().c_str(), 0700);
  }
  ::chmod(path.c_str(), 0700);
  fs::remove_all(path, ec);
}

Status mark_memory_store(const fs::path& store, const fs::path& dir) {
  return write_file_atomic(store / kStoreOwnerFile, absolute_path(dir).string() + "\n");
}

Result<CleanupReport> remove_pull(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return make_error(ErrorKind::kInput, "rm: '{}': no such directory", dir.string());
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  // A fetch (the background one too) holds the lock while it writes.
  auto lock = lock_layout(dir, std::chrono::steady_clock::now());
  if (!lock) {
    return make_error(ErrorKind::kUsage, "rm: '{}': {}; stop it first", dir.string(), lock.error().message);
  }
  const auto mounted = mounts_using(dir);
  if (!mounted.empty()) {
    std::string points;
    for (const auto& p : mounted) points += (points.empty() ? "" : ", ") + p;
    return make_error(ErrorKind::kUsage, "rm: '{}': its image is mounted at {} (cfmo-pull umount it first)",
                      dir.string(), points);
  }
  CleanupReport report;
  if (!state.memory_dir.empty() && fs::exists(state.memory_dir, ec)) {
    const std::string owner = store_owner(state.memory_dir);
    if (owner.empty() || owner == absolute_path(dir).string()) {
      remove_counted(state.memory_dir, report);
    } else {
      report.kept.push_back(fmt::format("{}: belongs to {}", state.memory_dir, owner));
    }
  }
  // The memory stores of --writable mounts by REF whose process died (their records name them).
  for (const auto& record : fs::directory_iterator(dir / kMountRecordDir, ec)) {
    std::ifstream in(record.path());
    std::string point;
    std::string store;
    std::getline(in, point);
    std::getline(in, store);
    if (store.empty() || !fs::exists(fs::path(store) / kRwMarker, ec)) continue;
    if (store_owner(store) == absolute_path(dir).string() && !upper_in_use(store)) remove_counted(store, report);
  }
  lock->release();
  remove_counted(dir, report);
  if (fs::exists(dir, ec))
    return make_error(ErrorKind::kInternal, "rm: '{}': could not be removed whole", dir.string());
  return report;
}

Result<CleanupReport> prune_stores(const fs::path& memory_dir) {
  std::error_code ec;
  if (!fs::is_directory(memory_dir, ec)) {
    return make_error(ErrorKind::kUsage, "prune: --memory-dir '{}': no such directory", memory_dir.string());
  }
  CleanupReport report;
  for (const auto& entry : fs::directory_iterator(memory_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(kStorePrefix) || !entry.is_directory(ec)) continue;
    const std::string owner = store_owner(entry.path());
    if (owner.empty()) {
      report.kept.push_back(fmt::format("{}: names no layout (made by an older cfmo-pull); remove it by hand if unused",
                                        entry.path().string()));
      continue;
    }
    // A writable mount's own store (mount --lazy REF --writable): its overlay alone uses it.
    if (fs::exists(entry.path() / kRwMarker, ec)) {
      if (upper_in_use(entry.path())) {
        report.kept.push_back(fmt::format("{}: the upper directory of a mount still mounted", entry.path().string()));
      } else {
        remove_counted(entry.path(), report);
      }
      continue;
    }
    // Gone, no longer a pull, or a pull that has another store now.
    auto state = read_state(owner);
    if (state && absolute_path(state->memory_dir) == absolute_path(entry.path())) continue;
    if (!mounts_using(owner).empty()) {
      report.kept.push_back(fmt::format("{}: its image is mounted still", entry.path().string()));
      continue;
    }
    remove_counted(entry.path(), report);
  }
  return report;
}

Status prune_lazy_layouts(const fs::path& cache, CleanupReport& report) {
  std::error_code ec;
  const fs::path lazy = cache / kLazyLayoutDir;
  if (!fs::is_directory(lazy, ec)) return {};
  for (const auto& entry : fs::directory_iterator(lazy, ec)) {
    if (!entry.is_directory(ec) || entry.is_symlink(ec)) continue;
    const fs::path dir = entry.path();
    if (fs::exists(state_path(dir), ec)) {
      auto removed = remove_pull(dir);
      if (!removed) {
        if (removed.error().kind != ErrorKind::kUsage) return std::move(removed).error();
        // Mounted, or a fetch (a --background one) holds it.
        std::string why = removed.error().message;
        if (const auto at = why.find("': "); at != std::string::npos) why = why.substr(at + 3);
        report.kept.push_back(fmt::format("{}: {}", dir.string(), why));
        continue;
      }
      for (auto& r : removed->removed) report.removed.push_back(std::move(r));
      for (auto& k : removed->kept) report.kept.push_back(std::move(k));
      report.bytes += removed->bytes;
      continue;
    }
    // No state file: a mount by REF stopped before its layout was made, or one making it now (it holds the lock).
    auto lock = lock_layout(dir, std::chrono::steady_clock::now());
    if (!lock) {
      report.kept.push_back(fmt::format("{}: {}", dir.string(), lock.error().message));
      continue;
    }
    lock->release();
    remove_counted(dir, report);
  }
  return {};
}

}  // namespace cfmo::oci
