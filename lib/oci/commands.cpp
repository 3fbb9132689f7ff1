#include "oci/commands.h"

#include "core/dir_lock.h"
#include "oci/cleanup.h"
#include "oci/gzip_index.h"
#include "oci/index_artifact.h"
#include "oci/index_sink.h"
#include "oci/lazy_mount.h"
#include "oci/manifest.h"
#include "oci/memory_budget.h"
#include "oci/mount.h"
#include "oci/pull_state.h"
#include "oci/reference.h"
#include "oci/rootfs.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <optional>

#include <stdlib.h>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr const char* kTool = "cfmo-pull";

Error usage(std::string message) { return Error{ErrorKind::kUsage, std::move(message)}; }

std::string json_text(const Json& j) { return j.dump(2) + "\n"; }

Json layers_json(const Manifest& manifest) {
  Json layers = Json::array();
  for (const auto& l : manifest.layers)
    layers.push_back({{"digest", l.digest}, {"size", l.size}, {"mediaType", l.media_type}});
  return layers;
}

Json report_json(const PullReport& report, const std::string& image, const std::string& output) {
  Json j;
  j["image"] = image;
  j["output"] = output;
  j["manifest_digest"] = report.image.manifest.digest;
  j["layout_manifest_digest"] =
      report.layout_manifest.digest.empty() ? Json(nullptr) : Json(report.layout_manifest.digest);
  j["complete"] = report.complete;
  j["cold"] = report.cold;
  j["layers"] = Json::array();
  for (const auto& l : report.layers) {
    j["layers"].push_back({{"digest", l.digest},
                           {"size", l.size},
                           {"hot", l.hot},
                           {"location", l.location},
                           {"state", l.state},
                           {"seconds", l.seconds}});
  }
  j["bytes_fetched"] = report.bytes_fetched;
  j["wall_s"] = report.wall_s;
  j["ready_s"] = report.ready_s >= 0 ? Json(report.ready_s) : Json(nullptr);
  j["peak_rss_bytes"] = peak_rss_bytes();
  j["memory_store"] = {{"dir", report.memory_dir.empty() ? Json(nullptr) : Json(report.memory_dir)},
                       {"bytes", report.memory_bytes},
                       {"capacity", report.memory_capacity}};
  j["buffer_memory"] = {{"budget", report.buffer_bytes}, {"peak", report.buffer_peak_bytes}};
  j["notes"] = report.notes;
  return j;
}

/// `cfmo-pull fetch DIR` in the background, with the registry settings of this run.
Result<int> start_background_fetch(const CommandHooks& hooks, const PullConfig& config, const fs::path& dir,
                                   int64_t buffer_memory) {
  std::error_code ec;
  const std::string absolute = fs::absolute(dir, ec).string();
  std::vector<std::string> args = {kTool, "fetch", absolute, "--progress", "plain"};
  for (auto& a : fetch_arguments(config, buffer_memory)) args.push_back(std::move(a));
  return hooks.start_detached(args, (fs::path(absolute) / kLogFile).string());
}

/// What --output asked for: an OCI layout, a rootfs, or both.
struct Outputs {
  std::string layout;  ///< oci:DIR
  std::string tag;
  std::string rootfs;  ///< rootfs:DIR
};

Result<Outputs> parse_outputs(const PullConfig& config, const Reference& ref) {
  Outputs out;
  for (const auto& output : config.output) {
    if (output.starts_with("oci:") && output.size() > 4 && out.layout.empty()) {
      out.layout = output.substr(4);
      out.tag = ref.tag.empty() ? ref.digest : ref.tag;
      if (const auto colon = out.layout.rfind(':');
          colon != std::string::npos && out.layout.find('/', colon) == std::string::npos) {
        out.tag = out.layout.substr(colon + 1);
        out.layout.resize(colon);
      }
    } else if (output.starts_with("rootfs:") && output.size() > 7 && out.rootfs.empty()) {
      out.rootfs = output.substr(7);
    } else {
      return usage(fmt::format("--output '{}': expected oci:DIR[:tag] or rootfs:DIR, each at most once", output));
    }
  }
  if (!config.cache.empty() && !out.layout.empty()) {
    return usage("--cache: the blobs of a pull with --output oci: go into that layout");
  }
  if (config.replace && out.rootfs.empty()) return usage("--replace: only for --output rootfs:DIR");
  return out;
}

Json rootfs_json(const RootfsReport& rootfs) {
  return {{"dir", rootfs.dir.string()},
          {"entries", rootfs.total.entries},
          {"uncompressed_bytes", rootfs.total.uncompressed_bytes},
          {"skipped_devices", rootfs.total.skipped_devices},
          {"skipped_xattrs", rootfs.total.skipped_xattrs},
          {"unpack_wait_s", rootfs.unpack_wait_s},
          {"sync_s", rootfs.sync_s}};
}

/// The closing line of a pull into a layout: what is ready and what is not yet.
std::string pull_line(const Reference& ref, const PullReport& report, const std::string& layout, int background_pid) {
  size_t waiting = 0;
  for (const auto& l : report.layers) waiting += l.state == "pending" ? 1 : 0;
  std::string tail;
  if (background_pid > 0) {
    tail = fmt::format("; {} cold layer(s) being fetched in the background (pid {}, log {}); see '{} status {}'",
                       waiting, background_pid, (fs::path(layout) / kLogFile).string(), kTool, layout);
  } else if (waiting > 0) {
    tail = fmt::format("; {} cold layer(s) not fetched yet: '{} fetch {}' brings them (index.json is written then)",
                       waiting, kTool, layout);
  } else if (!report.complete) {
    tail = "; cold layers skipped: the layout has no index.json until they are fetched";
  }
  const std::string ready = report.ready_s >= 0 ? fmt::format(", ready after {:.2f} s", report.ready_s) : "";
  return fmt::format("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s{}) into {}{}\n", kTool,
                     ref.to_string(), report.image.manifest.digest, report.layers.size(), report.bytes_fetched,
                     report.wall_s, ready, layout, tail);
}

