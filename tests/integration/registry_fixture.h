#pragma once
// What the cfmo-pull integration tests share: a real docker-registry on a
// free port with its own storage, fixture images pushed through its upload
// API, the suite fixture that serves them, a tiny HTTP server for what a
// well-behaved registry never does, and small helpers (running cfmo-pull,
// reading files, a gzip tar layer).
#include "core/atomic_file.h"
#include "integration/harness.h"
#include "oci/curl_handles.h"
#include "oci/registry.h"
#include "support/layer_builder.h"

#include <archive.h>
#include <archive_entry.h>
#include <curl/curl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cfmo::pulltest {

using testing::run;
using testing::RunResult;
using testing::TempDir;
namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

inline constexpr const char* kRegistryBinary = "/usr/bin/docker-registry";

inline std::string binary() { return testing::env_or("CFMO_PULL", "build/tools/cfmo-pull"); }
inline fs::path source_root() { return testing::env_or("CFMO_SOURCE_ROOT", "."); }

/// Runs cfmo-pull; `while_running` is called every 50 ms with its pid (for signals).
inline RunResult pull(std::vector<std::string> args, double timeout_s = 120,
                      const std::function<void(pid_t, double)>& while_running = nullptr) {
  args.insert(args.begin(), binary());
  return run(args, timeout_s, {}, while_running);
}

inline std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::set<std::string> matches(const std::string& text, const std::regex& pattern) {
  std::set<std::string> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it) {
    out.insert((*it)[1].str());
  }
  return out;
}

struct HttpResponse {
  long status = 0;
  std::string body;
  std::string location;
};

/// A plain libcurl request, for pushing fixtures (the code under test is not used to set up its own test).
inline HttpResponse http(const std::string& method, const std::string& url, const std::string& body = "",
                         const std::string& content_type = "", const std::string& accept = "") {
  HttpResponse response;
  const oci::CurlEasy handle = oci::make_curl_easy();
  CURL* curl = handle.get();
  oci::CurlHeaders headers;
  if (!content_type.empty()) headers.append("Content-Type: " + content_type);
  if (!accept.empty()) headers.append("Accept: " + accept);
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers.get());
  if (method == "PUT" || method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response.body);
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char* d, size_t s, size_t n, void* u) -> size_t {
        static_cast<std::string*>(u)->append(d, s * n);
        return s * n;
      });
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response.location);
  curl_easy_setopt(
      curl, CURLOPT_HEADERFUNCTION, +[](char* d, size_t s, size_t n, void* u) -> size_t {
        std::string line(d, s * n);
        if (line.size() > 9 && (line.rfind("Location:", 0) == 0 || line.rfind("location:", 0) == 0)) {
          line = line.substr(9);
          while (!line.empty() && (line.front() == ' ')) line.erase(0, 1);
          while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.pop_back();
          *static_cast<std::string*>(u) = line;
        }
        return s * n;
      });
  curl_easy_setopt(curl, CURLOPT_TIMEOUT, 30L);
  if (curl_easy_perform(curl) == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

/// What the pull tests must leave in /dev/shm: the memory stores that were
/// there before them (the tests' own directories there are removed by
/// their owners; another binary may be making one now).
class ShmUnchanged : public ::testing::Environment {
 public:
  void SetUp() override { before_ = listing(); }
  void TearDown() override {
    for (const auto& name : listing()) {
      if (before_.count(name) == 0) ADD_FAILURE() << "left behind in /dev/shm: " << name;
    }
  }

 private:
  static std::set<std::string> listing() {
    std::set<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("cfmo-pull-", 0) == 0) out.insert(name);
    }
    return out;
  }
  std::set<std::string> before_;
};
inline ::testing::Environment* const shm_unchanged = ::testing::AddGlobalTestEnvironment(new ShmUnchanged);

/// Deterministic bytes: a layer for a pull-only test need not be a real tar.
inline std::string fixture_bytes(size_t size, unsigned seed) {
  std::string out(size, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : out) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<char>(x);
  }
  return out;
}

inline Json descriptor(const std::string& media_type, const std::string& body) {
  return {{"mediaType", media_type}, {"digest", oci::sha256_digest(body)}, {"size", body.size()}};
}

