#include "oci/pull_state.h"

#include "core/atomic_file.h"

#include <nlohmann/json.hpp>

#include <ctime>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

Json strings(const std::vector<std::string>& v) {
  Json out = Json::array();
  for (const auto& s : v) out.push_back(s);
  return out;
}

/// Reads a key of the expected type, or returns an error naming it.
class Reader {
 public:
  Reader(const Json& j, std::string source) : j_(j), source_(std::move(source)) {}

  template <typename T>
  Status get(const Json& object, const char* key, T& out, const std::string& where = "") const {
    const std::string name = where.empty() ? key : where + "." + key;
    if (!object.is_object() || !object.contains(key)) return bad(name, "missing");
    const Json& value = object[key];
    if constexpr (std::is_same_v<T, bool>) {
      if (!value.is_boolean()) return bad(name, "not true or false");
    } else if constexpr (std::is_integral_v<T>) {
      if (!value.is_number_integer()) return bad(name, "not an integer");
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!value.is_number()) return bad(name, "not a number");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!value.is_string()) return bad(name, "not a string");
    } else {
      if (!value.is_array() || !std::all_of(value.begin(), value.end(), [](const Json& s) { return s.is_string(); }))
        return bad(name, "not an array of strings");
    }
    out = value.get<T>();
    return {};
  }

  Error bad(const std::string& key, const char* why) const {
    return make_error(ErrorKind::kInput, "state file '{}': '{}' {}", source_, key, why);
  }

 private:
  const Json& j_;
  std::string source_;
};

}  // namespace

const char* to_string(LayerStatus status) {
  switch (status) {
    case LayerStatus::kPending:
      return "pending";
    case LayerStatus::kFetching:
      return "fetching";
    case LayerStatus::kFetched:
      return "fetched";
    case LayerStatus::kSkipped:
      return "skipped";
    case LayerStatus::kFailed:
      return "failed";
  }
  return "?";
}

Result<LayerStatus> parse_layer_status(std::string_view text) {
  for (auto s : {LayerStatus::kPending, LayerStatus::kFetching, LayerStatus::kFetched, LayerStatus::kSkipped,
                 LayerStatus::kFailed}) {
    if (text == to_string(s)) return s;
  }
  return make_error(ErrorKind::kInput, "unknown layer state '{}'", text);
}

fs::path state_path(const fs::path& dir) { return dir / kStateFile; }

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

std::string state_to_json(const PullState& s) {
  Json j;
  j["format"] = "cfmo-pull-state";
  j["version"] = s.version;
  j["image"] = s.image;
  j["tag"] = s.tag;
  j["output"] = s.output;
  j["manifest"] = {{"digest", s.manifest_digest}, {"mediaType", s.manifest_media_type}};
  j["config"] = {{"digest", s.config.digest}, {"size", s.config.size}, {"mediaType", s.config.media_type}};
  j["cold"] = s.cold;
  j["hosts"] = {{"mirrors", strings(s.hosts.mirrors)},
                {"insecure", strings(s.hosts.insecure)},
                {"plain_http", s.hosts.plain_http}};
  j["authfile"] = s.auth_file;
  j["memory_store"] = {{"dir", s.memory_dir}, {"capacity", s.memory_capacity}, {"spill", s.spill}};
  j["ready"] = s.ready;
  j["ready_s"] = s.ready_s;
  j["ready_file"] = s.ready_file;
  j["complete"] = s.complete;
  j["fetcher_pid"] = s.fetcher_pid;
  j["interrupted"] = s.interrupted;
  j["updated"] = s.updated;
  j["layers"] = Json::array();
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const auto& l = s.layers[i];
    Json layer = {{"index", i},
                  {"digest", l.blob.digest},
                  {"size", l.blob.size},
                  {"mediaType", l.blob.media_type},
                  {"hot", l.hot},
                  {"location", l.location == Placement::kMemory ? "memory" : "disk"},
                  {"state", to_string(l.status)},
                  {"seconds", l.seconds}};
    if (!l.error.empty()) layer["error"] = l.error;
    j["layers"].push_back(std::move(layer));
  }
  return j.dump(2) + "\n";
}

