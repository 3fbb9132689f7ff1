// The lazy mount. The tree is built once from the indexes and never
// changes, so every answer the kernel gets about it is cached for an hour
// (entries, attributes, and file pages: keep_cache). Chunks are the
// uncompressed spans between two checkpoints: the unit a Range request
// fetches and one SHA-256 verifies, so a chunk on disk is always whole and
// checked (written to a temporary file, renamed into place).
#define FUSE_USE_VERSION 35
#include "oci/lazy_mount.h"

#include "core/atomic_file.h"
#include "core/dir_lock.h"
#include "core/fd.h"
#include "core/parallel.h"
#include "oci/blob.h"
#include "oci/cleanup.h"
#include "oci/memory_budget.h"
#include "oci/mount.h"
#include "oci/pull.h"
#include "oci/pull_state.h"
#include "oci/span_fds.h"
#include "oci/unpack.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/fanotify.h>
#include <sys/mount.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_frameHeader, ZSTD_estimateDStreamSize: the decoder's memory
#include <zstd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace cfmo::oci {

namespace fs = std::filesystem;

size_t LazyTree::child(size_t ino, std::string_view name) const {
  const auto& kids = node(ino).kids;
  const auto it =
      std::lower_bound(kids.begin(), kids.end(), name,
                       [](const std::pair<std::string, size_t>& k, std::string_view n) { return k.first < n; });
  return it != kids.end() && it->first == name ? it->second : 0;
}

size_t LazyTree::resolve(std::string_view path) const {
  size_t ino = 1;
  while (!path.empty()) {
    const auto slash = path.find('/');
    const std::string_view part = path.substr(0, slash);
    path = slash == std::string_view::npos ? std::string_view() : path.substr(slash + 1);
    if (part.empty() || part == ".") continue;
    if (node(ino).type != '5') return 0;
    ino = child(ino, part);
    if (ino == 0) return 0;
  }
  return ino;
}

std::string LazyTree::path(size_t ino) const {
  std::string out;
  for (size_t at = ino; at != 1 && !node(at).name.empty(); at = node(at).parent) out = "/" + node(at).name + out;
  return out.empty() ? "/" : out;
}

namespace {

/// Writes `text` to `path` through a temporary file renamed over it, without
/// the fsyncs of write_file_atomic: for files a reboot makes moot (the
/// counts, the record of a mount, which is gone after a reboot anyway),
/// written while a reader or the mount command waits.
void replace_file(const fs::path& path, const std::string& text) {
  const fs::path temp = path.string() + ".tmp";
  Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd || ::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) return;
  fd.reset();
  (void)::rename(temp.c_str(), path.c_str());
}

constexpr double kForever = 3600;        ///< seconds the kernel may cache what never changes
constexpr size_t kOpenSpans = 64;        ///< span files kept open for reads (SpanFds)
constexpr int kSessionThreads = 4;       ///< threads reading the FUSE device (LazyMount::Impl::session)
constexpr size_t kIndexThreads = 4;      ///< threads reading the indexes as the mount starts (prepare)
constexpr int kWakeSignal = SIGUSR2;     ///< interrupts a session thread's read of the device at the end
constexpr unsigned kMaxRead = 1u << 20;  ///< the largest read libfuse 3.14 lets the kernel send (FUSE_MAX_MAX_PAGES)
constexpr int kFillThreads = 2;          ///< threads storing pages into the page cache (Impl::fill)
constexpr size_t kFillQueue = 64;        ///< spans waiting to be stored into the page cache (Impl::fill)
constexpr size_t kFillsRemembered = size_t{1} << 15;  ///< (file, span) pairs remembered a mount, at most (~1.5 MB)

/// The size of the kernel's read requests (and the mount's readahead): as
/// large as one reply can be spliced. libfuse splices a reply through a
/// pipe only if the pipe holds the data plus a page per buffer and two
/// more; a pipe grows to /proc/sys/fs/pipe-max-size (1 MiB) without
/// CAP_SYS_RESOURCE, so a 1 MiB reply never fitted and every one was
/// copied into a fresh 1 MiB buffer instead (3-4 ms each on a loaded
/// machine: page faults, pread, munmap). Eight pages are left for the
/// header and the span boundaries a read crosses.
unsigned max_read_size() {
  const long page = ::sysconf(_SC_PAGESIZE);
  long pipe_max = 1 << 20;
  std::ifstream("/proc/sys/fs/pipe-max-size") >> pipe_max;
  const long fits = (pipe_max - 8 * page) / page * page;
  return static_cast<unsigned>(std::clamp<long>(fits, 32 * page, kMaxRead));
}

class TreeBuilder {
 public:
  TreeBuilder() {
    LazyNode root;
    root.parent = 1;
    tree_.nodes.push_back(root);
  }

  Status add_layer(const LayerIndex& index, int layer) {
    for (const auto& e : index.entries) CFMO_TRY(add(e, layer, index.layer_digest));
    return {};
  }

  LazyTree finish() {
    for (const auto& [name, mode] : {std::pair{"proc", 0555u}, {"sys", 0555u}, {"dev", 0755u}}) {
      if (tree_.child(1, name) == 0) {
        LazyNode d;
        d.mode = mode;
        link(1, name, make(std::move(d)));
      }
    }
    // A directory's link count: itself, its entry in the parent, and each subdirectory's "..".
    std::vector<uint32_t> subdirs(tree_.nodes.size(), 0);
    for (const auto& n : tree_.nodes) {
      for (const auto& [name, kid] : n.kids) subdirs[&n - tree_.nodes.data()] += tree_.node(kid).type == '5' ? 1 : 0;
    }
    for (size_t i = 0; i < tree_.nodes.size(); ++i) {
      if (tree_.nodes[i].type == '5') tree_.nodes[i].nlink = 2 + subdirs[i];
    }
    return std::move(tree_);
  }

 private:
  LazyNode& at(size_t ino) { return tree_.nodes[ino - 1]; }

  size_t make(LazyNode n) {
    tree_.nodes.push_back(std::move(n));
    return tree_.nodes.size();
  }

  void link(size_t dir, const std::string& name, size_t ino) {
    auto& kids = at(dir).kids;
    const auto it =
        std::lower_bound(kids.begin(), kids.end(), name,
                         [](const std::pair<std::string, size_t>& k, const std::string& n) { return k.first < n; });
    kids.insert(it, {name, ino});
    if (at(ino).type == '5' || at(ino).name.empty()) {
      at(ino).parent = dir;
      at(ino).name = name;
    }
  }

  /// Takes `name` out of `dir`; what it named loses a link (a directory, all it holds).
  void unlink(size_t dir, std::string_view name) {
    auto& kids = at(dir).kids;
    const auto it = std::find_if(kids.begin(), kids.end(), [&](const auto& k) { return k.first == name; });
    if (it == kids.end()) return;
    const size_t ino = it->second;
    kids.erase(it);
    drop(ino);
  }

  void drop(size_t ino) {
    LazyNode& n = at(ino);
    if (n.type != '5') {
      if (n.nlink > 0) --n.nlink;
      return;
    }
    for (const auto& [name, kid] : n.kids) drop(kid);
    n.kids.clear();
  }

  /// The directory at `parts`, made (0755, root) where missing or not a directory.
  size_t directory(const std::vector<std::string>& parts, size_t count, int layer) {
    size_t ino = 1;
    for (size_t i = 0; i < count; ++i) {
      size_t next = tree_.child(ino, parts[i]);
      if (next != 0 && at(next).type != '5') {
        unlink(ino, parts[i]);
        next = 0;
      }
      if (next == 0) {
        LazyNode d;
        d.added_by = layer;
        next = make(std::move(d));
        link(ino, parts[i], next);
      }
      ino = next;
    }
    return ino;
  }

  Status add(const IndexEntry& e, int layer, const std::string& digest) {
    std::vector<std::string> parts;
    for (size_t at = 0; at <= e.path.size();) {
      const size_t slash = std::min(e.path.find('/', at), e.path.size());
      std::string part = e.path.substr(at, slash - at);
      at = slash + 1;
      if (part.empty() || part == ".") continue;
      if (part == "..") return make_error(ErrorKind::kInput, "layer {}: '{}' leaves the root", digest, e.path);
      parts.push_back(std::move(part));
    }
    if (parts.empty()) return {};
    const std::string base = parts.back();
    const size_t parent = directory(parts, parts.size() - 1, layer);
    if (e.whiteout == IndexWhiteout::kOpaque) {
      // The directory keeps what this layer put in it, and loses what lower ones did.
      std::vector<std::string> lower;
      for (const auto& [name, kid] : at(parent).kids) {
        if (at(kid).added_by < layer) lower.push_back(name);
      }
      for (const auto& name : lower) unlink(parent, name);
      return {};
    }
    if (e.whiteout == IndexWhiteout::kFile) {
      const std::string victim = base.substr(4);
      if (const size_t ino = tree_.child(parent, victim); ino != 0 && at(ino).added_by < layer) unlink(parent, victim);
      return {};
    }
    const size_t existing = tree_.child(parent, base);
    if (e.type == '5') {
      if (existing != 0 && at(existing).type == '5') {
        LazyNode& d = at(existing);
        d.mode = e.mode;
        d.uid = e.uid;
        d.gid = e.gid;
        d.mtime = e.mtime;
        d.added_by = layer;
        return {};
      }
    }
    if (e.type == '1') {
      const size_t target = tree_.resolve(e.link);
      if (target == 0 || at(target).type == '5') {
        return make_error(ErrorKind::kInput, "layer {}: '{}': hard link to '{}', which is not a file before it", digest,
                          e.path, e.link);
      }
      if (existing == target) return {};
      if (existing != 0) unlink(parent, base);
      ++at(target).nlink;
      // Named by this layer now: a whiteout in it does not take it away.
      at(target).added_by = std::max(at(target).added_by, layer);
      link(parent, base, target);
      return {};
    }
    if (existing != 0) unlink(parent, base);
    LazyNode n;
    n.type = e.type;
    n.mode = e.mode;
    n.uid = e.uid;
    n.gid = e.gid;
    n.mtime = e.mtime;
    n.added_by = layer;
    if (e.type == '0') {
      n.size = e.size;
      n.layer = layer;
      n.offset = e.offset;
      n.sparse = e.sparse;
    } else if (e.type == '2') {
      n.link = e.link;
      n.size = e.link.size();
    }
    link(parent, base, make(std::move(n)));
    return {};
  }