/// After a pull that left layers to fetch later: the indexes the registry
/// holds for the image (`index --push`), into DIR/cfmo-index/ for a lazy
/// mount. A damaged artifact fails the pull (kInput); a registry that cannot
/// be asked now is a note. Returns the JSON report's "indexes".
Result<Json> indexes_from_registry(const std::string& layout, const PullReport& report, const PullPlan& plan,
                                   bool quiet, CommandOutput& out) {
  const bool pending = std::any_of(report.layers.begin(), report.layers.end(),
                                   [](const LayerReport& l) { return l.state == "pending"; });
  if (!pending) return Json(nullptr);
  auto found = fetch_pull_indexes(layout, plan.pull.registry);
  if (!found) {
    if (found.error().kind == ErrorKind::kInput) return found.error();
    if (!quiet)
      out.notes.push_back(
          fmt::format("the registry's layer indexes could not be looked up: {}", found.error().message));
    return Json(nullptr);
  }
  if (!*found) return Json(nullptr);
  if (!quiet) {
    out.notes.push_back(fmt::format("indexes of {} layer(s) found in the registry through {} (artifact {}), in {}",
                                    (*found)->indexes.size(), (*found)->via, short_digest((*found)->artifact),
                                    (fs::path(layout) / kIndexDir).string()));
  }
  return Json{{"artifact", (*found)->artifact}, {"via", (*found)->via}, {"layers", (*found)->indexes.size()}};
}

/// What an IndexSink built: a note per layer it could not index (unless
/// quiet), and the JSON report's "built_indexes".
Json built_indexes(const IndexSink* sink, const std::string& layout, bool quiet, CommandOutput& out) {
  if (sink == nullptr) return Json(nullptr);
  Json layers = Json::array();
  size_t indexed = 0;
  for (const auto& o : sink->outcomes()) {
    layers.push_back({{"layer", o.layer},
                      {"digest", o.digest},
                      {"indexed", o.indexed},
                      {"streamed", o.streamed},
                      {"note", o.note.empty() ? Json(nullptr) : Json(o.note)}});
    indexed += o.indexed ? 1 : 0;
    if (!o.indexed && !quiet) out.notes.push_back(fmt::format("layer {}: not indexed: {}", o.layer, o.note));
  }
  if (!quiet && indexed > 0) {
    out.notes.push_back(fmt::format("built the indexes of {} layer(s) as they arrived, in {}", indexed,
                                    (fs::path(layout) / kIndexDir).string()));
  }
  return layers;
}

}  // namespace

void PullCommandLine::register_cli(CLI::App& app, PullCommand command, const char* args_name, const char* args_help) {
  id = command;
  // Checked by the subcommand, not CLI11, so that --print-config needs no argument.
  if (*args_name != '\0') app.add_option(args_name, args, args_help);
  app.add_option("--config", config_file, "TOML file with any of the options below")->group("General");
  app.add_flag("--print-config", print_config, "print the merged configuration as TOML and exit")->group("General");
  add_pull_options(table, config, id);
  table.register_cli(app);
  // One value per occurrence (--hot 0 --hot 2), so that a list flag does not swallow REF.
  for (const char* list : {"--hot", "--mirror", "--insecure-registry", "--output"}) {
    if (auto* option = app.get_option_no_throw(list)) option->allow_extra_args(false);
  }
}

Result<PullPlan> PullCommandLine::plan() {
  if (!config_file.empty()) CFMO_TRY(load_pull_config(table, config_file, id));
  const bool takes_ref = id == PullCommand::kPull || id == PullCommand::kInspect;
  if (takes_ref && !args.empty()) {
    if (args.size() > 1) {
      return usage(fmt::format("{}: one image at a time (got '{}' and '{}')", to_string(id), args[0], args[1]));
    }
    config.image = args[0];  // the argument wins over --image and the file
  }
  return validate(config, id);
}

CommandResult run_inspect(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks) {
  const PullConfig& config = line.config;
  if (config.image.empty()) return usage("inspect: which image? give REF (or image in the --config file)");
  CFMO_ASSIGN_OR_RETURN(const Reference ref, parse_reference(config.image));
  PullOptions options = plan.pull;
  if (hooks.progress != nullptr) options.sinks.push_back(hooks.progress);
  CFMO_ASSIGN_OR_RETURN(const ResolvedImage image, inspect_image(ref, options));
  int64_t total = 0;
  for (const auto& l : image.parsed.layers) total += l.size;
  CommandOutput out;
  if (config.json) {
    Json j;
    j["image"] = ref.to_string();
    j["index_digest"] = image.index_digest.empty() ? Json(nullptr) : Json(image.index_digest);
    j["manifest"] = {
        {"digest", image.manifest.digest}, {"mediaType", image.manifest.media_type}, {"size", image.manifest.size}};
    j["config"] = Json::parse(image.config_body, nullptr, false);
    j["layers"] = layers_json(image.parsed);
    j["total_size"] = total;
    out.text = json_text(j);
    return out;
  }
  out.text =
      fmt::format("image     {}\nmanifest  {} ({})\nconfig    {} ({} bytes)\n", ref.to_string(), image.manifest.digest,
                  image.manifest.media_type, image.parsed.config.digest, image.parsed.config.size);
  if (!image.index_digest.empty()) out.text += fmt::format("index     {}\n", image.index_digest);
  out.text += fmt::format("layers    {} ({} bytes)\n", image.parsed.layers.size(), total);
  for (size_t i = 0; i < image.parsed.layers.size(); ++i) {
    const auto& l = image.parsed.layers[i];
    out.text += fmt::format("  {:>3}  {}  {:>12}  {}\n", i, l.digest, l.size, l.media_type);
  }
  return out;
}

