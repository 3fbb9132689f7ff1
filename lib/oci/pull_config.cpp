#include "oci/pull_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <sstream>

namespace cfmo::oci {
namespace {

constexpr std::array<PullCommand, 9> kCommands = {PullCommand::kPull,   PullCommand::kInspect, PullCommand::kFetch,
                                                  PullCommand::kStatus, PullCommand::kMount,   PullCommand::kUmount,
                                                  PullCommand::kIndex,  PullCommand::kRm,      PullCommand::kPrune};

bool among(PullCommand c, std::initializer_list<PullCommand> set) {
  return std::find(set.begin(), set.end(), c) != set.end();
}

Result<double> duration(const std::string& text, const char* flag, double max_s) {
  auto d = parse_duration(text);
  if (!d) return make_error(ErrorKind::kUsage, "--{}: {}", flag, d.error().message);
  if (*d > max_s) return make_error(ErrorKind::kUsage, "--{} '{}': at most {} s", flag, text, max_s);
  return *d;
}

Result<int64_t> size_flag(const std::string& text, const char* flag) {
  auto s = parse_size(text);
  if (!s) return make_error(ErrorKind::kUsage, "--{}: {}", flag, s.error().message);
  if (*s > (uint64_t{1} << 50)) return make_error(ErrorKind::kUsage, "--{} '{}': too large", flag, text);
  return static_cast<int64_t>(*s);
}

}  // namespace

std::string_view to_string(PullCommand command) {
  switch (command) {
    case PullCommand::kPull:
      return "pull";
    case PullCommand::kInspect:
      return "inspect";
    case PullCommand::kFetch:
      return "fetch";
    case PullCommand::kStatus:
      return "status";
    case PullCommand::kMount:
      return "mount";
    case PullCommand::kUmount:
      return "umount";
    case PullCommand::kIndex:
      return "index";
    case PullCommand::kRm:
      return "rm";
    case PullCommand::kPrune:
      return "prune";
  }
  return "?";
}

void add_pull_options(OptionTable& t, PullConfig& c, PullCommand s) {
  using enum PullCommand;
  const std::string image = "Image";
  if (among(s, {kPull, kInspect})) {
    t.add("image", &c.image, "the image reference, [registry[:port]/]name[:tag|@digest] (or the REF argument)", image);
    t.add("platform", &c.platform, "os/arch[/variant] to choose from an index (empty: this machine's)", image);
  }
  if (s == kPull) {
    t.add("output", &c.output,
          "where the image goes: oci:DIR[:tag] (an OCI layout), rootfs:DIR (its layers unpacked), or both", image,
          "-o");
    t.add("cache", &c.cache, "blob store of a pull without oci: (empty: $XDG_CACHE_HOME/cfmo-pull, ~/.cache/cfmo-pull)",
          image);
    t.add("replace", &c.replace, "replace a rootfs:DIR that is not empty, once the new tree is complete", image);
  }

  if (s == kMount) {
    t.add("platform", &c.platform, "--lazy REF: os/arch[/variant] to choose from an index (empty: this machine's)",
          image);
    t.add("cache", &c.cache,
          "--lazy REF: where the image's layout, indexes and span cache are kept, in lazy/NAME-DIGEST (empty: "
          "$XDG_CACHE_HOME/cfmo-pull, ~/.cache/cfmo-pull)",
          image);
  }
  if (s == kIndex) {
    t.add("cache", &c.cache,
          "index REF: where the image is pulled while it is indexed, removed after (empty: $XDG_CACHE_HOME/cfmo-pull, "
          "~/.cache/cfmo-pull)",
          image);
  }

  const std::string registry = "Registry";
  if (among(s, {kPull, kInspect, kFetch, kMount, kIndex})) {
    t.add("plain_http", &c.plain_http, "speak HTTP, not HTTPS, to every registry and mirror", registry);
    t.add("insecure_registry", &c.insecure_registry,
          "speak plain HTTP to this host (HOST or HOST:PORT; repeatable), HTTPS to the others", registry);
    t.add("mirror", &c.mirror,
          "try this mirror (HOST[:PORT], http:// for plain HTTP) before the image's registry; repeatable, in order",
          registry);
    t.add("authfile", &c.authfile,
          "docker config.json with credentials (empty: $DOCKER_CONFIG/config.json, ~/.docker/config.json)", registry);
    if (s == kMount) {
      t.add("jobs", &c.jobs, "--lazy: reads of cold files served in parallel (1 to 64)", registry);
    } else if (s != kInspect) {
      t.add("jobs", &c.jobs, "blobs downloaded in parallel (1 to 64)", registry);
    }
    t.add("retries", &c.retries, "attempts after the first on connection errors, 408, 429 and 5xx (0 to 100)",
          registry);
    t.add("retry_delay", &c.retry_delay, "first backoff (e.g. 0.5s); doubles per attempt, with jitter", registry);
    t.add("retry_max_delay", &c.retry_max_delay, "longest backoff, Retry-After included (e.g. 30s)", registry);
    t.add("stall_timeout", &c.stall_timeout, "abort and retry a transfer slower than 1 KiB/s for this long", registry);
    t.add("request_timeout", &c.request_timeout, "longest one request may take, body included (0: no limit)", registry);
    if (s != kMount) {
      t.add("timeout", &c.timeout, "longest the whole command may take, retries included (0: no limit; e.g. 30s)",
            registry);
    }
  }

  const std::string layers = "Hot and cold layers";
  if (s == kPull) {
    t.add("hot", &c.hot,
          "hot layers, fetched first into the memory store: sha256:PREFIX, index N or -N, smallest:N, top:N (the "
          "first N in manifest order), last:N, all, none; repeatable",
          layers);
    t.add("max_memory", &c.max_memory,
          "memory this pull may use: the memory store of hot layers plus the download buffers (e.g. 2G)", layers);
  }
  if (among(s, {kPull, kFetch})) {
    t.add("buffer_memory", &c.buffer_memory,
          "download buffers shared by the parallel downloads (empty: 16M, or max_memory/4 when less)", layers);
  }
  if (s == kPull) {
    t.add("spill", &c.spill, "put hot layers that do not fit in the memory store on disk (with a warning)", layers);
    t.add("cold", &c.cold, "what happens to the other layers: eager (fetch them now), lazy (later) or skip", layers);
    t.add("background", &c.background,
          "fetch the cold layers in a detached process once the hot ones are ready (its log: DIR/cfmo-pull.log)",
          layers);
    t.add("ready_file", &c.ready_file, "file written the moment the hot layers are complete (empty: none)", layers);
    t.add("memory_dir", &c.memory_dir, "memory-backed directory (tmpfs) the memory store is made in", layers);
  }
  if (s == kPrune) {
    t.add("memory_dir", &c.memory_dir, "memory-backed directory whose cfmo-pull-* stores are pruned", "Cleaning up");
    t.add("cache", &c.cache,
          "the cache whose lazy/ layouts of mount --lazy REF are pruned when unused (empty: $XDG_CACHE_HOME/cfmo-pull, "
          "~/.cache/cfmo-pull)",
          "Cleaning up");
  }

  if (s == kMount) {
    const std::string mounting = "Mounting";
    t.add("lazy", &c.lazy,
          "a FUSE mount whose files are fetched on first read (HTTP Range, by the layers' indexes) into a cache",
          mounting);
    t.add("cache_size", &c.cache_size, "--lazy: the on-disk cache of inflated spans, least recently used first out",
          mounting);
    t.add("max_memory", &c.max_memory,
          "--lazy: memory the whole mount may use: its process and indexes, the background fetch, and --writable's "
          "writes in memory (a tmpfs of what is left: ENOSPC past it)",
          mounting);
    t.add("background", &c.background,
          "--lazy: fetch the layers not fetched yet in a detached process meanwhile (the mount reads them locally "
          "once there)",
          mounting);
    t.add("record", &c.record, "--lazy: append the path of each file the mount serves, once, in order, to this file",
          mounting);
    t.add("prefetch", &c.prefetch,
          "--lazy: a file of paths (one a line, as --record writes) whose spans are fetched first", mounting);
    t.add("partial", &c.partial, "mount though some layers are not fetched yet (their files are missing)", mounting);
    t.add("writable", &c.writable,
          "add an upper directory, dropped at umount: in the memory store if the pull has one, else on disk; "
          "--lazy REF: in a memory store of the mount's own",
          mounting);
    t.add("memory_dir", &c.memory_dir,
          "--lazy REF --writable: memory-backed directory (tmpfs) the mount's memory store for its writes is made in",
          mounting);
  }
  if (among(s, {kPull, kFetch})) {
    const std::string indexing = "Indexing";
    t.add("build_index", &c.build_index,
          "build each layer's seekable index from its bytes while it downloads, into DIR/cfmo-index (as 'index' "
          "would, without reading the layer again), for a later mount --lazy",
          indexing);
    t.add("span", &c.span, "--build-index: uncompressed bytes between two checkpoints (at least 64K)", indexing);
  }
  if (s == kIndex) {
    const std::string indexing = "Indexing";
    t.add("span", &c.span, "uncompressed bytes between two checkpoints of a gzip layer's index (at least 64K)",
          indexing);
    t.add("list", &c.list, "print the file tables of the indexes already made instead of making them", indexing);
    t.add("push", &c.push,
          "store the indexes in the image's registry as an OCI artifact whose subject is the image, for every later "
          "pull to find",
          indexing);
  }
  const std::string output = "Output";
  if (s != kUmount) t.add("json", &c.json, "print a JSON report on stdout", output);
  if (among(s, {kPull, kFetch, kMount, kUmount, kIndex, kRm, kPrune})) {
    t.add("quiet", &c.quiet, "print nothing but errors (and the JSON report)", output, "-q");
  }
  if (among(s, {kPull, kFetch})) {
    t.add("progress", &c.progress,
          "per-layer progress on stderr: auto (tty on a terminal, else plain), tty, plain, none", output);
  }
}

Status load_pull_config(OptionTable& table, const std::filesystem::path& file, PullCommand command) {
  SharedConfigShape shape;
  for (const PullCommand c : kCommands) shape.subcommands.emplace_back(to_string(c));
  shape.knows = [](size_t c, std::string_view key) {
    PullConfig scratch;
    OptionTable t;
    add_pull_options(t, scratch, kCommands[c]);
    return t.has(key);
  };
  const auto index = static_cast<size_t>(std::find(kCommands.begin(), kCommands.end(), command) - kCommands.begin());
  return load_shared_config(table, file, shape, index);
}

Result<PullPlan> validate(const PullConfig& c, PullCommand s) {
  using enum PullCommand;
  PullPlan plan;
  if (c.progress == "auto") {
    plan.progress = ProgressMode::kAuto;
  } else if (c.progress == "tty") {
    plan.progress = ProgressMode::kTty;
  } else if (c.progress == "plain") {
    plan.progress = ProgressMode::kPlain;
  } else if (c.progress == "none") {
    plan.progress = ProgressMode::kNone;
  } else {
    return make_error(ErrorKind::kUsage, "--progress '{}': expected auto, tty, plain or none", c.progress);
  }
  if (c.json || c.quiet) plan.progress = ProgressMode::kNone;

  RegistryOptions r;
  if (c.retries < 0 || c.retries > 100) return make_error(ErrorKind::kUsage, "--retries {}: 0 to 100", c.retries);
  if (c.jobs < 1 || c.jobs > 64) return make_error(ErrorKind::kUsage, "--jobs {}: 1 to 64", c.jobs);
  r.retries = c.retries;
  CFMO_ASSIGN_OR_RETURN(r.retry_base_s, duration(c.retry_delay, "retry-delay", 3600));
  CFMO_ASSIGN_OR_RETURN(r.retry_max_delay_s, duration(c.retry_max_delay, "retry-max-delay", 3600));
  CFMO_ASSIGN_OR_RETURN(const double stall, duration(c.stall_timeout, "stall-timeout", 3600));
  if (stall < 1) return make_error(ErrorKind::kUsage, "--stall-timeout '{}': at least 1 s", c.stall_timeout);
  r.stall_timeout_s = static_cast<long>(std::ceil(stall));
  CFMO_ASSIGN_OR_RETURN(r.request_timeout_s, duration(c.request_timeout, "request-timeout", 1e6));
  CFMO_ASSIGN_OR_RETURN(const double timeout, duration(c.timeout, "timeout", 1e6));
  if (timeout > 0) {
    r.timeout_s = timeout;
    r.deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                        std::chrono::duration<double>(timeout));
  }
  r.auth_file = c.authfile;
  HostSettings hosts{c.mirror, c.insecure_registry, c.plain_http};
  // Checked now (a usage error before any request), used per pull.
  CFMO_TRY(endpoints_for(Reference{"registry.invalid", "x", "latest", ""}, hosts));

