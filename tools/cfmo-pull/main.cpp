// cfmo-pull: pulls container images from an OCI Distribution registry in
// bounded memory, hot layers first, cold ones now, later or never. Parses
// flags and config, calls lib/oci, prints, and maps the result to the
// shared exit status.
#include "../common/stop_signals.h"
#include "../common/tool_main.h"
#include "background.h"
#include "console_progress.h"
#include "core/config.h"
#include "oci/cleanup.h"
#include "oci/gzip_index.h"
#include "oci/lazy_mount.h"
#include "oci/manifest.h"
#include "oci/memory_budget.h"
#include "oci/mount.h"
#include "oci/pull.h"
#include "oci/pull_config.h"
#include "oci/pull_state.h"
#include "oci/reference.h"
#include "oci/rootfs.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace {

using cfmo::oci::PullCommand;
namespace fs = std::filesystem;
namespace oci = cfmo::oci;
using Json = nlohmann::ordered_json;

constexpr const char* kTool = "cfmo-pull";

/// A failure is reported as itself, unless a signal caused it: then one line
/// says the run stopped and that nothing fetched is lost.
int fail(const cfmo::Error& error) {
  if (cfmo::tool::stop_requested().load()) {
    fmt::print(stderr, "{}: stopped by {}; what was fetched is kept, partial blobs too: the same command resumes\n",
               kTool, cfmo::tool::stop_signal_name());
    return cfmo::tool::stop_status();
  }
  return cfmo::tool::fail(kTool, error);
}

/// Everything one subcommand parsed; it stays in place because CLI11 and the
/// option table hold pointers into it.
struct Invocation {
  PullCommand id{};
  CLI::App* app = nullptr;
  oci::PullConfig config;
  cfmo::OptionTable table;
  std::string config_file;
  bool print_config = false;
  std::vector<std::string> args;  ///< the positional arguments
  char** argv = nullptr;

  Invocation() = default;
  Invocation(const Invocation&) = delete;
  Invocation& operator=(const Invocation&) = delete;
};

void print(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

std::unique_ptr<cfmo::pulltool::ConsoleProgress> console(const Invocation& inv, const oci::PullPlan& plan) {
  using Mode = cfmo::pulltool::ConsoleProgress::Mode;
  Mode mode = Mode::kNone;
  switch (plan.progress) {
    case oci::ProgressMode::kAuto:
      mode = ::isatty(STDERR_FILENO) != 0 ? Mode::kTty : Mode::kPlain;
      break;
    case oci::ProgressMode::kTty:
      mode = Mode::kTty;
      break;
    case oci::ProgressMode::kPlain:
      mode = Mode::kPlain;
      break;
    case oci::ProgressMode::kNone:
      break;
  }
  return std::make_unique<cfmo::pulltool::ConsoleProgress>(kTool, mode, !inv.config.quiet);
}

Json layers_json(const oci::Manifest& manifest) {
  Json layers = Json::array();
  for (const auto& l : manifest.layers)
    layers.push_back({{"digest", l.digest}, {"size", l.size}, {"mediaType", l.media_type}});
  return layers;
}

Json report_json(const oci::PullReport& report, const std::string& image, const std::string& output) {
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
  j["peak_rss_bytes"] = oci::peak_rss_bytes();
  j["memory_store"] = {{"dir", report.memory_dir.empty() ? Json(nullptr) : Json(report.memory_dir)},
                       {"bytes", report.memory_bytes},
                       {"capacity", report.memory_capacity}};
  j["buffer_memory"] = {{"budget", report.buffer_bytes}, {"peak", report.buffer_peak_bytes}};
  j["notes"] = report.notes;
  return j;
}

int run_inspect(Invocation& inv, const oci::PullPlan& plan) {
  auto ref = oci::parse_reference(inv.config.image);
  if (!ref) return fail(ref.error());
  auto progress = console(inv, plan);
  oci::PullOptions options = plan.pull;
  options.observer = progress.get();
  auto image = oci::inspect_image(*ref, options);
  if (!image) return fail(image.error());
  int64_t total = 0;
  for (const auto& l : image->parsed.layers) total += l.size;
  if (inv.config.json) {
    Json j;
    j["image"] = ref->to_string();
    j["index_digest"] = image->index_digest.empty() ? Json(nullptr) : Json(image->index_digest);
    j["manifest"] = {
        {"digest", image->manifest.digest}, {"mediaType", image->manifest.media_type}, {"size", image->manifest.size}};
    j["config"] = Json::parse(image->config_body, nullptr, false);
    j["layers"] = layers_json(image->parsed);
    j["total_size"] = total;
    print(j.dump(2) + "\n");
    return 0;
  }
  std::string out = fmt::format("image     {}\nmanifest  {} ({})\nconfig    {} ({} bytes)\n", ref->to_string(),
                                image->manifest.digest, image->manifest.media_type, image->parsed.config.digest,
                                image->parsed.config.size);
  if (!image->index_digest.empty()) out += fmt::format("index     {}\n", image->index_digest);
  out += fmt::format("layers    {} ({} bytes)\n", image->parsed.layers.size(), total);
  for (size_t i = 0; i < image->parsed.layers.size(); ++i) {
    const auto& l = image->parsed.layers[i];
    out += fmt::format("  {:>3}  {}  {:>12}  {}\n", i, l.digest, l.size, l.media_type);
  }
  print(out);
  return 0;
}

/// What --output asked for: an OCI layout, a rootfs, or both.
struct Outputs {
  std::string layout;  ///< oci:DIR
  std::string tag;
  std::string rootfs;  ///< rootfs:DIR
};

cfmo::Result<Outputs> parse_outputs(const oci::PullConfig& config, const oci::Reference& ref) {
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
      return cfmo::Error{cfmo::ErrorKind::kUsage,
                         fmt::format("--output '{}': expected oci:DIR[:tag] or rootfs:DIR, each at most once", output)};
    }
  }
  if (!config.cache.empty() && !out.layout.empty()) {
    return cfmo::Error{cfmo::ErrorKind::kUsage, "--cache: the blobs of a pull with --output oci: go into that layout"};
  }
  if (config.replace && out.rootfs.empty()) {
    return cfmo::Error{cfmo::ErrorKind::kUsage, "--replace: only for --output rootfs:DIR"};
  }
  return out;
}