/// A docker-registry serving from a temporary directory on a free port.
class Registry {
 public:
  bool start() {
    port_ = testing::free_port();
    const std::string config =
        "version: 0.1\n"
        "log:\n  level: error\n"
        "storage:\n  filesystem:\n    rootdirectory: " +
        (dir_ / "storage").string() +
        "\n"
        "http:\n  addr: 127.0.0.1:" +
        std::to_string(port_) + "\n";
    if (!write_file_atomic(dir_ / "config.yml", config)) return false;
    // setpriv execs the registry in its own process with a parent-death signal,
    // so a test binary that crashes cannot leave a registry running.
    process_ = testing::spawn(
        {"/usr/bin/setpriv", "--pdeathsig", "KILL", kRegistryBinary, "serve", (dir_ / "config.yml").string()}, {},
        (dir_ / "stdout").string(), (dir_ / "stderr").string());
    for (int i = 0; i < 200; ++i) {
      if (http("GET", url() + "/v2/").status == 200) return true;
      if (process_.wait(0.05)) return false;
    }
    return false;
  }
  ~Registry() { process_.reap(); }

  std::string host() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string url() const { return "http://" + host(); }
  std::string log() const { return slurp(dir_ / "stderr"); }

  /// POST an upload, PUT its bytes with the digest; true on 201.
  bool push_blob(const std::string& repository, const std::string& body) {
    const auto started = http("POST", url() + "/v2/" + repository + "/blobs/uploads/");
    if (started.status != 202 || started.location.empty()) return false;
    std::string location = started.location.rfind("http", 0) == 0 ? started.location : url() + started.location;
    location +=
        (location.find('?') == std::string::npos ? "?" : "&") + std::string("digest=") + oci::sha256_digest(body);
    return http("PUT", location, body, "application/octet-stream").status == 201;
  }

  bool push_manifest(const std::string& repository, const std::string& reference, const std::string& body,
                     const std::string& media_type) {
    return http("PUT", url() + "/v2/" + repository + "/manifests/" + reference, body, media_type).status == 201;
  }

 private:
  TempDir dir_;
  int port_ = 0;
  testing::Background process_;
};

struct FixtureImage {
  std::string config;
  std::vector<std::string> layers;
  std::string manifest;
  std::string manifest_digest;
};

inline FixtureImage make_image(unsigned seed, const std::string& architecture, std::vector<size_t> layer_sizes) {
  FixtureImage image;
  image.config = Json{{"architecture", architecture},
                      {"os", "linux"},
                      {"config", {{"Env", {"SEED=" + std::to_string(seed)}}}},
                      {"rootfs", {{"type", "layers"}, {"diff_ids", Json::array()}}}}
                     .dump();
  Json layers = Json::array();
  for (size_t i = 0; i < layer_sizes.size(); ++i) {
    image.layers.push_back(fixture_bytes(layer_sizes[i], seed * 100 + static_cast<unsigned>(i)));
    layers.push_back(descriptor("application/vnd.oci.image.layer.v1.tar+gzip", image.layers.back()));
  }
  image.manifest = Json{
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"config", descriptor("application/vnd.oci.image.config.v1+json", image.config)},
      {"layers",
       layers}}.dump();
  image.manifest_digest = oci::sha256_digest(image.manifest);
  return image;
}

/// A layer of a real image: an uncompressed tar and how to compress it
/// ("tar", "tar+gzip", "tar+zstd": the OCI media type's suffix).
struct RealLayer {
  std::string tar;
  std::string kind = "tar+gzip";
  size_t zstd_frame = 0;  ///< "tar+zstd": frames of this many tar bytes each; 0: one frame
  int gzip_level = 6;     ///< "tar+gzip": zlib's level (1 for a large fixture made quickly)
};

