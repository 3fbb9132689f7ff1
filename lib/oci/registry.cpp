#include "oci/registry.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

namespace cfmo::oci {

const char* const kManifestAccept =
    "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, "
    "application/vnd.docker.distribution.manifest.list.v2+json, "
    "application/vnd.docker.distribution.manifest.v2+json";

namespace {

constexpr size_t kErrorBodyLimit = 4096;

std::string lowercase(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return std::string(s);
}

/// Parses `Bearer realm="…",service="…",scope="…"` into its parameters.
std::map<std::string, std::string> challenge_params(std::string_view text) {
  std::map<std::string, std::string> params;
  const auto space = text.find(' ');
  if (space == std::string_view::npos) return params;
  params["scheme"] = lowercase(std::string(text.substr(0, space)));
  size_t i = space + 1;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ' ' || text[i] == ',')) ++i;
    const auto eq = text.find('=', i);
    if (eq == std::string_view::npos) break;
    std::string key = lowercase(trim(text.substr(i, eq - i)));
    i = eq + 1;
    std::string value;
    if (i < text.size() && text[i] == '"') {
      ++i;
      while (i < text.size() && text[i] != '"') {
        if (text[i] == '\\' && i + 1 < text.size()) ++i;
        value += text[i++];
      }
      ++i;
    } else {
      while (i < text.size() && text[i] != ',') value += text[i++];
      value = trim(value);
    }
    params[key] = value;
  }
  return params;
}

std::string base64(std::string_view data) {
  std::string out(4 * ((data.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(data.data()), static_cast<int>(data.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::optional<std::string> unbase64(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out(text.size() / 4 * 3 + 1, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  size_t size = static_cast<size_t>(n);
  // EVP_DecodeBlock counts the '=' padding as zero bytes.
  for (size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) --size;
  out.resize(size);
  return out;
}

std::string url_escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

bool retryable_status(long status) { return status == 408 || status == 429 || (status >= 500 && status <= 599); }

}  // namespace

struct RegistryClient::Attempt {
  CURLcode code = CURLE_OK;
  std::string curl_error;
  ResponseInfo info;
  std::string error_body;  ///< the first bytes of a non-2xx body
  std::optional<Error> sink_error;
};

Status StringSink::write(std::string_view chunk) {
  if (body.size() + chunk.size() > limit_) {
    return make_error(ErrorKind::kInput, "{}: larger than {} bytes", what_, limit_);
  }
  body.append(chunk);
  return {};
}

Error interrupted(const std::string& what) { return make_error(ErrorKind::kPeer, "{}: interrupted", what); }

std::string ResponseInfo::header(const std::string& lowercase_name) const {
  const auto it = headers.find(lowercase_name);
  return it == headers.end() ? std::string() : it->second;
}

std::string sha256_digest(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), md, &length, EVP_sha256(), nullptr);
  std::string out = "sha256:";
  for (unsigned int i = 0; i < length; ++i) out += fmt::format("{:02x}", md[i]);
  return out;
}

Result<std::optional<Credentials>> load_credentials(const std::string& host, const std::string& auth_file) {
  namespace fs = std::filesystem;
  fs::path path = auth_file;
  if (path.empty()) {
    if (const char* dir = std::getenv("DOCKER_CONFIG"); dir != nullptr && *dir != '\0') {
      path = fs::path(dir) / "config.json";
    } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
      path = fs::path(home) / ".docker" / "config.json";
    } else {
      return std::optional<Credentials>();
    }
  }
  std::ifstream in(path);
  if (!in) {
    if (!auth_file.empty()) return make_error(ErrorKind::kUsage, "auth file '{}': cannot be read", path.string());
    return std::optional<Credentials>();
  }
  nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
  if (config.is_discarded() || !config.is_object()) {
    return make_error(ErrorKind::kInput, "auth file '{}': not valid JSON", path.string());
  }
  if (!config.contains("auths") || !config["auths"].is_object()) return std::optional<Credentials>();
  const auto& auths = config["auths"];
  std::vector<std::string> keys = {host, "https://" + host, "http://" + host, "https://" + host + "/v1/"};
  if (host == "registry-1.docker.io" || host == "docker.io") {
    keys.insert(keys.begin(), {"https://index.docker.io/v1/", "docker.io", "index.docker.io"});
  }
  for (const auto& key : keys) {
    if (!auths.contains(key) || !auths[key].is_object()) continue;
    const auto& entry = auths[key];
    if (!entry.contains("auth") || !entry["auth"].is_string()) continue;
    const auto decoded = unbase64(entry["auth"].get<std::string>());
    const auto colon = decoded ? decoded->find(':') : std::string::npos;
    // The message names the file and host, never the credentials.
    if (colon == std::string::npos) {
      return make_error(ErrorKind::kInput, "auth file '{}': entry for '{}' is not base64 'user:password'",
                        path.string(), key);
    }
    return std::optional<Credentials>(Credentials{decoded->substr(0, colon), decoded->substr(colon + 1)});
  }
  return std::optional<Credentials>();
}

RegistryClient::RegistryClient(Reference ref, RegistryOptions options, std::optional<Credentials> credentials)
    : ref_(std::move(ref)), options_(std::move(options)), credentials_(std::move(credentials)) {
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT);
  (void)global;
  curl_ = make_curl_easy();
}

RegistryClient::~RegistryClient() = default;

std::string RegistryClient::base_url() const {
  return (options_.plain_http ? "http://" : "https://") + ref_.api_host();
}

namespace {

struct TransferState {
  RegistryClient::Attempt* attempt;
  BodySink* sink;
  CURL* curl;
  bool began = false;
};

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* state = static_cast<TransferState*>(user);
  const std::string_view line(data, size * count);
  if (line.starts_with("HTTP/")) {
    state->attempt->info.headers.clear();  // a new response (after a redirect or 100)
  } else if (const auto colon = line.find(':'); colon != std::string_view::npos) {
    state->attempt->info.headers[lowercase(std::string(line.substr(0, colon)))] = trim(line.substr(colon + 1));
  }
  return size * count;
}

}  // namespace