  CFMO_ASSIGN_OR_RETURN(const int64_t max_memory, size_flag(c.max_memory, "max-memory"));
  if (max_memory < (int64_t{1} << 20)) {
    return make_error(ErrorKind::kUsage, "--max-memory '{}': at least 1M", c.max_memory);
  }
  int64_t buffers = std::min<int64_t>(int64_t{16} << 20, max_memory / 4);
  if (!c.buffer_memory.empty()) {
    CFMO_ASSIGN_OR_RETURN(buffers, size_flag(c.buffer_memory, "buffer-memory"));
    if (buffers < (int64_t{256} << 10)) {
      return make_error(ErrorKind::kUsage, "--buffer-memory '{}': at least 256K", c.buffer_memory);
    }
    if (s == kPull && buffers >= max_memory) {
      return make_error(ErrorKind::kUsage, "--buffer-memory {} must be less than --max-memory {}", c.buffer_memory,
                        c.max_memory);
    }
  }

  PullOptions& p = plan.pull;
  p.registry = r;
  p.hosts = hosts;
  p.jobs = c.jobs;
  if (c.platform.empty()) {
    p.platform = host_platform();
  } else {
    CFMO_ASSIGN_OR_RETURN(p.platform, parse_platform(c.platform));
  }
  for (const auto& text : c.hot) {
    CFMO_ASSIGN_OR_RETURN(auto spec, parse_layer_spec(text, "--hot"));
    p.hot.push_back(std::move(spec));
  }
  p.max_memory = max_memory;
  p.buffer_memory = buffers;
  p.spill = c.spill;
  CFMO_ASSIGN_OR_RETURN(p.cold, parse_cold_strategy(c.cold));
  p.background = c.background;
  if (c.background && p.cold == ColdStrategy::kSkip) {
    return make_error(ErrorKind::kUsage, "--background with --cold skip: there is nothing to fetch in the background");
  }
  if (c.memory_dir.empty()) return make_error(ErrorKind::kUsage, "--memory-dir: empty");
  p.memory_dir = c.memory_dir;
  p.ready_file = c.ready_file;
  if (!c.ready_file.empty()) {
    std::error_code ec;
    const auto parent = std::filesystem::absolute(c.ready_file, ec).parent_path();
    if (!std::filesystem::is_directory(parent, ec)) {
      return make_error(ErrorKind::kUsage, "--ready-file '{}': directory '{}' does not exist", c.ready_file,
                        parent.string());
    }
  }

