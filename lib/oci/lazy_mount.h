#pragma once
/// `cfmo-pull mount DIR MOUNTPOINT --lazy`: the image as a read-only FUSE
/// file system (libfuse3, low-level API) whose tree and metadata come from
/// the layers' indexes (gzip_index.h) at once, merged with OCI whiteouts and
/// opaque directories applied, and whose file contents are read on first
/// access: the span of the layer that holds them is inflated from its
/// checkpoint (from the local blob when the layer is fetched, hot ones from
/// the memory store, else fetched from the registry with one HTTP Range
/// request and checked against the span's SHA-256) and kept as one file per
/// span in an on-disk cache, DIR/cfmo-lazy-cache/, bounded by `cache_bytes`
/// (least recently used spans go first). A span that fails (a digest
/// mismatch, the registry gone past its retries) fails that read with EIO,
/// writes one line naming the layer and span to the mount's log, caches
/// nothing, and is tried again by the next read. With `writable`, the file
/// system is mounted below an overlay (mount.h) whose upper directory holds
/// the writes; in memory, they have a tmpfs of their own sized to what
/// max_memory leaves them, so a write past it fails with ENOSPC (one line
/// in the mount's log says so when it fills).
///
/// Four threads read the FUSE device and answer metadata from memory, and
/// reads of cached spans from their files' open descriptors; reads of spans
/// not cached go to `jobs` worker threads, each with its own registry
/// clients. After a random read (not the next of a sequential reader), two
/// filler threads store the file's other pages in that span into the
/// kernel's page cache (FUSE_NOTIFY_STORE), so that later random reads
/// there do not each cost a round trip through the daemon. The
/// chunks being inflated draw their buffers from a MemoryBudget, so the
/// process stays under `max_memory` with the indexes counted. SIGTERM (what
/// `cfmo-pull umount` sends) detaches the mount, so that the mount point is
/// free at once, and answers EIO to whatever the processes still holding
/// files open ask until they close them or a grace period passes.
/// Without root, fusermount3 mounts and detaches it (mount.h's
/// run_fusermount and detach_mount), as libfuse does for a user.

#include "core/error.h"
#include "oci/gzip_index.h"
#include "oci/hosts.h"
#include "oci/mount.h"
#include "oci/registry.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::oci {

inline constexpr const char* kLazyCacheDir = "cfmo-lazy-cache";
inline constexpr const char* kLazyLogFile = "cfmo-pull-mount.log";
inline constexpr const char* kLazyStatsFile = "stats.json";
/// The file system's type (fuse.<subtype>) and its source's prefix, "cfmo-pull@PID".
inline constexpr const char* kLazySubtype = "cfmo-pull";
/// What a cfmo-pull process takes before its indexes and buffers (code, libraries, heap), for --max-memory.
inline constexpr int64_t kProcessMemory = int64_t{24} << 20;

/// One node of the merged tree. Its inode number is its place in the tree's vector, plus one.
struct LazyNode {
  char type = '5';  ///< the tar typeflag of gzip_index.h ('1' never: a hard link shares its target's node)
  uint32_t mode = 0755;
  uint64_t uid = 0;
  uint64_t gid = 0;
  uint64_t size = 0;
  int64_t mtime = 0;  ///< from the index (the epoch for an index of version 1)
  std::string link;   ///< a symlink's target
  int layer = -1;     ///< a regular file's layer (its position in the mount's layer list)
  uint64_t offset = 0;
  bool sparse = false;
  uint32_t nlink = 1;
  size_t parent = 0;  ///< a directory's parent, a file's first directory (the root's is itself)
  std::string name;   ///< its first name there
  std::vector<std::pair<std::string, size_t>> kids;  ///< a directory's entries, sorted by name
  int added_by = -1;                                 ///< the layer that made it (whiteouts remove only lower ones)
};

/// The layers merged into one tree: inode 1 is the root.
struct LazyTree {
  std::vector<LazyNode> nodes;
  const LazyNode& node(size_t ino) const { return nodes[ino - 1]; }
  /// The child `name` of directory `ino`, or 0.
  size_t child(size_t ino, std::string_view name) const;
  /// The inode of a path ("" or "/" is the root), or 0.
  size_t resolve(std::string_view path) const;
  /// A path of `ino` ("/usr/bin/tool"): its first name, up to the root.
  std::string path(size_t ino) const;
};