int run_pull(Invocation& inv, const oci::PullPlan& plan) {
  if (inv.config.image.empty()) {
    return fail({cfmo::ErrorKind::kUsage, "pull: which image? give REF (or image in the --config file)"});
  }
  auto ref = oci::parse_reference(inv.config.image);
  if (!ref) return fail(ref.error());
  if (inv.config.output.empty()) {
    return fail({cfmo::ErrorKind::kUsage, "pull: --output oci:DIR[:tag] or rootfs:DIR is required"});
  }
  auto outputs = parse_outputs(inv.config, *ref);
  if (!outputs) return fail(outputs.error());
  auto progress = console(inv, plan);
  oci::PullOptions options = plan.pull;
  options.observer = progress.get();

  std::optional<oci::RootfsReport> rootfs;
  std::optional<oci::PullReport> report;
  std::string layout = outputs->layout;
  if (outputs->rootfs.empty()) {
    auto got = oci::pull_to_layout(*ref, options, layout, outputs->tag);
    if (!got) return fail(got.error());
    report = std::move(*got);
  } else {
    // A rootfs-only pull keeps its blobs in the cache (resumable, not fetched
    // twice), named there by the whole reference.
    std::string tag = outputs->tag;
    if (layout.empty()) {
      layout = inv.config.cache.empty() ? oci::default_blob_cache().string() : inv.config.cache;
      tag = ref->to_string();
      options.state_file = false;
    }
    oci::RootfsOptions rootfs_options;
    rootfs_options.dir = outputs->rootfs;
    rootfs_options.replace = inv.config.replace;
    auto got = oci::pull_to_rootfs(*ref, options, layout, tag, rootfs_options);
    if (!got) return fail(got.error());
    report = got->pull;
    rootfs = std::move(*got);
  }
  if (rootfs && rootfs->total.skipped_devices > 0 && !inv.config.quiet) {
    fmt::print(stderr, "{}: {} device node(s) not created (creating them needs root)\n", kTool,
               rootfs->total.skipped_devices);
  }

  int background_pid = 0;
  const bool pending = std::any_of(report->layers.begin(), report->layers.end(),
                                   [](const oci::LayerReport& l) { return l.state == "pending"; });
  if (options.background && pending) {
    std::error_code ec;
    const std::string absolute = fs::absolute(layout, ec).string();
    std::vector<std::string> args = {kTool, "fetch", absolute, "--progress", "plain"};
    for (auto& a : oci::fetch_arguments(inv.config, plan.pull.buffer_memory)) args.push_back(std::move(a));
    auto started = cfmo::pulltool::start_detached(args, (fs::path(absolute) / oci::kLogFile).string());
    if (!started) return fail(started.error());
    background_pid = *started;
  }
  if (inv.config.json) {
    Json j = report_json(*report, ref->to_string(), inv.config.output.front());
    j["outputs"] = inv.config.output;
    j["background_pid"] = background_pid > 0 ? Json(background_pid) : Json(nullptr);
    if (rootfs) {
      for (size_t i = 0; i < report->layers.size(); ++i) {
        j["layers"][i]["entries"] = rootfs->layers[i].entries;
        j["layers"][i]["uncompressed_bytes"] = rootfs->layers[i].uncompressed_bytes;
      }
      j["blobs"] = layout;
      j["rootfs"] = {{"dir", rootfs->dir.string()},
                     {"entries", rootfs->total.entries},
                     {"uncompressed_bytes", rootfs->total.uncompressed_bytes},
                     {"skipped_devices", rootfs->total.skipped_devices},
                     {"skipped_xattrs", rootfs->total.skipped_xattrs},
                     {"unpack_wait_s", rootfs->unpack_wait_s},
                     {"sync_s", rootfs->sync_s}};
    }
    print(j.dump(2) + "\n");
    return 0;
  }
  if (inv.config.quiet) return 0;
  if (rootfs) {
    print(fmt::format("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s) into rootfs {} ({} entries)\n",
                      kTool, ref->to_string(), report->image.manifest.digest, report->layers.size(),
                      report->bytes_fetched, report->wall_s, rootfs->dir.string(), rootfs->total.entries));
    return 0;
  }
  size_t waiting = 0;
  for (const auto& l : report->layers) waiting += l.state == "pending" ? 1 : 0;
  std::string tail;
  if (background_pid > 0) {
    tail = fmt::format("; {} cold layer(s) being fetched in the background (pid {}, log {}); see '{} status {}'",
                       waiting, background_pid, (fs::path(layout) / oci::kLogFile).string(), kTool, layout);
  } else if (waiting > 0) {
    tail = fmt::format("; {} cold layer(s) not fetched yet: '{} fetch {}' brings them (index.json is written then)",
                       waiting, kTool, layout);
  } else if (!report->complete) {
    tail = "; cold layers skipped: the layout has no index.json until they are fetched";
  }
  const std::string ready = report->ready_s >= 0 ? fmt::format(", ready after {:.2f} s", report->ready_s) : "";
  print(fmt::format("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s{}) into {}{}\n", kTool,
                    ref->to_string(), report->image.manifest.digest, report->layers.size(), report->bytes_fetched,
                    report->wall_s, ready, layout, tail));
  return 0;
}