RegistryClient::Attempt RegistryClient::perform(const std::string& url, const std::vector<std::string>& headers,
                                                BodySink& sink, bool head, bool with_auth, const Upload* upload) {
  Attempt attempt;
  CURL* curl = curl_.get();
  curl_easy_reset(curl);
  CurlHeaders list;
  for (const auto& h : headers) list.append(h);
  for (const auto& h : sink.extra_headers()) list.append(h);
  if (upload != nullptr) list.append("Expect:");  // no 100-continue round trip: the body is small and in memory
  if (with_auth && !authorization_.empty()) list.append(authorization_);
  TransferState state{&attempt, &sink, curl};
  char error_buffer[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list.get());
  curl_easy_setopt(curl, CURLOPT_NOBODY, head ? 1L : 0L);
  if (upload != nullptr) {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, upload->method.c_str());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, upload->body.empty() ? "" : upload->body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(upload->body.size()));
  }
  // Blob GETs are redirected to object stores; curl drops a custom
  // Authorization header when the host or port changes, and
  // UNRESTRICTED_AUTH=0 keeps it that way.
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(curl, CURLOPT_UNRESTRICTED_AUTH, 0L);
  curl_easy_setopt(curl, CURLOPT_MAXREDIRS, 10L);
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_REDIR_PROTOCOLS_STR, options_.plain_http ? "http,https" : "https");
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, options_.connect_timeout_s);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, options_.stall_timeout_s);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  // Larger reads than curl's 16 KiB: a tenth of the syscalls and sink calls
  // on a fast link, for 256 KiB per transfer.
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 256L << 10);
  double limit_s = options_.request_timeout_s;
  if (options_.deadline) {
    const double left = std::chrono::duration<double>(*options_.deadline - std::chrono::steady_clock::now()).count();
    limit_s = limit_s > 0 ? std::min(limit_s, left) : left;
  }
  if (limit_s > 0 || options_.deadline) {
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, std::max(1L, static_cast<long>(limit_s * 1000)));
  }
  if (options_.stop != nullptr) {
    // curl calls this at least once a second, also while a transfer stalls.
    curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(curl, CURLOPT_XFERINFODATA, options_.stop);
    curl_easy_setopt(
        curl, CURLOPT_XFERINFOFUNCTION, +[](void* stop, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
          return static_cast<const std::atomic<bool>*>(stop)->load(std::memory_order_relaxed) ? 1 : 0;
        });
  }
  curl_easy_setopt(curl, CURLOPT_USERAGENT, "cfmo-pull/0.1");
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &state);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &state);
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t count, void* user) -> size_t {
        auto* s = static_cast<TransferState*>(user);
        long status = 0;
        curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &status);
        const std::string_view chunk(data, size * count);
        if (status < 200 || status > 299) {
          auto& body = s->attempt->error_body;
          body.append(chunk.substr(0, kErrorBodyLimit - std::min(kErrorBodyLimit, body.size())));
          return size * count;
        }
        if (!s->began) {
          s->began = true;
          if (auto st = s->sink->begin(status); !st) {
            s->attempt->sink_error = std::move(st).error();
            return 0;
          }
        }
        if (auto st = s->sink->write(chunk); !st) {
          s->attempt->sink_error = std::move(st).error();
          return 0;
        }
        return size * count;
      });
  attempt.code = curl_easy_perform(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &attempt.info.status);
  if (attempt.code != CURLE_OK) {
    attempt.curl_error = error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(attempt.code);
  } else if (!state.began && attempt.info.status >= 200 && attempt.info.status <= 299) {
    if (auto st = sink.begin(attempt.info.status); !st) attempt.sink_error = std::move(st).error();
  }
  return attempt;
}

