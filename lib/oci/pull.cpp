#include "oci/pull.h"
#include "core/clock.h"

#include "core/atomic_file.h"
#include "core/parallel.h"
#include "oci/blob.h"
#include "oci/blob_jobs.h"
#include "oci/cleanup.h"
#include "oci/layout_store.h"
#include "oci/memory_budget.h"

#include <linux/magic.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

int64_t free_bytes(const fs::path& dir) {
  struct statvfs info {};
  if (::statvfs(dir.c_str(), &info) != 0) return -1;
  return static_cast<int64_t>(info.f_bavail) * static_cast<int64_t>(info.f_frsize);
}

/// The state, changed, to every sink (the state file is one: StateRecorder); the first error stops the pull.
Status publish(const std::vector<PullSink*>& sinks, const PullState& state) {
  for (auto* s : sinks) CFMO_TRY(s->on_state(state));
  return {};
}

std::string layer_what(size_t index, const std::string& digest) {
  return fmt::format("layer {} ({})", short_digest(digest), index);
}

LayerReport report_of(const LayerState& layer, const char* state, double seconds, int64_t bytes) {
  return {layer.blob.digest,
          layer.blob.size,
          layer.hot,
          layer.location == Placement::kMemory ? "memory" : "disk",
          state,
          seconds,
          bytes};
}

const char* fetched_state(const BlobResult& r) {
  return r.already_present ? "present" : (r.resumed ? "resumed" : "fetched");
}

Status write_ready_file(const PullState& state, double ready_s) {
  if (state.ready_file.empty()) return {};
  Json j;
  j["image"] = state.image;
  j["manifest_digest"] = state.manifest_digest;
  j["ready_s"] = ready_s;
  j["hot"] = Json::array();
  for (const auto& l : state.layers) {
    if (l.hot) j["hot"].push_back(l.blob.digest);
  }
  return write_file_atomic(state.ready_file, j.dump() + "\n");
}

/// The job for layer `i` of `state`: its blob into the memory store and a
/// link, or straight into DIR.
BlobJob layer_job(const fs::path& dir, const PullState& state, size_t i) {
  const auto& layer = state.layers[i];
  BlobJob job;
  job.layer = i;
  job.blob = layer.blob;
  job.what = layer_what(i, layer.blob.digest);
  const bool memory = layer.location == Placement::kMemory && !state.memory_dir.empty();
  job.store = memory ? fs::path(state.memory_dir) : dir;
  job.link = memory;
  return job;
}

/// Builds the job list's `done`: records each outcome in the state and the
/// report, and feeds both to the sinks (the state file's among them).
std::function<Status(const BlobJob&, const Result<JobOutcome>&)> recorder(PullState& state, PullReport& report,
                                                                          const std::vector<PullSink*>& sinks) {
  return [&state, &report, &sinks](const BlobJob& job, const Result<JobOutcome>& outcome) -> Status {
    if (job.layer == kConfigJob) {
      if (outcome) report.bytes_fetched += outcome->result.bytes_fetched;
      return {};
    }
    if (outcome) report.bytes_fetched += outcome->result.bytes_fetched;
    std::vector<size_t> indices = {job.layer};
    indices.insert(indices.end(), job.also.begin(), job.also.end());
    for (const size_t k : indices) {
      auto& layer = state.layers[k];
      if (!outcome) {
        layer.status = LayerStatus::kFailed;
        layer.error = outcome.error().message;
        report.layers[k] = report_of(layer, "failed", 0, 0);
      } else {
        layer.status = LayerStatus::kFetched;
        layer.error.clear();
        if (outcome->kept_on_disk) layer.location = Placement::kDisk;
        layer.seconds = outcome->seconds;
        // The bytes are the first layer's; the others of the same digest came with them.
        report.layers[k] = report_of(layer, k == job.layer ? fetched_state(outcome->result) : "present",
                                     outcome->seconds, k == job.layer ? outcome->result.bytes_fetched : 0);
      }
      for (auto* s : sinks) s->on_layer_done(k, report.layers[k]);
    }
    return publish(sinks, state);
  };
}