int run_fetch(Invocation& inv, const oci::PullPlan& plan) {
  if (inv.args.empty()) return fail({cfmo::ErrorKind::kUsage, "fetch: which directory? give DIR [LAYER...]"});
  const std::string dir = inv.args[0];
  oci::FetchOptions options = plan.fetch;
  for (size_t i = 1; i < inv.args.size(); ++i) {
    auto spec = oci::parse_layer_spec(inv.args[i], "fetch");
    if (!spec) return fail(spec.error());
    options.layers.push_back(*spec);
  }
  auto progress = console(inv, plan);
  options.observer = progress.get();
  auto report = oci::fetch_layers(dir, options);
  if (!report) return fail(report.error());
  if (inv.config.json) {
    auto state = oci::read_state(dir);
    print(report_json(*report, state ? state->image : "", state ? state->output : "").dump(2) + "\n");
    return 0;
  }
  if (inv.config.quiet) return 0;
  size_t missing = 0;
  for (const auto& l : report->layers) missing += l.state == "pending" || l.state == "skipped" ? 1 : 0;
  print(fmt::format(
      "{}: fetched {} bytes into {} in {:.2f} s; {}\n", kTool, report->bytes_fetched, dir, report->wall_s,
      report->complete ? std::string("the image is complete") : fmt::format("{} layer(s) still not fetched", missing)));
  return 0;
}

