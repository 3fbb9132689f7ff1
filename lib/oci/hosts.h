#pragma once
/// Where a repository is pulled from: its mirrors in the order given, then
/// the origin registry; each host spoken to over HTTPS unless it is listed as
/// insecure (plain HTTP). A request goes to the first host that is still
/// up; a mirror that fails (unreachable after one retry, a 5xx, a digest
/// mismatch) is skipped for the rest of the pull, and one that lacks an
/// object (404) is skipped for that object only.

#include "core/error.h"
#include "oci/reference.h"
#include "oci/registry.h"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::oci {

struct HostSettings {
  std::vector<std::string> mirrors;   ///< "host[:port]", "http://host[:port]" (plain HTTP), "https://..."
  std::vector<std::string> insecure;  ///< hosts spoken to over plain HTTP ("host:port", or "host": any port)
  bool plain_http = false;            ///< every host over plain HTTP
};

struct Endpoint {
  std::string host;  ///< host[:port] the API is spoken to
  bool plain_http = false;
  bool mirror = false;
  std::string describe() const;  ///< "mirror 127.0.0.1:5001" / "registry docker.io"
};

/// The mirrors, then the origin. A malformed mirror is kUsage.
Result<std::vector<Endpoint>> endpoints_for(const Reference& ref, const HostSettings& hosts);

/// Which endpoints have failed, shared by every thread of one pull.
class EndpointHealth {
 public:
  explicit EndpointHealth(size_t count) : down_(count) {}
  bool down(size_t i) const { return down_[i].load(); }
  /// True the first time (so the caller reports it once).
  bool mark_down(size_t i) { return !down_[i].exchange(true); }

 private:
  std::vector<std::atomic<bool>> down_;
};

/// One thread's clients, one per endpoint, made on first use (a curl handle
/// belongs to one thread). `notify` hears about each mirror given up.
class RegistryPool {
 public:
  using Notify = std::function<void(const std::string&)>;
  RegistryPool(Reference ref, std::vector<Endpoint> endpoints, RegistryOptions options, std::string auth_file,
               std::shared_ptr<EndpointHealth> health, Notify notify = nullptr);

  /// Runs `request` against each live endpoint in order until one succeeds;
  /// the origin's error is the answer when every host failed.
  Status each_until_ok(const std::string& what, const std::function<Status(RegistryApi&)>& request);

  const std::vector<Endpoint>& endpoints() const { return endpoints_; }
  const Reference& reference() const { return ref_; }

 private:
  Result<RegistryApi*> client(size_t i);

  Reference ref_;
  std::vector<Endpoint> endpoints_;
  RegistryOptions options_;
  std::string auth_file_;
  std::shared_ptr<EndpointHealth> health_;
  Notify notify_;
  std::vector<std::unique_ptr<RegistryApi>> clients_;
};

}  // namespace cfmo::oci