/// Adds layer `i` to `jobs`, or to the job already fetching its digest.
void add_layer_job(std::vector<BlobJob>& jobs, const fs::path& dir, const PullState& state, size_t i) {
  for (auto& job : jobs) {
    if (job.layer != kConfigJob && job.blob.digest == state.layers[i].blob.digest) {
      if (job.layer != i && std::find(job.also.begin(), job.also.end(), i) == job.also.end()) job.also.push_back(i);
      return;
    }
  }
  jobs.push_back(layer_job(dir, state, i));
}

bool all_fetched(const PullState& state) {
  return std::all_of(state.layers.begin(), state.layers.end(),
                     [](const LayerState& l) { return l.status == LayerStatus::kFetched; });
}

/// After a run: the layers it left "fetching" are pending again; when a
/// signal stopped it (`stopped`), so are those whose downloads it cut short
/// (their partial blobs stay for the resume), and the state says so.
void settle(PullState& state, bool stopped) {
  for (auto& layer : state.layers) {
    const bool cut = stopped && layer.status == LayerStatus::kFailed && layer.error.ends_with(": interrupted");
    if (layer.status == LayerStatus::kFetching || cut) layer.status = LayerStatus::kPending;
    if (cut) layer.error.clear();
  }
  state.interrupted = stopped;
  state.fetcher_pid = 0;
}

bool hot_fetched(const PullState& state) {
  return std::all_of(state.layers.begin(), state.layers.end(),
                     [](const LayerState& l) { return !l.hot || l.status == LayerStatus::kFetched; });
}

void fill_report_from_state(PullReport& report, const PullState& state) {
  report.layers.resize(state.layers.size());
  for (size_t i = 0; i < state.layers.size(); ++i) {
    const auto& l = state.layers[i];
    if (!report.layers[i].digest.empty()) continue;
    const char* s = l.status == LayerStatus::kFetched   ? "present"
                    : l.status == LayerStatus::kSkipped ? "skipped"
                    : l.status == LayerStatus::kFailed  ? "failed"
                                                        : "pending";
    report.layers[i] = report_of(l, s, 0, 0);
  }
  report.complete = state.complete;
  report.cold = state.cold;
  report.ready_s = state.ready_s;
  report.memory_dir = state.memory_dir;
  report.memory_capacity = state.memory_capacity;
  report.memory_bytes = 0;
  for (const auto& l : state.layers) {
    if (l.location == Placement::kMemory && l.status == LayerStatus::kFetched) report.memory_bytes += l.blob.size;
  }
}

/// `announce`: the sinks hear on_ready too (a fetch completing an earlier pull's hot layers does not announce).
Status mark_ready(PullState& state, double ready_s, const std::vector<PullSink*>& sinks, bool announce = true) {
  CFMO_TRY(write_ready_file(state, ready_s));
  state.ready = true;
  state.ready_s = ready_s;
  CFMO_TRY(publish(sinks, state));
  if (announce) {
    for (auto* s : sinks) s->on_ready(ready_s);
  }
  return {};
}

}  // namespace

const char* to_string(ColdStrategy cold) {
  switch (cold) {
    case ColdStrategy::kEager:
      return "eager";
    case ColdStrategy::kLazy:
      return "lazy";
    case ColdStrategy::kSkip:
      return "skip";
  }
  return "?";
}

Result<ColdStrategy> parse_cold_strategy(std::string_view text) {
  for (auto c : {ColdStrategy::kEager, ColdStrategy::kLazy, ColdStrategy::kSkip}) {
    if (text == to_string(c)) return c;
  }
  return make_error(ErrorKind::kUsage, "--cold '{}': expected eager, lazy or skip", text);
}

Result<std::string> docker_to_oci_manifest(std::string_view docker_manifest, const std::string& what) {
  Json j = Json::parse(docker_manifest, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("config") || !j.contains("layers") || !j["layers"].is_array()) {
    return make_error(ErrorKind::kInput, "{}: not a Docker schema 2 manifest", what);
  }
  static const std::map<std::string, std::string> kLayerTypes = {
      {"application/vnd.docker.image.rootfs.diff.tar.gzip", "application/vnd.oci.image.layer.v1.tar+gzip"},
      {"application/vnd.docker.image.rootfs.diff.tar", "application/vnd.oci.image.layer.v1.tar"},
      {"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
       "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"},
  };
  j["mediaType"] = kOciManifest;
  j["config"]["mediaType"] = "application/vnd.oci.image.config.v1+json";
  for (auto& layer : j["layers"]) {
    const std::string type = layer.value("mediaType", "");
    if (const auto it = kLayerTypes.find(type); it != kLayerTypes.end()) layer["mediaType"] = it->second;
  }
  return j.dump();
}

