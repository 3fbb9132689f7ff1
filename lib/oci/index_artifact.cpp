#include "oci/index_artifact.h"

#include "core/atomic_file.h"
#include "core/parallel.h"
#include "oci/blob.h"
#include "oci/hosts.h"
#include "oci/hot_set.h"
#include "oci/pull_state.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr const char* kOciManifestType = "application/vnd.oci.image.manifest.v1+json";
constexpr const char* kOciIndexType = "application/vnd.oci.image.index.v1+json";
/// The OCI empty descriptor's content, `{}`, as the artifact's config.
constexpr const char* kEmptyType = "application/vnd.oci.empty.v1+json";
constexpr const char* kEmptyBody = "{}";
constexpr const char* kCreatedAnnotation = "org.opencontainers.image.created";
/// An index is a few MiB for a GB layer (a window per 4 MiB span); more is not an index.
constexpr size_t kIndexBlobLimit = size_t{256} << 20;
/// Indexes fetched at once after a lazy pull (one connection each).
constexpr size_t kIndexJobs = 4;

std::string fallback_tag(const std::string& digest) {
  // The OCI 1.1 tag schema: <alg>-<ref>, truncated to a tag's 128 characters.
  std::string tag = digest;
  if (const auto colon = tag.find(':'); colon != std::string::npos) tag[colon] = '-';
  return tag.substr(0, 128);
}

std::string blob_api(const RegistryApi& client, const std::string& digest) {
  return "/v2/" + client.reference().repository + "/blobs/" + digest;
}

/// A blob into the repository, unless it is there already: POST an upload, PUT its bytes.
Status upload_blob(RegistryApi& client, const std::string& body, const std::string& what) {
  const std::string digest = sha256_digest(body);
  StringSink ignore(what, 1u << 20);
  if (client.get(blob_api(client, digest), {}, ignore, what, true)) return {};
  const std::string repo = client.reference().repository;
  CFMO_ASSIGN_OR_RETURN(const ResponseInfo started,
                        client.send("POST", "/v2/" + repo + "/blobs/uploads/", {}, "", ignore, what));
  std::string location = started.header("location");
  if (location.empty()) {
    return make_error(ErrorKind::kPeer, "{}: registry {} started an upload without a Location", what,
                      client.reference().api_host());
  }
  location += (location.find('?') == std::string::npos ? "?" : "&") + std::string("digest=") + digest;
  CFMO_TRY(client.send("PUT", location, {"Content-Type: application/octet-stream"}, body, ignore, what));
  return {};
}

Result<ResponseInfo> put_manifest(RegistryApi& client, const std::string& reference, const std::string& body,
                                  const std::string& media_type, const std::string& what) {
  StringSink ignore(what, 1u << 20);
  return client.send("PUT", "/v2/" + client.reference().repository + "/manifests/" + reference,
                     {"Content-Type: " + media_type}, body, ignore, what);
}

/// The `manifests` of an image index listing referrers, as JSON; a body that is not one is kInput.
Result<Json> listed_manifests(const std::string& body, const std::string& what) {
  const Json index = Json::parse(body, nullptr, false);
  if (!index.is_object() || !index.contains("manifests") || !index["manifests"].is_array()) {
    return make_error(ErrorKind::kInput, "{}: not an image index", what);
  }
  return index["manifests"];
}

/// The newest index artifact in a referrers listing, by its created annotation, then its place.
std::optional<std::string> newest_artifact(const Json& manifests) {
  std::optional<std::string> best;
  std::string best_created;
  for (const auto& m : manifests) {
    if (!m.is_object() || m.value("artifactType", "") != kIndexArtifactType) continue;
    if (!m.contains("digest") || !m["digest"].is_string()) continue;
    std::string created;
    if (m.contains("annotations") && m["annotations"].is_object()) {
      created = m["annotations"].value(kCreatedAnnotation, "");
    }
    if (!best || created >= best_created) {
      best = m["digest"].get<std::string>();
      best_created = created;
    }
  }
  return best;
}

bool is_not_found(const Error& error) {
  return error.kind == ErrorKind::kInput && error.message.find("HTTP 404") != std::string::npos;
}

