#pragma once
/// A whole pull: resolve the reference (index → platform manifest, through
/// the mirrors, then the origin), fetch the config and the hot layers first
/// (in parallel; hot blobs into the memory-backed store), mark the image
/// ready, then the cold layers by the cold strategy (now, later with
/// `fetch_layers`, or never), and write an OCI image layout that skopeo and
/// umoci read once every layer is there. Also `inspect`, which fetches no
/// layer. The pull's progress is kept in DIR's state file (pull_state.h).

#include "core/error.h"
#include "oci/blob.h"
#include "oci/hosts.h"
#include "oci/hot_set.h"
#include "oci/manifest.h"
#include "oci/pull_sink.h"
#include "oci/pull_state.h"
#include "oci/reference.h"
#include "oci/registry.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace cfmo::oci {

/// What happens to the layers that are not hot.
enum class ColdStrategy {
  kEager,  ///< fetched right after the hot ones
  kLazy,   ///< recorded as pending; `fetch_layers` (cfmo-pull fetch, or a background fetch) brings them
  kSkip,   ///< left out
};
const char* to_string(ColdStrategy cold);
Result<ColdStrategy> parse_cold_strategy(std::string_view text);

/// One layer's outcome in a report.
struct LayerReport {
  std::string digest;
  int64_t size = 0;
  bool hot = false;
  std::string location;  ///< "memory" or "disk"
  /// "fetched", "resumed" (a partial blob continued), "present" (there
  /// already), "pending" (lazy: not fetched yet), "skipped", "failed"
  std::string state;
  double seconds = 0;
  int64_t bytes_fetched = 0;
};

struct PullOptions {
  RegistryOptions registry;  ///< its auth_file is read per host
  HostSettings hosts;
  Platform platform;
  int jobs = 4;
  std::vector<LayerSpec> hot;
  int64_t max_memory = int64_t{2} << 30;      ///< the memory store and the buffers together
  int64_t buffer_memory = int64_t{16} << 20;  ///< the buffers shared by the parallel downloads
  bool spill = false;
  ColdStrategy cold = ColdStrategy::kEager;
  /// The caller fetches the cold layers in a detached process after this
  /// returns: they are left pending, whatever `cold` says (not kSkip).
  bool background = false;
  std::filesystem::path memory_dir = "/dev/shm";  ///< where the memory store is made
  /// false: hot layers only go first; every blob goes to the layout (a
  /// rootfs pull, whose product is the unpacked tree, not the blobs).
  bool memory_store = true;
  /// false: no state file and no lock on the layout (a rootfs pull's shared
  /// blob cache, where per-blob locks let pulls of other images go on).
  bool state_file = true;
  std::filesystem::path ready_file;  ///< written when the hot layers are complete; empty: none
  /// Fed in order as the pull goes (pull_sink.h): progress, a rootfs applier.
  std::vector<PullSink*> sinks;
};

/// The image a reference resolves to.
struct ResolvedImage {
  Reference ref;
  std::string index_digest;   ///< when the reference named an index, else empty
  Descriptor manifest;        ///< the image manifest's descriptor (platform chosen)
  std::string manifest_body;  ///< its exact bytes, as digested
  Manifest parsed;
  std::string config_body;  ///< only filled by inspect
  std::string host;         ///< the host that served the manifest
};

struct PullReport {
  ResolvedImage image;
  /// The manifest the layout's index.json names: the registry's own, or its
  /// OCI conversion when the registry served Docker schema 2 (umoci reads
  /// only OCI manifests; skopeo converts the same way). Empty digest while
  /// layers are still pending or skipped (no index.json yet).
  Descriptor layout_manifest;
  std::vector<LayerReport> layers;
  int64_t bytes_fetched = 0;
  double wall_s = 0;
  double ready_s = -1;  ///< when the hot layers were complete; -1: not reached
  bool complete = false;
  std::string cold;
  std::string memory_dir;  ///< the memory store; empty when none was used
  int64_t memory_bytes = 0;
  int64_t memory_capacity = 0;
  int64_t buffer_bytes = 0;       ///< the download buffers' budget
  int64_t buffer_peak_bytes = 0;  ///< the most of it held at once
  std::vector<std::string> notes;
};

/// A Docker schema 2 manifest rewritten with OCI media types (config and
/// layer bytes, digests and sizes unchanged).
Result<std::string> docker_to_oci_manifest(std::string_view docker_manifest, const std::string& what);

/// Fetches and verifies the manifest (through an index when there is one).
Result<ResolvedImage> resolve(RegistryApi& client, const Platform& platform);

/// Resolves `ref` through the mirrors, then the origin (no blob is fetched).
Result<ResolvedImage> resolve_image(const Reference& ref, const PullOptions& options);

/// Resolve and fetch the config too, for `inspect`.
Result<ResolvedImage> inspect_image(const Reference& ref, const PullOptions& options);

/// The memory store a pull into `dir` uses under `memory_dir`:
/// MEMORY_DIR/cfmo-pull-<name>-<hash of DIR's absolute path>.
std::filesystem::path memory_store_for(const std::filesystem::path& dir, const std::filesystem::path& memory_dir);

/// Whether `dir` is in memory: on tmpfs or ramfs.
bool memory_backed(const std::filesystem::path& dir);

/// Pulls `ref` into the OCI layout at `dir` (created if absent); blobs
/// already there are not fetched again; `tag` names it in index.json. The
/// layout (blobs, state file, index.json) is the puller's own store; each
/// of `options.sinks` is fed the resolved image, the plan, every layer's
/// bytes as they are written and its outcome (a layer a lazy or skipping
/// pull leaves out gets no blob calls).
Result<PullReport> pull_to_layout(const Reference& ref, const PullOptions& options, const std::filesystem::path& dir,
                                  const std::string& tag);

struct FetchOptions {
  RegistryOptions registry;
  std::optional<HostSettings> hosts;  ///< empty: the pull's, from the state file
  std::optional<std::string> auth_file;
  int jobs = 4;
  int64_t buffer_memory = int64_t{16} << 20;
  std::vector<LayerSpec> layers;  ///< empty: every layer not fetched yet
  std::vector<PullSink*> sinks;   ///< fed as a pull feeds them
};

/// Brings the layers of an earlier pull into `dir` (cfmo-pull fetch, and the
/// background fetch), resuming partial blobs, and completes the layout when
/// the last one arrives. Waits for the directory's lock.
Result<PullReport> fetch_layers(const std::filesystem::path& dir, const FetchOptions& options);

/// Per layer, the bytes of its blob on disk now (its file, or its .partial).
std::vector<int64_t> bytes_on_disk(const std::filesystem::path& dir, const PullState& state);

}  // namespace cfmo::oci