int run_status(Invocation& inv, const oci::PullPlan&) {
  if (inv.args.empty()) return fail({cfmo::ErrorKind::kUsage, "status: which directory? give DIR"});
  const fs::path dir = inv.args[0];
  auto state = oci::read_state(dir);
  if (!state) return fail(state.error());
  const auto on_disk = oci::bytes_on_disk(dir, *state);
  const bool fetcher_alive = state->fetcher_pid > 0 && cfmo::process_alive(state->fetcher_pid);
  size_t fetched = 0;
  int64_t total = 0;
  int64_t have = 0;
  for (size_t i = 0; i < state->layers.size(); ++i) {
    fetched += state->layers[i].status == oci::LayerStatus::kFetched ? 1 : 0;
    total += state->layers[i].blob.size;
    have += std::min(on_disk[i], state->layers[i].blob.size);
  }
  // A layer "fetching" by a process that is gone was interrupted: it is pending, its partial blob kept.
  auto state_of = [&](const oci::LayerState& l) -> std::string {
    if (l.status == oci::LayerStatus::kFetching && !fetcher_alive) return "interrupted";
    return oci::to_string(l.status);
  };
  const auto lazy = oci::read_lazy_stats(dir);
  if (inv.config.json) {
    Json j = Json::parse(oci::state_to_json(*state));
    j["fetcher_alive"] = fetcher_alive;
    j["layers_fetched"] = fetched;
    j["bytes_on_disk"] = have;
    j["bytes_total"] = total;
    for (size_t i = 0; i < state->layers.size(); ++i) {
      j["layers"][i]["state"] = state_of(state->layers[i]);
      j["layers"][i]["bytes_on_disk"] = on_disk[i];
    }
    j["lazy"] = nullptr;
    if (lazy) {
      j["lazy"] = {{"bytes_fetched", lazy->bytes_fetched},   {"requests", lazy->requests},
                   {"spans_inflated", lazy->spans_inflated}, {"cache_bytes", lazy->cache_bytes},
                   {"cache_capacity", lazy->cache_capacity}, {"errors", lazy->errors},
                   {"mounted_at", oci::mounts_using(dir)}};
    }
    print(j.dump(2) + "\n");
    return 0;
  }
  std::string out = fmt::format("image     {}\noutput    {}\n", state->image, state->output);
  out += fmt::format("layers    {} of {} fetched ({} of {}){}\n", fetched, state->layers.size(), oci::human_bytes(have),
                     oci::human_bytes(total), state->complete ? "; complete (index.json written)" : "");
  out += fmt::format("ready     {}\n", state->ready ? fmt::format("yes, after {:.2f} s", state->ready_s) : "no");
  std::string fetcher = "none";
  if (state->fetcher_pid > 0) {
    fetcher = fetcher_alive ? fmt::format("pid {} running", state->fetcher_pid)
                            : fmt::format("pid {} gone before it finished ('{} fetch {}' resumes)", state->fetcher_pid,
                                          kTool, dir.string());
  }
  out += fmt::format("cold      {}; fetcher: {}\n", state->cold, fetcher);
  if (state->interrupted) {
    out += fmt::format("stopped   by a signal before it finished; its partial blobs are kept: '{} fetch {}' resumes\n",
                       kTool, dir.string());
  }
  if (!state->memory_dir.empty()) {
    int64_t in_memory = 0;
    for (size_t i = 0; i < state->layers.size(); ++i) {
      if (state->layers[i].location == oci::Placement::kMemory) in_memory += on_disk[i];
    }
    out += fmt::format("memory    {}: {} of {}\n", state->memory_dir, oci::human_bytes(in_memory),
                       oci::human_bytes(state->memory_capacity));
  }
  if (lazy) {
    std::string points;
    for (const auto& p : oci::mounts_using(dir)) points += (points.empty() ? "" : ", ") + p;
    out += fmt::format(
        "lazy      {} fetched by {} range request(s) ({:.1f}% of the image), {} span(s) inflated; cache {} "
        "of {}; {} error(s); {}\n",
        oci::human_bytes(lazy->bytes_fetched), lazy->requests,
        total > 0 ? 100.0 * static_cast<double>(lazy->bytes_fetched) / static_cast<double>(total) : 0.0,
        lazy->spans_inflated, oci::human_bytes(lazy->cache_bytes), oci::human_bytes(lazy->cache_capacity), lazy->errors,
        points.empty() ? std::string("not mounted") : "mounted at " + points);
  }
  for (size_t i = 0; i < state->layers.size(); ++i) {
    const auto& l = state->layers[i];
    const std::string bytes = l.status == oci::LayerStatus::kFetched
                                  ? oci::human_bytes(l.blob.size)
                                  : fmt::format("{} of {}", oci::human_bytes(std::min(on_disk[i], l.blob.size)),
                                                oci::human_bytes(l.blob.size));
    out += fmt::format("  {:>3}  {}  {}  {:<6}  {:<11}  {}{}\n", i, l.blob.digest.substr(0, 19),
                       l.hot ? "hot " : "cold", l.location == oci::Placement::kMemory ? "memory" : "disk", state_of(l),
                       bytes, l.error.empty() ? "" : "  (" + l.error + ")");
  }
  print(out);
  return 0;
}