CommandResult run_pull(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks) {
  const PullConfig& config = line.config;
  if (config.image.empty()) return usage("pull: which image? give REF (or image in the --config file)");
  CFMO_ASSIGN_OR_RETURN(const Reference ref, parse_reference(config.image));
  if (config.output.empty()) return usage("pull: --output oci:DIR[:tag] or rootfs:DIR is required");
  CFMO_ASSIGN_OR_RETURN(const Outputs outputs, parse_outputs(config, ref));
  PullOptions options = plan.pull;
  if (hooks.progress != nullptr) options.sinks.push_back(hooks.progress);

  std::optional<RootfsReport> rootfs;
  PullReport report;
  std::string layout = outputs.layout;
  std::optional<IndexSink> indexer;
  if (config.build_index) {
    if (layout.empty()) return usage("--build-index: the indexes go into an oci:DIR output; give one");
    options.sinks.push_back(&indexer.emplace(layout, plan.span));
  }
  if (outputs.rootfs.empty()) {
    CFMO_ASSIGN_OR_RETURN(report, pull_to_layout(ref, options, layout, outputs.tag));
  } else {
    // A rootfs-only pull keeps its blobs in the cache (resumable, not fetched
    // twice), named there by the whole reference.
    std::string tag = outputs.tag;
    if (layout.empty()) {
      layout = config.cache.empty() ? default_blob_cache().string() : config.cache;
      tag = ref.to_string();
      options.state_file = false;
    }
    RootfsOptions rootfs_options;
    rootfs_options.dir = outputs.rootfs;
    rootfs_options.replace = config.replace;
    CFMO_ASSIGN_OR_RETURN(rootfs, pull_to_rootfs(ref, options, layout, tag, rootfs_options));
    report = rootfs->pull;
  }
  CommandOutput out;
  Json found_json = nullptr;
  const Json built_json = built_indexes(indexer ? &*indexer : nullptr, layout, config.quiet || config.json, out);
  if (!rootfs) {
    CFMO_ASSIGN_OR_RETURN(found_json, indexes_from_registry(layout, report, plan, config.quiet, out));
  }
  if (rootfs && rootfs->total.skipped_devices > 0 && !config.quiet) {
    out.notes.push_back(
        fmt::format("{} device node(s) not created (creating them needs root)", rootfs->total.skipped_devices));
  }

  int background_pid = 0;
  const bool pending = std::any_of(report.layers.begin(), report.layers.end(),
                                   [](const LayerReport& l) { return l.state == "pending"; });
  if (options.background && pending) {
    CFMO_ASSIGN_OR_RETURN(background_pid, start_background_fetch(hooks, config, layout, plan.pull.buffer_memory));
  }
  if (config.json) {
    Json j = report_json(report, ref.to_string(), config.output.front());
    j["outputs"] = config.output;
    j["background_pid"] = background_pid > 0 ? Json(background_pid) : Json(nullptr);
    if (!rootfs) j["indexes"] = found_json;
    j["built_indexes"] = built_json;
    if (rootfs) {
      for (size_t i = 0; i < report.layers.size(); ++i) {
        j["layers"][i]["entries"] = rootfs->layers[i].entries;
        j["layers"][i]["uncompressed_bytes"] = rootfs->layers[i].uncompressed_bytes;
      }
      j["blobs"] = layout;
      j["rootfs"] = rootfs_json(*rootfs);
    }
    out.text = json_text(j);
  } else if (config.quiet) {
  } else if (rootfs) {
    out.text =
        fmt::format("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s) into rootfs {} ({} entries)\n",
                    kTool, ref.to_string(), report.image.manifest.digest, report.layers.size(), report.bytes_fetched,
                    report.wall_s, rootfs->dir.string(), rootfs->total.entries);
  } else {
    out.text = pull_line(ref, report, layout, background_pid);
  }
  return out;
}

CommandResult run_fetch(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks) {
  if (line.args.empty()) return usage("fetch: which directory? give DIR [LAYER...]");
  const std::string dir = line.args[0];
  FetchOptions options = plan.fetch;
  for (size_t i = 1; i < line.args.size(); ++i) {
    CFMO_ASSIGN_OR_RETURN(const LayerSpec spec, parse_layer_spec(line.args[i], "fetch"));
    options.layers.push_back(spec);
  }
  if (hooks.progress != nullptr) options.sinks.push_back(hooks.progress);
  std::optional<IndexSink> indexer;
  if (line.config.build_index) options.sinks.push_back(&indexer.emplace(dir, plan.span));
  CFMO_ASSIGN_OR_RETURN(const PullReport report, fetch_layers(dir, options));
  CommandOutput out;
  const Json built_json = built_indexes(indexer ? &*indexer : nullptr, dir, line.config.quiet || line.config.json, out);
  if (line.config.json) {
    auto state = read_state(dir);
    Json j = report_json(report, state ? state->image : "", state ? state->output : "");
    j["built_indexes"] = built_json;
    out.text = json_text(j);
    return out;
  }
  if (line.config.quiet) return out;
  size_t missing = 0;
  for (const auto& l : report.layers) missing += l.state == "pending" || l.state == "skipped" ? 1 : 0;
  out.text = fmt::format(
      "{}: fetched {} bytes into {} in {:.2f} s; {}\n", kTool, report.bytes_fetched, dir, report.wall_s,
      report.complete ? std::string("the image is complete") : fmt::format("{} layer(s) still not fetched", missing));
  return out;
}