/// An OCI image of real tar layers, with the config's diff_ids right (umoci checks them).
inline FixtureImage make_real_image(const std::vector<RealLayer>& layers, const std::string& architecture = "amd64") {
  FixtureImage image;
  Json diff_ids = Json::array();
  Json descriptors = Json::array();
  for (const auto& layer : layers) {
    diff_ids.push_back(oci::sha256_digest(layer.tar));
    std::string blob = layer.tar;
    if (layer.kind == "tar+gzip") blob = testing::gzip(layer.tar, layer.gzip_level);
    if (layer.kind == "tar+zstd")
      blob = layer.zstd_frame > 0 ? testing::zstd_frames(layer.tar, layer.zstd_frame) : testing::zstd(layer.tar);
    image.layers.push_back(blob);
    descriptors.push_back(descriptor("application/vnd.oci.image.layer.v1." + layer.kind, blob));
  }
  image.config = Json{{"architecture", architecture},
                      {"os", "linux"},
                      {"config", {{"Env", {"PATH=/usr/bin:/bin"}}}},
                      {"rootfs", {{"type", "layers"}, {"diff_ids", diff_ids}}}}
                     .dump();
  image.manifest = Json{
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"config", descriptor("application/vnd.oci.image.config.v1+json", image.config)},
      {"layers",
       descriptors}}.dump();
  image.manifest_digest = oci::sha256_digest(image.manifest);
  return image;
}

inline bool push_image(Registry& registry, const std::string& repository, const std::string& tag,
                       const FixtureImage& image) {
  if (!registry.push_blob(repository, image.config)) return false;
  for (const auto& layer : image.layers) {
    if (!registry.push_blob(repository, layer)) return false;
  }
  return registry.push_manifest(repository, tag, image.manifest, "application/vnd.oci.image.manifest.v1+json");
}

/// A suite's registry, started, with `image` pushed as REPOSITORY:v1; the error, or empty.
inline std::string start_suite_registry(Registry*& registry, const std::string& repository, const FixtureImage& image) {
  registry = new Registry();
  if (!registry->start()) return "docker-registry did not start: " + registry->log();
  if (!push_image(*registry, repository, "v1", image)) return "pushing the fixture failed: " + registry->log();
  return "";
}

/// One registry for the whole suite, with "fixtures/small:v1" (three layers,
/// one of 3 MiB) and "fixtures/multi:latest", an index of amd64 and arm64.
class PullFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kRegistryBinary)) return;
    registry_ = new Registry();
    if (!registry_->start()) {
      setup_error_ = "docker-registry did not start: " + registry_->log();
      return;
    }
    small_ = new FixtureImage(make_image(1, "amd64", {1000, 3u << 20, 0}));
    amd64_ = new FixtureImage(make_image(2, "amd64", {2000}));
    arm64_ = new FixtureImage(make_image(3, "arm64", {3000}));
    if (!push_image(*registry_, "fixtures/small", "v1", *small_) ||
        !push_image(*registry_, "fixtures/multi", "amd64", *amd64_) ||
        !push_image(*registry_, "fixtures/multi", "arm64", *arm64_)) {
      setup_error_ = "pushing the fixtures failed: " + registry_->log();
      return;
    }
    Json index = {
        {"schemaVersion", 2}, {"mediaType", "application/vnd.oci.image.index.v1+json"}, {"manifests", Json::array()}};
    for (const auto* image : {amd64_, arm64_}) {
      auto d = descriptor("application/vnd.oci.image.manifest.v1+json", image->manifest);
      d["platform"] = {{"os", "linux"}, {"architecture", image == amd64_ ? "amd64" : "arm64"}};
      index["manifests"].push_back(d);
    }
    if (!registry_->push_manifest("fixtures/multi", "latest", index.dump(),
                                  "application/vnd.oci.image.index.v1+json")) {
      setup_error_ = "pushing the index failed: " + registry_->log();
    }
  }
  static void TearDownTestSuite() {
    delete registry_;
    registry_ = nullptr;
  }
  void SetUp() override {
    if (!fs::exists(kRegistryBinary)) GTEST_SKIP() << kRegistryBinary << " not installed (Debian docker-registry)";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }

  static inline Registry* registry_ = nullptr;
  static inline FixtureImage* small_ = nullptr;
  static inline FixtureImage* amd64_ = nullptr;
  static inline FixtureImage* arm64_ = nullptr;
  static inline std::string setup_error_;
};