  FetchOptions& f = plan.fetch;
  f.registry = r;
  if (!c.mirror.empty() || !c.insecure_registry.empty() || c.plain_http) f.hosts = hosts;
  if (!c.authfile.empty()) f.auth_file = c.authfile;
  f.jobs = c.jobs;
  f.buffer_memory = buffers;
  CFMO_ASSIGN_OR_RETURN(const int64_t span, size_flag(c.span, "span"));
  if (span < (64 << 10)) return make_error(ErrorKind::kUsage, "--span '{}': at least 64K", c.span);
  plan.span = static_cast<uint64_t>(span);
  CFMO_ASSIGN_OR_RETURN(const int64_t cache, size_flag(c.cache_size, "cache-size"));
  if (cache < (int64_t{16} << 20))
    return make_error(ErrorKind::kUsage, "--cache-size '{}': at least 16M", c.cache_size);
  plan.cache_bytes = static_cast<uint64_t>(cache);
  if (s == kMount && c.partial && c.lazy) {
    return make_error(ErrorKind::kUsage, "--lazy: a lazy mount is whole (no --partial)");
  }
  return plan;
}

std::vector<std::string> fetch_arguments(const PullConfig& c, int64_t buffer_memory) {
  std::vector<std::string> args = {"--jobs",
                                   std::to_string(c.jobs),
                                   "--retries",
                                   std::to_string(c.retries),
                                   "--retry-delay",
                                   c.retry_delay,
                                   "--retry-max-delay",
                                   c.retry_max_delay,
                                   "--stall-timeout",
                                   c.stall_timeout,
                                   "--request-timeout",
                                   c.request_timeout,
                                   "--timeout",
                                   c.timeout,
                                   "--buffer-memory",
                                   std::to_string(buffer_memory)};
  if (c.build_index) args.insert(args.end(), {"--build-index", "--span", c.span});
  return args;
}

}  // namespace cfmo::oci