  LazyTree tree_;
};

void raise_readahead(const fs::path& point, unsigned bytes);

using ChunkKey = std::pair<size_t, size_t>;  ///< (mount layer, checkpoint)

struct ReadJob {
  fuse_req_t req;
  size_t ino;
  size_t size;
  off_t offset;
  bool fill = false;  ///< a read away from where the file's last one ended: store its span's pages after it
};

/// The memory the system has available, and its total (/proc/meminfo), in bytes; zeros if unreadable.
std::pair<uint64_t, uint64_t> memory_available() {
  std::ifstream in("/proc/meminfo");
  uint64_t available = 0;
  uint64_t total = 0;
  for (std::string key; in >> key;) {
    uint64_t kib = 0;
    in >> kib;
    if (key == "MemTotal:") total = kib << 10;
    if (key == "MemAvailable:") available = kib << 10;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return {available, total};
}

std::string layer_name(size_t index, const std::string& digest) {
  return fmt::format("layer {} ({})", short_digest(digest), index);
}

}  // namespace

Result<LazyTree> merge_indexes(const std::vector<const LayerIndex*>& layers) {
  TreeBuilder builder;
  for (size_t i = 0; i < layers.size(); ++i) CFMO_TRY(builder.add_layer(*layers[i], static_cast<int>(i)));
  return builder.finish();
}

struct LazyMount::Impl {
  /// A layer an index cannot seek (one zstd frame), local: read from its
  /// start, the decoder kept where the last chunk ended, so that reading it
  /// in order decodes it once.
  struct Stream {
    std::mutex mu;
    std::unique_ptr<FileSource> source;
    std::unique_ptr<LayerStream> reader;
    uint64_t decoder_bytes = 0;  ///< the decoder's memory for the frame's window
  };

  struct Layer {
    LazyLayer info;
    LayerIndex
        index;  ///< for a stream layer, its checkpoints are every `span` bytes of output (chunks, not seek points)
    fs::path blob;
    std::string what;
    std::unique_ptr<Stream> stream;  ///< set for a layer read from its start
  };

  fs::path dir;
  fs::path point;
  LazyMountOptions options;
  LazyMountReport report;
  std::vector<Layer> layers;
  LazyTree tree;
  Reference ref;
  std::vector<Endpoint> endpoints;
  std::string auth_file;
  fs::path record;

  fuse_session* se = nullptr;
  std::atomic<bool> stopping{false};
  std::atomic<bool> registry_stop{false};
  std::atomic<bool> initialized{false};  ///< the kernel's INIT answered
  std::atomic<bool> readahead_raised{false};
  unsigned max_read = kMaxRead;  ///< max_read_size(), taken before serving

  // The chunk cache: what is on disk, least recently used last.
  std::mutex mu;
  std::condition_variable cv;
  std::list<ChunkKey> lru;
  std::map<ChunkKey, std::pair<std::list<ChunkKey>::iterator, uint64_t>> cached;
  /// Chunks being made: empty until their bytes are there, readable from here until they are stored.
  std::map<ChunkKey, std::shared_ptr<const std::string>> in_flight;
  SpanFds<ChunkKey> fds{kOpenSpans};
  std::mutex stats_mu;  ///< one writer of stats.json at a time
  uint64_t cache_used = 0;
  LazyStats stats;
  std::unique_ptr<MemoryBudget> budget;
  FILE* log = nullptr;

  std::set<size_t> recorded;  ///< under mu
  FILE* record_file = nullptr;

  std::mutex queue_mu;
  std::condition_variable queue_cv;
  std::deque<ReadJob> queue;
  std::vector<std::thread> workers;
  Fd watch_wake;  ///< readable once the mount stops: ends watch_upper

  // Storing the pages around random reads into the kernel's page cache (fill).
  std::vector<std::atomic<uint64_t>> read_ends;  ///< per inode: where its last read ended (away)
  std::mutex fill_mu;
  std::condition_variable fill_cv;
  std::deque<ChunkKey> fill_queue;  ///< (inode, checkpoint of its layer), waiting
  std::map<ChunkKey, bool> fills;   ///< a random read seen there (false), or queued or stored (true): once a mount
  bool fill_stop = false;           ///< under fill_mu
  std::vector<std::thread> fillers;

  ~Impl() {
    if (log != nullptr) std::fclose(log);
    if (record_file != nullptr) std::fclose(record_file);
  }

  void record_open(size_t ino) {
    if (record_file == nullptr) return;
    std::lock_guard lock(mu);
    if (!recorded.insert(ino).second) return;
    const std::string line = tree.path(ino) + "\n";
    std::fwrite(line.data(), 1, line.size(), record_file);
    std::fflush(record_file);
  }

  /// Fetches the spans of the files listed in options.prefetch, in order.
  void prefetch() {
    std::ifstream in(options.prefetch);
    RegistryOptions registry = options.registry;
    registry.stop = &registry_stop;
    RegistryPool pool(ref, endpoints, registry, auth_file, std::make_shared<EndpointHealth>(endpoints.size()));
    size_t files = 0;
    for (std::string line; std::getline(in, line) && !stopping;) {
      const size_t ino = tree.resolve(line);
      if (ino == 0 || tree.node(ino).type != '0' || tree.node(ino).size == 0) continue;
      const LazyNode& n = tree.node(ino);
      const auto& cps = layers[static_cast<size_t>(n.layer)].index.checkpoints;
      const auto [first, last] = layers[static_cast<size_t>(n.layer)].index.spans_for(n.offset, n.size);
      for (size_t k = first; k <= last && k < cps.size() && !stopping; ++k) {
        std::vector<Made> made;
        Status got = make({static_cast<size_t>(n.layer), k}, pool, made);
        if (got) got = store_made(made);
        if (!got) note(got.error().message);
      }
      ++files;
    }
    note(fmt::format("prefetched the spans of {} file(s) listed in {}", files, options.prefetch.string()));
  }

  fs::path cache_dir() const { return dir / kLazyCacheDir; }
  fs::path chunk_path(const ChunkKey& key) const {
    return cache_dir() / layers[key.first].info.digest.substr(7) / std::to_string(key.second);
  }
  std::pair<uint64_t, uint64_t> chunk_range(const ChunkKey& key) const {
    const auto& index = layers[key.first].index;
    const uint64_t begin = index.checkpoints[key.second].out;
    const uint64_t end =
        key.second + 1 < index.checkpoints.size() ? index.checkpoints[key.second + 1].out : index.uncompressed_size;
    return {begin, end};
  }

  void note(const std::string& line) {
    std::lock_guard lock(mu);
    if (log == nullptr) return;
    std::fprintf(log, "cfmo-pull mount: %s\n", line.c_str());
    std::fflush(log);
  }

  /// The counts into stats.json, replaced whole (renamed into place) but
  /// not fsync'd: they are for looking at, and a read waits for them.
  void save_stats() {
    nlohmann::ordered_json j;
    {
      std::lock_guard lock(mu);
      j = {{"bytes_fetched", stats.bytes_fetched},      {"requests", stats.requests},
           {"spans_inflated", stats.spans_inflated},    {"cache_bytes", cache_used},
           {"cache_capacity", options.cache_bytes},     {"errors", stats.errors},
           {"page_cache_bytes", stats.page_cache_bytes}};
    }
    std::lock_guard lock(stats_mu);
    replace_file(cache_dir() / kLazyStatsFile, j.dump() + "\n");
  }

  /// Puts a chunk in the LRU, then evicts the least recently used until the cache fits.
  void remember(const ChunkKey& key, uint64_t bytes) {  // mu held
    lru.push_front(key);
    cached[key] = {lru.begin(), bytes};
    cache_used += bytes;
    while (cache_used > options.cache_bytes && lru.size() > 1) {
      const ChunkKey victim = lru.back();
      lru.pop_back();
      cache_used -= cached[victim].second;
      cached.erase(victim);
      fds.drop(victim);  // closed once the reads using it end; its file's blocks are freed then
      ::unlink(chunk_path(victim).c_str());
    }
  }