/// The lazy mount: prepared here (where errors can still be told), then
/// served by a child that stays, detached, with its output in the log; the
/// child says through a pipe whether the mount itself worked.
int run_lazy_mount(Invocation& inv, const oci::PullPlan& plan) {
  oci::LazyMountOptions options;
  options.cache_bytes = plan.cache_bytes;
  options.max_memory = plan.pull.max_memory;
  options.jobs = plan.fetch.jobs;
  options.registry = plan.fetch.registry;
  options.hosts = plan.fetch.hosts;
  options.auth_file = plan.fetch.auth_file;
  std::error_code ec;
  if (!inv.config.record.empty()) options.record = fs::absolute(inv.config.record, ec);
  if (!inv.config.prefetch.empty()) options.prefetch = fs::absolute(inv.config.prefetch, ec);
  auto mount = oci::LazyMount::prepare(inv.args[0], inv.args[1], options);
  if (!mount) return fail(mount.error());
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return fail({cfmo::ErrorKind::kInternal, "mount: pipe failed"});
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) return fail({cfmo::ErrorKind::kInternal, "mount: fork failed"});
  if (pid == 0) {
    ::close(pipe_fds[0]);
    ::setsid();
    const int null = ::open("/dev/null", O_RDWR);
    const int log = ::open((*mount)->report().log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(null, STDIN_FILENO);
    ::dup2(log >= 0 ? log : null, STDOUT_FILENO);
    ::dup2(log >= 0 ? log : null, STDERR_FILENO);
    auto mounted = (*mount)->mount();
    const std::string answer =
        mounted ? std::string("ok")
                : fmt::format("{} {}", static_cast<int>(mounted.error().kind), mounted.error().message);
    (void)!::write(pipe_fds[1], answer.data(), answer.size());
    ::close(pipe_fds[1]);
    if (!mounted) std::_Exit(static_cast<int>(mounted.error().kind));
    const auto served = (*mount)->serve();
    std::_Exit(served ? 0 : static_cast<int>(served.error().kind));
  }
  ::close(pipe_fds[1]);
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) answer.append(buffer, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  if (answer != "ok") {
    ::waitpid(pid, nullptr, 0);
    const auto space = answer.find(' ');
    if (space == std::string::npos) return fail({cfmo::ErrorKind::kInternal, "mount: the mount's process ended"});
    return fail({static_cast<cfmo::ErrorKind>(std::stoi(answer.substr(0, space))), answer.substr(space + 1)});
  }
  const auto& report = (*mount)->report();
  int background_pid = 0;
  const bool pending =
      std::any_of(report.layers.begin(), report.layers.end(), [](const oci::LazyLayer& l) { return !l.local; });
  if (inv.config.background && pending) {
    const std::string absolute = fs::absolute(inv.args[0], ec).string();
    std::vector<std::string> args = {kTool, "fetch", absolute, "--progress", "plain"};
    for (auto& a : oci::fetch_arguments(inv.config, plan.fetch.buffer_memory)) args.push_back(std::move(a));
    auto started = cfmo::pulltool::start_detached(args, (fs::path(absolute) / oci::kLogFile).string());
    if (!started) return fail(started.error());
    background_pid = *started;
  }
  if (!inv.config.quiet && !inv.config.json) {
    for (const auto& note : report.notes) fmt::print(stderr, "{}: {}\n", kTool, note);
  }
  if (inv.config.json) {
    Json layers = Json::array();
    for (const auto& l : report.layers) {
      layers.push_back({{"index", l.index},
                        {"digest", l.digest},
                        {"hot", l.hot},
                        {"local", l.local},
                        {"index_from", l.index_from},
                        {"note", l.whole_note.empty() ? Json(nullptr) : Json(l.whole_note)}});
    }
    print(Json{{"mounted", true},
               {"lazy", true},
               {"mountpoint", inv.args[1]},
               {"pid", pid},
               {"background_pid", background_pid > 0 ? Json(background_pid) : Json(nullptr)},
               {"entries", report.entries},
               {"index_bytes", report.index_bytes},
               {"cache", report.cache.string()},
               {"cache_size", plan.cache_bytes},
               {"log", report.log.string()},
               {"layers", layers},
               {"notes", report.notes}}
              .dump(2) +
          "\n");
  } else if (!inv.config.quiet) {
    size_t cold = 0;
    for (const auto& l : report.layers) cold += l.local ? 0 : 1;
    print(
        fmt::format("{}: mounted {} lazily at {} ({} layer(s), {} of them read from the registry on first access; "
                    "pid {}, log {})\n",
                    kTool, inv.args[0], inv.args[1], report.layers.size(), cold, pid, report.log.string()));
  }
  return 0;
}

