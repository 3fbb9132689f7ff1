#pragma once
// An in-process registry behind oci::RegistryApi, for unit tests of the pull
// pipeline without a registry binary (the integration tests keep the real
// docker-registry). It serves manifests and blobs from memory, honours
// "Range: bytes=N-" and "bytes=N-M" as Distribution does, records each
// request, and injects faults per blob: a connection dropped after some
// bytes, a flipped byte, Range refused. It takes uploads (POST and PUT of
// blobs, PUT of manifests) and, once `enable_referrers_api`, keeps each
// pushed manifest's subject as an OCI 1.1 registry does: it answers
// OCI-Subject and lists the referrers at /v2/NAME/referrers/DIGEST, which
// Debian's docker-registry 2.8 lacks.
#include "oci/registry.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cfmo::oci::testing {

class FakeRegistry {
 public:
  struct Request {
    std::string path;
    long range_start = -1;  ///< -1: no Range header
  };

  void add_manifest(const std::string& reference, const std::string& media_type, const std::string& body) {
    std::lock_guard lock(mu_);
    manifests_[reference] = {media_type, body};
    manifests_[sha256_digest(body)] = {media_type, body};
  }
  std::string add_blob(const std::string& bytes) {
    std::lock_guard lock(mu_);
    const std::string digest = sha256_digest(bytes);
    blobs_[digest] = bytes;
    return digest;
  }
  /// The next `times` requests of `digest` end (kPeer) after `bytes` body bytes.
  void drop_after(const std::string& digest, size_t bytes, int times = 1) {
    std::lock_guard lock(mu_);
    drops_[digest] = {bytes, times};
  }
  /// Every answer of `digest` has its byte `at` flipped.
  void corrupt(const std::string& digest, size_t at) {
    std::lock_guard lock(mu_);
    corrupt_[digest] = at;
  }
  void refuse_ranges() {
    std::lock_guard lock(mu_);
    ranges_ = false;
  }
  void enable_referrers_api() {
    std::lock_guard lock(mu_);
    referrers_api_ = true;
  }
  /// A manifest pushed or added under `reference` (a tag or digest), or empty.
  std::string manifest(const std::string& reference) const {
    std::lock_guard lock(mu_);
    const auto m = manifests_.find(reference);
    return m == manifests_.end() ? "" : m->second.second;
  }
  std::vector<Request> requests(const std::string& part = "") const {
    std::lock_guard lock(mu_);
    std::vector<Request> out;
    for (const auto& r : requests_) {
      if (r.path.find(part) != std::string::npos) out.push_back(r);
    }
    return out;
  }

  /// What RegistryOptions::connect takes: a client of this registry for any host.
  std::function<Result<std::unique_ptr<RegistryApi>>(const Reference&, const RegistryOptions&)> connector() {
    return [this](const Reference& ref, const RegistryOptions&) -> Result<std::unique_ptr<RegistryApi>> {
      return std::unique_ptr<RegistryApi>(new Client(*this, ref));
    };
  }

 private:
  class Client : public RegistryApi {
   public:
    Client(FakeRegistry& registry, Reference ref) : registry_(registry), ref_(std::move(ref)) {}
    using RegistryApi::get;
    Result<ResponseInfo> get(const std::string& api_path, const std::vector<std::string>& headers, BodySink& sink,
                             const std::string& what, bool head) override {
      return registry_.serve(api_path, headers, sink, what, head);
    }
    Result<ResponseInfo> send(const std::string& method, const std::string& target,
                              const std::vector<std::string>& headers, std::string_view body, BodySink&,
                              const std::string& what) override {
      return registry_.receive(method, target, headers, std::string(body), what);
    }
    const Reference& reference() const override { return ref_; }

   private:
    FakeRegistry& registry_;
    Reference ref_;
  };

