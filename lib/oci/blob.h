#pragma once
/// Downloads one blob into an OCI layout's `blobs/sha256/<hex>`, streaming
/// through a `.partial` file: SHA-256 while the bytes arrive, the size
/// checked, a Range request resumes from what is already on disk, and the
/// blob is renamed into place only when its digest matches.

#include "core/error.h"
#include "oci/manifest.h"
#include "oci/registry.h"

#include <cstdint>
#include <filesystem>
#include <functional>

namespace cfmo::oci {

struct BlobResult {
  int64_t bytes_fetched = 0;  ///< over the network, this run
  bool already_present = false;
  bool resumed = false;  ///< a partial file from an earlier run was continued
};

/// Sees a blob's bytes as fetch_blob writes them to the partial file (a tee,
/// e.g. to an unpacker). Calls come from the downloading thread, in order.
class BlobObserver {
 public:
  virtual ~BlobObserver() = default;
  /// Before the first request: the partial file already holds this many bytes
  /// (a download resumed from an earlier run), which on_write will not repeat.
  virtual void on_start(int64_t bytes_on_disk) = 0;
  /// The registry answered 200 to a Range request: the file starts over, empty.
  virtual void on_restart() = 0;
  /// Bytes just appended to the partial file; an error aborts the download.
  virtual Status on_write(std::string_view chunk) = 0;
};

/// How one blob is fetched. The write buffer (drawn by the caller from its
/// MemoryBudget) gathers the network's small chunks into large writes; the
/// bytes in it count as received, so a Range resume continues after them.
struct BlobFetchOptions {
  size_t buffer_bytes = 0;  ///< 0: each chunk is written as it arrives
  /// Called as bytes arrive with the blob's bytes so far (resumed ones
  /// included), at most every 256 KiB and once at the end.
  std::function<void(int64_t)> on_bytes;
  /// Sees the bytes as they are written to the partial file (not those of a
  /// blob already present).
  BlobObserver* observer = nullptr;
};

/// The path of a blob in a layout: DIR/blobs/sha256/<hex>.
std::filesystem::path blob_path(const std::filesystem::path& layout, const std::string& digest);

/// Fetches `blob` (from /v2/<repo>/blobs/<digest>) into `layout`. A digest
/// or size mismatch is kInput, and the partial file is removed so the next
/// run starts clean; a network failure keeps it for resuming.
Result<BlobResult> fetch_blob(RegistryApi& client, const Descriptor& blob, const std::filesystem::path& layout,
                              const std::string& what, const BlobFetchOptions& options = {});

/// Checks that a file holds `digest` and `size` (for blobs already present).
Result<bool> file_matches(const std::filesystem::path& path, const std::string& digest, int64_t size);

}  // namespace cfmo::oci