int run_mount(Invocation& inv, const oci::PullPlan& plan) {
  if (inv.args.size() != 2) {
    return fail({cfmo::ErrorKind::kUsage, "mount: give the pull's DIR and the MOUNTPOINT"});
  }
  if (inv.config.lazy) return run_lazy_mount(inv, plan);
  oci::MountOptions options;
  options.partial = inv.config.partial;
  options.writable = inv.config.writable;
  auto report = oci::mount_image(inv.args[0], inv.args[1], options);
  if (!report) return fail(report.error());
  if (!inv.config.quiet) {
    for (const auto& note : report->notes) fmt::print(stderr, "{}: {}\n", kTool, note);
  }
  if (inv.config.json) {
    Json j;
    j["mounted"] = report->mounted;
    j["mountpoint"] = inv.args[1];
    j["not_mounted"] = report->not_mounted.empty() ? Json(nullptr) : Json(report->not_mounted);
    j["upper"] = report->upper.empty() ? Json(nullptr) : Json(report->upper.string());
    j["upper_in_memory"] = report->upper_in_memory;
    j["memory_bytes"] = report->memory_bytes;
    j["layers"] = Json::array();
    for (const auto& l : report->layers) {
      j["layers"].push_back({{"index", l.index},
                             {"digest", l.digest},
                             {"hot", l.hot},
                             {"dir", l.dir.string()},
                             {"memory", l.memory},
                             {"unpacked_now", l.unpacked_now},
                             {"bytes", l.bytes}});
    }
    j["notes"] = report->notes;
    print(j.dump(2) + "\n");
  }
  if (!report->mounted) {
    // One clear line; the per-layer directories stay, in order, for whoever can use them.
    std::string dirs;
    for (const auto& l : report->layers) {
      if (!dirs.empty()) dirs += ':';
      dirs += l.dir.string();
    }
    fmt::print(stderr,
               "{}: mount: cannot mount at '{}': {}; the layers are unpacked, base first, with OCI whiteouts (.wh. "
               "files), in {}\n",
               kTool, inv.args[1], report->not_mounted, dirs);
    return static_cast<int>(cfmo::ErrorKind::kUsage);
  }
  if (!inv.config.json && !inv.config.quiet) {
    size_t in_memory = 0;
    for (const auto& l : report->layers) in_memory += l.memory ? 1 : 0;
    std::string writes = " read-only";
    if (!report->upper.empty()) {
      writes = fmt::format(", writes kept {} in {} until umount", report->upper_in_memory ? "in memory" : "on disk",
                           report->upper.string());
    }
    print(fmt::format("{}: mounted {} layer(s) of {} at {} ({} from memory){}\n", kTool, report->layers.size(),
                      inv.args[0], inv.args[1], in_memory, writes));
  }
  return 0;
}

int run_umount(Invocation& inv, const oci::PullPlan&) {
  if (inv.args.size() != 1) return fail({cfmo::ErrorKind::kUsage, "umount: give the MOUNTPOINT"});
  if (auto done = oci::unmount_image(inv.args[0]); !done) return fail(done.error());
  if (!inv.config.quiet) print(fmt::format("{}: unmounted {}\n", kTool, inv.args[0]));
  return 0;
}

int list_indexes(Invocation& inv, const fs::path& dir) {
  auto indexes = oci::read_pull_indexes(dir);
  if (!indexes) return fail(indexes.error());
  Json layers = Json::array();
  std::string out;
  for (const auto& [layer, index] : *indexes) {
    Json entries = Json::array();
    out += fmt::format("layer {} {} ({} entries)\n", layer, index.layer_digest, index.entries.size());
    for (const auto& e : index.entries) {
      const char* whiteout = e.whiteout == oci::IndexWhiteout::kOpaque ? "opaque"
                             : e.whiteout == oci::IndexWhiteout::kFile ? "whiteout"
                                                                       : "";
      entries.push_back({{"path", e.path},
                         {"type", oci::entry_type_name(e.type)},
                         {"mode", e.mode},
                         {"uid", e.uid},
                         {"gid", e.gid},
                         {"size", e.size},
                         {"offset", e.offset},
                         {"link", e.link},
                         {"whiteout", *whiteout != '\0' ? Json(whiteout) : Json(nullptr)}});
      out += fmt::format("  {:<8} {:04o} {}:{} {:>12} {:>12}  {}{}{}\n", oci::entry_type_name(e.type), e.mode, e.uid,
                         e.gid, e.size, e.offset, e.path, e.link.empty() ? "" : " -> " + e.link,
                         *whiteout != '\0' ? fmt::format(" ({})", whiteout) : "");
    }
    layers.push_back({{"layer", layer}, {"digest", index.layer_digest}, {"entries", entries}});
  }
  print(inv.config.json ? Json{{"layers", layers}}.dump(2) + "\n" : out);
  return 0;
}