  /// An upload: POST starts one, PUT ...?digest= stores a blob, PUT /manifests/REF a manifest.
  Result<ResponseInfo> receive(const std::string& method, const std::string& target,
                               const std::vector<std::string>& headers, const std::string& body,
                               const std::string& what) {
    std::lock_guard lock(mu_);
    requests_.push_back({method + " " + target, -1});
    ResponseInfo info;
    const auto uploads = target.find("/blobs/uploads/");
    if (method == "POST" && uploads != std::string::npos) {
      info.status = 202;
      info.headers["location"] = target.substr(0, uploads) + fmt::format("/blobs/uploads/{}", ++uploads_);
      return info;
    }
    const auto digest_at = target.find("digest=");
    if (method == "PUT" && uploads != std::string::npos && digest_at != std::string::npos) {
      const std::string digest = target.substr(digest_at + 7);
      if (sha256_digest(body) != digest)
        return make_error(ErrorKind::kInput, "{}: registry fake answered HTTP 400", what);
      blobs_[digest] = body;
      info.status = 201;
      return info;
    }
    const auto manifests = target.find("/manifests/");
    if (method == "PUT" && manifests != std::string::npos) {
      std::string media_type;
      for (const auto& h : headers) {
        if (h.rfind("Content-Type: ", 0) == 0) media_type = h.substr(14);
      }
      const std::string digest = sha256_digest(body);
      manifests_[target.substr(manifests + 11)] = {media_type, body};
      manifests_[digest] = {media_type, body};
      const auto json = nlohmann::json::parse(body, nullptr, false);
      if (referrers_api_ && json.is_object() && json.contains("subject") && json["subject"].is_object()) {
        const std::string subject = json["subject"].value("digest", "");
        nlohmann::json entry = {{"mediaType", media_type}, {"digest", digest}, {"size", body.size()}};
        if (json.contains("artifactType")) entry["artifactType"] = json["artifactType"];
        if (json.contains("annotations")) entry["annotations"] = json["annotations"];
        referrers_[subject].push_back(entry);
        info.headers["oci-subject"] = subject;
      }
      info.status = 201;
      return info;
    }
    return make_error(ErrorKind::kInput, "{}: registry fake answered HTTP 405", what);
  }

  Result<ResponseInfo> serve(const std::string& path, std::vector<std::string> headers, BodySink& sink,
                             const std::string& what, bool head) {
    for (auto& h : sink.extra_headers()) headers.push_back(std::move(h));
    long first = -1;
    long last = -1;
    for (const auto& h : headers) {
      if (h.rfind("Range: bytes=", 0) == 0) std::sscanf(h.c_str() + 13, "%ld-%ld", &first, &last);
    }
    std::string body;
    ResponseInfo info;
    size_t drop = std::string::npos;
    {
      std::lock_guard lock(mu_);
      requests_.push_back({path, first});
      const auto slash = path.rfind('/');
      const std::string name = path.substr(slash + 1);
      if (path.find("/referrers/") != std::string::npos && referrers_api_) {
        info.headers["content-type"] = "application/vnd.oci.image.index.v1+json";
        body = nlohmann::json{{"schemaVersion", 2},
                              {"mediaType", "application/vnd.oci.image.index.v1+json"},
                              {"manifests", referrers_.count(name) != 0 ? referrers_[name] : nlohmann::json::array()}}
                   .dump();
      } else if (path.find("/manifests/") != std::string::npos && manifests_.count(name) != 0) {
        info.headers["content-type"] = manifests_[name].first;
        body = manifests_[name].second;
      } else if (path.find("/blobs/") != std::string::npos && blobs_.count(name) != 0) {
        body = blobs_[name];
        if (const auto c = corrupt_.find(name); c != corrupt_.end() && c->second < body.size()) body[c->second] ^= 1;
        if (auto d = drops_.find(name); d != drops_.end() && d->second.second > 0) {
          drop = d->second.first;
          --d->second.second;
        }
      } else {
        return make_error(ErrorKind::kInput, "{}: registry fake answered HTTP 404", what);
      }
    }
    info.status = 200;
    if (first >= 0 && ranges_) {
      if (static_cast<size_t>(first) > body.size()) {
        return make_error(ErrorKind::kPeer, "{}: registry fake answered HTTP 416", what);
      }
      const size_t end = last >= 0 ? std::min(body.size(), static_cast<size_t>(last) + 1) : body.size();
      body = body.substr(static_cast<size_t>(first), end - static_cast<size_t>(first));
      info.status = 206;
    }
    if (head) return info;
    CFMO_TRY(sink.begin(info.status));
    const size_t send = std::min(body.size(), drop);
    for (size_t at = 0; at < send; at += 64u << 10) {
      CFMO_TRY(sink.write(std::string_view(body).substr(at, std::min<size_t>(64u << 10, send - at))));
    }
    if (send < body.size()) return make_error(ErrorKind::kPeer, "{}: registry fake: connection dropped", what);
    return info;
  }

  mutable std::mutex mu_;
  std::map<std::string, std::pair<std::string, std::string>> manifests_;
  std::map<std::string, std::string> blobs_;
  std::map<std::string, std::pair<size_t, int>> drops_;
  std::map<std::string, size_t> corrupt_;
  bool ranges_ = true;
  bool referrers_api_ = false;
  std::map<std::string, nlohmann::json> referrers_;  ///< subject digest -> its referrers' descriptors
  int uploads_ = 0;
  std::vector<Request> requests_;
};

}  // namespace cfmo::oci::testing