  void scan_cache() {
    std::error_code ec;
    std::vector<std::pair<fs::file_time_type, ChunkKey>> found;
    for (size_t l = 0; l < layers.size(); ++l) {
      const fs::path sub = cache_dir() / layers[l].info.digest.substr(7);
      for (const auto& f : fs::directory_iterator(sub, ec)) {
        const std::string name = f.path().filename().string();
        size_t k = 0;
        const bool number = !name.empty() && std::all_of(name.begin(), name.end(), ::isdigit);
        if (number) k = std::stoul(name);
        const ChunkKey key{l, k};
        if (!number || k >= layers[l].index.checkpoints.size() ||
            f.file_size(ec) != chunk_range(key).second - chunk_range(key).first) {
          fs::remove(f.path(), ec);  // a temporary file of a mount that died, or not ours
          continue;
        }
        found.emplace_back(f.last_write_time(ec), key);
      }
    }
    std::sort(found.begin(), found.end());
    for (const auto& [time, key] : found) remember(key, chunk_range(key).second - chunk_range(key).first);
  }

  /// The memory making chunk `key` takes: its bytes, and the compressed span or the stream's input and decoder.
  uint64_t chunk_memory(const ChunkKey& key) const {
    const Layer& layer = layers[key.first];
    const auto [begin, end] = chunk_range(key);
    if (layer.stream) return (end - begin) + (1 << 20) + layer.stream->decoder_bytes;
    const auto [in_begin, in_end] = layer.index.span_range(key.second);
    return (end - begin) + (in_end - in_begin) + (256 << 10);
  }

  /// Writes a chunk made now into the cache, and takes it out of
  /// in_flight; the readers that used its bytes meanwhile were answered
  /// already, so the fsync of the file is off their path.
  Status store(const ChunkKey& key, const std::string& bytes) {
    const fs::path path = chunk_path(key);
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    const Status written = write_file_atomic(path, bytes);
    {
      std::lock_guard lock(mu);
      in_flight.erase(key);
      cv.notify_all();
      if (written) {
        ++stats.spans_inflated;
        remember(key, bytes.size());
      } else {
        ++stats.errors;
      }
    }
    save_stats();
    return written;
  }

  /// A chunk that could not be made: nothing cached, the next read tries again.
  void failed(const ChunkKey& key) {
    {
      std::lock_guard lock(mu);
      in_flight.erase(key);
      cv.notify_all();
      ++stats.errors;
    }
    save_stats();
  }

  /// Chunk `key` of a stream layer: decoded on from where the last one
  /// ended, or from the start; the chunks passed on the way are cached too.
  Result<std::string> stream_chunk(const ChunkKey& key) {
    const Layer& layer = layers[key.first];
    Stream& st = *layer.stream;
    std::lock_guard guard(st.mu);
    const auto [begin, end] = chunk_range(key);
    if (!st.reader || st.reader->position() > begin) {
      st.source = std::make_unique<FileSource>(layer.blob);
      st.reader = std::make_unique<LayerStream>(layer.index, *st.source, layer.what);
    }
    auto fail = [&](Error e) -> Result<std::string> {
      st.reader.reset();  // where it stopped is unknown: the next chunk starts over
      return e;
    };
    while (st.reader->position() < begin) {
      const ChunkKey passed{key.first, static_cast<size_t>(st.reader->position() / layer.index.span)};
      const auto [passed_begin, passed_end] = chunk_range(passed);
      auto bytes = st.reader->read(passed_end - passed_begin);
      if (!bytes) return fail(bytes.error());
      bool wanted = false;
      {
        std::lock_guard lock(mu);
        wanted = cached.count(passed) == 0 && in_flight.emplace(passed, nullptr).second;
      }
      if (wanted) (void)store(passed, *bytes);
    }
    auto bytes = st.reader->read(end - begin);
    if (!bytes) return fail(bytes.error());
    return bytes;
  }

  Result<std::string> inflate_chunk(const ChunkKey& key, RegistryPool& pool) {
    const Layer& layer = layers[key.first];
    const auto [begin, end] = chunk_range(key);
    if (layer.stream) return stream_chunk(key);
    const auto [in_begin, in_end] = layer.index.span_range(key.second);
    const std::string what =
        fmt::format("{} span {} (compressed bytes {}-{})", layer.what, key.second, in_begin, in_end);
    std::error_code ec;
    if (fs::exists(layer.blob, ec)) {
      FileSource source(layer.blob);
      return read_range(layer.index, source, begin, end - begin, what);
    }
    std::string out;
    int64_t fetched = 0;
    int64_t requests = 0;
    const Status got = pool.each_until_ok(what, [&](RegistryApi& client) -> Status {
      RegistrySource source(client, layer.info.digest, what);
      auto r = read_range(layer.index, source, begin, end - begin, what);
      fetched += static_cast<int64_t>(source.bytes_fetched());
      requests += source.requests();
      if (!r) return r.error();
      out = std::move(*r);
      return {};
    });
    {
      std::lock_guard lock(mu);
      stats.bytes_fetched += fetched;
      stats.requests += requests;
    }
    if (!got) return got.error();
    return out;
  }

  /// A chunk made by this thread, its bytes readable in in_flight until store() puts it on disk.
  struct Made {
    ChunkKey key;
    std::shared_ptr<const std::string> bytes;
    MemoryBudget::Lease lease;  ///< its memory, until it is stored
  };

  /// Makes chunk `key` unless it is cached or another thread is making it
  /// (then waits until its bytes are there); what this thread made goes to `made`.
  Status make(const ChunkKey& key, RegistryPool& pool, std::vector<Made>& made) {
    {
      std::unique_lock lock(mu);
      for (;;) {
        if (cached.count(key) != 0) return {};
        const auto it = in_flight.find(key);
        if (it == in_flight.end()) break;
        if (it->second) return {};
        cv.wait(lock);
      }
      in_flight.emplace(key, nullptr);
    }
    auto lease = budget->acquire(static_cast<size_t>(chunk_memory(key)));
    auto bytes = inflate_chunk(key, pool);
    if (!bytes) {
      failed(key);
      return bytes.error();
    }
    auto shared = std::make_shared<const std::string>(std::move(*bytes));
    {
      std::lock_guard lock(mu);
      in_flight[key] = shared;
      cv.notify_all();
    }
    made.push_back({key, std::move(shared), std::move(lease)});
    return {};
  }

  /// Stores what make() made (the first error is returned, each is logged by the caller).
  Status store_made(std::vector<Made>& made) {
    Status first{};
    for (auto& m : made) {
      if (Status s = store(m.key, *m.bytes); !s && first) first = s;
    }
    made.clear();
    return first;
  }

  /// Part of a read's answer: a span file's bytes through its cached descriptor, or a span made now.
  struct Piece {
    SpanFds<ChunkKey>::Handle fd;
    std::shared_ptr<const std::string> bytes;
    uint64_t at = 0;  ///< where in the span
    size_t length = 0;
  };