Result<ResolvedImage> resolve(RegistryApi& client, const Platform& platform) {
  ResolvedImage image;
  image.ref = client.reference();
  image.host = client.reference().api_host();
  const std::string what = "image " + image.ref.to_string();
  CFMO_ASSIGN_OR_RETURN(auto first, client.get_manifest(image.ref.manifest_reference()));
  std::string digest = sha256_digest(first.second);
  if (!image.ref.digest.empty() && digest != image.ref.digest) {
    return make_error(ErrorKind::kInput, "{}: manifest digest mismatch: got {}", what, digest);
  }
  CFMO_ASSIGN_OR_RETURN(auto parsed, parse_manifest(first.second, first.first.header("content-type"), what));
  std::string body = std::move(first.second);
  std::string media_type = parsed.media_type;
  if (parsed.is_index) {
    image.index_digest = digest;
    CFMO_ASSIGN_OR_RETURN(const auto chosen, select_platform(parsed, platform, what));
    CFMO_ASSIGN_OR_RETURN(auto second, client.get_manifest(chosen.digest));
    digest = sha256_digest(second.second);
    if (digest != chosen.digest) {
      return make_error(ErrorKind::kInput, "manifest {}: digest mismatch: got {}", chosen.digest, digest);
    }
    const std::string sub_what = "manifest " + chosen.digest;
    CFMO_ASSIGN_OR_RETURN(parsed, parse_manifest(second.second, second.first.header("content-type"), sub_what));
    if (parsed.is_index) return make_error(ErrorKind::kInput, "{}: an index inside an index", sub_what);
    body = std::move(second.second);
    media_type = parsed.media_type;
  }
  image.manifest = {media_type, digest, static_cast<int64_t>(body.size()), {}};
  image.manifest_body = std::move(body);
  image.parsed = std::move(parsed);
  return image;
}

namespace {

/// Resolves `ref` on the first host that has it; `more` then runs on the same client.
Result<ResolvedImage> resolve_with(const Reference& ref, const PullOptions& options,
                                   const std::function<Status(RegistryApi&, ResolvedImage&)>& more) {
  CFMO_ASSIGN_OR_RETURN(auto endpoints, endpoints_for(ref, options.hosts));
  auto health = std::make_shared<EndpointHealth>(endpoints.size());
  RegistryPool pool(ref, std::move(endpoints), options.registry, options.registry.auth_file, health,
                    [&](const std::string& m) {
                      for (auto* s : options.sinks) s->on_note(m);
                    });
  ResolvedImage image;
  CFMO_TRY(pool.each_until_ok("image " + ref.to_string(), [&](RegistryApi& client) -> Status {
    CFMO_ASSIGN_OR_RETURN(image, resolve(client, options.platform));
    return more ? more(client, image) : Status{};
  }));
  image.ref = ref;
  return image;
}

}  // namespace

Result<ResolvedImage> resolve_image(const Reference& ref, const PullOptions& options) {
  return resolve_with(ref, options, nullptr);
}

Result<ResolvedImage> inspect_image(const Reference& ref, const PullOptions& options) {
  return resolve_with(ref, options, [](RegistryApi& client, ResolvedImage& image) -> Status {
    const auto& config = image.parsed.config;
    StringSink sink("config " + config.digest);
    CFMO_TRY(client.get("/v2/" + client.reference().repository + "/blobs/" + config.digest, {}, sink,
                        "config " + config.digest));
    if (static_cast<int64_t>(sink.body.size()) != config.size || sha256_digest(sink.body) != config.digest) {
      return make_error(ErrorKind::kInput, "config {}: digest or size mismatch", config.digest);
    }
    image.config_body = std::move(sink.body);
    return {};
  });
}

