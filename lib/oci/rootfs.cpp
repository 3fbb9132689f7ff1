// The rootfs pipeline. Each layer has a LayerPipe, the observer of its
// download. One applier thread unpacks the layers in manifest order: for
// layer k it starts a LayerUnpacker, feeds it the bytes already in the
// layer's partial (or complete) blob file, and once it has caught up with the
// download it goes "live": the downloading thread hands each new chunk to the
// unpacker itself, right after writing it to the file. A layer that finished
// downloading before its turn is unpacked from the file alone (page cache,
// usually). A 200 in place of 206 empties the file and bumps the pipe's
// generation: the applier aborts that unpacker and starts the layer again
// from its first byte (re-applying a prefix of the same layer leaves the
// same tree).
#include "oci/rootfs.h"
#include "core/clock.h"

#include "core/atomic_file.h"

#include "oci/blob.h"
#include "oci/cleanup.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

/// The staging directory's name for DIR and a process: DIR's parent/.NAME.partial-PID.
fs::path staging_path(const fs::path& dir, pid_t pid) {
  return dir.parent_path() / fmt::format(".{}.partial-{}", dir.filename().string(), pid);
}

/// Staging trees left by runs that died (their pid is gone) are removed.
void remove_stale_staging(const fs::path& dir) {
  const std::string prefix = fmt::format(".{}.partial-", dir.filename().string());
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) remove_tree(entry.path());
  }
}

/// One layer's download as the applier sees it.
class LayerPipe {
 public:
  void on_start(int64_t bytes_on_disk) {
    std::lock_guard lock(mutex_);
    on_disk_ = bytes_on_disk;
    started_ = true;
    cv_.notify_all();
  }

  void on_restart() {
    std::lock_guard lock(mutex_);
    on_disk_ = 0;
    ++generation_;
    live_ = nullptr;
    cv_.notify_all();
  }

  Status on_write(std::string_view chunk) {
    LayerUnpacker* live = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (cancelled_) return make_error(ErrorKind::kInternal, "cancelled");
      on_disk_ += static_cast<int64_t>(chunk.size());
      live = live_;
      if (live == nullptr) {
        cv_.notify_all();
        return {};
      }
    }
    // Only this (downloading) thread changes the state that would end `live`
    // (a restart, the end of the download), so it stays valid here.
    return live->write(chunk);
  }

  void done(const Error* error, int64_t size) {
    std::lock_guard lock(mutex_);
    finished_ = true;
    if (error == nullptr) {
      on_disk_ = size;
    } else {
      error_ = *error;
    }
    cv_.notify_all();
  }

  /// The pull ended without fetching this layer.
  void not_fetched(const std::string& what) {
    std::lock_guard lock(mutex_);
    if (finished_) return;
    finished_ = true;
    unfetched_ = true;
    error_ = Error{ErrorKind::kInternal, what + ": not fetched"};
    cv_.notify_all();
  }

  /// Whether the layer was cancelled or never fetched (rather than failing itself).
  bool cut_short() {
    std::lock_guard lock(mutex_);
    return cancelled_ || unfetched_;
  }

  void cancel() {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
    cv_.notify_all();
  }

  /// Unpacks the layer into `root` (the applier's thread).
  Result<UnpackStats> apply(const fs::path& root, const fs::path& layout, const Descriptor& layer,
                            Compression compression, const UnpackOptions& options, const std::string& what) {
    const fs::path final_path = blob_path(layout, layer.digest);
    const fs::path partial_path = final_path.string() + ".partial";
    std::vector<char> buffer(1u << 20);
    while (true) {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return started_ || finished_ || cancelled_; });
      if (cancelled_) return make_error(ErrorKind::kInternal, "{}: cancelled", what);
      if (finished_ && error_) return *error_;
      const uint64_t generation = generation_;
      const bool complete = finished_;
      lock.unlock();

      CFMO_ASSIGN_OR_RETURN(auto unpacker, LayerUnpacker::start(root, compression, options, what));
      // The partial file being written, or the complete blob (it was renamed to).
      int fd = complete ? -1 : ::open(partial_path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) fd = ::open(final_path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        return make_error(ErrorKind::kInternal, "{}: cannot open '{}': {}", what, final_path.string(),
                          std::strerror(errno));
      }
      struct Closer {
        int fd;
        ~Closer() { ::close(fd); }
      } closer{fd};
      int64_t fed = 0;
      bool restarted = false;
      lock.lock();
      while (true) {
        if (generation_ != generation) {
          restarted = true;
          break;
        }
        if (cancelled_) break;
        if (fed < on_disk_) {
          const size_t want = static_cast<size_t>(std::min<int64_t>(on_disk_ - fed, buffer.size()));
          lock.unlock();
          const ssize_t n = ::pread(fd, buffer.data(), want, fed);
          if (n <= 0) {
            // Emptied by a restart between our look and the read: go round again.
            lock.lock();
            if (generation_ != generation) continue;
            lock.unlock();
            return make_error(ErrorKind::kInternal, "{}: reading '{}' failed", what, partial_path.string());
          }
          Status fed_ok = unpacker->write(std::string_view(buffer.data(), static_cast<size_t>(n)));
          if (!fed_ok) return std::move(fed_ok).error();
          fed += n;
          lock.lock();
          continue;
        }
        if (finished_) break;
        // Caught up: the downloading thread feeds the unpacker from here on.
        live_ = unpacker.get();
        cv_.wait(lock, [&] { return finished_ || cancelled_ || generation_ != generation; });
        live_ = nullptr;
        if (generation_ != generation) {
          restarted = true;
          break;
        }
        break;
      }
      const bool cancelled = cancelled_;
      const std::optional<Error> error = error_;
      lock.unlock();
      if (restarted) {
        unpacker->abort();
        continue;
      }
      if (cancelled) {
        unpacker->abort();
        return make_error(ErrorKind::kInternal, "{}: cancelled", what);
      }
      if (error) {
        unpacker->abort();
        return *error;
      }
      return unpacker->finish();
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t on_disk_ = 0;  ///< bytes in the file, as far as the applier may read
  uint64_t generation_ = 0;
  bool started_ = false;
  bool finished_ = false;
  bool cancelled_ = false;
  bool unfetched_ = false;
  std::optional<Error> error_;
  LayerUnpacker* live_ = nullptr;  ///< set while the applier has caught up
};

