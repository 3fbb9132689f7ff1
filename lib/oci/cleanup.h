#pragma once
/// Cleaning up after pulls: `cfmo-pull rm DIR` removes a pull's layout, its
/// memory store (in /dev/shm, which outlives the layout otherwise) and the
/// lazy mount's cache inside DIR; `cfmo-pull prune` removes the memory
/// stores whose layout is gone, and the layouts `mount --lazy REF` keeps
/// under CACHE/lazy (indexes and span cache) that nothing uses any more.
/// A memory store names its layout in a file of
/// its own (kStoreOwnerFile), written when the pull makes it; a store
/// without one (made before cfmo-pull wrote it) is reported, never removed
/// by guess.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::oci {

/// Under a cache (--cache): the layouts `mount --lazy REF` makes, one per image manifest.
inline constexpr const char* kLazyLayoutDir = "lazy";

/// In a memory store: the absolute path of the layout it belongs to.
inline constexpr const char* kStoreOwnerFile = "cfmo-pull-layout";

/// Records `dir` as the owner of the memory store `store`.
Status mark_memory_store(const std::filesystem::path& store, const std::filesystem::path& dir);

struct RemovedPath {
  std::filesystem::path path;
  int64_t bytes = 0;  ///< what it used on its file system
};

struct CleanupReport {
  std::vector<RemovedPath> removed;
  std::vector<std::string> kept;  ///< what was left, and why
  int64_t bytes = 0;              ///< removed, together
};

/// Removes the pull in `dir`: its memory store (and those of --writable
/// mounts by REF whose process died, named in DIR/cfmo-mounts), then DIR itself (the layout,
/// its unpacked layers, the lazy cache). Refused (kUsage) while a process
/// fetches into it or an image of it is mounted, naming them; a directory
/// that is not a pull is kInput.
Result<CleanupReport> remove_pull(const std::filesystem::path& dir);

/// Removes the memory stores under `memory_dir` (cfmo-pull-*) whose layout is
/// gone or no longer names them, and the stores of --writable mounts by REF
/// (kRwMarker in them) whose overlay is not mounted any more.
Result<CleanupReport> prune_stores(const std::filesystem::path& memory_dir);

/// Removes, into `report`, the layouts of `mount --lazy REF` under
/// CACHE/lazy (each with its indexes, span cache and memory store) that no
/// mount uses and no process holds, and what a mount by REF that was cut
/// short left there; those in use are kept, saying why. No CACHE/lazy is
/// nothing to prune.
Status prune_lazy_layouts(const std::filesystem::path& cache, CleanupReport& report);

/// A tree's use of its file system, in bytes (what du counts).
int64_t tree_bytes(const std::filesystem::path& root);

/// Removes a tree, making directories writable first where a layer left them read-only.
void remove_tree(const std::filesystem::path& path);

}  // namespace cfmo::oci
