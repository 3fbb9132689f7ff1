#include "oci/pull.h"

#include "core/atomic_file.h"
#include "oci/blob.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string short_digest(const std::string& digest) { return digest.substr(0, 19) + "…"; }

/// index.json with this image's entry added (or replacing one of the same name).
Result<std::string> updated_index(const fs::path& dir, const Descriptor& manifest, const std::string& name) {
  Json index = {{"schemaVersion", 2}, {"mediaType", kOciIndex}, {"manifests", Json::array()}};
  if (fs::exists(dir / "index.json")) {
    CFMO_ASSIGN_OR_RETURN(const auto text, read_file(dir / "index.json"));
    index = Json::parse(text, nullptr, false);
    if (index.is_discarded() || !index.is_object() || !index.contains("manifests") || !index["manifests"].is_array()) {
      return make_error(ErrorKind::kInput, "'{}': not an OCI index", (dir / "index.json").string());
    }
  }
  Json kept = Json::array();
  for (const auto& entry : index["manifests"]) {
    const bool same_name = entry.contains("annotations") && entry["annotations"].is_object() &&
                           entry["annotations"].value("org.opencontainers.image.ref.name", "") == name;
    if (!same_name) kept.push_back(entry);
  }
  Json descriptor = {{"mediaType", manifest.media_type}, {"digest", manifest.digest}, {"size", manifest.size}};
  if (!name.empty()) descriptor["annotations"] = {{"org.opencontainers.image.ref.name", name}};
  kept.push_back(descriptor);
  index["manifests"] = kept;
  return index.dump(2) + "\n";
}

}  // namespace

Result<std::string> docker_to_oci_manifest(std::string_view docker_manifest, const std::string& what) {
  Json j = Json::parse(docker_manifest, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("config") || !j.contains("layers") || !j["layers"].is_array()) {
    return make_error(ErrorKind::kInput, "{}: not a Docker schema 2 manifest", what);
  }
  static const std::map<std::string, std::string> kLayerTypes = {
      {"application/vnd.docker.image.rootfs.diff.tar.gzip", "application/vnd.oci.image.layer.v1.tar+gzip"},
      {"application/vnd.docker.image.rootfs.diff.tar", "application/vnd.oci.image.layer.v1.tar"},
      {"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
       "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"},
  };
  j["mediaType"] = kOciManifest;
  j["config"]["mediaType"] = "application/vnd.oci.image.config.v1+json";
  for (auto& layer : j["layers"]) {
    const std::string type = layer.value("mediaType", "");
    if (const auto it = kLayerTypes.find(type); it != kLayerTypes.end()) layer["mediaType"] = it->second;
  }
  return j.dump();
}

Result<ResolvedImage> resolve(RegistryClient& client, const Platform& platform) {
  ResolvedImage image;
  image.ref = client.reference();
  const std::string what = "image " + image.ref.to_string();
  CFMO_ASSIGN_OR_RETURN(auto first, client.get_manifest(image.ref.manifest_reference()));
  std::string digest = sha256_digest(first.second);
  if (!image.ref.digest.empty() && digest != image.ref.digest) {
    return make_error(ErrorKind::kInput, "{}: manifest digest mismatch: got {}", what, digest);
  }
  CFMO_ASSIGN_OR_RETURN(auto parsed, parse_manifest(first.second, first.first.header("content-type"), what));
  std::string body = std::move(first.second);
  std::string media_type = parsed.media_type;
  if (parsed.is_index) {
    image.index_digest = digest;
    CFMO_ASSIGN_OR_RETURN(const auto chosen, select_platform(parsed, platform, what));
    CFMO_ASSIGN_OR_RETURN(auto second, client.get_manifest(chosen.digest));
    digest = sha256_digest(second.second);
    if (digest != chosen.digest) {
      return make_error(ErrorKind::kInput, "manifest {}: digest mismatch: got {}", chosen.digest, digest);
    }
    const std::string sub_what = "manifest " + chosen.digest;
    CFMO_ASSIGN_OR_RETURN(parsed, parse_manifest(second.second, second.first.header("content-type"), sub_what));
    if (parsed.is_index) return make_error(ErrorKind::kInput, "{}: an index inside an index", sub_what);
    body = std::move(second.second);
    media_type = parsed.media_type;
  }
  image.manifest = {media_type, digest, static_cast<int64_t>(body.size()), {}};
  image.manifest_body = std::move(body);
  image.parsed = std::move(parsed);
  return image;
}

Result<ResolvedImage> inspect_image(const Reference& ref, const PullOptions& options,
                                    const std::optional<Credentials>& credentials) {
  RegistryClient client(ref, options.registry, credentials);
  CFMO_ASSIGN_OR_RETURN(auto image, resolve(client, options.platform));
  const auto& config = image.parsed.config;
  StringSink sink("config " + config.digest);
  CFMO_TRY(client.get("/v2/" + ref.repository + "/blobs/" + config.digest, {}, sink, "config " + config.digest));
  if (static_cast<int64_t>(sink.body.size()) != config.size || sha256_digest(sink.body) != config.digest) {
    return make_error(ErrorKind::kInput, "config {}: digest or size mismatch", config.digest);
  }
  image.config_body = std::move(sink.body);
  return image;
}