/// The rootfs as a sink of the pull: a LayerPipe per layer, fed by the
/// downloading threads, and one applier thread that unpacks the layers in
/// manifest order into the staging tree.
class RootfsSink : public PullSink {
 public:
  RootfsSink(fs::path staging, fs::path layout, const UnpackOptions& unpack, std::vector<UnpackStats>& stats)
      : staging_(std::move(staging)), layout_(std::move(layout)), unpack_(unpack), stats_(stats) {}
  ~RootfsSink() override { finish(false); }
  RootfsSink(const RootfsSink&) = delete;
  RootfsSink& operator=(const RootfsSink&) = delete;

  Status on_resolved(const ResolvedImage& image) override {
    layers_ = image.parsed.layers;
    for (const auto& layer : layers_) {
      CFMO_ASSIGN_OR_RETURN(const Compression c, layer_compression(layer.media_type));
      compressions_.push_back(c);
      pipes_.push_back(std::make_unique<LayerPipe>());
    }
    stats_.resize(layers_.size());
    applier_ = std::thread([this] { apply_all(); });
    return {};
  }
  void on_blob_start(size_t layer, int64_t bytes_on_disk) override { pipes_[layer]->on_start(bytes_on_disk); }
  void on_blob_restart(size_t layer) override { pipes_[layer]->on_restart(); }
  Status on_blob_write(size_t layer, std::string_view chunk) override { return pipes_[layer]->on_write(chunk); }
  void on_blob_done(size_t layer, const Error* error) override { pipes_[layer]->done(error, layers_[layer].size); }

  /// The pull ended: the layers it did not fetch end the applier's wait, a
  /// failed pull cancels the unpacking; then the applier is waited for.
  void finish(bool pulled) {
    for (size_t i = 0; i < pipes_.size(); ++i) pipes_[i]->not_fetched(fmt::format("layer {}", i));
    if (!pulled) cancel_all();
    if (applier_.joinable()) applier_.join();
  }
  /// The unpacking's error, if any, and whether it only stopped because the pull did.
  const std::optional<Error>& error() const { return error_; }
  bool cut_short() const { return cut_short_; }

 private:
  void cancel_all() {
    for (auto& pipe : pipes_) pipe->cancel();
  }
  void apply_all() {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const std::string what = fmt::format("layer {}… ({})", layers_[i].digest.substr(0, 19), i);
      auto stats = pipes_[i]->apply(staging_, layout_, layers_[i], compressions_[i], unpack_, what);
      if (!stats) {
        error_ = std::move(stats).error();
        cut_short_ = pipes_[i]->cut_short();
        cancel_all();
        return;
      }
      stats_[i] = *stats;
    }
  }

  fs::path staging_;
  fs::path layout_;
  UnpackOptions unpack_;
  std::vector<UnpackStats>& stats_;
  std::vector<Descriptor> layers_;
  std::vector<Compression> compressions_;
  std::vector<std::unique_ptr<LayerPipe>> pipes_;
  std::thread applier_;
  std::optional<Error> error_;
  bool cut_short_ = false;
};

}  // namespace

fs::path default_blob_cache() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg == '/')
    return fs::path(xdg) / "cfmo-pull";
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return fs::path(home) / ".cache" / "cfmo-pull";
  }
  return fs::temp_directory_path() / "cfmo-pull-cache";
}

Status check_rootfs_target(const fs::path& dir, bool replace) {
  std::error_code ec;
  const auto status = fs::symlink_status(dir, ec);
  if (!fs::exists(status)) return {};
  if (!fs::is_directory(status)) {
    return make_error(ErrorKind::kUsage, "--output rootfs:{}: exists and is not a directory", dir.string());
  }
  if (!replace && !fs::is_empty(dir, ec)) {
    return make_error(ErrorKind::kUsage,
                      "--output rootfs:{}: exists and is not empty; remove it, or pass --replace to swap in the new "
                      "tree when the pull succeeds",
                      dir.string());
  }
  return {};
}