Status RegistryClient::authenticate(const std::string& challenge, const std::string& what) {
  auto params = challenge_params(challenge);
  const std::string scheme = params["scheme"];
  if (scheme == "basic") {
    if (!credentials_) {
      return make_error(ErrorKind::kPeer, "{}: registry {} asks for a login and no credentials are configured for it",
                        what, ref_.api_host());
    }
    authorization_ = "Authorization: Basic " + base64(credentials_->username + ":" + credentials_->password);
    return {};
  }
  if (scheme != "bearer" || params["realm"].empty()) {
    return make_error(ErrorKind::kPeer, "{}: registry {} asks for an unsupported authentication '{}'", what,
                      ref_.api_host(), challenge.substr(0, 64));
  }
  const std::string scope = params.count("scope") ? params["scope"] : "repository:" + ref_.repository + ":pull";
  if (const auto it = tokens_.find(scope); it != tokens_.end() && authorization_ != it->second) {
    authorization_ = it->second;  // a cached token the last request did not carry
    return {};
  }
  std::string url = params["realm"];
  url += url.find('?') == std::string::npos ? "?" : "&";
  if (!params["service"].empty()) url += "service=" + url_escape(params["service"]) + "&";
  url += "scope=" + url_escape(scope);
  std::vector<std::string> headers;
  if (credentials_) {
    headers.push_back("Authorization: Basic " + base64(credentials_->username + ":" + credentials_->password));
  }
  StringSink sink("token from " + params["realm"], 1u << 20);
  Attempt attempt = perform(url, headers, sink, false, false);
  if (attempt.code != CURLE_OK || attempt.info.status != 200) {
    const std::string reason =
        attempt.code != CURLE_OK ? attempt.curl_error : fmt::format("HTTP {}", attempt.info.status);
    const bool denied = attempt.info.status == 401 || attempt.info.status == 403;
    return make_error(ErrorKind::kPeer, "{}: token service {} refused a token for '{}': {}{}", what, params["realm"],
                      scope, reason, denied && !credentials_ ? " (no credentials configured)" : "");
  }
  const auto json = nlohmann::json::parse(sink.body, nullptr, false);
  std::string token;
  if (json.is_object()) {
    if (json.contains("token") && json["token"].is_string()) token = json["token"];
    if (token.empty() && json.contains("access_token") && json["access_token"].is_string())
      token = json["access_token"];
  }
  if (token.empty()) {
    return make_error(ErrorKind::kPeer, "{}: token service {} answered without a token", what, params["realm"]);
  }
  authorization_ = "Authorization: Bearer " + token;
  tokens_[scope] = authorization_;
  // The spec's default lifetime is 60 s; renewing at 90% of it avoids a 401 per expiry.
  double lifetime_s = 60;
  if (json.contains("expires_in") && json["expires_in"].is_number() && json["expires_in"].get<double>() > 0) {
    lifetime_s = json["expires_in"].get<double>();
  }
  token_expiry_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(0.9 * lifetime_s));
  bearer_challenge_ = challenge;
  return {};
}

Result<ResponseInfo> RegistryClient::get(const std::string& api_path, const std::vector<std::string>& headers,
                                         BodySink& sink, const std::string& what, bool head) {
  return request(base_url() + api_path, headers, sink, what, head, nullptr);
}

Result<ResponseInfo> RegistryClient::send(const std::string& method, const std::string& target,
                                          const std::vector<std::string>& headers, std::string_view body,
                                          BodySink& sink, const std::string& what) {
  const Upload upload{method, body};
  const bool absolute = target.starts_with("http://") || target.starts_with("https://");
  return request(absolute ? target : base_url() + target, headers, sink, what, false, &upload);
}