/// The referrers of `subject`, through the API or its fallback tag; `via` says which. None: an empty array.
Result<Json> referrers(RegistryApi& client, const std::string& subject, std::string& via) {
  const std::string repo = client.reference().repository;
  StringSink sink("the referrers of " + subject);
  auto api = client.get("/v2/" + repo + "/referrers/" + subject, {std::string("Accept: ") + kOciIndexType}, sink,
                        "the referrers of " + subject);
  if (api) {
    via = "the referrers API";
    return listed_manifests(sink.body,
                            fmt::format("the referrers of {} (registry {})", subject, client.reference().api_host()));
  }
  if (!is_not_found(api.error())) return api.error();
  via = "tag " + fallback_tag(subject);
  auto tagged = client.get_manifest(fallback_tag(subject));
  if (!tagged) {
    if (is_not_found(tagged.error())) return Json::array();
    return tagged.error();
  }
  return listed_manifests(tagged->second, fmt::format("{}:{}", repo, fallback_tag(subject)));
}

}  // namespace

Result<PushedIndexes> push_index_artifact(RegistryApi& client, const Descriptor& subject,
                                          const std::vector<IndexBlob>& blobs) {
  const std::string repo = client.reference().repository;
  const std::string what = fmt::format("index artifact of {}@{}", repo, subject.digest);
  PushedIndexes pushed;
  CFMO_TRY(upload_blob(client, kEmptyBody, what + ": its empty config"));
  const std::string created = utc_now();
  Json layers = Json::array();
  for (const auto& blob : blobs) {
    CFMO_TRY(
        upload_blob(client, blob.bytes, fmt::format("{}: the index of {}", what, short_digest(blob.layer_digest))));
    layers.push_back({{"mediaType", kIndexBlobType},
                      {"digest", sha256_digest(blob.bytes)},
                      {"size", blob.bytes.size()},
                      {"annotations", {{kIndexLayerAnnotation, blob.layer_digest}}}});
    pushed.bytes += static_cast<int64_t>(blob.bytes.size());
  }
  const Json manifest = {
      {"schemaVersion", 2},
      {"mediaType", kOciManifestType},
      {"artifactType", kIndexArtifactType},
      {"config", {{"mediaType", kEmptyType}, {"digest", sha256_digest(kEmptyBody)}, {"size", 2}}},
      {"layers", layers},
      {"subject", {{"mediaType", subject.media_type}, {"digest", subject.digest}, {"size", subject.size}}},
      {"annotations", {{kCreatedAnnotation, created}}}};
  const std::string body = manifest.dump();
  pushed.artifact = sha256_digest(body);
  pushed.layers = blobs.size();
  CFMO_ASSIGN_OR_RETURN(const ResponseInfo put, put_manifest(client, pushed.artifact, body, kOciManifestType, what));
  // A registry that keeps referrers itself says so; for the others the tag schema's index is extended.
  if (put.header("oci-subject") == subject.digest) {
    pushed.referrers_api = true;
    return pushed;
  }
  pushed.fallback_tag = fallback_tag(subject.digest);
  Json listing = {{"schemaVersion", 2}, {"mediaType", kOciIndexType}, {"manifests", Json::array()}};
  auto tagged = client.get_manifest(pushed.fallback_tag);
  if (tagged) {
    CFMO_ASSIGN_OR_RETURN(listing["manifests"],
                          listed_manifests(tagged->second, fmt::format("{}:{}", repo, pushed.fallback_tag)));
  } else if (!is_not_found(tagged.error())) {
    return tagged.error();
  }
  Json kept = Json::array();
  for (const auto& m : listing["manifests"]) {
    if (m.is_object() && m.value("digest", "") != pushed.artifact) kept.push_back(m);
  }
  kept.push_back({{"mediaType", kOciManifestType},
                  {"digest", pushed.artifact},
                  {"size", body.size()},
                  {"artifactType", kIndexArtifactType},
                  {"annotations", {{kCreatedAnnotation, created}}}});
  listing["manifests"] = kept;
  pushed.fallback_entries = kept.size();
  CFMO_TRY(put_manifest(client, pushed.fallback_tag, listing.dump(), kOciIndexType,
                        fmt::format("{}:{}", repo, pushed.fallback_tag)));
  return pushed;
}