Result<RootfsReport> pull_to_rootfs(const Reference& ref, const PullOptions& options, const fs::path& layout,
                                    const std::string& tag, const RootfsOptions& rootfs) {
  const fs::path dir = fs::absolute(rootfs.dir).lexically_normal();
  const fs::path target = dir.filename().empty() ? dir.parent_path() : dir;
  // Said before anything is fetched, never turned silently into a full pull.
  if (options.cold != ColdStrategy::kEager || options.background) {
    return make_error(ErrorKind::kUsage,
                      "--cold {}{} cannot stay lazy with --output rootfs:{}: a root filesystem is built from every "
                      "layer in order and put in place whole; use --cold eager, or pull to oci:DIR and present the "
                      "layers fetched so far with 'cfmo-pull mount DIR MOUNTPOINT'",
                      to_string(options.cold), options.background ? " --background" : "", target.string());
  }
  CFMO_TRY(check_rootfs_target(target, rootfs.replace));
  if (rootfs.unpack.whiteouts != WhiteoutMode::kApply) {
    return make_error(ErrorKind::kUsage, "--output rootfs:{}: a merged tree applies whiteouts", target.string());
  }
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  if (ec)
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", target.parent_path().string(), ec.message());
  remove_stale_staging(target);
  const fs::path staging = staging_path(target, ::getpid());
  remove_tree(staging);
  if (::mkdir(staging.c_str(), 0755) != 0) {
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", staging.string(), std::strerror(errno));
  }
  struct Cleanup {
    fs::path path;
    bool keep = false;
    ~Cleanup() {
      if (!keep) remove_tree(path);
    }
  } cleanup{staging};

  RootfsReport report;
  report.dir = target;
  RootfsSink sink(staging, layout, rootfs.unpack, report.layers);
  PullOptions inner = options;
  inner.memory_store = false;
  inner.ready_file.clear();  // ready means DIR in place, below
  inner.sinks.push_back(&sink);
  auto pulled = pull_to_layout(ref, inner, layout, tag);
  const auto downloads_done = std::chrono::steady_clock::now();
  sink.finish(pulled.has_value());
  report.unpack_wait_s = seconds_since(downloads_done);
  // The first cause wins: an unpacking error cancels the downloads (whose
  // "cancelled" is then no news); a failed download stops the unpacking.
  if (sink.error() && !sink.cut_short()) return *sink.error();
  if (!pulled) return std::move(pulled).error();
  if (sink.error()) return *sink.error();
  report.pull = std::move(*pulled);
  for (const auto& s : report.layers) {
    report.total.compressed_bytes += s.compressed_bytes;
    report.total.uncompressed_bytes += s.uncompressed_bytes;
    report.total.entries += s.entries;
    report.total.skipped_devices += s.skipped_devices;
    report.total.skipped_xattrs += s.skipped_xattrs;
  }

  // The tree reaches the disk before its name does: after a crash DIR is
  // either absent (or the old tree) or complete, never files without data.
  const auto sync_start = std::chrono::steady_clock::now();
  if (const int fd = ::open(staging.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    const int rc = ::syncfs(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0)
      return make_error(ErrorKind::kInternal, "'{}': syncfs failed: {}", staging.string(), std::strerror(err));
  }
  report.sync_s = seconds_since(sync_start);

  // Into place: an empty DIR is replaced by the staging tree; a full one only with `replace`.
  CFMO_TRY(check_rootfs_target(target, rootfs.replace));
  fs::path old;
  if (fs::exists(fs::symlink_status(target, ec))) {
    old = target.parent_path() / fmt::format(".{}.old-{}", target.filename().string(), ::getpid());
    if (::rename(target.c_str(), old.c_str()) != 0) {
      return make_error(ErrorKind::kInternal, "'{}': cannot move aside: {}", target.string(), std::strerror(errno));
    }
  }
  if (::rename(staging.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (!old.empty()) ::rename(old.c_str(), target.c_str());
    return make_error(ErrorKind::kInternal, "'{}': cannot rename into place: {}", target.string(), std::strerror(err));
  }
  cleanup.keep = true;
  if (!old.empty()) remove_tree(old);
  const int parent = ::open(target.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (parent >= 0) {
    ::fsync(parent);
    ::close(parent);
  }
  report.pull.wall_s += seconds_since(downloads_done);
  // Ready means the tree in place: it is renamed into place whole, so the hot layers only went first.
  report.pull.ready_s = report.pull.wall_s;
  if (!options.ready_file.empty()) {
    nlohmann::ordered_json j;
    j["image"] = ref.to_string();
    j["manifest_digest"] = report.pull.image.manifest.digest;
    j["rootfs"] = target.string();
    j["ready_s"] = report.pull.ready_s;
    j["hot"] = nlohmann::ordered_json::array();
    for (const auto& l : report.pull.layers) {
      if (l.hot) j["hot"].push_back(l.digest);
    }
    CFMO_TRY(write_file_atomic(options.ready_file, j.dump() + "\n"));
  }
  return report;
}

}  // namespace cfmo::oci