namespace {

/// A pull's layers counted: how many are fetched, and their bytes on disk of all.
struct LayerTotals {
  size_t fetched = 0;
  int64_t total = 0;
  int64_t have = 0;
};

LayerTotals count_layers(const PullState& state, const std::vector<int64_t>& on_disk) {
  LayerTotals t;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    t.fetched += state.layers[i].status == LayerStatus::kFetched ? 1 : 0;
    t.total += state.layers[i].blob.size;
    t.have += std::min(on_disk[i], state.layers[i].blob.size);
  }
  return t;
}

/// `status` in words: the pull, its memory store, its lazy mount and each layer.
std::string status_text(const fs::path& dir, const PullState& state, const std::vector<int64_t>& on_disk,
                        bool fetcher_alive, const LazyStats* lazy,
                        const std::function<std::string(const LayerState&)>& state_of) {
  const auto [fetched, total, have] = count_layers(state, on_disk);
  std::string out = fmt::format("image     {}\noutput    {}\n", state.image, state.output);
  out += fmt::format("layers    {} of {} fetched ({} of {}){}\n", fetched, state.layers.size(), human_bytes(have),
                     human_bytes(total), state.complete ? "; complete (index.json written)" : "");
  out += fmt::format("ready     {}\n", state.ready ? fmt::format("yes, after {:.2f} s", state.ready_s) : "no");
  std::string fetcher = "none";
  if (state.fetcher_pid > 0) {
    fetcher = fetcher_alive ? fmt::format("pid {} running", state.fetcher_pid)
                            : fmt::format("pid {} gone before it finished ('{} fetch {}' resumes)", state.fetcher_pid,
                                          kTool, dir.string());
  }
  out += fmt::format("cold      {}; fetcher: {}\n", state.cold, fetcher);
  if (state.interrupted) {
    out += fmt::format("stopped   by a signal before it finished; its partial blobs are kept: '{} fetch {}' resumes\n",
                       kTool, dir.string());
  }
  if (!state.memory_dir.empty()) {
    int64_t in_memory = 0;
    for (size_t i = 0; i < state.layers.size(); ++i) {
      if (state.layers[i].location == Placement::kMemory) in_memory += on_disk[i];
    }
    out += fmt::format("memory    {}: {} of {}\n", state.memory_dir, human_bytes(in_memory),
                       human_bytes(state.memory_capacity));
  }
  if (lazy) {
    std::string points;
    for (const auto& p : mounts_using(dir)) points += (points.empty() ? "" : ", ") + p;
    out += fmt::format(
        "lazy      {} fetched by {} range request(s) ({:.1f}% of the image), {} span(s) inflated; cache {} "
        "of {}; {} error(s); {}\n",
        human_bytes(lazy->bytes_fetched), lazy->requests,
        total > 0 ? 100.0 * static_cast<double>(lazy->bytes_fetched) / static_cast<double>(total) : 0.0,
        lazy->spans_inflated, human_bytes(lazy->cache_bytes), human_bytes(lazy->cache_capacity), lazy->errors,
        points.empty() ? std::string("not mounted") : "mounted at " + points);
  }
  for (size_t i = 0; i < state.layers.size(); ++i) {
    const auto& l = state.layers[i];
    const std::string bytes =
        l.status == LayerStatus::kFetched
            ? human_bytes(l.blob.size)
            : fmt::format("{} of {}", human_bytes(std::min(on_disk[i], l.blob.size)), human_bytes(l.blob.size));
    out += fmt::format("  {:>3}  {}  {}  {:<6}  {:<11}  {}{}\n", i, l.blob.digest.substr(0, 19),
                       l.hot ? "hot " : "cold", l.location == Placement::kMemory ? "memory" : "disk", state_of(l),
                       bytes, l.error.empty() ? "" : "  (" + l.error + ")");
  }
  return out;
}

}  // namespace

CommandResult run_status(const PullCommandLine& line, const PullPlan&, const CommandHooks&) {
  if (line.args.empty()) return usage("status: which directory? give DIR");
  const fs::path dir = line.args[0];
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  const auto on_disk = bytes_on_disk(dir, state);
  const bool fetcher_alive = state.fetcher_pid > 0 && process_alive(state.fetcher_pid);
  // A layer "fetching" by a process that is gone was interrupted: it is pending, its partial blob kept.
  auto state_of = [&](const LayerState& l) -> std::string {
    if (l.status == LayerStatus::kFetching && !fetcher_alive) return "interrupted";
    return to_string(l.status);
  };
  const auto lazy_read = read_lazy_stats(dir);
  const LazyStats* lazy = lazy_read ? &*lazy_read : nullptr;
  CommandOutput out;
  if (!line.config.json) {
    out.text = status_text(dir, state, on_disk, fetcher_alive, lazy, state_of);
    return out;
  }
  const auto [fetched, total, have] = count_layers(state, on_disk);
  Json j = Json::parse(state_to_json(state));
  j["fetcher_alive"] = fetcher_alive;
  j["layers_fetched"] = fetched;
  j["bytes_on_disk"] = have;
  j["bytes_total"] = total;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    j["layers"][i]["state"] = state_of(state.layers[i]);
    j["layers"][i]["bytes_on_disk"] = on_disk[i];
  }
  j["lazy"] = nullptr;
  if (lazy) {
    j["lazy"] = {{"bytes_fetched", lazy->bytes_fetched},   {"requests", lazy->requests},
                 {"spans_inflated", lazy->spans_inflated}, {"cache_bytes", lazy->cache_bytes},
                 {"cache_capacity", lazy->cache_capacity}, {"errors", lazy->errors},
                 {"mounted_at", mounts_using(dir)}};
  }
  out.text = json_text(j);
  return out;
}