Result<PullReport> pull_to_layout(const Reference& ref, const PullOptions& options,
                                  const std::optional<Credentials>& credentials, const fs::path& dir,
                                  const std::string& tag, const LayerHooks* hooks) {
  const auto start = std::chrono::steady_clock::now();
  PullReport report;
  std::error_code ec;
  fs::create_directories(dir / "blobs" / "sha256", ec);
  if (ec) return make_error(ErrorKind::kInternal, "output '{}': cannot create: {}", dir.string(), ec.message());
  if (fs::exists(dir / "oci-layout")) {
    CFMO_ASSIGN_OR_RETURN(const auto text, read_file(dir / "oci-layout"));
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || j.value("imageLayoutVersion", "") != "1.0.0") {
      return make_error(ErrorKind::kInput, "output '{}': oci-layout is not imageLayoutVersion 1.0.0", dir.string());
    }
  }

  RegistryClient client(ref, options.registry, credentials);
  CFMO_ASSIGN_OR_RETURN(report.image, resolve(client, options.platform));
  const auto& manifest = report.image.parsed;
  if (hooks != nullptr && hooks->resolved) CFMO_TRY(hooks->resolved(report.image));

  // Config and layers share one queue; the blobs are fetched by `jobs` threads,
  // each with its own client (a curl handle is not shared between threads).
  // A blob named twice (the empty layer of many images) is fetched once: two
  // downloads into one partial file would race.
  std::vector<Descriptor> blobs;
  std::vector<std::vector<size_t>> layers_of;  // blob index -> the layer indices it is
  std::map<std::string, size_t> blob_index;
  blobs.push_back(manifest.config);
  layers_of.emplace_back();
  blob_index.emplace(manifest.config.digest, 0);
  for (size_t k = 0; k < manifest.layers.size(); ++k) {
    const auto [it, fresh] = blob_index.emplace(manifest.layers[k].digest, blobs.size());
    if (fresh) {
      blobs.push_back(manifest.layers[k]);
      layers_of.emplace_back();
    }
    layers_of[it->second].push_back(k);
  }
  report.layers.resize(manifest.layers.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;  // guards first_error and report.bytes_fetched
  std::optional<Error> first_error;
  auto worker = [&] {
    RegistryClient own(ref, options.registry, credentials);
    for (size_t i = next++; i < blobs.size() && !failed.load(); i = next++) {
      const auto& blob = blobs[i];
      const auto& layers = layers_of[i];
      const std::string what = i == 0 ? "config " + short_digest(blob.digest)
                                      : fmt::format("layer {} ({})", short_digest(blob.digest), layers.front());
      const auto blob_start = std::chrono::steady_clock::now();
      BlobObserver* observer =
          !layers.empty() && hooks != nullptr && hooks->observer ? hooks->observer(layers.front()) : nullptr;
      auto got = fetch_blob(own, blob, dir, what, observer);
      if (hooks != nullptr && hooks->done) {
        for (const size_t k : layers) hooks->done(k, got);
      }
      std::lock_guard lock(mutex);
      if (!got) {
        if (!first_error) first_error = std::move(got).error();
        failed.store(true);
        return;
      }
      report.bytes_fetched += got->bytes_fetched;
      for (const size_t k : layers) {
        report.layers[k] = {blob.digest, blob.size,
                            got->already_present ? "present" : (got->resumed ? "resumed" : "fetched"),
                            seconds_since(blob_start)};
      }
    }
  };
  const size_t threads = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(options.jobs), blobs.size()));
  {
    std::vector<std::jthread> pool;
    for (size_t t = 0; t < threads; ++t) pool.emplace_back(worker);
  }
  if (first_error) return *first_error;

  // The manifest goes in last, so a layout never names blobs it lacks.
  std::string layout_body = report.image.manifest_body;
  report.layout_manifest = report.image.manifest;
  if (report.image.manifest.media_type == kDockerManifest) {
    CFMO_ASSIGN_OR_RETURN(layout_body, docker_to_oci_manifest(layout_body, "manifest " + report.image.manifest.digest));
    report.layout_manifest = {
        std::string(kOciManifest), sha256_digest(layout_body), static_cast<int64_t>(layout_body.size()), {}};
  }
  CFMO_TRY(write_file_atomic(blob_path(dir, report.layout_manifest.digest), layout_body));
  CFMO_TRY(write_file_atomic(dir / "oci-layout", "{\"imageLayoutVersion\":\"1.0.0\"}\n"));
  CFMO_ASSIGN_OR_RETURN(const auto index, updated_index(dir, report.layout_manifest, tag));
  CFMO_TRY(write_file_atomic(dir / "index.json", index));
  report.wall_s = seconds_since(start);
  return report;
}

}  // namespace cfmo::oci
