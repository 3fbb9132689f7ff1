// cfmo-pull: pulls a container image from an OCI Distribution registry into
// an OCI image layout and/or a root filesystem, streaming and verifying every
// blob and unpacking layers while they download. Parses flags,
// calls lib/oci, prints, and maps the result to the shared exit status.
#include "../common/tool_main.h"
#include "oci/manifest.h"
#include "oci/pull.h"
#include "oci/reference.h"
#include "oci/rootfs.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr const char* kTool = "cfmo-pull";
using Json = nlohmann::ordered_json;

int fail(const cfmo::Error& error) { return cfmo::tool::fail(kTool, error); }

/// What the flags of one subcommand set.
struct Invocation {
  std::string reference;
  std::vector<std::string> outputs;
  std::string cache;
  bool replace = false;
  std::string platform;
  std::string authfile;
  bool plain_http = false;
  bool json = false;
  int jobs = 4;
  int retries = 5;
  double retry_delay = 0.5;
  double retry_max_delay = 30;
  long stall_timeout = 30;
  double request_timeout = 0;
  double timeout = 0;
};

void add_registry_flags(CLI::App& app, Invocation& inv) {
  app.add_option("REF", inv.reference, "image reference: [registry[:port]/]name[:tag|@digest]")->required();
  app.add_flag("--plain-http", inv.plain_http, "speak HTTP, not HTTPS, to the registry (a local test registry)");
  app.add_option("--platform", inv.platform, "os/arch[/variant] to choose from an index (default: this machine's)");
  app.add_option("--authfile", inv.authfile,
                 "docker config.json with credentials (default: $DOCKER_CONFIG/config.json, ~/.docker/config.json)");
  app.add_option("--retries", inv.retries, "attempts after the first on connection errors, 408, 429 and 5xx")
      ->check(CLI::Range(0, 100));
  app.add_option("--retry-delay", inv.retry_delay, "first backoff in seconds; doubles per attempt, with jitter")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--retry-max-delay", inv.retry_max_delay, "longest backoff in seconds, Retry-After included")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--stall-timeout", inv.stall_timeout, "abort and retry a transfer slower than 1 KiB/s for this long")
      ->check(CLI::Range(1, 3600));
  app.add_option("--request-timeout", inv.request_timeout, "seconds one request may take, body included; 0: no limit")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--timeout", inv.timeout, "seconds the whole command may take, retries included; 0: no limit")
      ->check(CLI::Range(0.0, 1e6));
  app.add_flag("--json", inv.json, "print a JSON report on stdout");
}

cfmo::Result<cfmo::oci::PullOptions> pull_options(const Invocation& inv) {
  cfmo::oci::PullOptions options;
  options.registry.plain_http = inv.plain_http;
  options.registry.retries = inv.retries;
  options.registry.retry_base_s = inv.retry_delay;
  options.registry.retry_max_delay_s = inv.retry_max_delay;
  options.registry.stall_timeout_s = inv.stall_timeout;
  options.registry.auth_file = inv.authfile;
  options.registry.request_timeout_s = inv.request_timeout;
  if (inv.timeout > 0) {
    options.registry.timeout_s = inv.timeout;
    options.registry.deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(inv.timeout));
  }
  options.jobs = inv.jobs;
  if (inv.platform.empty()) {
    options.platform = cfmo::oci::host_platform();
  } else {
    CFMO_ASSIGN_OR_RETURN(options.platform, cfmo::oci::parse_platform(inv.platform));
  }
  return options;
}

Json layers_json(const cfmo::oci::Manifest& manifest) {
  Json layers = Json::array();
  for (const auto& l : manifest.layers)
    layers.push_back({{"digest", l.digest}, {"size", l.size}, {"mediaType", l.media_type}});
  return layers;
}

