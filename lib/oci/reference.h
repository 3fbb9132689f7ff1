#pragma once
/// Image references as users type them: `[registry[:port]/]name[:tag|@digest]`,
/// with Docker Hub's defaults (docker.io, `library/` for one-component names,
/// tag `latest`).

#include "core/error.h"

#include <string>
#include <string_view>

namespace cfmo::oci {

/// A parsed reference. Exactly one of `tag` and `digest` is what the pull
/// resolves; when both are given the digest wins and the tag only names the
/// result.
struct Reference {
  std::string registry;    ///< host[:port] as typed, or "docker.io"
  std::string repository;  ///< "library/alpine", "team/app"
  std::string tag;         ///< "latest" when neither tag nor digest is given
  std::string digest;      ///< "sha256:<64 hex>" or empty

  /// The host the API is spoken to: docker.io is served by registry-1.docker.io.
  std::string api_host() const;
  /// What the manifest is fetched by: the digest if any, else the tag.
  std::string manifest_reference() const { return digest.empty() ? tag : digest; }
  /// The canonical spelling, "docker.io/library/alpine:3.19".
  std::string to_string() const;
};

Result<Reference> parse_reference(std::string_view text);

/// What is wrong with `host` as a registry's address, HOST[:PORT] (a DNS
/// name or IPv4 address, or an IPv6 one in brackets; a port from 1 to
/// 65535), or empty when nothing is: what can never be connected to is a
/// usage error at once, not a network failure after the retries.
std::string host_problem(std::string_view host);

/// True for "sha256:" followed by 64 lowercase hex digits (the only algorithm
/// cfmo verifies).
bool is_sha256_digest(std::string_view digest);

}  // namespace cfmo::oci