int run_index(Invocation& inv, const oci::PullPlan& plan) {
  if (inv.args.size() != 1) return fail({cfmo::ErrorKind::kUsage, "index: give the pull's DIR"});
  const fs::path dir = inv.args[0];
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return fail({cfmo::ErrorKind::kUsage,
                 fmt::format("index: '{}' is not a directory; give the DIR of a pull (an image is indexed once it "
                             "is pulled: 'cfmo-pull pull REF --output oci:DIR')",
                             dir.string())});
  }
  if (inv.config.list) return list_indexes(inv, dir);
  auto reports = oci::index_pull(dir, plan.span);
  if (!reports) return fail(reports.error());
  Json layers = Json::array();
  std::string out;
  for (const auto& r : *reports) {
    layers.push_back({{"layer", r.layer},
                      {"digest", r.digest},
                      {"mediaType", r.media_type},
                      {"indexed", r.indexed},
                      {"note", r.note.empty() ? Json(nullptr) : Json(r.note)},
                      {"index", r.indexed ? Json(r.path.string()) : Json(nullptr)},
                      {"entries", r.entries},
                      {"checkpoints", r.checkpoints},
                      {"members", r.members},
                      {"uncompressed_size", r.uncompressed_size},
                      {"index_bytes", r.index_bytes}});
    out += r.indexed
               ? fmt::format("{}: layer {} {}: {} entries, {} checkpoint(s), {} uncompressed; index {} ({})\n", kTool,
                             r.layer, r.digest.substr(0, 19), r.entries, r.checkpoints,
                             oci::human_bytes(static_cast<int64_t>(r.uncompressed_size)), r.path.string(),
                             oci::human_bytes(static_cast<int64_t>(r.index_bytes)))
               : fmt::format("{}: layer {} {}: not indexed: {}\n", kTool, r.layer, r.digest.substr(0, 19), r.note);
  }
  if (inv.config.json) {
    print(Json{{"dir", dir.string()}, {"span", plan.span}, {"layers", layers}}.dump(2) + "\n");
  } else if (!inv.config.quiet) {
    print(out);
  }
  return 0;
}

int print_cleanup(Invocation& inv, const oci::CleanupReport& report, const std::string& verb) {
  if (inv.config.json) {
    Json removed = Json::array();
    for (const auto& r : report.removed) removed.push_back({{"path", r.path.string()}, {"bytes", r.bytes}});
    print(Json{{"removed", removed}, {"bytes", report.bytes}, {"kept", report.kept}}.dump(2) + "\n");
    return 0;
  }
  if (inv.config.quiet) return 0;
  std::string out;
  for (const auto& r : report.removed) {
    out += fmt::format("{}: {} {} ({})\n", kTool, verb, r.path.string(), oci::human_bytes(r.bytes));
  }
  for (const auto& k : report.kept) out += fmt::format("{}: kept {}\n", kTool, k);
  if (report.removed.empty()) out += fmt::format("{}: nothing to {}\n", kTool, verb == "removed" ? "remove" : "prune");
  print(out);
  return 0;
}

int run_rm(Invocation& inv, const oci::PullPlan&) {
  if (inv.args.size() != 1) return fail({cfmo::ErrorKind::kUsage, "rm: give the pull's DIR"});
  auto report = oci::remove_pull(inv.args[0]);
  if (!report) return fail(report.error());
  return print_cleanup(inv, *report, "removed");
}

int run_prune(Invocation& inv, const oci::PullPlan&) {
  if (!inv.args.empty()) return fail({cfmo::ErrorKind::kUsage, "prune: takes no argument (--memory-dir DIR)"});
  auto report = oci::prune_stores(inv.config.memory_dir);
  if (!report) return fail(report.error());
  return print_cleanup(inv, *report, "pruned");
}

/// The subcommands, as a table (ninja's way): name, one line of help, positional arguments, body.
struct SubcommandEntry {
  PullCommand id;
  const char* description;
  const char* args_name;
  const char* args_help;
  int (*run)(Invocation&, const oci::PullPlan&);
};

