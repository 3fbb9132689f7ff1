#pragma once
/// A client for the OCI Distribution API over libcurl: content negotiation,
/// anonymous, Bearer-token and Basic auth, and retries with exponential
/// backoff and jitter on connection errors, 408, 429 and 5xx. Bodies stream
/// into a caller's sink, so memory stays bounded whatever the blob's size.

#include "core/error.h"
#include "oci/curl_handles.h"
#include "oci/reference.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::oci {

class RegistryApi;

/// The Accept list for manifests: OCI index and manifest, Docker manifest
/// list and schema 2.
extern const char* const kManifestAccept;

struct RegistryOptions {
  bool plain_http = false;
  int retries = 5;                ///< attempts after the first, per request
  double retry_base_s = 0.5;      ///< first backoff; doubles per attempt, with jitter
  double retry_max_delay_s = 30;  ///< cap on one backoff, Retry-After included
  long connect_timeout_s = 15;
  long stall_timeout_s = 30;     ///< abort a transfer below 1 KiB/s for this long
  std::string auth_file;         ///< docker config.json; empty: $DOCKER_CONFIG, ~/.docker
  double request_timeout_s = 0;  ///< one request, body included; 0: none (large blobs)
  /// The whole pull's deadline, shared by every request and retry; none when unset.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  double timeout_s = 0;  ///< what `deadline` was made from, for messages
  /// Set (by a signal handler) to stop: a transfer in flight is aborted within
  /// about a second, a backoff cut short, and the request fails as interrupted.
  const std::atomic<bool>* stop = nullptr;
  /// Makes the client of one host (`ref.registry`, with `options.plain_http`
  /// as its endpoint says); empty: a RegistryClient. Unit tests put an
  /// in-process registry here.
  std::function<Result<std::unique_ptr<RegistryApi>>(const Reference& ref, const RegistryOptions& options)> connect;

  bool stopped() const { return stop != nullptr && stop->load(std::memory_order_relaxed); }
};

/// The error of a request that `RegistryOptions::stop` ended.
Error interrupted(const std::string& what);

/// Receives a response body. begin() is called once per attempt with a 2xx
/// status before the first byte; a sink that resumes (Range) adds headers
/// through extra_headers() and restarts when it gets 200 in place of 206.
class BodySink {
 public:
  virtual ~BodySink() = default;
  virtual std::vector<std::string> extra_headers() { return {}; }
  virtual Status begin(long status) = 0;
  /// Writes a chunk; an error aborts the transfer and is returned as is.
  virtual Status write(std::string_view chunk) = 0;
};

/// A sink that keeps the body in memory, refusing more than `limit` bytes
/// (manifests and configs are small; a huge one is a malformed input).
class StringSink : public BodySink {
 public:
  explicit StringSink(std::string what, size_t limit = 4u << 20) : what_(std::move(what)), limit_(limit) {}
  Status begin(long) override {
    body.clear();
    return {};
  }
  Status write(std::string_view chunk) override;
  std::string body;

 private:
  std::string what_;
  size_t limit_;
};

struct ResponseInfo {
  long status = 0;
  std::map<std::string, std::string> headers;  ///< lowercase names, last response after redirects
  std::string header(const std::string& lowercase_name) const;
};

struct Credentials {
  std::string username;
  std::string password;
};

/// Looks up `host` in a docker config.json (`auths`, base64 "user:pass").
/// An absent file is no credentials, not an error.
Result<std::optional<Credentials>> load_credentials(const std::string& host, const std::string& auth_file);

/// One registry host and one repository, as the pull, the index artifacts
/// and the lazy mount speak to it: RegistryClient over libcurl, or an
/// in-process fake in unit tests (RegistryOptions::connect). Not thread-safe:
/// one per thread.
class RegistryApi {
 public:
  virtual ~RegistryApi() = default;

  /// GET (or HEAD) /v2/<repo>/<kind>/<reference>; non-2xx answers after auth
  /// and retries are errors naming the object: 404 is kInput, others kPeer.
  virtual Result<ResponseInfo> get(const std::string& api_path, const std::vector<std::string>& headers, BodySink& sink,
                                   const std::string& what, bool head) = 0;
  Result<ResponseInfo> get(const std::string& api_path, const std::vector<std::string>& headers, BodySink& sink,
                           const std::string& what) {
    return get(api_path, headers, sink, what, false);
  }

  /// PUT or POST `body` to `target` (an API path, or an absolute URL such as
  /// an upload's Location), authenticated and retried as get() is.
  virtual Result<ResponseInfo> send(const std::string& method, const std::string& target,
                                    const std::vector<std::string>& headers, std::string_view body, BodySink& sink,
                                    const std::string& what) = 0;

  /// The reference's host (a mirror's, for a mirror) and repository.
  virtual const Reference& reference() const = 0;

  /// Fetches a manifest by tag or digest with full content negotiation (through get).
  Result<std::pair<ResponseInfo, std::string>> get_manifest(const std::string& reference);
};

/// The libcurl RegistryApi. The token cache is per client.
class RegistryClient : public RegistryApi {
 public:
  RegistryClient(Reference ref, RegistryOptions options, std::optional<Credentials> credentials);
  ~RegistryClient() override;
  RegistryClient(const RegistryClient&) = delete;
  RegistryClient& operator=(const RegistryClient&) = delete;

  using RegistryApi::get;
  Result<ResponseInfo> get(const std::string& api_path, const std::vector<std::string>& headers, BodySink& sink,
                           const std::string& what, bool head) override;
  Result<ResponseInfo> send(const std::string& method, const std::string& target,
                            const std::vector<std::string>& headers, std::string_view body, BodySink& sink,
                            const std::string& what) override;

  const Reference& reference() const override { return ref_; }
  const RegistryOptions& options() const { return options_; }
  std::string base_url() const;

  struct Attempt;  ///< one request's outcome; defined in registry.cpp

 private:
  /// A request's method and body other than GET's and HEAD's.
  struct Upload {
    std::string method;
    std::string_view body;
  };
  Result<ResponseInfo> request(const std::string& url, const std::vector<std::string>& headers, BodySink& sink,
                               const std::string& what, bool head, const Upload* upload);
  Attempt perform(const std::string& url, const std::vector<std::string>& headers, BodySink& sink, bool head,
                  bool with_auth, const Upload* upload = nullptr);
  Status authenticate(const std::string& challenge, const std::string& what);

  Reference ref_;
  RegistryOptions options_;
  std::optional<Credentials> credentials_;
  std::string authorization_;                  ///< current "Authorization:" header, or empty
  std::map<std::string, std::string> tokens_;  ///< Bearer token per scope
  std::string bearer_challenge_;               ///< the last Bearer challenge, to renew its token before it expires
  std::chrono::steady_clock::time_point token_expiry_{};
  CurlEasy curl_;  ///< reused for keep-alive
};

/// The lowercase hex SHA-256 of a buffer, as "sha256:<hex>".
std::string sha256_digest(std::string_view data);

}  // namespace cfmo::oci
