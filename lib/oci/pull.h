#pragma once
/// A whole pull: resolve the reference (index → platform manifest), fetch
/// config and layers (in parallel), and write an OCI image layout that
/// skopeo and umoci read. Also `inspect`, which fetches no layer.

#include "core/error.h"
#include "oci/blob.h"
#include "oci/manifest.h"
#include "oci/reference.h"
#include "oci/registry.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace cfmo::oci {

struct PullOptions {
  RegistryOptions registry;
  Platform platform;
  int jobs = 4;
};

/// The image a reference resolves to.
struct ResolvedImage {
  Reference ref;
  std::string index_digest;   ///< when the reference named an index, else empty
  Descriptor manifest;        ///< the image manifest's descriptor (platform chosen)
  std::string manifest_body;  ///< its exact bytes, as digested
  Manifest parsed;
  std::string config_body;  ///< only filled by inspect
};

struct LayerReport {
  std::string digest;
  int64_t size = 0;
  std::string state;  ///< "fetched", "present", "resumed"
  double seconds = 0;
};

struct PullReport {
  ResolvedImage image;
  /// The manifest the layout's index.json names: the registry's own, or its
  /// OCI conversion when the registry served Docker schema 2 (umoci reads
  /// only OCI manifests; skopeo converts the same way).
  Descriptor layout_manifest;
  std::vector<LayerReport> layers;
  int64_t bytes_fetched = 0;
  double wall_s = 0;
};

/// A Docker schema 2 manifest rewritten with OCI media types (config and
/// layer bytes, digests and sizes unchanged).
Result<std::string> docker_to_oci_manifest(std::string_view docker_manifest, const std::string& what);

/// Fetches and verifies the manifest (through an index when there is one).
Result<ResolvedImage> resolve(RegistryClient& client, const Platform& platform);

/// Resolve and fetch the config too, for `inspect`.
Result<ResolvedImage> inspect_image(const Reference& ref, const PullOptions& options,
                                    const std::optional<Credentials>& credentials);

/// What a caller may attach to a pull to see its layers while they download
/// (the rootfs unpacker does). Both are called on download threads.
struct LayerHooks {
  /// Called once the manifest is known, before any blob is fetched; an error stops the pull.
  std::function<Status(const ResolvedImage&)> resolved;
  /// Before layer `index` is fetched: an observer of its bytes, or null.
  std::function<BlobObserver*(size_t index)> observer;
  /// After layer `index` is fetched, present, or failed.
  std::function<void(size_t index, const Result<BlobResult>&)> done;
};

/// Pulls `ref` into the OCI layout at `dir` (created if absent); blobs
/// already there are not fetched again; `tag` names it in index.json.
Result<PullReport> pull_to_layout(const Reference& ref, const PullOptions& options,
                                  const std::optional<Credentials>& credentials, const std::filesystem::path& dir,
                                  const std::string& tag, const LayerHooks* hooks = nullptr);

}  // namespace cfmo::oci