namespace {

/// A directory removed when it goes out of scope, with what a pull put in it.
struct PullDirGuard {
  fs::path dir;
  ~PullDirGuard() {
    if (dir.empty()) return;
    (void)remove_pull(dir);
    remove_tree(dir);
  }
};

/// The image `arg` names when it is not a directory but a reference that
/// names its registry, tag or digest (a path that does not exist, such as
/// out/typo, stays a path, and its error says so).
std::optional<Reference> image_argument(const std::string& arg) {
  std::error_code ec;
  if (fs::exists(arg, ec) || arg.find('/') == std::string::npos) return std::nullopt;
  auto ref = parse_reference(arg);
  if (!ref) return std::nullopt;
  const std::string first = arg.substr(0, arg.find('/'));
  const std::string last = arg.substr(arg.rfind('/') + 1);
  const bool names_registry = first.find_first_of(".:") != std::string::npos || first == "localhost";
  const bool names_version = last.find_first_of(":@") != std::string::npos;
  if (!names_registry && !names_version) return std::nullopt;
  return *ref;
}

/// `mount --lazy REF`: the image's layout under --cache (CACHE/lazy/NAME-HEX,
/// named by its manifest's digest, so every mount of the image shares its
/// indexes and span cache): the manifest, the config and the indexes the
/// registry holds for it, no layer. A layout already there for the same
/// manifest is used as it is. `made` is set to a layout made now, for the
/// caller to remove if the mount fails.
Result<fs::path> lazy_layout(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks,
                             const Reference& ref, PullDirGuard& made, CommandOutput& out) {
  PullOptions options = plan.pull;
  if (hooks.progress != nullptr) options.sinks.push_back(hooks.progress);
  CFMO_ASSIGN_OR_RETURN(const ResolvedImage image, resolve_image(ref, options));
  const fs::path cache = line.config.cache.empty() ? default_blob_cache() : fs::path(line.config.cache);
  std::string name = ref.repository;
  std::replace(name.begin(), name.end(), '/', '_');
  const fs::path dir =
      fs::absolute(cache / kLazyLayoutDir / fmt::format("{}-{}", name, image.manifest.digest.substr(7, 16)));
  std::error_code ec;
  if (fs::exists(state_path(dir), ec)) {
    if (auto state = read_state(dir); state && state->manifest_digest == image.manifest.digest) return dir;
  }
  if (!fs::exists(dir, ec)) made.dir = dir;
  // Pinned to the digest just resolved: a tag that moves meanwhile cannot mix two images.
  Reference pinned = ref;
  pinned.digest = image.manifest.digest;
  options.cold = ColdStrategy::kLazy;
  options.hot.clear();
  options.memory_store = false;
  options.background = false;
  options.ready_file.clear();
  CFMO_ASSIGN_OR_RETURN(const PullReport report,
                        pull_to_layout(pinned, options, dir, ref.tag.empty() ? "latest" : ref.tag));
  CFMO_TRY(indexes_from_registry(dir.string(), report, plan, line.config.quiet || line.config.json, out));
  return dir;
}

/// The lazy mount of the pull in `dir`: prepared here (where errors can
/// still be told), then served by a process the tool starts
/// (hooks.serve_detached). `shown` names what is mounted (DIR, or REF).
CommandResult run_lazy_mount(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks,
                             const fs::path& dir, const std::string& shown, CommandOutput out) {
  const PullConfig& config = line.config;
  LazyMountOptions options;
  options.cache_bytes = plan.cache_bytes;
  options.max_memory = plan.pull.max_memory;
  options.jobs = plan.fetch.jobs;
  options.registry = plan.fetch.registry;
  options.hosts = plan.fetch.hosts;
  options.auth_file = plan.fetch.auth_file;
  std::error_code ec;
  if (!config.record.empty()) options.record = fs::absolute(config.record, ec);
  if (!config.prefetch.empty()) options.prefetch = fs::absolute(config.prefetch, ec);
  options.writable = config.writable;
  if (config.background) options.fetcher_memory = kProcessMemory + plan.fetch.buffer_memory;
  // A layout of a mount by REF is shared and has no memory store: the writes get one of the mount's own.
  if (shown != dir.string()) options.upper_memory_dir = plan.pull.memory_dir;
  CFMO_ASSIGN_OR_RETURN(auto mount, LazyMount::prepare(dir, line.args[1], options));
  CFMO_ASSIGN_OR_RETURN(const int pid, hooks.serve_detached(*mount));
  const auto& report = mount->report();
  std::string writes;
  if (report.upper) {
    // Mounted from here, not by the daemon: the overlay's first lookups are FUSE requests it must be serving.
    const fs::path point = fs::weakly_canonical(fs::absolute(line.args[1], ec), ec);
    if (auto overlay = mount_writable_overlay(report.fuse_point, *report.upper, point); !overlay) {
      (void)unmount_image(report.fuse_point);
      return overlay.error();
    }
    writes = fmt::format("; writes kept {} in {} until umount", report.upper->in_memory ? "in memory" : "on disk",
                         report.upper->upper.string());
    if (report.upper->bytes > 0) {
      writes += fmt::format(" (at most {} of --max-memory {}: ENOSPC past it)", human_bytes(report.upper->bytes),
                            human_bytes(plan.pull.max_memory));
    }
  }
  int background_pid = 0;
  const bool pending =
      std::any_of(report.layers.begin(), report.layers.end(), [](const LazyLayer& l) { return !l.local; });
  if (config.background && pending) {
    CFMO_ASSIGN_OR_RETURN(background_pid, start_background_fetch(hooks, config, dir, plan.fetch.buffer_memory));
  }
  if (!config.quiet && !config.json) out.notes.insert(out.notes.end(), report.notes.begin(), report.notes.end());
  if (config.json) {
    Json layers = Json::array();
    for (const auto& l : report.layers) {
      layers.push_back({{"index", l.index},
                        {"digest", l.digest},
                        {"hot", l.hot},
                        {"local", l.local},
                        {"index_from", l.index_from},
                        {"note", l.whole_note.empty() ? Json(nullptr) : Json(l.whole_note)}});
    }
    out.text = json_text(
        Json{{"mounted", true},
             {"lazy", true},
             {"image", shown == dir.string() ? Json(nullptr) : Json(shown)},
             {"dir", dir.string()},
             {"mountpoint", line.args[1]},
             {"pid", pid},
             {"background_pid", background_pid > 0 ? Json(background_pid) : Json(nullptr)},
             {"entries", report.entries},
             {"index_bytes", report.index_bytes},
             {"cache", report.cache.string()},
             {"cache_size", plan.cache_bytes},
             {"log", report.log.string()},
             {"upper", report.upper ? Json(report.upper->upper.string()) : Json(nullptr)},
             {"upper_in_memory", report.upper && report.upper->in_memory},
             {"upper_bytes", report.upper && report.upper->bytes > 0 ? Json(report.upper->bytes) : Json(nullptr)},
             {"read_bytes", report.read_bytes},
             {"fetcher_bytes", report.fetcher_bytes},
             {"layers", layers},
             {"notes", report.notes}});
  } else if (!config.quiet) {
    size_t cold = 0;
    for (const auto& l : report.layers) cold += l.local ? 0 : 1;
    out.text = fmt::format(
        "{}: mounted {} lazily at {} ({} layer(s), {} of them read from the registry on first access; "
        "pid {}, log {}){}\n",
        kTool, shown, line.args[1], report.layers.size(), cold, pid, report.log.string(), writes);
    if (shown != dir.string()) {
      out.text += fmt::format("{}: its layout, indexes and span cache are kept in {} ('{} rm' it to reclaim)\n", kTool,
                              dir.string(), kTool);
    }
  }
  // The daemon, forked, holds the same pages copy-on-write: freeing the tree
  // and indexes here (tens of MB in small blocks) wrote to each page the
  // allocator touched, copying it, 0.3-0.5 s of this command's 0.6-1.8 s on
  // a loaded machine, just before the process ends. They are left to the exit.
  (void)mount.release();
  return out;
}

Json mount_json(const MountReport& report, const std::string& mountpoint) {
  Json j;
  j["mounted"] = report.mounted;
  j["mountpoint"] = mountpoint;
  j["not_mounted"] = report.not_mounted.empty() ? Json(nullptr) : Json(report.not_mounted);
  j["upper"] = report.upper.empty() ? Json(nullptr) : Json(report.upper.string());
  j["upper_in_memory"] = report.upper_in_memory;
  j["memory_bytes"] = report.memory_bytes;
  j["layers"] = Json::array();
  for (const auto& l : report.layers) {
    j["layers"].push_back({{"index", l.index},
                           {"digest", l.digest},
                           {"hot", l.hot},
                           {"dir", l.dir.string()},
                           {"memory", l.memory},
                           {"unpacked_now", l.unpacked_now},
                           {"bytes", l.bytes}});
  }
  j["notes"] = report.notes;
  return j;
}

}  // namespace

