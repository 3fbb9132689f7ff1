#include "oci/reference.h"

#include <algorithm>
#include <optional>
#include <regex>

namespace cfmo::oci {
namespace {

constexpr std::string_view kDockerHub = "docker.io";

bool is_registry_component(std::string_view first) {
  // Docker's rule: the first component is a registry when it has a dot or a
  // port, or is "localhost"; otherwise it is part of a Docker Hub name.
  return first.find('.') != std::string_view::npos || first.find(':') != std::string_view::npos || first == "localhost";
}

bool valid_repository(const std::string& name) {
  static const std::regex kComponent(
      R"([a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*)");
  return std::regex_match(name, kComponent);
}

bool valid_tag(const std::string& tag) {
  static const std::regex kTag(R"([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})");
  return std::regex_match(tag, kTag);
}

}  // namespace

std::string host_problem(std::string_view host) {
  if (host.empty()) return "no host";
  std::string_view name = host;
  std::optional<std::string_view> port;
  if (host.starts_with('[')) {
    const auto close = host.find(']');
    if (close == std::string_view::npos) return "an IPv6 address without its ']'";
    name = host.substr(0, close + 1);
    const std::string_view rest = host.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') return fmt::format("'{}' after the IPv6 address", rest);
    if (!rest.empty()) port = rest.substr(1);
    static const std::regex kIpv6(R"(\[[0-9A-Fa-f:.]+\])");
    if (!std::regex_match(name.begin(), name.end(), kIpv6)) return fmt::format("'{}' is not an IPv6 address", name);
  } else {
    if (const auto colon = host.find(':'); colon != std::string_view::npos) {
      name = host.substr(0, colon);
      port = host.substr(colon + 1);
    }
    if (name.empty()) return "no host before the port";
    static const std::regex kName(R"([A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)");
    if (!std::regex_match(name.begin(), name.end(), kName)) return fmt::format("'{}' is not a host name", name);
  }
  if (port) {
    if (port->empty() || port->size() > 5 ||
        !std::all_of(port->begin(), port->end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return fmt::format("port '{}' is not a number", *port);
    }
    const long value = std::stol(std::string(*port));
    if (value < 1 || value > 65535) return fmt::format("port {} is out of range (1-65535)", value);
  }
  return "";
}

bool is_sha256_digest(std::string_view digest) {
  if (digest.size() != 71 || !digest.starts_with("sha256:")) return false;
  return std::all_of(digest.begin() + 7, digest.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string Reference::api_host() const { return registry == kDockerHub ? "registry-1.docker.io" : registry; }

std::string Reference::to_string() const {
  std::string out = registry + "/" + repository;
  if (!tag.empty()) out += ":" + tag;
  if (!digest.empty()) out += "@" + digest;
  return out;
}

Result<Reference> parse_reference(std::string_view text) {
  if (text.empty()) return make_error(ErrorKind::kUsage, "image reference is empty");
  Reference ref;
  std::string rest(text);
  if (const auto at = rest.find('@'); at != std::string::npos) {
    ref.digest = rest.substr(at + 1);
    rest.resize(at);
    if (!is_sha256_digest(ref.digest)) {
      return make_error(ErrorKind::kUsage, "image reference '{}': digest '{}' is not sha256:<64 lowercase hex>", text,
                        ref.digest);
    }
  }
  // A tag is after the last ':' that comes after the last '/', so a port is not read as a tag.
  const auto slash = rest.rfind('/');
  if (const auto colon = rest.rfind(':'); colon != std::string::npos && (slash == std::string::npos || colon > slash)) {
    ref.tag = rest.substr(colon + 1);
    rest.resize(colon);
    if (!valid_tag(ref.tag)) return make_error(ErrorKind::kUsage, "image reference '{}': bad tag '{}'", text, ref.tag);
  }
  const auto first_slash = rest.find('/');
  if (first_slash != std::string::npos && is_registry_component(std::string_view(rest).substr(0, first_slash))) {
    ref.registry = rest.substr(0, first_slash);
    ref.repository = rest.substr(first_slash + 1);
  } else {
    ref.registry = std::string(kDockerHub);
    ref.repository = rest;
  }
  if (const std::string problem = host_problem(ref.registry); !problem.empty()) {
    return make_error(ErrorKind::kUsage, "image reference '{}': registry '{}': {}", text, ref.registry, problem);
  }
  if (ref.registry == "index.docker.io" || ref.registry == "registry-1.docker.io") ref.registry = kDockerHub;
  if (ref.registry == kDockerHub && ref.repository.find('/') == std::string::npos) {
    ref.repository = "library/" + ref.repository;
  }
  if (ref.repository.empty() || !valid_repository(ref.repository)) {
    return make_error(ErrorKind::kUsage,
                      "image reference '{}': bad repository name '{}' (lowercase letters, digits, . _ - and /)", text,
                      ref.repository);
  }
  if (ref.tag.empty() && ref.digest.empty()) ref.tag = "latest";
  return ref;
}

}  // namespace cfmo::oci