inline void expect_blob(const fs::path& layout, const std::string& body) {
  const auto path = layout / "blobs" / "sha256" / oci::sha256_digest(body).substr(7);
  EXPECT_TRUE(fs::exists(path)) << path;
  EXPECT_TRUE(slurp(path) == body) << path << ": other bytes than pushed";
}

/// A one-thread HTTP/1.1 server answering from a table of path → handler,
/// for responses a real registry never gives.
class TinyServer {
 public:
  using Handler = std::function<std::string(const std::string& request)>;
  explicit TinyServer(std::map<std::string, Handler> routes) : routes_(std::move(routes)) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t length = sizeof addr;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length);
    port_ = ntohs(addr.sin_port);
    listen(fd_, 16);
    thread_ = std::thread([this] { serve(); });
  }
  ~TinyServer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
  }
  std::string host() const { return "127.0.0.1:" + std::to_string(port_); }

  /// The response announcing the whole body but ending after `sent` bytes of it (a dropped connection).
  static std::string truncated(const std::string& body, size_t sent) {
    const std::string full = response(200, body);
    return full.substr(0, full.size() - body.size() + sent);
  }

  static std::string response(int status, const std::string& body, const std::string& extra_headers = "") {
    return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n" + extra_headers + "\r\n" + body;
  }

 private:
  void serve() {
    while (!stop_) {
      const int client = accept(fd_, nullptr, nullptr);
      if (client < 0) return;
      std::string request;
      char buffer[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = read(client, buffer, sizeof buffer);
        if (n <= 0) break;
        request.append(buffer, static_cast<size_t>(n));
      }
      const auto first_space = request.find(' ');
      const auto second_space = request.find(' ', first_space + 1);
      const std::string path = request.substr(first_space + 1, second_space - first_space - 1);
      const auto it = routes_.find(path);
      const std::string reply = it == routes_.end() ? response(404, "{}") : it->second(request);
      size_t sent = 0;
      while (sent < reply.size()) {
        const ssize_t n = ::send(client, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<size_t>(n);
      }
      close(client);
    }
  }

  std::map<std::string, Handler> routes_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Serves `image` under /v2/<repository>/ with a per-blob handler override.
inline std::map<std::string, TinyServer::Handler> image_routes(const std::string& repository, const FixtureImage& image,
                                                               const std::string& manifest_type) {
  std::map<std::string, TinyServer::Handler> routes;
  routes["/v2/" + repository + "/manifests/latest"] = [&image, manifest_type](const std::string&) {
    return TinyServer::response(200, image.manifest, "Content-Type: " + manifest_type + "\r\n");
  };
  routes["/v2/" + repository + "/blobs/" + oci::sha256_digest(image.config)] = [&image](const std::string&) {
    return TinyServer::response(200, image.config);
  };
  return routes;
}

/// The N of a "Range: bytes=N-" header, or -1.
inline long range_start(const std::string& request) {
  const auto at = request.find("Range: bytes=");
  return at == std::string::npos ? -1 : std::stol(request.substr(at + 13));
}

/// A gzip-compressed tar holding `files` (path → contents), written with
/// libarchive, and the digest of the uncompressed tar (the diff ID).
inline std::pair<std::string, std::string> tar_gz(const std::map<std::string, std::string>& files) {
  std::string out[2];
  for (int compressed = 0; compressed < 2; ++compressed) {
    std::vector<char> buffer(1 << 20);
    size_t used = 0;
    archive* a = archive_write_new();
    archive_write_set_format_pax_restricted(a);
    if (compressed == 1) archive_write_add_filter_gzip(a);
    archive_write_open_memory(a, buffer.data(), buffer.size(), &used);
    for (const auto& [path, contents] : files) {
      archive_entry* e = archive_entry_new();
      archive_entry_set_pathname(e, path.c_str());
      archive_entry_set_size(e, static_cast<la_int64_t>(contents.size()));
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_set_perm(e, 0644);
      archive_entry_set_mtime(e, 1700000000, 0);
      archive_write_header(a, e);
      archive_write_data(a, contents.data(), contents.size());
      archive_entry_free(e);
    }
    archive_write_close(a);
    archive_write_free(a);
    out[compressed].assign(buffer.data(), used);
  }
  return {out[1], oci::sha256_digest(out[0])};
}

}  // namespace cfmo::pulltest