CommandResult run_mount(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks) {
  if (line.args.size() != 2)
    return usage("mount: give the pull's DIR (or, with --lazy, an image REF) and the MOUNTPOINT");
  const PullConfig& config = line.config;
  const auto ref = config.lazy ? image_argument(line.args[0]) : std::nullopt;
  if (!ref && (!config.platform.empty() || !config.cache.empty())) {
    return usage("mount: --platform and --cache are for 'mount --lazy REF' (an image not pulled here)");
  }
  if (config.lazy) {
    if (!ref) return run_lazy_mount(line, plan, hooks, line.args[0], line.args[0], {});
    // Checked before anything is fetched for it.
    std::error_code ec;
    if (!fs::is_directory(line.args[1], ec)) {
      return usage(fmt::format("mount point '{}': not a directory", line.args[1]));
    }
    if (config.writable && !fs::is_directory(config.memory_dir, ec)) {
      return usage(
          fmt::format("--memory-dir '{}': no such directory (--writable's store is made there)", config.memory_dir));
    }
    PullDirGuard made;
    CommandOutput out;
    CFMO_ASSIGN_OR_RETURN(const fs::path dir, lazy_layout(line, plan, hooks, *ref, made, out));
    CFMO_ASSIGN_OR_RETURN(out, run_lazy_mount(line, plan, hooks, dir, line.args[0], std::move(out)));
    made.dir.clear();  // mounted: the layout stays, the mount's cache
    return out;
  }
  MountOptions options;
  options.partial = config.partial;
  options.writable = config.writable;
  CFMO_ASSIGN_OR_RETURN(const MountReport report, mount_image(line.args[0], line.args[1], options));
  CommandOutput out;
  if (!config.quiet) out.notes = report.notes;
  if (config.json) out.text = json_text(mount_json(report, line.args[1]));
  if (!report.mounted) {
    // One clear line; the per-layer directories stay, in order, for whoever can use them.
    std::string dirs;
    for (const auto& l : report.layers) {
      if (!dirs.empty()) dirs += ':';
      dirs += l.dir.string();
    }
    out.notes.push_back(fmt::format(
        "mount: cannot mount at '{}': {}; the layers are unpacked, base first, with OCI whiteouts (.wh. files), in {}",
        line.args[1], report.not_mounted, dirs));
    out.status = static_cast<int>(ErrorKind::kUsage);
    return out;
  }
  if (!config.json && !config.quiet) {
    size_t in_memory = 0;
    for (const auto& l : report.layers) in_memory += l.memory ? 1 : 0;
    std::string writes = " read-only";
    if (!report.upper.empty()) {
      writes = fmt::format(", writes kept {} in {} until umount", report.upper_in_memory ? "in memory" : "on disk",
                           report.upper.string());
    }
    out.text = fmt::format("{}: mounted {} layer(s) of {} at {} ({} from memory){}\n", kTool, report.layers.size(),
                           line.args[0], line.args[1], in_memory, writes);
  }
  return out;
}