int run_inspect(const Invocation& inv) {
  auto ref = cfmo::oci::parse_reference(inv.reference);
  if (!ref) return fail(ref.error());
  auto options = pull_options(inv);
  if (!options) return fail(options.error());
  auto credentials = cfmo::oci::load_credentials(ref->api_host(), inv.authfile);
  if (!credentials) return fail(credentials.error());
  auto image = cfmo::oci::inspect_image(*ref, *options, *credentials);
  if (!image) return fail(image.error());
  int64_t total = 0;
  for (const auto& l : image->parsed.layers) total += l.size;
  if (inv.json) {
    Json j;
    j["image"] = ref->to_string();
    j["index_digest"] = image->index_digest.empty() ? Json(nullptr) : Json(image->index_digest);
    j["manifest"] = {
        {"digest", image->manifest.digest}, {"mediaType", image->manifest.media_type}, {"size", image->manifest.size}};
    j["config"] = Json::parse(image->config_body, nullptr, false);
    j["layers"] = layers_json(image->parsed);
    j["total_size"] = total;
    fmt::print("{}\n", j.dump(2));
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
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

/// What --output asked for: an OCI layout, a rootfs, or both.
struct Outputs {
  std::string layout;  ///< oci:DIR
  std::string tag;
  std::string rootfs;  ///< rootfs:DIR
};

cfmo::Result<Outputs> parse_outputs(const Invocation& inv, const cfmo::oci::Reference& ref) {
  Outputs out;
  for (const auto& output : inv.outputs) {
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
  if (!inv.cache.empty() && !out.layout.empty()) {
    return cfmo::Error{cfmo::ErrorKind::kUsage, "--cache: the blobs of a pull with --output oci: go into that layout"};
  }
  if (inv.replace && out.rootfs.empty()) {
    return cfmo::Error{cfmo::ErrorKind::kUsage, "--replace: only for --output rootfs:DIR"};
  }
  return out;
}

int run_pull(const Invocation& inv) {
  auto ref = cfmo::oci::parse_reference(inv.reference);
  if (!ref) return fail(ref.error());
  auto outputs = parse_outputs(inv, *ref);
  if (!outputs) return fail(outputs.error());
  auto options = pull_options(inv);
  if (!options) return fail(options.error());
  auto credentials = cfmo::oci::load_credentials(ref->api_host(), inv.authfile);
  if (!credentials) return fail(credentials.error());

  cfmo::Result<cfmo::oci::PullReport> report = cfmo::Error{};
  std::optional<cfmo::oci::RootfsReport> rootfs;
  std::string layout = outputs->layout;
  if (outputs->rootfs.empty()) {
    report = cfmo::oci::pull_to_layout(*ref, *options, *credentials, layout, outputs->tag);
  } else {
    // A rootfs-only pull keeps its blobs in the cache (resumable, not fetched
    // twice), named there by the whole reference.
    std::string tag = outputs->tag;
    if (layout.empty()) {
      layout = inv.cache.empty() ? cfmo::oci::default_blob_cache().string() : inv.cache;
      tag = ref->to_string();
    }
    cfmo::oci::RootfsOptions rootfs_options;
    rootfs_options.dir = outputs->rootfs;
    rootfs_options.replace = inv.replace;
    auto got = cfmo::oci::pull_to_rootfs(*ref, *options, *credentials, layout, tag, rootfs_options);
    if (!got) return fail(got.error());
    report = got->pull;
    rootfs = std::move(*got);
  }
  if (!report) return fail(report.error());
  if (rootfs && rootfs->total.skipped_devices > 0) {
    fmt::print(stderr, "{}: {} device node(s) not created (creating them needs root)\n", kTool,
               rootfs->total.skipped_devices);
  }
  if (inv.json) {
    Json j;
    j["image"] = ref->to_string();
    j["output"] = inv.outputs.front();
    j["outputs"] = inv.outputs;
    j["manifest_digest"] = report->image.manifest.digest;
    j["layout_manifest_digest"] = report->layout_manifest.digest;
    j["layers"] = Json::array();
    for (size_t i = 0; i < report->layers.size(); ++i) {
      const auto& l = report->layers[i];
      Json layer = {{"digest", l.digest}, {"size", l.size}, {"state", l.state}, {"seconds", l.seconds}};
      if (rootfs) {
        layer["entries"] = rootfs->layers[i].entries;
        layer["uncompressed_bytes"] = rootfs->layers[i].uncompressed_bytes;
      }
      j["layers"].push_back(layer);
    }
    j["bytes_fetched"] = report->bytes_fetched;
    if (rootfs) {
      j["blobs"] = layout;
      j["rootfs"] = {{"dir", rootfs->dir.string()},
                     {"entries", rootfs->total.entries},
                     {"uncompressed_bytes", rootfs->total.uncompressed_bytes},
                     {"skipped_devices", rootfs->total.skipped_devices},
                     {"skipped_xattrs", rootfs->total.skipped_xattrs},
                     {"unpack_wait_s", rootfs->unpack_wait_s},
                     {"sync_s", rootfs->sync_s}};
    }
    j["wall_s"] = report->wall_s;
    fmt::print("{}\n", j.dump(2));
  } else if (rootfs) {
    fmt::print("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s) into rootfs {} ({} entries)\n", kTool,
               ref->to_string(), report->image.manifest.digest, report->layers.size(), report->bytes_fetched,
               report->wall_s, rootfs->dir.string(), rootfs->total.entries);
  } else {
    fmt::print("{}: pulled {} ({}, {} layer(s), {} bytes fetched in {:.2f} s) into {}\n", kTool, ref->to_string(),
               report->image.manifest.digest, report->layers.size(), report->bytes_fetched, report->wall_s, layout);
  }
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{
      "Pull container images from an OCI Distribution registry into an OCI image layout, streaming\n"
      "and verifying every blob."};
  app.name(kTool);
  app.set_version_flag("--version", "cfmo-pull 0.1.0");
  app.require_subcommand(1);
  app.get_formatter()->column_width(30);

  Invocation pull_inv;
  CLI::App* pull = app.add_subcommand(
      "pull", "pull an image into an OCI layout (--output oci:DIR[:tag]) and/or a root filesystem (rootfs:DIR)");
  pull->get_formatter()->column_width(30);
  add_registry_flags(*pull, pull_inv);
  pull->add_option("--output", pull_inv.outputs,
                   "where the image goes: oci:DIR[:tag] (an OCI layout), rootfs:DIR (its layers unpacked), or both")
      ->required();
  pull->add_option("--cache", pull_inv.cache,
                   "blob store of a pull without oci: (default: $XDG_CACHE_HOME/cfmo-pull, ~/.cache/cfmo-pull)");
  pull->add_flag("--replace", pull_inv.replace,
                 "replace a rootfs:DIR that is not empty, once the new tree is complete");
  pull->add_option("--jobs", pull_inv.jobs, "blobs downloaded in parallel")->check(CLI::Range(1, 64));

  Invocation inspect_inv;
  CLI::App* inspect = app.add_subcommand("inspect", "print the manifest, config and layers, fetching no layer");
  inspect->get_formatter()->column_width(30);
  add_registry_flags(*inspect, inspect_inv);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "{}: {}\nRun '{} --help' for the subcommands, '{} SUBCOMMAND --help' for their options.\n",
               kTool, e.what(), kTool, kTool);
    return static_cast<int>(cfmo::ErrorKind::kUsage);
  }
  if (pull->parsed()) return run_pull(pull_inv);
  return run_inspect(inspect_inv);
}

}  // namespace

int main(int argc, char** argv) {
  return cfmo::tool::guarded(kTool, [&] { return run(argc, argv); });
}
