#pragma once
/// The layers' indexes (gzip_index.h) kept in the image's own registry, as
/// an OCI 1.1 artifact: an image manifest with `artifactType`
/// kIndexArtifactType, the empty config, one layer per index (media type
/// kIndexBlobType, annotated with the digest of the layer it indexes) and a
/// `subject` naming the image manifest. It is found again through the
/// referrers API (GET /v2/<name>/referrers/<digest>) or, where the registry
/// lacks it (Debian's docker-registry 2.8), through the OCI 1.1 tag schema:
/// an image index tagged `sha256-<hex>` listing the referrers, which the
/// pusher reads, extends and writes back. The newest artifact listed wins.
/// Every blob and manifest is checked against its digest, and each index
/// against the layer it claims; a damaged one is kInput naming it.

#include "core/error.h"
#include "oci/gzip_index.h"
#include "oci/hosts.h"
#include "oci/manifest.h"
#include "oci/registry.h"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::oci {

inline constexpr const char* kIndexArtifactType = "application/vnd.cfmo.pull.index.v1";
inline constexpr const char* kIndexBlobType = "application/vnd.cfmo.pull.layer-index.v1";
inline constexpr const char* kIndexLayerAnnotation = "io.cfmo.pull.layer";

/// One layer's index as bytes (serialize_index), and the layer it is of.
struct IndexBlob {
  std::string layer_digest;
  std::string bytes;
};

struct PushedIndexes {
  std::string artifact;         ///< the artifact manifest's digest
  size_t layers = 0;            ///< indexes in it
  int64_t bytes = 0;            ///< of the indexes
  bool referrers_api = false;   ///< the registry took the subject itself (it answered OCI-Subject)
  std::string fallback_tag;     ///< the sha256-<hex> tag written, when it did not
  size_t fallback_entries = 0;  ///< referrers listed under that tag now, this one included
};

/// Pushes `blobs` as the index artifact of `subject` through `client` (the
/// image's repository), then updates the fallback tag where needed.
Result<PushedIndexes> push_index_artifact(RegistryApi& client, const Descriptor& subject,
                                          const std::vector<IndexBlob>& blobs);

struct FoundIndexes {
  std::string artifact;  ///< the artifact manifest's digest
  std::string via;       ///< "the referrers API" or "tag sha256-<hex>"
  std::vector<IndexBlob> blobs;
};

/// An index listed in an artifact, not fetched yet.
struct ListedIndex {
  std::string blob_digest;
  std::string layer_digest;
  int64_t size = 0;  ///< as the artifact says (bounded)
  std::string what;  ///< names it in errors
};

struct ListedIndexes {
  std::string artifact;              ///< the artifact manifest's digest
  std::string via;                   ///< "the referrers API" or "tag sha256-<hex>"
  std::vector<ListedIndex> indexes;  ///< one per layer (the first listed of each)
};

/// The newest index artifact of the manifest `subject_digest`, its indexes
/// listed: none when the registry lists none; one listed but damaged is
/// kInput naming it.
Result<std::optional<ListedIndexes>> list_index_artifact(RegistryApi& client, const std::string& subject_digest);

/// One listed index, fetched and checked: its digest, and that its header
/// names its layer (the rest is checked when it is parsed); kInput otherwise.
Result<IndexBlob> fetch_index_blob(RegistryApi& client, const ListedIndex& index);

/// list_index_artifact, then every index fetched on `client`, one after another.
Result<std::optional<FoundIndexes>> find_index_artifact(RegistryApi& client, const std::string& subject_digest);

/// `cfmo-pull index DIR --push`: the indexes in DIR/cfmo-index/ of the
/// pull's layers, pushed to the pull's own registry (its hosts and auth file
/// unless `hosts` or options.auth_file say otherwise; the origin only: a
/// mirror is not written to).
Result<PushedIndexes> push_pull_indexes(const std::filesystem::path& dir, const RegistryOptions& options,
                                        const std::optional<HostSettings>& hosts);

/// After a pull into `dir`: the indexes its registry holds for the image
/// (mirrors first, as the pull), fetched side by side and written to
/// DIR/cfmo-index/ for the layers that have none there yet (only those are
/// fetched). None listed is an empty answer; a damaged artifact is kInput.
Result<std::optional<ListedIndexes>> fetch_pull_indexes(const std::filesystem::path& dir,
                                                        const RegistryOptions& options);

}  // namespace cfmo::oci