CommandResult run_umount(const PullCommandLine& line, const PullPlan&, const CommandHooks&) {
  if (line.args.size() != 1) return usage("umount: give the MOUNTPOINT");
  CFMO_TRY(unmount_image(line.args[0]));
  CommandOutput out;
  if (!line.config.quiet) out.text = fmt::format("{}: unmounted {}\n", kTool, line.args[0]);
  return out;
}

namespace {

CommandResult list_indexes(const PullCommandLine& line, const fs::path& dir) {
  CFMO_ASSIGN_OR_RETURN(const auto indexes, read_pull_indexes(dir));
  Json layers = Json::array();
  std::string text;
  for (const auto& [layer, index] : indexes) {
    Json entries = Json::array();
    text += fmt::format("layer {} {} ({} entries)\n", layer, index.layer_digest, index.entries.size());
    for (const auto& e : index.entries) {
      const char* whiteout = e.whiteout == IndexWhiteout::kOpaque ? "opaque"
                             : e.whiteout == IndexWhiteout::kFile ? "whiteout"
                                                                  : "";
      entries.push_back({{"path", e.path},
                         {"type", entry_type_name(e.type)},
                         {"mode", e.mode},
                         {"uid", e.uid},
                         {"gid", e.gid},
                         {"size", e.size},
                         {"offset", e.offset},
                         {"link", e.link},
                         {"whiteout", *whiteout != '\0' ? Json(whiteout) : Json(nullptr)}});
      text += fmt::format("  {:<8} {:04o} {}:{} {:>12} {:>12}  {}{}{}\n", entry_type_name(e.type), e.mode, e.uid, e.gid,
                          e.size, e.offset, e.path, e.link.empty() ? "" : " -> " + e.link,
                          *whiteout != '\0' ? fmt::format(" ({})", whiteout) : "");
    }
    layers.push_back({{"layer", layer}, {"digest", index.layer_digest}, {"entries", entries}});
  }
  CommandOutput out;
  out.text = line.config.json ? json_text(Json{{"layers", layers}}) : text;
  return out;
}

}  // namespace

namespace {

/// `index REF --push`: the image pulled whole into a temporary layout under
/// the blob cache, indexed there, pushed, and the layout removed.
Result<fs::path> pull_for_index(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks,
                                const Reference& ref, PullDirGuard& guard) {
  const fs::path cache = line.config.cache.empty() ? default_blob_cache() : fs::path(line.config.cache);
  std::error_code ec;
  fs::create_directories(cache, ec);
  std::string pattern = (cache / ".index-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return make_error(ErrorKind::kInternal, "index: cannot make a directory in '{}'", cache.string());
  }
  guard.dir = pattern;
  PullOptions options = plan.pull;
  options.cold = ColdStrategy::kEager;
  options.hot.clear();
  options.memory_store = false;
  options.background = false;
  if (hooks.progress != nullptr) options.sinks.push_back(hooks.progress);
  CFMO_TRY(pull_to_layout(ref, options, guard.dir, ref.tag.empty() ? "latest" : ref.tag));
  return guard.dir;
}

Json index_json(const LayerIndexReport& r, bool from_ref) {
  return {{"layer", r.layer},
          {"digest", r.digest},
          {"mediaType", r.media_type},
          {"indexed", r.indexed},
          {"note", r.note.empty() ? Json(nullptr) : Json(r.note)},
          {"index", r.indexed && !from_ref ? Json(r.path.string()) : Json(nullptr)},
          {"entries", r.entries},
          {"checkpoints", r.checkpoints},
          {"members", r.members},
          {"uncompressed_size", r.uncompressed_size},
          {"index_bytes", r.index_bytes}};
}

}  // namespace

