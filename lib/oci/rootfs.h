#pragma once
/// `--output rootfs:DIR`: a pull whose layers are unpacked, in order, into
/// one directory tree while they download. Blobs go to an OCI layout (the
/// `oci:` output, or a cache) so that a second run resumes or finds them; the
/// tree is built in a staging directory beside DIR and renamed into place
/// only when every layer is verified and unpacked.

#include "core/error.h"
#include "oci/pull.h"
#include "oci/unpack.h"

#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::oci {

struct RootfsOptions {
  std::filesystem::path dir;
  /// An existing DIR that is not empty is replaced at the end (else it is a
  /// usage error, before anything is fetched). An empty one is filled.
  bool replace = false;
  UnpackOptions unpack;  ///< whiteouts must be WhiteoutMode::kApply (one merged tree)
};

struct RootfsReport {
  PullReport pull;
  std::filesystem::path dir;
  std::vector<UnpackStats> layers;  ///< per layer, in manifest order
  UnpackStats total;
  double unpack_wait_s = 0;  ///< how long the unpacking outlasted the downloads
  double sync_s = 0;         ///< syncfs of the tree before it is renamed into place
};

/// Where blobs go when no `oci:` output is asked for: $XDG_CACHE_HOME/cfmo-pull,
/// else ~/.cache/cfmo-pull (an OCI layout shared by every pull).
std::filesystem::path default_blob_cache();

/// Pulls `ref` into the layout at `layout` (index.json names it `tag`) and
/// unpacks its layers into `rootfs.dir`. Layers download in parallel; each is
/// unpacked in manifest order, from its partial file for the bytes already on
/// disk and then straight from the network as they arrive. Any failure
/// (digest mismatch, a malicious layer, the network) removes the staging tree
/// and leaves DIR as it was.
///
/// Hot layers (options.hot) are fetched first, into the layout like the
/// others (the memory store holds blobs, and the product here is the tree);
/// the ready file is written once DIR is in place. Lazy or skipped cold
/// layers cannot make a tree that is renamed into place whole: kUsage.
Result<RootfsReport> pull_to_rootfs(const Reference& ref, const PullOptions& options,
                                    const std::filesystem::path& layout, const std::string& tag,
                                    const RootfsOptions& rootfs);

/// Checks that `dir` may receive a rootfs (absent, empty, or `replace`); kUsage otherwise.
Status check_rootfs_target(const std::filesystem::path& dir, bool replace);

}  // namespace cfmo::oci
