#include "oci/manifest.h"

#include "oci/reference.h"

#include <sys/utsname.h>

#include <nlohmann/json.hpp>

namespace cfmo::oci {
namespace {

using Json = nlohmann::json;

std::string string_field(const Json& j, const char* key) {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
}

Result<Descriptor> parse_descriptor(const Json& j, const std::string& what) {
  if (!j.is_object()) return make_error(ErrorKind::kInput, "{}: a descriptor is not an object", what);
  Descriptor d;
  d.media_type = string_field(j, "mediaType");
  d.digest = string_field(j, "digest");
  if (!is_sha256_digest(d.digest)) {
    return make_error(ErrorKind::kInput, "{}: descriptor digest '{}' is not sha256:<64 lowercase hex>", what,
                      d.digest.substr(0, 80));
  }
  if (!j.contains("size") || !j["size"].is_number_integer() || j["size"].get<int64_t>() < 0) {
    return make_error(ErrorKind::kInput, "{}: descriptor {} has no valid size", what, d.digest);
  }
  d.size = j["size"].get<int64_t>();
  if (j.contains("platform") && j["platform"].is_object()) {
    d.platform.os = string_field(j["platform"], "os");
    d.platform.architecture = string_field(j["platform"], "architecture");
    d.platform.variant = string_field(j["platform"], "variant");
  }
  return d;
}

}  // namespace

std::string Platform::to_string() const { return os + "/" + architecture + (variant.empty() ? "" : "/" + variant); }

Result<Platform> parse_platform(std::string_view text) {
  Platform p;
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const auto slash = text.find('/', start);
    parts.emplace_back(text.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start));
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  if (parts.size() < 2 || parts.size() > 3 || parts[0].empty() || parts[1].empty() ||
      (parts.size() == 3 && parts[2].empty())) {
    return make_error(ErrorKind::kUsage, "platform '{}': expected os/arch[/variant], e.g. linux/amd64", text);
  }
  p.os = parts[0];
  p.architecture = parts[1];
  if (parts.size() == 3) p.variant = parts[2];
  return p;
}

Platform host_platform() {
  utsname u{};
  uname(&u);
  const std::string machine = u.machine;
  Platform p{"linux", machine, ""};
  if (machine == "x86_64") p.architecture = "amd64";
  if (machine == "aarch64" || machine == "arm64") p = {"linux", "arm64", ""};
  if (machine.starts_with("armv7")) p = {"linux", "arm", "v7"};
  if (machine == "i686" || machine == "i386") p.architecture = "386";
  return p;
}

Result<Manifest> parse_manifest(std::string_view body, std::string_view content_type, const std::string& what) {
  const Json j = Json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return make_error(ErrorKind::kInput, "{}: not valid JSON", what);
  Manifest m;
  m.media_type = string_field(j, "mediaType");
  if (m.media_type.empty()) {
    m.media_type = std::string(content_type.substr(0, content_type.find(';')));
    while (!m.media_type.empty() && m.media_type.back() == ' ') m.media_type.pop_back();
  }
  if (m.media_type.empty()) {
    // An OCI manifest may omit mediaType; its shape tells.
    m.media_type = std::string(j.contains("manifests") ? kOciIndex : kOciManifest);
  }
  if (j.contains("schemaVersion") && j["schemaVersion"] != 2) {
    return make_error(ErrorKind::kInput, "{}: schemaVersion {} is not supported (only 2)", what,
                      j["schemaVersion"].dump());
  }
  if (m.media_type == kOciIndex || m.media_type == kDockerList) {
    m.is_index = true;
    if (!j.contains("manifests") || !j["manifests"].is_array()) {
      return make_error(ErrorKind::kInput, "{}: index without a manifests array", what);
    }
    for (const auto& entry : j["manifests"]) {
      CFMO_ASSIGN_OR_RETURN(auto d, parse_descriptor(entry, what));
      m.manifests.push_back(std::move(d));
    }
    return m;
  }
  if (m.media_type != kOciManifest && m.media_type != kDockerManifest) {
    return make_error(ErrorKind::kInput, "{}: unsupported media type '{}'", what, m.media_type);
  }
  if (!j.contains("config")) return make_error(ErrorKind::kInput, "{}: manifest without a config", what);
  CFMO_ASSIGN_OR_RETURN(m.config, parse_descriptor(j["config"], what));
  if (!j.contains("layers") || !j["layers"].is_array()) {
    return make_error(ErrorKind::kInput, "{}: manifest without a layers array", what);
  }
  for (const auto& entry : j["layers"]) {
    CFMO_ASSIGN_OR_RETURN(auto d, parse_descriptor(entry, what));
    m.layers.push_back(std::move(d));
  }
  return m;
}

Result<Descriptor> select_platform(const Manifest& index, const Platform& platform, const std::string& what) {
  std::string available;
  for (const auto& d : index.manifests) {
    if (d.platform.os == platform.os && d.platform.architecture == platform.architecture &&
        (platform.variant.empty() || d.platform.variant == platform.variant)) {
      return d;
    }
    if (!d.platform.os.empty()) available += (available.empty() ? "" : ", ") + d.platform.to_string();
  }
  return make_error(ErrorKind::kInput, "{}: no image for platform {} (available: {})", what, platform.to_string(),
                    available.empty() ? "none" : available);
}

}  // namespace cfmo::oci