Result<std::optional<ListedIndexes>> list_index_artifact(RegistryApi& client, const std::string& subject_digest) {
  ListedIndexes found;
  CFMO_ASSIGN_OR_RETURN(const Json listed, referrers(client, subject_digest, found.via));
  const auto digest = newest_artifact(listed);
  if (!digest) return std::optional<ListedIndexes>();
  found.artifact = *digest;
  const std::string what = fmt::format("index artifact {} of {} (found through {})", short_digest(*digest),
                                       short_digest(subject_digest), found.via);
  if (!is_sha256_digest(*digest)) return make_error(ErrorKind::kInput, "{}: not a sha256 digest", what);
  CFMO_ASSIGN_OR_RETURN(const auto got, client.get_manifest(*digest));
  if (sha256_digest(got.second) != *digest) {
    return make_error(ErrorKind::kInput, "{}: the manifest's bytes do not match its digest", what);
  }
  const Json manifest = Json::parse(got.second, nullptr, false);
  if (!manifest.is_object() || manifest.value("artifactType", "") != kIndexArtifactType ||
      !manifest.contains("layers") || !manifest["layers"].is_array()) {
    return make_error(ErrorKind::kInput, "{}: not a cfmo-pull index artifact", what);
  }
  if (!manifest.contains("subject") || !manifest["subject"].is_object() ||
      manifest["subject"].value("digest", "") != subject_digest) {
    return make_error(ErrorKind::kInput, "{}: its subject is not {}", what, subject_digest);
  }
  std::set<std::string> seen;
  for (const auto& layer : manifest["layers"]) {
    if (!layer.is_object() || layer.value("mediaType", "") != kIndexBlobType) continue;
    ListedIndex index;
    index.blob_digest = layer.value("digest", "");
    if (layer.contains("annotations") && layer["annotations"].is_object()) {
      index.layer_digest = layer["annotations"].value(kIndexLayerAnnotation, "");
    }
    if (!is_sha256_digest(index.blob_digest) || !is_sha256_digest(index.layer_digest)) {
      return make_error(ErrorKind::kInput, "{}: a layer without a digest or the {} annotation", what,
                        kIndexLayerAnnotation);
    }
    const int64_t size = layer.value("size", int64_t{0});
    index.size = std::clamp<int64_t>(size, 0, static_cast<int64_t>(kIndexBlobLimit));
    index.what = fmt::format("{}: the index of layer {}", what, short_digest(index.layer_digest));
    if (seen.insert(index.layer_digest).second) found.indexes.push_back(std::move(index));
  }
  return std::optional<ListedIndexes>(std::move(found));
}

Result<IndexBlob> fetch_index_blob(RegistryApi& client, const ListedIndex& index) {
  StringSink sink(index.what, kIndexBlobLimit);
  // Its size is known: grown by doubling, an index of MBs was copied several times.
  sink.body.reserve(static_cast<size_t>(index.size));
  CFMO_TRY(client.get(blob_api(client, index.blob_digest), {}, sink, index.what));
  if (sha256_digest(sink.body) != index.blob_digest) {
    return make_error(ErrorKind::kInput, "{}: the blob's bytes do not match its digest", index.what);
  }
  // Its header only: the lazy mount parses (and checks) the whole index when it reads it.
  CFMO_ASSIGN_OR_RETURN(const std::string indexed, index_layer_digest(sink.body, index.what));
  if (indexed != index.layer_digest) {
    return make_error(ErrorKind::kInput, "{}: it indexes {}, not that layer", index.what, indexed);
  }
  return IndexBlob{index.layer_digest, std::move(sink.body)};
}

Result<std::optional<FoundIndexes>> find_index_artifact(RegistryApi& client, const std::string& subject_digest) {
  CFMO_ASSIGN_OR_RETURN(const auto listed, list_index_artifact(client, subject_digest));
  if (!listed) return std::optional<FoundIndexes>();
  FoundIndexes found;
  found.artifact = listed->artifact;
  found.via = listed->via;
  for (const auto& index : listed->indexes) {
    CFMO_ASSIGN_OR_RETURN(IndexBlob blob, fetch_index_blob(client, index));
    found.blobs.push_back(std::move(blob));
  }
  return std::optional<FoundIndexes>(std::move(found));
}

namespace {

/// The pull's registry: its repository (by the image's digest), its hosts, mirrors first.
struct PullRegistry {
  PullState state;
  Reference ref;
  std::vector<Endpoint> endpoints;
};

Result<PullRegistry> pull_registry(const fs::path& dir, const std::optional<HostSettings>& hosts) {
  PullRegistry r;
  CFMO_ASSIGN_OR_RETURN(r.state, read_state(dir));
  CFMO_ASSIGN_OR_RETURN(r.ref, parse_reference(r.state.image));
  CFMO_ASSIGN_OR_RETURN(r.endpoints, endpoints_for(r.ref, hosts.value_or(r.state.hosts)));
  return r;
}

}  // namespace