constexpr std::array<SubcommandEntry, 9> kSubcommands = {{
    {PullCommand::kPull, "pull an image: hot layers first, cold ones now, later or never", "REF",
     "image reference: [registry[:port]/]name[:tag|@digest]", run_pull},
    {PullCommand::kInspect, "print the manifest, config and layers, fetching no layer", "REF",
     "image reference: [registry[:port]/]name[:tag|@digest]", run_inspect},
    {PullCommand::kFetch, "fetch the layers a lazy pull left (all, or those named), resuming partial blobs", "DIR",
     "the pull's directory, then layers (sha256:PREFIX, N, smallest:N, top:N, last:N)", run_fetch},
    {PullCommand::kStatus, "show what a pull has fetched, what is pending, and its background fetch", "DIR",
     "the pull's directory", run_status},
    {PullCommand::kMount, "present a pull's image as one overlay file system: hot layers from memory, cold from disk",
     "DIR MOUNTPOINT", "the pull's directory and where to mount it", run_mount},
    {PullCommand::kUmount, "unmount what cfmo-pull mount mounted (and drop its writes)", "MOUNTPOINT",
     "where it is mounted", run_umount},
    {PullCommand::kIndex, "index a pull's gzip layers for seeking: file table, inflate checkpoints, span digests",
     "DIR", "the pull's directory", run_index},
    {PullCommand::kRm, "remove a pull: its layout, its memory store in /dev/shm, its unpacked layers and cache", "DIR",
     "the pull's directory", run_rm},
    {PullCommand::kPrune, "remove the memory stores whose layout is gone", "", "", run_prune},
}};

int run(int argc, char** argv) {
  CLI::App app{
      "Pull container images from an OCI Distribution registry in bounded memory: hot layers first into a\n"
      "memory-backed store, cold layers now, later or never. Every option can also be set in a TOML file\n"
      "(--config); flags override the file."};
  app.name(kTool);
  app.set_version_flag("--version", "cfmo-pull " CFMO_VERSION);
  app.require_subcommand(1);
  app.get_formatter()->column_width(34);

  std::array<Invocation, kSubcommands.size()> invocations;
  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    const auto& entry = kSubcommands[i];
    Invocation& inv = invocations[i];
    inv.id = entry.id;
    inv.argv = argv;
    inv.app = app.add_subcommand(std::string(oci::to_string(entry.id)), entry.description);
    inv.app->get_formatter()->column_width(34);
    // Checked by the subcommand, not CLI11, so that --print-config needs no argument.
    if (*entry.args_name != '\0') inv.app->add_option(entry.args_name, inv.args, entry.args_help);
    inv.app->add_option("--config", inv.config_file, "TOML file with any of the options below")->group("General");
    inv.app->add_flag("--print-config", inv.print_config, "print the merged configuration as TOML and exit")
        ->group("General");
    oci::add_pull_options(inv.table, inv.config, entry.id);
    inv.table.register_cli(*inv.app);
    // One value per occurrence (--hot 0 --hot 2), so that a list flag does not swallow REF.
    for (const char* list : {"--hot", "--mirror", "--insecure-registry", "--output"}) {
      if (auto* option = inv.app->get_option_no_throw(list)) option->allow_extra_args(false);
    }
  }

  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "cfmo-pull", true)) return *done;

  for (size_t i = 0; i < kSubcommands.size(); ++i) {
    Invocation& inv = invocations[i];
    if (!inv.app->parsed()) continue;
    if (!inv.config_file.empty()) {
      if (auto loaded = oci::load_pull_config(inv.table, inv.config_file, inv.id); !loaded) {
        return fail(loaded.error());
      }
    }
    const bool takes_ref = inv.id == PullCommand::kPull || inv.id == PullCommand::kInspect;
    if (takes_ref && !inv.args.empty()) {
      if (inv.args.size() > 1) {
        return fail({cfmo::ErrorKind::kUsage, fmt::format("{}: one image at a time (got '{}' and '{}')",
                                                          oci::to_string(inv.id), inv.args[0], inv.args[1])});
      }
      inv.config.image = inv.args[0];  // the argument wins over --image and the file
    }
    auto plan = oci::validate(inv.config, inv.id);
    if (!plan) return fail(plan.error());
    if (inv.print_config) {
      print(inv.table.to_toml());
      return 0;
    }
    if (inv.id == PullCommand::kInspect && inv.config.image.empty()) {
      return fail({cfmo::ErrorKind::kUsage, "inspect: which image? give REF (or image in the --config file)"});
    }
    // What talks to a registry stops cleanly on SIGINT/SIGTERM; the rest is quick or must not stop halfway.
    if (inv.id == PullCommand::kPull || inv.id == PullCommand::kFetch || inv.id == PullCommand::kInspect) {
      plan->pull.registry.stop = &cfmo::tool::stop_requested();
      plan->fetch.registry.stop = &cfmo::tool::stop_requested();
      cfmo::tool::catch_stop_signals();
    }
    return kSubcommands[i].run(inv, *plan);
  }
  return static_cast<int>(cfmo::ErrorKind::kUsage);  // unreachable: CLI11 requires a subcommand
}

}  // namespace

int main(int argc, char** argv) {
  return cfmo::tool::guarded(kTool, [&] { return run(argc, argv); });
}
