#pragma once
/// `cfmo-pull mount DIR MOUNTPOINT`: an earlier pull's image presented as
/// one overlay filesystem. Each layer is unpacked once into a directory of
/// its own — a hot layer in the memory store, a cold one in DIR/layers/ —
/// and the directories are stacked in the image's order (the base layer at
/// the bottom) as overlayfs lower layers, so the hot layers are served from
/// memory and the cold ones from disk. Where the process may mount (root
/// with CAP_SYS_ADMIN) the layers carry overlayfs whiteouts
/// (WhiteoutMode::kOverlay, in DIR/layers/overlay/); otherwise they keep the
/// OCI .wh. files (kKeep, in DIR/layers/oci/), and the mount itself is
/// refused with the reason, the directories staying usable. Below the
/// image's layers lies one of empty /proc, /sys and /dev, the mount points a
/// container runtime needs and a read-only root cannot be given later.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::oci {

struct MountOptions {
  bool partial = false;  ///< mount though some layers are not fetched (their files are absent)
  /// An upper directory, dropped at umount: in the memory store when the
  /// pull has one (hot layers), else on disk in DIR/layers/rw/.
  bool writable = false;
};

struct MountedLayer {
  size_t index = 0;
  std::string digest;
  bool hot = false;
  std::filesystem::path dir;  ///< the unpacked layer
  bool memory = false;        ///< dir is in the memory store
  bool unpacked_now = false;  ///< false: it was there from an earlier mount
  int64_t bytes = 0;          ///< the unpacked tree's disk (or memory) use
};

struct MountReport {
  std::vector<MountedLayer> layers;  ///< in the image's order, base first
  std::vector<std::string> notes;    ///< layers left out, spilled to disk
  bool mounted = false;
  std::string not_mounted;       ///< why the mount was not made (the directories are there)
  std::filesystem::path upper;   ///< --writable: the upper directory
  bool upper_in_memory = false;  ///< it is on tmpfs: writes take memory, not disk
  int64_t memory_bytes = 0;      ///< the memory store's use now: hot blobs and unpacked hot layers
};

/// Why this process cannot mount overlayfs, or empty when it can (it has
/// CAP_SYS_ADMIN and the kernel knows overlay).
std::string mount_unavailable_reason();

/// Unpacks the fetched layers of the pull in `dir` and mounts them at
/// `mountpoint` (an existing directory). Missing layers (pending, failed)
/// are kUsage naming them, unless `partial`; skipped ones are left out with
/// a note. When the process may not mount, the report says why and
/// `mounted` is false (not an error: the caller decides).
/// Where a --writable mount's writes go: `base` (holding upper/ and work/)
/// under the pull's memory store `store`, or DIR/layers/ without one.
struct UpperDir {
  std::filesystem::path base;
  std::filesystem::path upper;
  bool in_memory = false;       ///< `store` is memory-backed (tmpfs)
  bool own_store = false;       ///< `base` is a memory store of the mount's own, removed whole with it
  std::filesystem::path owner;  ///< own_store: the layout it belongs to (kStoreOwnerFile), for prune
  /// in_memory, for mount --lazy: `base` is a tmpfs of its own of this
  /// size (the writes' share of --max-memory), so writes past it fail with
  /// ENOSPC rather than growing the store; 0: a plain directory.
  int64_t bytes = 0;
};
UpperDir upper_dir_for(const std::filesystem::path& dir, const std::filesystem::path& store,
                       const std::filesystem::path& point);

/// mount --lazy REF --writable: the layout under CACHE/lazy/ is shared by
/// every mount of the image and has no memory store, so the mount gets one
/// of its own, MEMORY_DIR/cfmo-pull-NAME-HASH-rw-HASH (named by the layout
/// and the mount point, owned by `dir`), holding upper/ and work/ directly;
/// umount and SIGTERM remove it whole, prune one whose overlay is gone.
UpperDir mount_store_upper(const std::filesystem::path& dir, const std::filesystem::path& memory_dir,
                           const std::filesystem::path& point);

/// Whether a cfmo-pull overlay mounted now has its upper directory under `base`.
bool upper_in_use(const std::filesystem::path& base);

/// Removes an upper directory's base, its own tmpfs (UpperDir::bytes) detached first.
void remove_upper(const std::filesystem::path& base);

/// Detaches the tmpfs of --writable's writes mounted at or below `path`
/// that no overlay uses (their mount died): the tree can be removed then.
void detach_unused_uppers(const std::filesystem::path& path);

/// In an upper directory's base: the mount point it was made for (it marks the base as ours to remove).
inline constexpr const char* kRwMarker = ".cfmo-pull-rw";

/// mount --lazy --writable: an overlay at `point` whose lower directory is
/// the lazy mount at `lower` and whose upper is `upper` (made empty now);
/// umount removes the overlay, its upper directory and the lazy mount below.
Status mount_writable_overlay(const std::filesystem::path& lower, const UpperDir& upper,
                              const std::filesystem::path& point);

Result<MountReport> mount_image(const std::filesystem::path& dir, const std::filesystem::path& mountpoint,
                                const MountOptions& options);

/// Where an image of the pull in `dir` is mounted now: overlays over its
/// layers, and lazy mounts (whose daemons record themselves in
/// DIR/cfmo-mounts/PID).
std::vector<std::string> mounts_using(const std::filesystem::path& dir);

inline constexpr const char* kMountRecordDir = "cfmo-mounts";

/// The source of what is mounted at `point` (the mount a lookup sees), or empty.
std::string mounted_source(const std::filesystem::path& point);

/// Runs fusermount3 (setuid root: FUSE mounts for a user who may not mount,
/// or open /dev/fuse) with `args`, its signal mask cleared, and returns its
/// exit status; `comm_fd` (when >= 0) is handed to it as _FUSE_COMMFD, the
/// socket it sends the /dev/fuse descriptor back on. Not installed is kUsage.
Result<int> run_fusermount(const std::vector<std::string>& args, int comm_fd = -1);

/// Detaches what is mounted at `point` at once (MNT_DETACH): with umount2
/// where the process may, else (not root) through fusermount3 -u -z, which
/// unmounts a FUSE mount of this user's, as libfuse does without root.
/// Neither allowed is kUsage naming the mount point.
Status detach_mount(const std::filesystem::path& point);

/// Unmounts a cfmo-pull overlay at `mountpoint` and removes its upper
/// directory; anything else mounted there is kUsage.
Status unmount_image(const std::filesystem::path& mountpoint);

}  // namespace cfmo::oci
