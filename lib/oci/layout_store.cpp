#include "oci/layout_store.h"

#include "core/atomic_file.h"
#include "oci/blob.h"
#include "oci/pull.h"
#include "oci/registry.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

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

Status prepare_layout(const fs::path& dir) {
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
  return {};
}

Status finish_layout(const fs::path& dir, const std::string& manifest_body, const Descriptor& manifest,
                     const std::string& tag, Descriptor& layout_manifest) {
  std::string layout_body = manifest_body;
  layout_manifest = manifest;
  if (manifest.media_type == kDockerManifest) {
    CFMO_ASSIGN_OR_RETURN(layout_body, docker_to_oci_manifest(layout_body, "manifest " + manifest.digest));
    layout_manifest = {
        std::string(kOciManifest), sha256_digest(layout_body), static_cast<int64_t>(layout_body.size()), {}};
  }
  CFMO_TRY(write_file_atomic(blob_path(dir, layout_manifest.digest), layout_body));
  CFMO_TRY(write_file_atomic(dir / "oci-layout", "{\"imageLayoutVersion\":\"1.0.0\"}\n"));
  CFMO_ASSIGN_OR_RETURN(const auto index, updated_index(dir, layout_manifest, tag));
  return write_file_atomic(dir / "index.json", index);
}

Status link_blob(const fs::path& dir, const fs::path& target, const std::string& digest) {
  const fs::path link = blob_path(dir, digest);
  const fs::path temp = link.string() + ".link." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove(temp, ec);
  fs::create_symlink(target, temp, ec);
  if (!ec) fs::rename(temp, link, ec);
  if (ec) {
    fs::remove(temp, ec);
    return make_error(ErrorKind::kInternal, "'{}': cannot link to the memory store: {}", link.string(), ec.message());
  }
  return {};
}

}  // namespace cfmo::oci