  /// The descriptor of cached chunk `key` (mu held), opened now if none is
  /// held; empty if its file is gone (then it is no longer cached).
  SpanFds<ChunkKey>::Handle chunk_fd(const ChunkKey& key) {
    if (auto fd = fds.find(key)) return fd;
    Fd fd(::open(chunk_path(key).c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) {
      // Removed behind our back: made again by the next read.
      if (const auto it = cached.find(key); it != cached.end()) {
        cache_used -= it->second.second;
        lru.erase(it->second.first);
        cached.erase(it);
      }
      return {};
    }
    auto handle = std::make_shared<const Fd>(std::move(fd));
    fds.put(key, handle);
    return handle;
  }

  /// The checkpoint of mount layer `layer` whose chunk holds uncompressed byte `position`.
  size_t checkpoint_at(size_t layer, uint64_t position) const {
    const auto& cps = layers[layer].index.checkpoints;
    return static_cast<size_t>(std::upper_bound(cps.begin(), cps.end(), position,
                                                [](uint64_t p, const IndexCheckpoint& c) { return p < c.out; }) -
                               cps.begin() - 1);
  }

  /// The pieces of file `ino`'s bytes [offset, offset + size) if every
  /// chunk they need is cached or made (true), else the first chunk missing.
  bool plan(size_t ino, size_t size, off_t offset, std::vector<Piece>& pieces, ChunkKey& missing) {
    pieces.clear();
    const LazyNode& n = tree.node(ino);
    if (static_cast<uint64_t>(offset) >= n.size) return true;
    const uint64_t length = std::min<uint64_t>(size, n.size - static_cast<uint64_t>(offset));
    std::lock_guard lock(mu);
    for (uint64_t done = 0; done < length;) {
      const uint64_t position = n.offset + static_cast<uint64_t>(offset) + done;
      const ChunkKey key{static_cast<size_t>(n.layer), checkpoint_at(static_cast<size_t>(n.layer), position)};
      const auto [begin, end] = chunk_range(key);
      Piece piece;
      piece.at = position - begin;
      piece.length = static_cast<size_t>(std::min<uint64_t>(length - done, end - position));
      if (const auto it = cached.find(key); it != cached.end()) {
        lru.splice(lru.begin(), lru, it->second.first);
        piece.fd = chunk_fd(key);
      } else if (const auto made = in_flight.find(key); made != in_flight.end()) {
        piece.bytes = made->second;
      }
      if (!piece.fd && !piece.bytes) {
        missing = key;
        return false;
      }
      pieces.push_back(std::move(piece));
      done += piece.length;
    }
    return true;
  }

  /// Pieces as libfuse's buffer vector: the span files' bytes by their
  /// descriptors, so that they go to the kernel spliced where it allows,
  /// without a copy here. Valid while the pieces are.
  class PieceBufs {
   public:
    explicit PieceBufs(const std::vector<Piece>& pieces) : storage_(pieces.size() + 1) {
      // Room for the fuse_bufvec header before the bufs.
      static_assert(sizeof(fuse_bufvec) <= 2 * sizeof(fuse_buf) && offsetof(fuse_bufvec, buf) <= sizeof(fuse_buf));
      vec_ = reinterpret_cast<fuse_bufvec*>(reinterpret_cast<char*>(storage_.data() + 1) - offsetof(fuse_bufvec, buf));
      vec_->count = pieces.size();
      vec_->idx = 0;
      vec_->off = 0;
      fuse_buf* bufs = storage_.data() + 1;
      for (size_t i = 0; i < pieces.size(); ++i) {
        const Piece& p = pieces[i];
        fuse_buf b{};
        b.size = p.length;
        if (p.fd) {
          b.flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
          b.fd = p.fd->get();
          b.pos = static_cast<off_t>(p.at);
        } else {
          b.mem = const_cast<char*>(p.bytes->data() + p.at);
        }
        bufs[i] = b;
      }
    }
    PieceBufs(const PieceBufs&) = delete;
    PieceBufs& operator=(const PieceBufs&) = delete;
    fuse_bufvec* get() const { return vec_; }

   private:
    std::vector<fuse_buf> storage_;
    fuse_bufvec* vec_ = nullptr;
  };

  /// Answers a read with its pieces.
  static void reply(fuse_req_t req, const std::vector<Piece>& pieces) {
    if (pieces.empty()) return (void)fuse_reply_buf(req, nullptr, 0);
    const PieceBufs bufs(pieces);
    fuse_reply_data(req, bufs.get(), static_cast<fuse_buf_copy_flags>(0));
  }

  /// Whether a read of `ino` lands away from where its last read ended: a
  /// random read, not the next of a sequential reader (whose readahead
  /// requests the session threads may answer a little out of order, hence
  /// the slack of two requests). The first read of a file counts from 0.
  bool away(size_t ino, size_t size, off_t offset) {
    const uint64_t at = static_cast<uint64_t>(offset);
    const uint64_t last = read_ends[ino - 1].exchange(at + size, std::memory_order_relaxed);
    const uint64_t slack = 2 * uint64_t{size};
    return at + slack < last || at > last + slack;
  }

  /// After a random read of `ino` at `offset`: at the second in the same
  /// span, the file's pages in that span go to the page cache (fill), once
  /// a mount. Not at the first: a reader that touches a large file here
  /// and there, once a span, would have its spans stored for nothing (4 MiB
  /// of page cache, ~1 ms of CPU each, for one 4 KiB read).
  void queue_fill(size_t ino, off_t offset) {
    const LazyNode& n = tree.node(ino);
    const size_t layer = static_cast<size_t>(n.layer);
    const ChunkKey key{ino, checkpoint_at(layer, n.offset + static_cast<uint64_t>(offset))};
    std::lock_guard lock(fill_mu);
    if (fill_stop) return;
    const auto it = fills.find(key);
    if (it == fills.end()) {
      if (fills.size() < kFillsRemembered) fills.emplace(key, false);
      return;
    }
    if (it->second || fill_queue.size() >= kFillQueue) return;
    it->second = true;
    fill_queue.push_back(key);
    fill_cv.notify_one();
  }

  /// Stores file `ino`'s bytes in chunk `k` of its layer into the kernel's
  /// page cache of the file (FUSE_NOTIFY_STORE), in requests as large as a
  /// read's, from the span files (verified before they were written; a
  /// chunk not cached, or evicted meanwhile, stores nothing more). Whole
  /// pages only: a page the chunk shares with the next or the last is left
  /// to reads. Returns the bytes stored.
  int64_t store_pages(size_t ino, size_t k) {
    const LazyNode& n = tree.node(ino);
    const auto [begin, end] = chunk_range({static_cast<size_t>(n.layer), k});
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t first = std::max(begin, n.offset) - n.offset;
    const uint64_t last = std::min(end, n.offset + n.size) - n.offset;
    uint64_t at = (first + page - 1) / page * page;
    const uint64_t stop = last == n.size ? last : last / page * page;
    int64_t stored = 0;
    std::vector<Piece> pieces;
    while (at < stop && !stopping) {
      const size_t length = static_cast<size_t>(std::min<uint64_t>(max_read, stop - at));
      ChunkKey missing{};
      if (!plan(ino, length, static_cast<off_t>(at), pieces, missing)) break;
      const PieceBufs bufs(pieces);
      const int sent =
          fuse_lowlevel_notify_store(se, ino, static_cast<off_t>(at), bufs.get(), static_cast<fuse_buf_copy_flags>(0));
      pieces.clear();
      if (sent != 0) break;  // -ENOENT: the kernel forgot the inode (its pages with it); or the mount is gone
      stored += static_cast<int64_t>(length);
      at += length;
    }
    return stored;
  }

  /// One of the kFillThreads that store pages into the page cache, off the session
  /// threads: the kernel locks each page it stores, and a page may be
  /// locked by a read waiting for its answer, which only a session thread
  /// gives. A random read through FUSE is a round trip (~50-80 us here),
  /// a page-cache hit a few us; so after random reads of a file, its other
  /// bytes in the same span (inflated and on disk already) are stored too,
  /// and the next random reads there are hits. Sequential readers get
  /// nothing stored: the kernel's readahead serves them in large requests.
  /// Nothing is stored while the system's available memory is under an
  /// eighth of its total: the page cache is evictable, but filling it then
  /// would push out pages others use. The daemon's own memory is not
  /// touched: the bytes go from the span files to the kernel spliced.
  void fill() {
    for (;;) {
      ChunkKey key;
      {
        std::unique_lock lock(fill_mu);
        fill_cv.wait(lock, [&] { return fill_stop || !fill_queue.empty(); });
        if (fill_stop) return;
        key = fill_queue.front();
        fill_queue.pop_front();
      }
      const auto [available, total] = memory_available();
      if (total > 0 && available < total / 8 + 2 * uint64_t{max_read}) continue;  // unreadable: no limit known
      const int64_t stored = store_pages(key.first, key.second);
      bool idle = false;
      {
        std::lock_guard lock(mu);
        stats.page_cache_bytes += stored;
      }
      {
        std::lock_guard lock(fill_mu);
        idle = fill_queue.empty();
      }
      if (idle && stored > 0) save_stats();
    }
  }

  void stop_fill() {
    {
      std::lock_guard lock(fill_mu);
      fill_stop = true;
      fill_queue.clear();
    }
    fill_cv.notify_all();
  }

  /// A read the session thread could not answer from the cache: the chunks
  /// it needs are made (one at a time, so that a thread holds at most one
  /// chunk's memory), the read answered, then the chunks stored.
  Status serve_read(const ReadJob& job, RegistryPool& pool, bool& answered) {
    const LazyNode& n = tree.node(job.ino);
    if (n.sparse) {
      return make_error(ErrorKind::kInput, "{}: a sparse file is not lazily readable",
                        layers[static_cast<size_t>(n.layer)].what);
    }
    std::vector<Made> made;
    std::vector<Piece> pieces;
    for (int round = 0; round < 16; ++round) {
      ChunkKey missing{};
      if (plan(job.ino, job.size, job.offset, pieces, missing)) {
        if (!made.empty()) save_stats();  // what was fetched, before the reader can look (not fsync'd: cheap)
        reply(job.req, pieces);
        answered = true;
        pieces.clear();
        return store_made(made);
      }
      if (!made.empty()) {
        CFMO_TRY(store_made(made));
        continue;
      }
      CFMO_TRY(make(missing, pool, made));
    }
    (void)store_made(made);
    return make_error(ErrorKind::kInternal,
                      "'{}': its spans were evicted from the cache faster than read (--cache-size)",
                      tree.path(job.ino));
  }

  void worker() {
    RegistryOptions registry = options.registry;
    registry.stop = &registry_stop;
    RegistryPool pool(ref, endpoints, registry, auth_file, std::make_shared<EndpointHealth>(endpoints.size()),
                      [this](const std::string& m) { note(m); });
    for (;;) {
      ReadJob job{};
      {
        std::unique_lock lock(queue_mu);
        queue_cv.wait(lock, [&] { return !queue.empty() || (stopping.load() && queue.empty()); });
        if (queue.empty()) return;
        job = queue.front();
        queue.pop_front();
      }
      if (stopping.load()) {
        fuse_reply_err(job.req, EIO);
        continue;
      }
      // A read that failed before its answer was sent gets EIO; a chunk
      // that could not be stored after it was answered is only logged.
      bool answered = false;
      if (const Status s = serve_read(job, pool, answered); !s) {
        note(s.error().message);
        if (!answered) fuse_reply_err(job.req, EIO);
      } else if (job.fill) {
        queue_fill(job.ino, job.offset);
      }
    }
  }

  struct stat attributes(size_t ino) const {
    const LazyNode& n = tree.node(ino);
    struct stat st {};
    st.st_ino = ino;
    mode_t type = S_IFREG;
    switch (n.type) {
      case '2':
        type = S_IFLNK;
        break;
      case '3':
        type = S_IFCHR;
        break;
      case '4':
        type = S_IFBLK;
        break;
      case '5':
        type = S_IFDIR;
        break;
      case '6':
        type = S_IFIFO;
        break;
      default:
        break;
    }
    st.st_mode = type | (n.mode & 07777);
    st.st_nlink = n.nlink;
    st.st_uid = static_cast<uid_t>(n.uid);
    st.st_gid = static_cast<gid_t>(n.gid);
    st.st_size = n.type == '5' ? 4096 : static_cast<off_t>(n.size);
    st.st_blksize = 4096;
    st.st_blocks = (st.st_size + 511) / 512;
    st.st_mtim.tv_sec = static_cast<time_t>(n.mtime);
    st.st_ctim = st.st_mtim;
    st.st_atim = st.st_mtim;
    return st;
  }

  bool valid(fuse_ino_t ino) const { return ino >= 1 && ino <= tree.nodes.size(); }

  /// --writable in memory: the writes' tmpfs (mounted by the tool once this
  /// process serves) looked at when something happens, not on a clock: a
  /// change of the mount table (/proc/self/mountinfo polls POLLPRI) until
  /// the tmpfs is there, then fanotify's FAN_MODIFY over its whole file
  /// system (every write that lands in it, the overlay's included) and
  /// FAN_DELETE, each batch of events one statvfs. One line in the log each
  /// time it fills (the writes failing with ENOSPC): it is full again once
  /// room was seen, or once a file was removed while it was full and a write
  /// landed after that (a removal and a new fill between two looks are a new
  /// line; a removal alone is not, as a removed file's pages may be freed
  /// only later). A write that fails adds no event, so a full tmpfs costs
  /// nothing. Where fanotify is refused (an old kernel, a file system
  /// without file handles) it looks four times a second, as it did before.
  /// Ends when stop_workers writes to watch_wake.
  void watch_upper() {
    const UpperDir& upper = *report.upper;
    const Fd mountinfo(::open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC));
    Fd events;
    bool polling = false;  // fanotify refused: every kPollMs
    bool full = false;
    bool removed = false;  // a file removed since it was seen full
    constexpr int kPollMs = 250;
    alignas(fanotify_event_metadata) char buffer[4096];
    while (!stopping) {
      struct stat base {};
      struct stat parent {};
      const bool mounted = ::stat(upper.base.c_str(), &base) == 0 &&
                           ::stat(upper.base.parent_path().c_str(), &parent) == 0 && base.st_dev != parent.st_dev;
      if (mounted && !events && !polling) {
        events.reset(::fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FID | FAN_CLOEXEC | FAN_NONBLOCK, O_RDONLY));
        if (!events || ::fanotify_mark(events.get(), FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_MODIFY | FAN_DELETE,
                                       AT_FDCWD, upper.base.c_str()) != 0) {
          note(fmt::format("--writable: cannot watch the writes' memory with fanotify ({}): looking at it every {} ms",
                           std::strerror(errno), kPollMs));
          events.reset();
          polling = true;
        }
      }
      struct statvfs fs {};
      if (mounted && ::statvfs(upper.base.c_str(), &fs) == 0) {
        const bool now = fs.f_bavail == 0;
        if (now && !full) {
          note(
              fmt::format("--writable: the writes' memory is full ({} of --max-memory {} in {}): writes fail with "
                          "ENOSPC until files there are removed",
                          human_bytes(upper.bytes), human_bytes(options.max_memory), upper.upper.string()));
        }
        full = now;
        if (!full) removed = false;
      }
      // Before the tmpfs is there: the mount table; then its writes.
      pollfd fds[2] = {{watch_wake.get(), POLLIN, 0},
                       events ? pollfd{events.get(), POLLIN, 0} : pollfd{mountinfo.get(), POLLPRI, 0}};
      const bool waits = events || (!polling && !mounted && mountinfo);
      if (::poll(fds, waits ? 2 : 1, waits ? -1 : kPollMs) < 0 && errno != EINTR) return;
      if ((fds[0].revents & POLLIN) != 0) return;
      // FID events hold no descriptor: read, their masks looked at, dropped.
      for (ssize_t n; events && (n = ::read(events.get(), buffer, sizeof buffer)) > 0;) {
        for (size_t at = 0; at + sizeof(fanotify_event_metadata) <= static_cast<size_t>(n);) {
          fanotify_event_metadata event{};
          std::memcpy(&event, buffer + at, sizeof event);
          if (event.event_len < sizeof event) break;
          if ((event.mask & FAN_DELETE) != 0 && full) removed = true;
          if ((event.mask & FAN_MODIFY) != 0 && removed) full = removed = false;  // written after a removal
          at += event.event_len;
        }
      }
    }
  }

  /// Workers end once the queue is empty; reads queued from now on get EIO (enqueue).
  void stop_workers() {
    {
      std::lock_guard lock(queue_mu);
      stopping = true;
    }
    registry_stop = true;
    queue_cv.notify_all();
    if (watch_wake) {
      const uint64_t one = 1;
      (void)!::write(watch_wake.get(), &one, sizeof one);
    }
  }

  /// Hands a read to the workers, or answers EIO once they are stopping
  /// (under queue_mu, so no read is queued after the last worker left).
  void enqueue(const ReadJob& job) {
    {
      std::lock_guard lock(queue_mu);
      if (!stopping) {
        queue.push_back(job);
        queue_cv.notify_one();
        return;
      }
    }
    fuse_reply_err(job.req, EIO);
  }

  /// One of the threads reading the FUSE device: each takes a request and
  /// answers it (metadata, and reads of cached spans, right here), so that
  /// the requests of a readahead window and of several readers are served
  /// side by side. A blocking read(2), not poll: the kernel wakes one
  /// waiting reader a request (poll woke all four, three for nothing). Ends
  /// with the session (then makes `ended` readable), or on `quit`, which
  /// serve() sets before interrupting the read with kWakeSignal.
  void session(const std::atomic<bool>& quit, int ended) {
    fuse_buf buf{};
    while (!quit) {
      const int got = fuse_session_receive_buf(se, &buf);
      if (got == -EINTR || got == -EAGAIN) continue;
      if (got <= 0) break;  // -ENODEV: unmounted, and the last file closed
      fuse_session_process_buf(se, &buf);
      if (initialized && !readahead_raised.exchange(true)) raise_readahead(report.fuse_point, max_read);
      if (fuse_session_exited(se) != 0) break;
    }
    std::free(buf.mem);
    const uint64_t one = 1;
    (void)!::write(ended, &one, sizeof one);
  }

  void begin_stop() {
    if (stopping.exchange(true)) return;
    stop_workers();
    stop_fill();
    // Detached, the mount point is free now; the processes that still hold
    // files get EIO until they close them (then the kernel ends the session).
    // A --writable overlay above goes first (unless umount took it already), its writes with it.
    if (report.upper && mounted_source(point) == kLazySubtype) {
      if (::umount2(point.c_str(), MNT_DETACH) == 0) remove_upper(report.upper->base);
    }
    if (const Status detached = detach_mount(report.fuse_point); !detached) note(detached.error().message);
  }
};