bool memory_backed(const fs::path& dir) {
  struct statfs info {};
  if (::statfs(dir.c_str(), &info) != 0) return false;
  return static_cast<unsigned long>(info.f_type) == TMPFS_MAGIC ||
         static_cast<unsigned long>(info.f_type) == RAMFS_MAGIC;
}

fs::path memory_store_for(const fs::path& dir, const fs::path& memory_dir) {
  std::error_code ec;
  fs::path absolute = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (absolute.empty()) absolute = dir;
  std::string name = absolute.filename().string();
  if (name.empty()) name = "image";
  for (auto& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
  }
  if (name.size() > 40) name.resize(40);
  return memory_dir / fmt::format("cfmo-pull-{}-{}", name, sha256_digest(absolute.string()).substr(7, 12));
}

Result<PullReport> pull_to_layout(const Reference& ref, const PullOptions& options, const fs::path& dir,
                                  const std::string& tag) {
  const auto start = Clock::now();
  PullReport report;
  CFMO_TRY(prepare_layout(dir));
  Transfer transfer;
  // The state file first among the sinks: written before the others hear of a change.
  StateRecorder state_file(dir);
  if (options.state_file) transfer.sinks.push_back(&state_file);
  transfer.sinks.insert(transfer.sinks.end(), options.sinks.begin(), options.sinks.end());
  std::optional<DirLock> lock;
  if (options.state_file) {
    CFMO_ASSIGN_OR_RETURN(
        lock, lock_layout(
                  dir, options.registry.deadline,
                  [&](int pid) {
                    transfer.note(fmt::format("waiting for another cfmo-pull (pid {}) using '{}'", pid, dir.string()));
                  },
                  options.registry.stop));
  }
  CFMO_ASSIGN_OR_RETURN(transfer.endpoints, endpoints_for(ref, options.hosts));
  transfer.ref = ref;
  transfer.registry = options.registry;
  transfer.auth_file = options.registry.auth_file;
  transfer.health = std::make_shared<EndpointHealth>(transfer.endpoints.size());
  transfer.dir = dir;
  MemoryBudget budget(static_cast<size_t>(std::max<int64_t>(options.buffer_memory, 64 << 10)));
  transfer.budget = &budget;

  {
    RegistryPool pool = transfer.pool();
    CFMO_TRY(pool.each_until_ok("image " + ref.to_string(), [&](RegistryApi& client) -> Status {
      CFMO_ASSIGN_OR_RETURN(report.image, resolve(client, options.platform));
      return {};
    }));
  }
  const auto& image = report.image;
  const auto& layers = image.parsed.layers;
  for (auto* s : transfer.sinks) CFMO_TRY(s->on_resolved(image));

  if (options.state_file && fs::exists(state_path(dir))) {
    CFMO_ASSIGN_OR_RETURN(const auto earlier, read_state(dir));
    // Layers left for later on purpose (lazy, skip) would be forgotten; an
    // eager pull that failed is only resumed or replaced (a shared cache).
    if (!earlier.complete && earlier.cold != "eager" && earlier.manifest_digest != image.manifest.digest &&
        std::any_of(earlier.layers.begin(), earlier.layers.end(),
                    [](const LayerState& l) { return l.status != LayerStatus::kFetched; })) {
      return make_error(ErrorKind::kUsage,
                        "output '{}' holds a pull of {} whose layers are not all fetched; finish it (cfmo-pull "
                        "fetch {}) or pull into another directory",
                        dir.string(), earlier.image, dir.string());
    }
  }

  // Which layers are hot and where each goes, decided before any layer is fetched.
  CFMO_ASSIGN_OR_RETURN(const auto hot, select_layers(options.hot, layers, "--hot"));
  const int64_t capacity = std::max<int64_t>(0, options.max_memory - options.buffer_memory);
  const std::string cap_text =
      fmt::format("--max-memory {} leaves {} for the memory store ({} go to download buffers)",
                  human_bytes(options.max_memory), human_bytes(capacity), human_bytes(options.buffer_memory));
  CFMO_ASSIGN_OR_RETURN(auto plan, options.memory_store
                                       ? plan_memory(layers, hot, capacity, options.spill, cap_text)
                                       : plan_memory(layers, std::vector<bool>(layers.size(), false), 0, false, ""));
  fs::path store;
  if (plan.memory_bytes > 0) {
    store = memory_store_for(dir, options.memory_dir);
    std::error_code ec;
    fs::create_directories(store / "blobs" / "sha256", ec);
    if (ec) {
      return make_error(ErrorKind::kUsage, "--memory-dir '{}': cannot create the memory store '{}': {}",
                        options.memory_dir.string(), store.string(), ec.message());
    }
    CFMO_TRY(mark_memory_store(store, dir));
    if (!memory_backed(store)) {
      transfer.note(
          fmt::format("the memory store '{}' is not on tmpfs: hot layers are kept on its disk", store.string()));
    }
    // Room in the store itself: what is not there yet must fit in what is free.
    int64_t needed = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (plan.placement[i] == Placement::kMemory && !fs::exists(blob_path(store, layers[i].digest))) {
        needed += layers[i].size;
      }
    }
    const int64_t free = free_bytes(store);
    if (free >= 0 && needed > free) {
      if (!options.spill) {
        return make_error(ErrorKind::kUsage,
                          "the hot layers need {} in the memory store '{}', which has {} free (pass --spill to put "
                          "the excess on disk, or --memory-dir elsewhere)",
                          human_bytes(needed), store.string(), human_bytes(free));
      }
      CFMO_ASSIGN_OR_RETURN(plan, plan_memory(layers, hot, plan.memory_bytes - needed + free, true,
                                              cap_text + fmt::format(" and the store has {} free", human_bytes(free))));
    }
  }
  for (const auto& w : plan.warnings) transfer.note(w);

  PullState state;
  state.image = ref.registry + "/" + ref.repository + "@" + image.manifest.digest;
  state.tag = tag;
  state.output = "oci:" + dir.string();
  state.manifest_digest = image.manifest.digest;
  state.manifest_media_type = image.manifest.media_type;
  state.config = image.parsed.config;
  // A background fetch is lazy as far as the state file goes: the layers wait for that process.
  state.cold = options.background ? "lazy" : to_string(options.cold);
  state.hosts = options.hosts;
  state.auth_file = options.registry.auth_file;
  state.memory_dir = plan.memory_bytes > 0 ? store.string() : "";
  state.memory_capacity = capacity;
  state.spill = options.spill;
  if (!options.ready_file.empty()) {
    std::error_code ec;
    state.ready_file = fs::absolute(options.ready_file, ec).string();
  }
  state.fetcher_pid = ::getpid();
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerState layer;
    layer.blob = layers[i];
    layer.hot = hot[i];
    layer.location = plan.placement[i];
    const bool skipped = !hot[i] && options.cold == ColdStrategy::kSkip;
    layer.status = skipped ? LayerStatus::kSkipped : LayerStatus::kPending;
    state.layers.push_back(std::move(layer));
  }
  // The registry's manifest is kept as a blob so a later fetch can check its layers against it.
  CFMO_TRY(write_file_atomic(blob_path(dir, image.manifest.digest), image.manifest_body));
  CFMO_TRY(publish(transfer.sinks, state));
  for (auto* s : transfer.sinks) s->on_plan(state);
  report.layers.resize(layers.size());
  report.buffer_bytes = static_cast<int64_t>(budget.total());
  const auto finish_report = [&] {
    fill_report_from_state(report, state);
    report.notes = transfer.notes;
    report.buffer_peak_bytes = static_cast<int64_t>(budget.peak());
    report.wall_s = seconds_since(start);
  };

  // The config and the hot layers first.
  std::vector<BlobJob> first;
  first.push_back(
      {kConfigJob, {}, image.parsed.config, dir, false, "config " + short_digest(image.parsed.config.digest)});
  for (size_t i = 0; i < layers.size(); ++i) {
    if (hot[i]) add_layer_job(first, dir, state, i);
  }
  // A cold layer with a hot one's digest comes with it.
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!hot[i] && std::any_of(first.begin(), first.end(), [&](const BlobJob& j) {
          return j.layer != kConfigJob && j.blob.digest == layers[i].digest;
        })) {
      add_layer_job(first, dir, state, i);
    }
  }
  const auto done = recorder(state, report, transfer.sinks);
  // A stop leaves a state that says so (a failure otherwise keeps this process as the fetcher, gone).
  const auto unless_stopped = [&](Status status) -> Status {
    if (status || !options.registry.stopped()) return status;
    settle(state, true);
    CFMO_TRY(publish(transfer.sinks, state));
    return status;
  };
  CFMO_TRY(unless_stopped(run_jobs(first, options.jobs, transfer, done)));

  const bool any_hot = std::any_of(hot.begin(), hot.end(), [](bool h) { return h; });
  const bool cold_now = options.cold == ColdStrategy::kEager && !options.background;
  if (any_hot || !cold_now) CFMO_TRY(mark_ready(state, seconds_since(start), transfer.sinks));

  if (cold_now) {
    std::vector<BlobJob> rest;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (state.layers[i].status != LayerStatus::kFetched) add_layer_job(rest, dir, state, i);
    }
    CFMO_TRY(unless_stopped(run_jobs(rest, options.jobs, transfer, done)));
    if (!any_hot) CFMO_TRY(mark_ready(state, seconds_since(start), transfer.sinks));
  }

  if (all_fetched(state)) {
    CFMO_TRY(finish_layout(dir, image.manifest_body, image.manifest, tag, report.layout_manifest));
    state.complete = true;
  }
  state.fetcher_pid = 0;
  CFMO_TRY(publish(transfer.sinks, state));
  finish_report();
  return report;
}