Result<PullState> state_from_json(std::string_view text, const std::string& source) {
  const Json j = Json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "cfmo-pull-state") {
    return make_error(ErrorKind::kInput, "state file '{}': not a cfmo-pull state file", source);
  }
  const Reader r(j, source);
  PullState s;
  CFMO_TRY(r.get(j, "version", s.version));
  if (s.version != 1) {
    return make_error(ErrorKind::kInput, "state file '{}': version {} (this cfmo-pull reads version 1)", source,
                      s.version);
  }
  CFMO_TRY(r.get(j, "image", s.image));
  CFMO_TRY(r.get(j, "tag", s.tag));
  CFMO_TRY(r.get(j, "output", s.output));
  if (!j.contains("manifest") || !j["manifest"].is_object()) return r.bad("manifest", "missing");
  CFMO_TRY(r.get(j["manifest"], "digest", s.manifest_digest, "manifest"));
  CFMO_TRY(r.get(j["manifest"], "mediaType", s.manifest_media_type, "manifest"));
  if (!j.contains("config") || !j["config"].is_object()) return r.bad("config", "missing");
  CFMO_TRY(r.get(j["config"], "digest", s.config.digest, "config"));
  CFMO_TRY(r.get(j["config"], "size", s.config.size, "config"));
  CFMO_TRY(r.get(j["config"], "mediaType", s.config.media_type, "config"));
  CFMO_TRY(r.get(j, "cold", s.cold));
  if (!j.contains("hosts") || !j["hosts"].is_object()) return r.bad("hosts", "missing");
  CFMO_TRY(r.get(j["hosts"], "mirrors", s.hosts.mirrors, "hosts"));
  CFMO_TRY(r.get(j["hosts"], "insecure", s.hosts.insecure, "hosts"));
  CFMO_TRY(r.get(j["hosts"], "plain_http", s.hosts.plain_http, "hosts"));
  CFMO_TRY(r.get(j, "authfile", s.auth_file));
  if (!j.contains("memory_store") || !j["memory_store"].is_object()) return r.bad("memory_store", "missing");
  CFMO_TRY(r.get(j["memory_store"], "dir", s.memory_dir, "memory_store"));
  CFMO_TRY(r.get(j["memory_store"], "capacity", s.memory_capacity, "memory_store"));
  CFMO_TRY(r.get(j["memory_store"], "spill", s.spill, "memory_store"));
  CFMO_TRY(r.get(j, "ready", s.ready));
  CFMO_TRY(r.get(j, "ready_s", s.ready_s));
  CFMO_TRY(r.get(j, "ready_file", s.ready_file));
  CFMO_TRY(r.get(j, "complete", s.complete));
  CFMO_TRY(r.get(j, "fetcher_pid", s.fetcher_pid));
  if (j.contains("interrupted")) CFMO_TRY(r.get(j, "interrupted", s.interrupted));  // absent before it was added
  CFMO_TRY(r.get(j, "updated", s.updated));
  if (!is_sha256_digest(s.manifest_digest)) return r.bad("manifest.digest", "not a sha256 digest");
  if (!is_sha256_digest(s.config.digest)) return r.bad("config.digest", "not a sha256 digest");
  if (!j.contains("layers") || !j["layers"].is_array()) return r.bad("layers", "not an array");
  for (size_t i = 0; i < j["layers"].size(); ++i) {
    const Json& l = j["layers"][i];
    const std::string where = fmt::format("layers[{}]", i);
    LayerState layer;
    std::string location;
    std::string state;
    CFMO_TRY(r.get(l, "digest", layer.blob.digest, where));
    CFMO_TRY(r.get(l, "size", layer.blob.size, where));
    CFMO_TRY(r.get(l, "mediaType", layer.blob.media_type, where));
    CFMO_TRY(r.get(l, "hot", layer.hot, where));
    CFMO_TRY(r.get(l, "location", location, where));
    CFMO_TRY(r.get(l, "state", state, where));
    CFMO_TRY(r.get(l, "seconds", layer.seconds, where));
    if (!is_sha256_digest(layer.blob.digest)) return r.bad(where + ".digest", "not a sha256 digest");
    if (layer.blob.size < 0) return r.bad(where + ".size", "negative");
    if (location != "memory" && location != "disk") return r.bad(where + ".location", "not memory or disk");
    layer.location = location == "memory" ? Placement::kMemory : Placement::kDisk;
    auto status = parse_layer_status(state);
    if (!status) return r.bad(where + ".state", "not pending, fetching, fetched, skipped or failed");
    layer.status = *status;
    if (l.contains("error") && l["error"].is_string()) layer.error = l["error"];
    s.layers.push_back(std::move(layer));
  }
  return s;
}

Result<PullState> read_state(const fs::path& dir) {
  const fs::path path = state_path(dir);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return make_error(ErrorKind::kInput, "'{}': not a cfmo-pull directory (no {})", dir.string(), kStateFile);
  }
  CFMO_ASSIGN_OR_RETURN(const auto text, read_file(path));
  return state_from_json(text, path.string());
}

Status write_state(const fs::path& dir, PullState& state) {
  state.updated = utc_now();
  return write_file_atomic(state_path(dir), state_to_json(state));
}

Status StateRecorder::on_state(const PullState& state) {
  PullState written = state;  // write_state stamps the time on its copy
  return write_state(dir_, written);
}

Result<DirLock> lock_layout(const fs::path& dir, std::optional<std::chrono::steady_clock::time_point> deadline,
                            const std::function<void(int pid)>& on_wait, const std::atomic<bool>* stop) {
  auto lock = DirLock::acquire(dir, kLockFile, "cfmo-pull", deadline, on_wait, stop);
  if (!lock && stop != nullptr && stop->load())
    return interrupted(fmt::format("waiting for the lock on '{}'", dir.string()));
  return lock;
}

}  // namespace cfmo::oci