namespace {

LazyMount::Impl* self(fuse_req_t req) { return static_cast<LazyMount::Impl*>(fuse_req_userdata(req)); }

void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(parent) || m->tree.node(parent).type != '5') return (void)fuse_reply_err(req, ENOTDIR);
  size_t ino = 0;
  if (std::strcmp(name, ".") == 0) {
    ino = parent;
  } else if (std::strcmp(name, "..") == 0) {
    ino = m->tree.node(parent).parent;
  } else {
    ino = m->tree.child(parent, name);
  }
  fuse_entry_param e{};
  e.attr_timeout = kForever;
  e.entry_timeout = kForever;
  if (ino == 0) {
    fuse_reply_entry(req, &e);  // ino 0: a negative entry the kernel caches
    return;
  }
  e.ino = ino;
  e.attr = m->attributes(ino);
  fuse_reply_entry(req, &e);
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(ino)) return (void)fuse_reply_err(req, ENOENT);
  const struct stat st = m->attributes(ino);
  fuse_reply_attr(req, &st, kForever);
}

void op_readlink(fuse_req_t req, fuse_ino_t ino) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(ino) || m->tree.node(ino).type != '2') return (void)fuse_reply_err(req, EINVAL);
  fuse_reply_readlink(req, m->tree.node(ino).link.c_str());
}

