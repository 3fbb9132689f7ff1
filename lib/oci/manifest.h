#pragma once
/// OCI image index / manifest and Docker manifest list / schema 2, parsed
/// and checked (media types, digests, sizes), and the platform choice.

#include "core/error.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::oci {

inline constexpr std::string_view kOciIndex = "application/vnd.oci.image.index.v1+json";
inline constexpr std::string_view kOciManifest = "application/vnd.oci.image.manifest.v1+json";
inline constexpr std::string_view kDockerList = "application/vnd.docker.distribution.manifest.list.v2+json";
inline constexpr std::string_view kDockerManifest = "application/vnd.docker.distribution.manifest.v2+json";

struct Platform {
  std::string os;
  std::string architecture;
  std::string variant;  ///< empty matches any
  std::string to_string() const;
};

/// "os/arch[/variant]".
Result<Platform> parse_platform(std::string_view text);
/// The machine this runs on, in OCI's names (linux/amd64, linux/arm64/v8…).
Platform host_platform();

struct Descriptor {
  std::string media_type;
  std::string digest;
  int64_t size = 0;
  Platform platform;  ///< only in an index
};

/// An index (manifest list) or an image manifest.
struct Manifest {
  std::string media_type;
  bool is_index = false;
  std::vector<Descriptor> manifests;  ///< index: one per platform
  Descriptor config;                  ///< image manifest
  std::vector<Descriptor> layers;     ///< image manifest, base layer first
};

/// Parses `body`; `content_type` (from the response) decides when the body
/// has no mediaType. `what` names the object in errors.
Result<Manifest> parse_manifest(std::string_view body, std::string_view content_type, const std::string& what);

/// The index entry for `platform` (a missing variant matches any).
Result<Descriptor> select_platform(const Manifest& index, const Platform& platform, const std::string& what);

}  // namespace cfmo::oci