Result<PullReport> fetch_layers(const fs::path& dir, const FetchOptions& options) {
  const auto start = Clock::now();
  PullReport report;
  Transfer transfer;
  StateRecorder state_file(dir);
  transfer.sinks.push_back(&state_file);
  transfer.sinks.insert(transfer.sinks.end(), options.sinks.begin(), options.sinks.end());
  if (!fs::exists(state_path(dir))) CFMO_TRY(read_state(dir));  // the "not a cfmo-pull directory" error
  CFMO_ASSIGN_OR_RETURN(
      auto lock,
      lock_layout(
          dir, options.registry.deadline,
          [&](int pid) {
            transfer.note(fmt::format("waiting for another cfmo-pull (pid {}) fetching into '{}'", pid, dir.string()));
          },
          options.registry.stop));
  CFMO_ASSIGN_OR_RETURN(auto state, read_state(dir));
  const fs::path manifest_path = blob_path(dir, state.manifest_digest);
  auto body = read_file(manifest_path);
  if (!body || sha256_digest(*body) != state.manifest_digest) {
    return make_error(ErrorKind::kInput, "'{}': the manifest {} is missing or damaged; pull the image again",
                      dir.string(), state.manifest_digest);
  }
  CFMO_ASSIGN_OR_RETURN(auto manifest,
                        parse_manifest(*body, state.manifest_media_type, "manifest " + state.manifest_digest));
  if (manifest.is_index || manifest.layers.size() != state.layers.size() ||
      manifest.config.digest != state.config.digest) {
    return make_error(ErrorKind::kInput, "state file '{}': does not match the manifest {}", state_path(dir).string(),
                      state.manifest_digest);
  }
  for (size_t i = 0; i < manifest.layers.size(); ++i) {
    if (manifest.layers[i].digest != state.layers[i].blob.digest) {
      return make_error(ErrorKind::kInput, "state file '{}': layer {} is not the manifest's", state_path(dir).string(),
                        i);
    }
  }
  CFMO_ASSIGN_OR_RETURN(transfer.ref, parse_reference(state.image));
  const HostSettings hosts = options.hosts.value_or(state.hosts);
  CFMO_ASSIGN_OR_RETURN(transfer.endpoints, endpoints_for(transfer.ref, hosts));
  transfer.registry = options.registry;
  transfer.auth_file = options.auth_file.value_or(state.auth_file);
  transfer.health = std::make_shared<EndpointHealth>(transfer.endpoints.size());
  transfer.dir = dir;
  MemoryBudget budget(static_cast<size_t>(std::max<int64_t>(options.buffer_memory, 64 << 10)));
  transfer.budget = &budget;

  report.image.ref = transfer.ref;
  report.image.manifest = {state.manifest_media_type, state.manifest_digest, static_cast<int64_t>(body->size()), {}};
  report.image.manifest_body = *body;
  report.image.parsed = manifest;

  // A layer counts as fetched only while its blob is there: a memory store
  // cleared by a reboot leaves links to nothing.
  for (auto& layer : state.layers) {
    if (layer.status == LayerStatus::kFetched && !fs::exists(blob_path(dir, layer.blob.digest))) {
      layer.status = LayerStatus::kPending;
      transfer.note(fmt::format("layer {} is gone from '{}'; fetching it again", short_digest(layer.blob.digest),
                                blob_path(dir, layer.blob.digest).string()));
    }
  }
  std::vector<bool> wanted(state.layers.size(), true);
  if (!options.layers.empty()) {
    CFMO_ASSIGN_OR_RETURN(wanted, select_layers(options.layers, manifest.layers, "fetch"));
  }
  // The memory store may be gone (a reboot); it is made again where it was.
  if (!state.memory_dir.empty()) {
    std::error_code ec;
    fs::create_directories(fs::path(state.memory_dir) / "blobs" / "sha256", ec);
    const Status marked = ec ? Status{} : mark_memory_store(state.memory_dir, dir);
    if (ec || !marked) {
      transfer.note(fmt::format("the memory store '{}' cannot be made again ({}); hot layers go to disk",
                                state.memory_dir, ec ? ec.message() : marked.error().message));
      state.memory_dir.clear();
      for (auto& layer : state.layers) layer.location = Placement::kDisk;
    }
  }
  std::vector<BlobJob> jobs;
  if (!fs::exists(blob_path(dir, state.config.digest))) {
    jobs.push_back({kConfigJob, {}, state.config, dir, false, "config " + short_digest(state.config.digest)});
  }
  report.layers.resize(state.layers.size());
  // Hot layers first, as in the pull.
  for (const bool hot_pass : {true, false}) {
    for (size_t i = 0; i < state.layers.size(); ++i) {
      auto& layer = state.layers[i];
      if (layer.hot != hot_pass || !wanted[i] || layer.status == LayerStatus::kFetched) continue;
      layer.status = LayerStatus::kFetching;
      add_layer_job(jobs, dir, state, i);
    }
  }
  state.fetcher_pid = ::getpid();
  CFMO_TRY(publish(transfer.sinks, state));
  for (auto* s : transfer.sinks) s->on_plan(state);
  const auto done = recorder(state, report, transfer.sinks);
  Status fetched = run_jobs(jobs, options.jobs, transfer, done);
  // A layer this run did not get to is pending again, not "fetching" by nobody.
  settle(state, !fetched && options.registry.stopped());
  if (fetched && !state.ready && hot_fetched(state)) {
    fetched = mark_ready(state, state.ready_s >= 0 ? state.ready_s : seconds_since(start), transfer.sinks, false);
  }
  if (fetched && !state.complete && all_fetched(state)) {
    fetched = finish_layout(dir, *body, report.image.manifest, state.tag, report.layout_manifest);
    if (fetched) state.complete = true;
  }
  state.fetcher_pid = 0;
  CFMO_TRY(publish(transfer.sinks, state));
  CFMO_TRY(std::move(fetched));
  fill_report_from_state(report, state);
  report.notes = transfer.notes;
  report.buffer_bytes = static_cast<int64_t>(budget.total());
  report.buffer_peak_bytes = static_cast<int64_t>(budget.peak());
  report.wall_s = seconds_since(start);
  return report;
}

std::vector<int64_t> bytes_on_disk(const fs::path& dir, const PullState& state) {
  std::vector<int64_t> out;
  for (const auto& layer : state.layers) {
    std::error_code ec;
    int64_t bytes = 0;
    for (const fs::path& root : {dir, state.memory_dir.empty() ? dir : fs::path(state.memory_dir)}) {
      const fs::path path = blob_path(root, layer.blob.digest);
      if (const auto size = fs::file_size(path, ec); !ec) {
        bytes = std::max(bytes, static_cast<int64_t>(size));
      } else if (const auto partial = fs::file_size(path.string() + ".partial", ec); !ec) {
        bytes = std::max(bytes, static_cast<int64_t>(partial));
      }
    }
    out.push_back(bytes);
  }
  return out;
}

}  // namespace cfmo::oci
