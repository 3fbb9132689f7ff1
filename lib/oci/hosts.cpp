#include "oci/hosts.h"

#include <algorithm>

namespace cfmo::oci {
namespace {

std::string host_without_port(const std::string& host) {
  if (host.starts_with('[')) {
    const auto close = host.find(']');
    return close == std::string::npos ? host : host.substr(0, close + 1);
  }
  const auto colon = host.rfind(':');
  return colon == std::string::npos ? host : host.substr(0, colon);
}

bool listed_insecure(const std::string& host, const std::vector<std::string>& insecure) {
  return std::any_of(insecure.begin(), insecure.end(), [&](const std::string& entry) {
    if (entry == host) return true;
    // An entry without a port covers every port of that host.
    return entry.find(':') == std::string::npos && !entry.starts_with('[') && entry == host_without_port(host);
  });
}

}  // namespace

std::string Endpoint::describe() const { return (mirror ? "mirror " : "registry ") + host; }

Result<std::vector<Endpoint>> endpoints_for(const Reference& ref, const HostSettings& hosts) {
  std::vector<Endpoint> out;
  for (const auto& given : hosts.mirrors) {
    Endpoint e;
    e.mirror = true;
    std::string host = given;
    bool scheme_http = false;
    if (host.starts_with("http://")) {
      scheme_http = true;
      host = host.substr(7);
    } else if (host.starts_with("https://")) {
      host = host.substr(8);
    }
    while (host.ends_with('/')) host.pop_back();
    if (const std::string problem = host_problem(host); !problem.empty()) {
      return make_error(ErrorKind::kUsage,
                        "--mirror '{}': {}; expected HOST[:PORT], optionally with http:// or https://", given, problem);
    }
    e.host = host;
    e.plain_http = hosts.plain_http || scheme_http || listed_insecure(host, hosts.insecure);
    out.push_back(std::move(e));
  }
  for (const auto& entry : hosts.insecure) {
    if (const std::string problem = host_problem(entry); !problem.empty()) {
      return make_error(ErrorKind::kUsage, "--insecure-registry '{}': {}; expected HOST or HOST:PORT", entry, problem);
    }
  }
  Endpoint origin;
  origin.host = ref.api_host();
  origin.plain_http = hosts.plain_http || listed_insecure(ref.registry, hosts.insecure) ||
                      listed_insecure(ref.api_host(), hosts.insecure);
  out.push_back(std::move(origin));
  return out;
}

RegistryPool::RegistryPool(Reference ref, std::vector<Endpoint> endpoints, RegistryOptions options,
                           std::string auth_file, std::shared_ptr<EndpointHealth> health, Notify notify)
    : ref_(std::move(ref)),
      endpoints_(std::move(endpoints)),
      options_(std::move(options)),
      auth_file_(std::move(auth_file)),
      health_(std::move(health)),
      notify_(std::move(notify)),
      clients_(endpoints_.size()) {}

Result<RegistryApi*> RegistryPool::client(size_t i) {
  if (clients_[i]) return clients_[i].get();
  const Endpoint& e = endpoints_[i];
  Reference ref = ref_;
  if (e.mirror) ref.registry = e.host;
  RegistryOptions options = options_;
  options.plain_http = e.plain_http;
  // The origin is there to fall back on: a mirror gets one retry, not the
  // whole backoff schedule, so a dead mirror costs seconds, not minutes.
  if (e.mirror) options.retries = std::min(options.retries, 1);
  if (options.connect) {
    CFMO_ASSIGN_OR_RETURN(clients_[i], options.connect(ref, options));
    return clients_[i].get();
  }
  CFMO_ASSIGN_OR_RETURN(auto credentials, load_credentials(e.host, auth_file_));
  clients_[i] = std::make_unique<RegistryClient>(std::move(ref), std::move(options), std::move(credentials));
  return clients_[i].get();
}

Status RegistryPool::each_until_ok(const std::string& what, const std::function<Status(RegistryApi&)>& request) {
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const bool last = i + 1 == endpoints_.size();
    if (!last && health_ && health_->down(i)) continue;
    CFMO_ASSIGN_OR_RETURN(RegistryApi * c, client(i));
    auto done = request(*c);
    if (done || last || options_.stopped()) return done;
    const Error& error = done.error();
    const bool missing = error.kind == ErrorKind::kInput && error.message.find("HTTP 404") != std::string::npos;
    if (error.kind == ErrorKind::kUsage || error.kind == ErrorKind::kInternal) return done;
    if (missing) {
      if (notify_)
        notify_(fmt::format("{}: {} does not have it; trying the next host", what, endpoints_[i].describe()));
      continue;
    }
    if (health_ == nullptr || health_->mark_down(i)) {
      if (notify_) notify_(fmt::format("{} skipped from now on: {}", endpoints_[i].describe(), error.message));
    }
  }
  return make_error(ErrorKind::kInternal, "{}: no registry to pull from", what);
}

}  // namespace cfmo::oci