void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(ino)) return (void)fuse_reply_err(req, ENOENT);
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return (void)fuse_reply_err(req, EROFS);
  fi->keep_cache = 1;
  m->record_open(ino);
  fuse_reply_open(req, fi);
}

void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, fuse_file_info*) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(ino) || m->tree.node(ino).type != '0') return (void)fuse_reply_err(req, EISDIR);
  const bool fill = m->away(ino, size, offset);
  // Cached (the common case once a span was read): answered here, from the
  // span files' open descriptors, without waking a worker.
  if (!m->tree.node(ino).sparse) {
    std::vector<LazyMount::Impl::Piece> pieces;
    if (ChunkKey missing{}; m->plan(ino, size, offset, pieces, missing)) {
      LazyMount::Impl::reply(req, pieces);
      if (fill) m->queue_fill(ino, offset);
      return;
    }
  }
  m->enqueue({req, ino, size, offset, fill});
}

void op_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  if (!m->valid(ino) || m->tree.node(ino).type != '5') return (void)fuse_reply_err(req, ENOTDIR);
  fi->cache_readdir = 1;
  fi->keep_cache = 1;
  fuse_reply_open(req, fi);
}

void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t offset, fuse_file_info*) {
  auto* m = self(req);
  if (m->stopping) return (void)fuse_reply_err(req, EIO);
  const LazyNode& dir = m->tree.node(ino);
  std::string buffer(size, '\0');
  size_t used = 0;
  const size_t count = dir.kids.size() + 2;
  for (size_t i = static_cast<size_t>(offset); i < count; ++i) {
    const size_t target = i == 0 ? ino : i == 1 ? dir.parent : dir.kids[i - 2].second;
    const char* name = i == 0 ? "." : i == 1 ? ".." : dir.kids[i - 2].first.c_str();
    struct stat st {};
    st.st_ino = target;
    st.st_mode = m->attributes(target).st_mode;
    const size_t need = fuse_add_direntry(req, buffer.data() + used, size - used, name, &st, static_cast<off_t>(i + 1));
    if (need > size - used) break;
    used += need;
  }
  fuse_reply_buf(req, buffer.data(), used);
}

void op_statfs(fuse_req_t req, fuse_ino_t) {
  auto* m = self(req);
  struct statvfs st {};
  st.f_bsize = 4096;
  st.f_frsize = 4096;
  st.f_files = m->tree.nodes.size();
  st.f_namemax = 255;
  fuse_reply_statfs(req, &st);
}

sigset_t stop_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  for (const int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&signals, s);
  return signals;
}

/// Reads as large as a reply can be spliced (max_read_size: max_write sets
/// the kernel's max_pages, which bounds reads too, and the readahead window,
/// raised after INIT by raise_readahead), answered by splicing from the span
/// files. The tree never changes, so the page cache is never invalidated.
void op_init(void* userdata, fuse_conn_info* conn) {
  auto* m = static_cast<LazyMount::Impl*>(userdata);
  conn->max_write = m->max_read;
  conn->max_readahead = m->max_read;
  if ((conn->capable & FUSE_CAP_SPLICE_WRITE) != 0) conn->want |= FUSE_CAP_SPLICE_WRITE;
  conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
  m->initialized = true;
}

constexpr fuse_lowlevel_ops make_ops() {
  fuse_lowlevel_ops ops{};
  ops.init = op_init;
  ops.lookup = op_lookup;
  ops.getattr = op_getattr;
  ops.readlink = op_readlink;
  ops.open = op_open;
  ops.read = op_read;
  ops.opendir = op_opendir;
  ops.readdir = op_readdir;
  ops.statfs = op_statfs;
  return ops;
}
constexpr fuse_lowlevel_ops kOps = make_ops();

/// The index of a layer: DIR/cfmo-index/, or made now from its local blob; empty when neither.
Result<std::optional<LayerIndex>> find_index(const fs::path& dir, const LayerState& layer, bool local, size_t i,
                                             LazyLayer& info) {
  const fs::path path = index_path(dir, layer.blob.digest);
  std::error_code ec;
  if (fs::exists(path, ec)) {
    CFMO_ASSIGN_OR_RETURN(LayerIndex index, read_index(path));
    if (index.layer_digest != layer.blob.digest) {
      return make_error(ErrorKind::kInput, "index '{}': is the index of {}, not of layer {}", path.string(),
                        index.layer_digest, i);
    }
    info.index_from = "dir";
    return std::optional<LayerIndex>(std::move(index));
  }
  if (!local) return std::optional<LayerIndex>();
  CFMO_ASSIGN_OR_RETURN(LayerIndex index, build_layer_index(blob_path(dir, layer.blob.digest), layer.blob,
                                                            kDefaultIndexSpan, layer_name(i, layer.blob.digest)));
  fs::create_directories(path.parent_path(), ec);
  CFMO_TRY(write_file_atomic(path, serialize_index(index)));
  info.index_from = "built";
  return std::optional<LayerIndex>(std::move(index));
}

/// A local layer the index cannot seek, set to be read from its start: its
/// checkpoints become chunk boundaries every `span` bytes of output, and the
/// decoder's memory is taken from the frame's window size.
Result<std::unique_ptr<LazyMount::Impl::Stream>> stream_layer(LayerIndex& index, const fs::path& blob) {
  auto stream = std::make_unique<LazyMount::Impl::Stream>();
  FileSource source(blob);
  CFMO_ASSIGN_OR_RETURN(const std::string head,
                        source.read(0, std::min<uint64_t>(ZSTD_FRAMEHEADERSIZE_MAX, index.compressed_size)));
  ZSTD_frameHeader header{};
  if (ZSTD_getFrameHeader(&header, head.data(), head.size()) != 0) {
    return make_error(ErrorKind::kInput, "'{}': not a zstd frame at its start", blob.string());
  }
  stream->decoder_bytes = ZSTD_estimateDStreamSize(static_cast<size_t>(header.windowSize));
  std::vector<IndexCheckpoint> chunks;
  for (uint64_t out = 0; out < index.uncompressed_size; out += index.span) {
    IndexCheckpoint c;
    c.out = out;
    chunks.push_back(std::move(c));
  }
  index.checkpoints = std::move(chunks);
  return stream;
}

/// The kernel sets a FUSE mount's readahead to the smaller of its device's
/// default (128 KiB) and what INIT answered, so reads reach the daemon in
/// 128 KiB requests, each a round trip; as root it is raised to `bytes`
/// through sysfs once INIT is answered (as `blockdev --setra` would for a
/// disk). Without root it stays, and so do reads of 128 KiB.
void raise_readahead(const fs::path& point, unsigned bytes) {
  if (!running_as_root()) return;
  std::ifstream mounts("/proc/self/mountinfo");
  for (std::string line; std::getline(mounts, line);) {
    std::istringstream fields(line);
    std::string id, parent, device, root, where;
    fields >> id >> parent >> device >> root >> where;
    if (where != point.string()) continue;
    std::ofstream(fs::path("/sys/class/bdi") / device / "read_ahead_kb") << (bytes >> 10) << "\n";
  }
}