Result<PushedIndexes> push_pull_indexes(const fs::path& dir, const RegistryOptions& options,
                                        const std::optional<HostSettings>& hosts) {
  CFMO_ASSIGN_OR_RETURN(PullRegistry r, pull_registry(dir, hosts));
  std::vector<IndexBlob> blobs;
  std::set<std::string> seen;
  for (const auto& layer : r.state.layers) {
    const fs::path path = index_path(dir, layer.blob.digest);
    std::error_code ec;
    if (!fs::exists(path, ec) || !seen.insert(layer.blob.digest).second) continue;
    CFMO_TRY(read_index(path));  // a damaged index is not pushed
    std::ifstream in(path, std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    blobs.push_back({layer.blob.digest, bytes.str()});
  }
  if (blobs.empty()) {
    return make_error(ErrorKind::kUsage, "index --push: '{}' has no index of any layer to push", dir.string());
  }
  Descriptor subject;
  subject.digest = r.state.manifest_digest;
  subject.media_type = r.state.manifest_media_type;
  std::error_code ec;
  subject.size = static_cast<int64_t>(fs::file_size(blob_path(dir, subject.digest), ec));
  if (ec) {
    return make_error(ErrorKind::kInput, "'{}': the image manifest {} is not in the layout", dir.string(),
                      subject.digest);
  }
  // Written to the origin only: a mirror is someone else's copy.
  const std::string auth_file = options.auth_file.empty() ? r.state.auth_file : options.auth_file;
  RegistryPool pool(r.ref, {r.endpoints.back()}, options, auth_file, nullptr);
  PushedIndexes pushed;
  CFMO_TRY(pool.each_until_ok("pushing the indexes", [&](RegistryApi& client) -> Status {
    CFMO_ASSIGN_OR_RETURN(pushed, push_index_artifact(client, subject, blobs));
    return {};
  }));
  return pushed;
}

Result<std::optional<ListedIndexes>> fetch_pull_indexes(const fs::path& dir, const RegistryOptions& options) {
  CFMO_ASSIGN_OR_RETURN(PullRegistry r, pull_registry(dir, std::nullopt));
  auto health = std::make_shared<EndpointHealth>(r.endpoints.size());
  RegistryPool pool(r.ref, r.endpoints, options, r.state.auth_file, health);
  std::optional<ListedIndexes> found;
  CFMO_TRY(pool.each_until_ok("the image's indexes", [&](RegistryApi& client) -> Status {
    CFMO_ASSIGN_OR_RETURN(found, list_index_artifact(client, r.state.manifest_digest));
    return {};
  }));
  if (!found) return found;
  std::set<std::string> layers;
  for (const auto& l : r.state.layers) layers.insert(l.blob.digest);
  std::vector<const ListedIndex*> wanted;
  for (const auto& index : found->indexes) {
    std::error_code ec;
    if (layers.count(index.layer_digest) != 0 && !fs::exists(index_path(dir, index.layer_digest), ec)) {
      wanted.push_back(&index);
    }
  }
  std::error_code ec;
  if (!wanted.empty()) fs::create_directories(dir / kIndexDir, ec);
  // Side by side, each on a connection of its own (the first on the pool's,
  // open already): fetched, checked and written (fsync'd) at once, the
  // indexes of a large image cost about one of them, not the sum.
  std::vector<Status> done(wanted.size());
  parallel_for(wanted.size(), static_cast<int>(std::min<size_t>(wanted.size(), kIndexJobs)), "pull-index",
               [&](size_t i) {
                 std::optional<RegistryPool> own;
                 if (i != 0) own.emplace(r.ref, r.endpoints, options, r.state.auth_file, health);
                 RegistryPool& p = i == 0 ? pool : *own;
                 done[i] = p.each_until_ok(wanted[i]->what, [&](RegistryApi& client) -> Status {
                   CFMO_ASSIGN_OR_RETURN(const IndexBlob blob, fetch_index_blob(client, *wanted[i]));
                   return write_file_atomic(index_path(dir, blob.layer_digest), blob.bytes);
                 });
               });
  for (const auto& status : done) CFMO_TRY(status);
  return found;
}

}  // namespace cfmo::oci