Result<ResponseInfo> RegistryClient::request(const std::string& url, const std::vector<std::string>& headers,
                                             BodySink& sink, const std::string& what, bool head, const Upload* upload) {
  std::mt19937_64 rng(std::random_device{}());
  bool authenticated_after_401 = false;
  std::string last_reason;
  for (int attempt_index = 0;; ++attempt_index) {
    if (options_.stopped()) return interrupted(what);
    if (!bearer_challenge_.empty() && std::chrono::steady_clock::now() >= token_expiry_) {
      tokens_.clear();
      authorization_.clear();
      CFMO_TRY(authenticate(bearer_challenge_, what));
    }
    Attempt attempt = perform(url, headers, sink, head, true, upload);
    if (attempt.sink_error) return *attempt.sink_error;
    if (options_.stopped()) return interrupted(what);
    double retry_after = -1;
    if (attempt.code == CURLE_URL_MALFORMAT || attempt.code == CURLE_UNSUPPORTED_PROTOCOL) {
      // No retry can mend a URL that cannot be spoken to.
      return make_error(ErrorKind::kUsage, "{}: registry {}: {}", what, ref_.api_host(), attempt.curl_error);
    }
    if (attempt.code != CURLE_OK) {
      last_reason = attempt.curl_error;
    } else if (attempt.info.status == 401 && !authenticated_after_401) {
      authenticated_after_401 = true;
      // A cached token that expired is dropped so a fresh one is fetched.
      for (auto it = tokens_.begin(); it != tokens_.end();) {
        it = it->second == authorization_ ? tokens_.erase(it) : std::next(it);
      }
      CFMO_TRY(authenticate(attempt.info.header("www-authenticate"), what));
      --attempt_index;  // the challenge is part of the protocol, not a failure
      continue;
    } else if (retryable_status(attempt.info.status)) {
      last_reason = fmt::format("HTTP {}", attempt.info.status);
      if (const auto value = attempt.info.header("retry-after"); !value.empty()) {
        char* end = nullptr;
        const double seconds = std::strtod(value.c_str(), &end);
        if (end != value.c_str() && seconds >= 0) retry_after = seconds;
      }
    } else if (attempt.info.status >= 200 && attempt.info.status <= 299) {
      return attempt.info;
    } else {
      std::string detail;
      const auto json = nlohmann::json::parse(attempt.error_body, nullptr, false);
      if (json.is_object() && json.contains("errors") && json["errors"].is_array() && !json["errors"].empty() &&
          json["errors"][0].is_object() && json["errors"][0].contains("message") &&
          json["errors"][0]["message"].is_string()) {
        detail = ": " + json["errors"][0]["message"].get<std::string>();
      }
      const ErrorKind kind = attempt.info.status == 404 ? ErrorKind::kInput : ErrorKind::kPeer;
      return make_error(kind, "{}: registry {} answered HTTP {}{}", what, ref_.api_host(), attempt.info.status, detail);
    }
    if (options_.deadline && std::chrono::steady_clock::now() >= *options_.deadline) {
      return make_error(ErrorKind::kPeer, "{}: registry {}: the pull's timeout of {} s ran out ({})", what,
                        ref_.api_host(), options_.timeout_s, last_reason);
    }
    if (attempt_index >= options_.retries) {
      return make_error(ErrorKind::kPeer, "{}: registry {}: {} (after {} attempt{})", what, ref_.api_host(),
                        last_reason, attempt_index + 1, attempt_index == 0 ? "" : "s");
    }
    double delay = options_.retry_base_s * std::pow(2.0, attempt_index);
    delay *= std::uniform_real_distribution<double>(0.5, 1.0)(rng);  // jitter: parallel pulls do not retry in step
    if (retry_after >= 0) delay = std::max(delay, retry_after);
    delay = std::min(delay, options_.retry_max_delay_s);
    if (options_.deadline) {
      // Sleeping past the deadline would only delay the same error.
      const double left = std::chrono::duration<double>(*options_.deadline - std::chrono::steady_clock::now()).count();
      delay = std::max(0.0, std::min(delay, left));
    }
    // In slices, so that a stop does not wait out a long backoff.
    const auto wake =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(delay));
    while (!options_.stopped() && std::chrono::steady_clock::now() < wake) {
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(wake - std::chrono::steady_clock::now(),
                                                                                std::chrono::milliseconds(50)));
    }
  }
}

Result<std::pair<ResponseInfo, std::string>> RegistryApi::get_manifest(const std::string& reference) {
  const std::string& repository = this->reference().repository;
  StringSink sink("manifest " + repository + ":" + reference);
  CFMO_ASSIGN_OR_RETURN(
      auto info, get("/v2/" + repository + "/manifests/" + reference, {std::string("Accept: ") + kManifestAccept}, sink,
                     "manifest " + repository + (reference.starts_with("sha256:") ? "@" : ":") + reference));
  return std::make_pair(std::move(info), std::move(sink.body));
}

}  // namespace cfmo::oci