CommandResult run_index(const PullCommandLine& line, const PullPlan& plan, const CommandHooks& hooks) {
  if (line.args.size() != 1) return usage("index: give the pull's DIR, or REF with --push");
  const PullConfig& config = line.config;
  fs::path dir = line.args[0];
  std::error_code ec;
  PullDirGuard guard;
  const bool from_ref = !fs::is_directory(dir, ec);
  if (from_ref) {
    auto ref = parse_reference(line.args[0]);
    if (!ref || fs::exists(dir, ec) || line.args[0].find('/') == std::string::npos) {
      return usage(
          fmt::format("index: '{}' is not a directory; give the DIR of a pull (an image is indexed once it "
                      "is pulled: 'cfmo-pull pull REF --output oci:DIR')",
                      dir.string()));
    }
    if (!config.push) {
      return usage(
          fmt::format("index {}: the indexes of an image not pulled here go to its registry: add --push "
                      "(or pull it and index its DIR)",
                      line.args[0]));
    }
    if (config.list) return usage("index --list: give the pull's DIR");
    CFMO_ASSIGN_OR_RETURN(dir, pull_for_index(line, plan, hooks, *ref, guard));
  }
  if (config.list) return list_indexes(line, dir);
  CFMO_ASSIGN_OR_RETURN(const auto reports, index_pull(dir, plan.span));
  Json layers = Json::array();
  std::string text;
  for (const auto& r : reports) {
    layers.push_back(index_json(r, from_ref));
    const std::string where =
        from_ref ? std::string()
                 : fmt::format("; index {} ({})", r.path.string(), human_bytes(static_cast<int64_t>(r.index_bytes)));
    text += r.indexed
                ? fmt::format("{}: layer {} {}: {} entries, {} checkpoint(s), {} uncompressed{}{}\n", kTool, r.layer,
                              r.digest.substr(0, 19), r.entries, r.checkpoints,
                              human_bytes(static_cast<int64_t>(r.uncompressed_size)), where,
                              r.note.empty() ? "" : "; " + r.note)
                : fmt::format("{}: layer {} {}: not indexed: {}\n", kTool, r.layer, r.digest.substr(0, 19), r.note);
  }
  Json pushed_json = nullptr;
  if (config.push) {
    CFMO_ASSIGN_OR_RETURN(const PushedIndexes pushed, push_pull_indexes(dir, plan.fetch.registry, plan.fetch.hosts));
    const std::string found_by =
        pushed.referrers_api ? std::string("the referrers API")
                             : fmt::format("tag {} ({} referrer(s))", pushed.fallback_tag, pushed.fallback_entries);
    text += fmt::format("{}: pushed the indexes of {} layer(s) ({}) as artifact {}, found through {}\n", kTool,
                        pushed.layers, human_bytes(pushed.bytes), pushed.artifact, found_by);
    pushed_json = {{"artifact", pushed.artifact},
                   {"layers", pushed.layers},
                   {"bytes", pushed.bytes},
                   {"referrers_api", pushed.referrers_api},
                   {"fallback_tag", pushed.fallback_tag.empty() ? Json(nullptr) : Json(pushed.fallback_tag)},
                   {"fallback_entries", pushed.fallback_entries}};
  }
  CommandOutput out;
  if (config.json) {
    Json j = {{from_ref ? "image" : "dir", line.args[0]}, {"span", plan.span}, {"layers", layers}};
    if (config.push) j["pushed"] = pushed_json;
    out.text = json_text(j);
  } else if (!config.quiet) {
    out.text = text;
  }
  return out;
}

namespace {

CommandOutput cleanup_output(const PullConfig& config, const CleanupReport& report, const std::string& verb) {
  CommandOutput out;
  if (config.json) {
    Json removed = Json::array();
    for (const auto& r : report.removed) removed.push_back({{"path", r.path.string()}, {"bytes", r.bytes}});
    out.text = json_text(Json{{"removed", removed}, {"bytes", report.bytes}, {"kept", report.kept}});
    return out;
  }
  if (config.quiet) return out;
  for (const auto& r : report.removed) {
    out.text += fmt::format("{}: {} {} ({})\n", kTool, verb, r.path.string(), human_bytes(r.bytes));
  }
  for (const auto& k : report.kept) out.text += fmt::format("{}: kept {}\n", kTool, k);
  if (report.removed.empty()) {
    out.text += fmt::format("{}: nothing to {}\n", kTool, verb == "removed" ? "remove" : "prune");
  }
  return out;
}

}  // namespace

CommandResult run_rm(const PullCommandLine& line, const PullPlan&, const CommandHooks&) {
  if (line.args.size() != 1) return usage("rm: give the pull's DIR");
  CFMO_ASSIGN_OR_RETURN(const CleanupReport report, remove_pull(line.args[0]));
  return cleanup_output(line.config, report, "removed");
}

CommandResult run_prune(const PullCommandLine& line, const PullPlan&, const CommandHooks&) {
  if (!line.args.empty()) return usage("prune: takes no argument (--memory-dir DIR, --cache DIR)");
  // The lazy layouts first: the memory stores of those removed go with them.
  CleanupReport report;
  const fs::path cache = line.config.cache.empty() ? default_blob_cache() : fs::path(line.config.cache);
  CFMO_TRY(prune_lazy_layouts(cache, report));
  CFMO_ASSIGN_OR_RETURN(const CleanupReport stores, prune_stores(line.config.memory_dir));
  report.removed.insert(report.removed.end(), stores.removed.begin(), stores.removed.end());
  report.kept.insert(report.kept.end(), stores.kept.begin(), stores.kept.end());
  report.bytes += stores.bytes;
  return cleanup_output(line.config, report, "pruned");
}

}  // namespace cfmo::oci