/// Without root: fusermount3 mounts `point` and sends the /dev/fuse
/// descriptor back over a socket, the protocol libfuse itself uses for a
/// user; done here because libfuse goes to fusermount3 only when mount(2)
/// is refused, not when /dev/fuse cannot be opened (0600 in containers),
/// and fuse_session_mount takes the descriptor as /dev/fd/N.
Result<int> fusermount_mount(const fs::path& point, const std::string& options) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    return make_error(ErrorKind::kInternal, "FUSE: socketpair: {}", std::strerror(errno));
  }
  ::fcntl(sv[0], F_SETFD, FD_CLOEXEC);  // ours; sv[1] is fusermount3's
  auto status = run_fusermount({"-o", options, "--", point.string()}, sv[1]);
  ::close(sv[1]);
  if (!status || *status != 0) {
    ::close(sv[0]);
    if (!status) return status.error();
    return make_error(ErrorKind::kUsage,
                      "mount point '{}': the FUSE mount failed: fusermount3 exited with {} (does this user own the "
                      "mount point, may it use FUSE?)",
                      point.string(), *status);
  }
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  ssize_t got = 0;
  do {
    got = ::recvmsg(sv[0], &message, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  ::close(sv[0]);
  const cmsghdr* c = CMSG_FIRSTHDR(&message);
  if (got <= 0 || c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
    (void)detach_mount(point);
    return make_error(ErrorKind::kInternal, "mount point '{}': fusermount3 mounted it but sent no descriptor",
                      point.string());
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

}  // namespace

LazyMount::LazyMount(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LazyMount::~LazyMount() {
  if (impl_->se != nullptr) {
    fuse_session_unmount(impl_->se);
    fuse_session_destroy(impl_->se);
  }
}

const LazyMountReport& LazyMount::report() const { return impl_->report; }

Result<std::unique_ptr<LazyMount>> LazyMount::prepare(const fs::path& dir, const fs::path& mountpoint,
                                                      const LazyMountOptions& options) {
  auto m = std::make_unique<Impl>();
  m->dir = fs::absolute(dir);
  m->options = options;
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  std::error_code ec;
  if (!options.prefetch.empty() && !fs::is_regular_file(options.prefetch, ec)) {
    return make_error(ErrorKind::kUsage, "--prefetch '{}': no such file", options.prefetch.string());
  }
  m->point = fs::weakly_canonical(fs::absolute(mountpoint, ec), ec);
  if (!fs::is_directory(m->point, ec)) {
    return make_error(ErrorKind::kUsage, "mount point '{}': not a directory", mountpoint.string());
  }
  if (mounted_source(m->point).starts_with(kLazySubtype)) {
    return make_error(ErrorKind::kUsage,
                      "mount point '{}': a cfmo-pull image is mounted there already (cfmo-pull umount {})",
                      mountpoint.string(), mountpoint.string());
  }
  m->report.fuse_point = m->point;
  if (options.writable) {
    if (state.memory_dir.empty() && !options.upper_memory_dir.empty()) {
      if (!fs::is_directory(options.upper_memory_dir, ec)) {
        return make_error(ErrorKind::kUsage, "--memory-dir '{}': no such directory", options.upper_memory_dir.string());
      }
      m->report.upper = mount_store_upper(m->dir, options.upper_memory_dir, m->point);
    } else {
      m->report.upper = upper_dir_for(m->dir, state.memory_dir, m->point);
    }
    m->report.fuse_point = m->dir / "layers" / "lazy" / m->report.upper->base.filename();
    fs::create_directories(m->report.fuse_point, ec);
    if (ec) {
      return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", m->report.fuse_point.string(), ec.message());
    }
  }
  CFMO_ASSIGN_OR_RETURN(m->ref, parse_reference(state.image));
  CFMO_ASSIGN_OR_RETURN(m->endpoints, endpoints_for(m->ref, options.hosts.value_or(state.hosts)));
  m->auth_file = options.auth_file.value_or(state.auth_file);

  // Layers without an index, or that an index cannot seek (one zstd frame), are fetched whole first.
  const size_t count = state.layers.size();
  std::vector<LazyLayer> infos(count);
  std::vector<size_t> first_of(count);  ///< the first layer of the same digest
  for (size_t i = 0; i < count; ++i) {
    const auto& l = state.layers[i];
    LazyLayer& info = infos[i];
    info.index = i;
    info.digest = l.blob.digest;
    info.hot = l.hot;
    info.local = l.status == LayerStatus::kFetched && fs::exists(blob_path(dir, l.blob.digest), ec);
    first_of[i] = i;
    for (size_t j = 0; j < i; ++j) {
      if (state.layers[j].blob.digest == l.blob.digest) {
        first_of[i] = j;
        break;
      }
    }
  }
  // The indexes (MBs each: reading and checking them was most of a mount's
  // start) read side by side, and meanwhile one Range request of a byte
  // tells whether the registry serves parts of a blob (asked whenever a
  // layer is cold; its answer is used unless every layer is fetched whole).
  // A repeated layer's index is read after its first (which may write it).
  const auto cold = std::find_if(infos.begin(), infos.end(), [](const LazyLayer& l) { return !l.local; });
  bool refused = false;
  Status probe{};
  std::vector<Result<std::optional<LayerIndex>>> found(count, std::optional<LayerIndex>());
  parallel_for(count + 1, static_cast<int>(std::min<size_t>(count + 1, kIndexThreads)), "mount-index", [&](size_t i) {
    if (i < count) {
      if (first_of[i] == i) found[i] = find_index(dir, state.layers[i], infos[i].local, i, infos[i]);
      return;
    }
    if (cold == infos.end()) return;
    RegistryPool pool(m->ref, m->endpoints, options.registry, m->auth_file,
                      std::make_shared<EndpointHealth>(m->endpoints.size()));
    probe = pool.each_until_ok("a Range request", [&](RegistryApi& client) -> Status {
      RegistrySource source(client, cold->digest, "a Range request");
      auto got = source.read(0, 1);
      refused = refused || source.ranges_refused();
      if (!got) return got.error();
      return {};
    });
  });
  std::vector<std::optional<LayerIndex>> indexes(count);
  std::vector<size_t> whole;
  for (size_t i = 0; i < count; ++i) {
    LazyLayer& info = infos[i];
    if (first_of[i] != i) found[i] = find_index(dir, state.layers[i], info.local, i, info);
    CFMO_ASSIGN_OR_RETURN(indexes[i], std::move(found[i]));
    if (!indexes[i]) {
      info.whole_note = "no index: fetched whole, then indexed";
      whole.push_back(i);
    } else if (!indexes[i]->lazily_loadable() && !info.local) {
      info.whole_note = not_lazily_loadable(*indexes[i]);
      whole.push_back(i);
    }
  }
  if (cold != infos.end() && whole.size() < infos.size()) {
    if (refused) {
      for (auto& info : infos) {
        if (info.local || !info.whole_note.empty()) continue;
        info.whole_note = "the registry does not serve parts of a blob (HTTP Range): fetched whole";
        whole.push_back(info.index);
      }
    } else if (!probe) {
      m->report.notes.push_back(
          fmt::format("the registry does not answer now ({}): reads of cold files retry it", probe.error().message));
    }
  }
  if (!whole.empty()) {
    FetchOptions fetch;
    fetch.registry = options.registry;
    fetch.hosts = options.hosts;
    fetch.auth_file = options.auth_file;
    fetch.jobs = std::max(1, options.jobs);
    for (const size_t i : whole) fetch.layers.push_back({LayerSpec::Kind::kIndex, "", static_cast<int64_t>(i), ""});
    CFMO_TRY(fetch_layers(dir, fetch));
    CFMO_ASSIGN_OR_RETURN(const PullState now, read_state(dir));
    for (const size_t i : whole) {
      infos[i].local = true;
      CFMO_ASSIGN_OR_RETURN(indexes[i], find_index(dir, now.layers[i], true, i, infos[i]));
      m->report.notes.push_back(fmt::format("layer {}: {}", i, infos[i].whole_note));
    }
  }
  std::vector<const LayerIndex*> order;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    Impl::Layer layer;
    layer.info = infos[i];
    layer.index = std::move(*indexes[i]);
    layer.blob = blob_path(m->dir, infos[i].digest);
    layer.what = layer_name(i, infos[i].digest);
    m->report.index_bytes += static_cast<int64_t>(serialized_size(layer.index));
    if (!layer.index.lazily_loadable()) {
      CFMO_ASSIGN_OR_RETURN(layer.stream, stream_layer(layer.index, layer.blob));
    }
    m->layers.push_back(std::move(layer));
  }
  for (const auto& l : m->layers) order.push_back(&l.index);
  CFMO_ASSIGN_OR_RETURN(m->tree, merge_indexes(order));
  for (auto& l : m->layers) {
    l.index.entries.clear();  // in the tree now
    l.index.entries.shrink_to_fit();
  }
  m->read_ends = std::vector<std::atomic<uint64_t>>(m->tree.nodes.size());

  // The memory: the process itself, the indexes and the tree, the
  // background fetch when it runs, then the chunks being inflated, and
  // what is left the writes' (in memory). The hot layers are not counted
  // here: they are in the pull's memory store, under the pull's --max-memory.
  const int64_t tree_bytes = static_cast<int64_t>(m->tree.nodes.size() * (sizeof(LazyNode) + 48 + sizeof(uint64_t)));
  uint64_t largest = 0;
  for (size_t l = 0; l < m->layers.size(); ++l) {
    for (size_t k = 0; k < m->layers[l].index.checkpoints.size(); ++k)
      largest = std::max(largest, m->chunk_memory({l, k}));
  }
  const bool pending =
      std::any_of(m->layers.begin(), m->layers.end(), [](const Impl::Layer& l) { return !l.info.local; });
  m->report.fetcher_bytes = pending ? options.fetcher_memory : 0;
  const int64_t taken = kProcessMemory + m->report.index_bytes + tree_bytes + m->report.fetcher_bytes;
  const std::string fetcher_part =
      m->report.fetcher_bytes > 0 ? fmt::format(", the background fetch {}", human_bytes(m->report.fetcher_bytes)) : "";
  const int64_t left = options.max_memory - taken;
  if (left < static_cast<int64_t>(largest)) {
    return make_error(ErrorKind::kUsage,
                      "--max-memory {}: the process takes about {}, the indexes and tree {}{}, and one span needs {} "
                      "(index with a smaller --span, or allow more)",
                      human_bytes(options.max_memory), human_bytes(kProcessMemory),
                      human_bytes(m->report.index_bytes + tree_bytes), fetcher_part,
                      human_bytes(static_cast<int64_t>(largest)));
  }
  m->report.read_bytes = left;
  if (m->report.upper && m->report.upper->in_memory) {
    // The reads keep what they use at most (a span a worker, and the
    // prefetch's); the writes take the rest, in a tmpfs of that size.
    constexpr int64_t kLeastWrites = int64_t{1} << 20;
    const int64_t reads = std::min<int64_t>(left, static_cast<int64_t>(largest) * (std::max(1, options.jobs) + 1));
    if (left - reads < kLeastWrites) {
      return make_error(ErrorKind::kUsage,
                        "--max-memory {}: the process takes about {}, the indexes and tree {}{}, the spans being read "
                        "{}: less than {} left for --writable's writes in memory (allow more)",
                        human_bytes(options.max_memory), human_bytes(kProcessMemory),
                        human_bytes(m->report.index_bytes + tree_bytes), fetcher_part, human_bytes(reads),
                        human_bytes(kLeastWrites));
    }
    m->report.read_bytes = reads;
    m->report.upper->bytes = left - reads;
  }
  m->budget = std::make_unique<MemoryBudget>(static_cast<size_t>(m->report.read_bytes));
  m->report.entries = m->tree.nodes.size();
  m->report.cache = m->cache_dir();
  m->report.log = m->dir / kLazyLogFile;
  for (const auto& l : m->layers) m->report.layers.push_back(l.info);
  fs::create_directories(m->cache_dir(), ec);
  if (ec) return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", m->cache_dir().string(), ec.message());
  m->scan_cache();
  m->stats.cache_capacity = static_cast<int64_t>(options.cache_bytes);
  return std::unique_ptr<LazyMount>(new LazyMount(std::move(m)));
}

Status LazyMount::mount() {
  Impl& m = *impl_;
  // The spans (MiBs each) are allocated and freed by several threads; with
  // glibc's sliding mmap threshold they soon came from per-thread arenas
  // that keep what was freed, and the daemon's peak RSS passed
  // --max-memory (87 MB under a 64M cap reading a 2 GB image). A fixed
  // threshold keeps them mmapped, so RSS follows the budget.
  ::mallopt(M_MMAP_THRESHOLD, 256 << 10);
  // Blocked from before the mount is there (a SIGTERM then waits for serve's
  // signalfd) and before any thread, so that only the signalfd sees them.
  const sigset_t signals = stop_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  m.log = std::fopen(m.report.log.c_str(), "ae");
  if (!m.options.record.empty()) {
    m.record_file = std::fopen(m.options.record.c_str(), "ae");
    if (m.record_file == nullptr) {
      return make_error(ErrorKind::kUsage, "--record '{}': cannot open: {}", m.options.record.string(),
                        std::strerror(errno));
    }
  }
  std::string opts =
      fmt::format("ro,default_permissions,fsname={}@{},subtype={}", kLazySubtype, ::getpid(), kLazySubtype);
  if (running_as_root()) opts += ",allow_other";
  std::vector<std::string> argv_strings = {"cfmo-pull", "-o", opts};
  std::vector<char*> argv;
  for (auto& a : argv_strings) argv.push_back(a.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  m.max_read = max_read_size();
  m.se = fuse_session_new(&args, &kOps, sizeof kOps, &m);
  if (m.se == nullptr) return make_error(ErrorKind::kInternal, "FUSE: cannot start a session (options '{}')", opts);
  std::string target = m.report.fuse_point.string();
  if (!running_as_root()) {
    auto fd = fusermount_mount(m.report.fuse_point, opts);
    if (!fd) {
      fuse_session_destroy(m.se);
      m.se = nullptr;
      return fd.error();
    }
    target = fmt::format("/dev/fd/{}", *fd);
  }
  if (fuse_session_mount(m.se, target.c_str()) != 0) {
    fuse_session_destroy(m.se);
    m.se = nullptr;
    return make_error(ErrorKind::kUsage,
                      "mount point '{}': the FUSE mount failed (is /dev/fuse there, may this user mount?)",
                      m.point.string());
  }
  m.record = m.dir / kMountRecordDir / std::to_string(::getpid());
  std::error_code ec;
  fs::create_directories(m.record.parent_path(), ec);
  // A --writable mount's own memory store on the second line: rm DIR finds it there if the mount dies.
  const bool own_store = m.report.upper && m.report.upper->own_store;
  replace_file(m.record, m.point.string() + "\n" + (own_store ? m.report.upper->base.string() + "\n" : ""));
  m.save_stats();  // this mount's counts, from zero
  m.note(fmt::format("mounted {} at {} (pid {})", m.dir.string(), m.point.string(), ::getpid()));
  if (m.report.upper && m.report.upper->bytes > 0) {
    m.watch_wake.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!m.watch_wake) return make_error(ErrorKind::kInternal, "--writable: eventfd: {}", std::strerror(errno));
    m.workers.emplace_back([&m] { m.watch_upper(); });
  }
  return {};
}

Status LazyMount::serve() {
  Impl& m = *impl_;
  const sigset_t signals = stop_signals();
  const Fd signal_fd(::signalfd(-1, &signals, SFD_CLOEXEC));
  const int sfd = signal_fd.get();
  // Readable once a session thread saw the session end.
  const Fd ended(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!signal_fd || !ended) {
    return make_error(ErrorKind::kInternal, "FUSE: signalfd or eventfd: {}", std::strerror(errno));
  }
  // A handler that does nothing, without SA_RESTART: kWakeSignal makes a session thread's read(2) return EINTR.
  struct sigaction wake {};
  wake.sa_handler = [](int) {};
  ::sigaction(kWakeSignal, &wake, nullptr);
  for (int i = 0; i < std::max(1, m.options.jobs); ++i) m.workers.emplace_back([&m] { m.worker(); });
  for (int i = 0; i < kFillThreads; ++i) m.fillers.emplace_back([&m] { m.fill(); });
  if (!m.options.prefetch.empty()) m.workers.emplace_back([&m] { m.prefetch(); });
  std::atomic<bool> quit{false};
  std::vector<std::thread> sessions;
  std::vector<std::atomic<bool>> done(kSessionThreads);
  for (int i = 0; i < kSessionThreads; ++i) {
    sessions.emplace_back([&m, &quit, &ended, &done, i] {
      m.session(quit, ended.get());
      done[static_cast<size_t>(i)] = true;
    });
  }
  std::chrono::steady_clock::time_point deadline{};
  for (;;) {
    int timeout = -1;
    if (m.stopping) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      timeout = static_cast<int>(left.count());
    }
    pollfd fds[2] = {{ended.get(), POLLIN, 0}, {sfd, POLLIN, 0}};
    if (::poll(fds, 2, timeout) < 0 && errno != EINTR) break;
    if ((fds[0].revents & POLLIN) != 0) break;  // unmounted, and the last file closed
    if ((fds[1].revents & POLLIN) != 0) {
      signalfd_siginfo info{};
      if (::read(sfd, &info, sizeof info) > 0 && !m.stopping) {
        m.note(fmt::format("signal {}: unmounting {}", info.ssi_signo, m.point.string()));
        m.begin_stop();
        deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(m.options.grace_s));
      }
    }
  }
  // The fillers first, while the session threads still answer the reads
  // whose pages a store may be waiting for (EIO, once stopping).
  m.stop_fill();
  for (auto& t : m.fillers) t.join();
  m.fillers.clear();
  // A thread may test `quit` just before it blocks in read(2), missing one
  // signal: it is signalled again until it ends.
  quit = true;
  for (size_t i = 0; i < sessions.size(); ++i) {
    while (!done[i]) {
      ::pthread_kill(sessions[i].native_handle(), kWakeSignal);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    sessions[i].join();
  }
  m.stop_workers();
  for (auto& t : m.workers) t.join();
  m.workers.clear();
  fuse_session_unmount(m.se);  // a mount made through fusermount3 is not libfuse's to unmount:
  if (!running_as_root() && lazy_mount_pid(mounted_source(m.report.fuse_point)) == ::getpid())
    (void)detach_mount(m.report.fuse_point);
  fuse_session_destroy(m.se);
  m.se = nullptr;
  std::error_code ec;
  fs::remove(m.record, ec);
  m.note(fmt::format("unmounted {}", m.point.string()));
  return {};
}

int lazy_mount_pid(const std::string& source) {
  const std::string prefix = std::string(kLazySubtype) + "@";
  if (!source.starts_with(prefix)) return 0;
  try {
    return std::stoi(source.substr(prefix.size()));
  } catch (const std::exception&) {
    return 0;
  }
}

Result<LazyStats> read_lazy_stats(const fs::path& dir) {
  const fs::path path = dir / kLazyCacheDir / kLazyStatsFile;
  std::error_code ec;
  if (!fs::exists(path, ec))
    return make_error(ErrorKind::kInput, "'{}': no lazy mount has read anything", path.string());
  CFMO_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) return make_error(ErrorKind::kInput, "'{}': not JSON", path.string());
  LazyStats s;
  s.bytes_fetched = j.value("bytes_fetched", int64_t{0});
  s.requests = j.value("requests", int64_t{0});
  s.spans_inflated = j.value("spans_inflated", int64_t{0});
  s.cache_bytes = j.value("cache_bytes", int64_t{0});
  s.cache_capacity = j.value("cache_capacity", int64_t{0});
  s.errors = j.value("errors", int64_t{0});
  s.page_cache_bytes = j.value("page_cache_bytes", int64_t{0});
  return s;
}

}  // namespace cfmo::oci