/// Merges the indexes, base layer first, as unpacking them in order into one
/// directory with whiteouts applied would (rootfs.h), and adds empty proc,
/// sys and dev directories where the image has none. `layers[i]` is the
/// index of mount layer i.
Result<LazyTree> merge_indexes(const std::vector<const LayerIndex*>& layers);

struct LazyMountOptions {
  uint64_t cache_bytes = uint64_t{1} << 30;
  int64_t max_memory = int64_t{256} << 20;
  int jobs = 4;
  RegistryOptions registry;
  std::optional<HostSettings> hosts;  ///< empty: the pull's
  std::optional<std::string> auth_file;
  std::filesystem::path record;    ///< appends each file's path at its first open; empty: none
  std::filesystem::path prefetch;  ///< paths whose spans are fetched right after the mount; empty: none
  /// An overlay on top (mount_writable_overlay) whose upper directory is in
  /// the pull's memory store; the FUSE mount is then DIR/layers/lazy/HASH.
  bool writable = false;
  /// writable, the pull having no memory store (a layout of mount --lazy
  /// REF): the upper directory goes in a memory store of the mount's own
  /// made in this directory (mount_store_upper); empty: DIR/layers/rw/.
  std::filesystem::path upper_memory_dir;
  /// The background fetch (--background) started beside the mount: its
  /// process and buffers, taken from max_memory first when a layer is not local.
  int64_t fetcher_memory = 0;
  double grace_s = 2;  ///< after SIGTERM: how long processes holding files open get EIO before the daemon ends
};

struct LazyLayer {
  size_t index = 0;  ///< in the image
  std::string digest;
  bool hot = false;
  bool local = false;      ///< its blob is in DIR (or the memory store): no network
  std::string index_from;  ///< "dir" (DIR/cfmo-index) or "built" (made now from the local blob)
  std::string whole_note;  ///< why it was fetched whole first, or empty
};

struct LazyMountReport {
  std::vector<LazyLayer> layers;
  std::vector<std::string> notes;
  size_t entries = 0;  ///< nodes of the merged tree
  int64_t index_bytes = 0;
  std::filesystem::path cache;
  std::filesystem::path log;
  std::filesystem::path fuse_point;  ///< where the FUSE file system is mounted: the mount point, or below an overlay
  std::optional<UpperDir> upper;     ///< --writable: where the writes go (in memory: upper->bytes of them at most)
  int64_t read_bytes = 0;            ///< the budget of the spans being inflated
  int64_t fetcher_bytes = 0;         ///< the background fetch's share, when it runs
};

/// A lazy mount: prepare() does all that can fail clearly (the pull's
/// state, its indexes, the tree, the memory check) in the calling process;
/// mount() and serve() run in the process that stays (the tool forks
/// between them, so that no thread exists at the fork).
class LazyMount {
 public:
  static Result<std::unique_ptr<LazyMount>> prepare(const std::filesystem::path& dir,
                                                    const std::filesystem::path& mountpoint,
                                                    const LazyMountOptions& options);
  ~LazyMount();
  LazyMount(const LazyMount&) = delete;
  LazyMount& operator=(const LazyMount&) = delete;

  const LazyMountReport& report() const;
  /// Mounts the file system (fsname cfmo-pull@<this pid>) and records it in DIR/cfmo-mounts/.
  Status mount();
  /// Serves until unmounted or SIGTERM/SIGINT/SIGHUP; then unmounts.
  Status serve();

  struct Impl;

 private:
  explicit LazyMount(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The daemon's pid from a lazy mount's source ("cfmo-pull@PID"), or 0.
int lazy_mount_pid(const std::string& source);

/// What the mount's daemon counts, in DIR/cfmo-lazy-cache/stats.json.
struct LazyStats {
  int64_t bytes_fetched = 0;  ///< compressed bytes over the network
  int64_t requests = 0;
  int64_t spans_inflated = 0;
  int64_t cache_bytes = 0;
  int64_t cache_capacity = 0;
  int64_t errors = 0;
  int64_t page_cache_bytes = 0;  ///< file bytes stored into the kernel's page cache after random reads
};
Result<LazyStats> read_lazy_stats(const std::filesystem::path& dir);

}  // namespace cfmo::oci
