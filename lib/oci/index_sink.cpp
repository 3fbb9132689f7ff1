#include "oci/index_sink.h"

#include "core/atomic_file.h"
#include "oci/blob.h"
#include "oci/hot_set.h"
#include "oci/pull_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>

namespace cfmo::oci {

namespace fs = std::filesystem;

/// One layer's indexer: build_layer_index on its own thread, reading the
/// bytes on disk before the download started (from `prefix_fd`, which it
/// owns), then the queue.
class IndexSink::Job : public LayerBytes {
 public:
  Job(const Descriptor& layer, fs::path prefix, int prefix_fd, int64_t prefix_bytes, uint64_t span, size_t cap,
      std::string what)
      : layer_(layer),
        prefix_(std::move(prefix)),
        prefix_left_(prefix_bytes),
        fd_(prefix_fd),
        streamed_(prefix_bytes < layer.size),
        cap_(cap),
        what_(std::move(what)) {
    thread_ = std::thread([this, span] {
      auto built = build_layer_index(*this, layer_, span, what_);
      std::lock_guard lock(mu_);
      result_ = std::move(built);
      finished_ = true;
      cv_.notify_all();
    });
  }
  ~Job() override {
    if (thread_.joinable()) abort();
    if (fd_ >= 0) ::close(fd_);
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Result<size_t> read(unsigned char* buffer, size_t size) override {
    if (prefix_left_ > 0) return read_prefix(buffer, size);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !queue_.empty() || closed_ || aborted_; });
    if (aborted_) return make_error(ErrorKind::kInternal, "{}: the download stopped", what_);
    if (queue_.empty()) return size_t{0};
    std::string& front = queue_.front();
    const size_t n = std::min(size, front.size() - front_at_);
    std::memcpy(buffer, front.data() + front_at_, n);
    front_at_ += n;
    queued_ -= n;
    if (front_at_ == front.size()) {
      queue_.pop_front();
      front_at_ = 0;
    }
    cv_.notify_all();
    return n;
  }

  /// Queues a copy of `chunk`, waiting while the queue is full; dropped once the indexer has ended (it gave up).
  void push(std::string_view chunk) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return queued_ < cap_ || finished_ || aborted_; });
    if (finished_ || aborted_) return;
    queue_.emplace_back(chunk);
    queued_ += chunk.size();
    cv_.notify_all();
  }

  /// The blob is complete: the indexer reads to its end and its index is returned.
  Result<LayerIndex> close() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      cv_.notify_all();
    }
    thread_.join();
    return std::move(result_);
  }

  void abort() {
    {
      std::lock_guard lock(mu_);
      aborted_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }

  bool streamed() const { return streamed_; }

 private:
  Result<size_t> read_prefix(unsigned char* buffer, size_t size) {
    ssize_t n = 0;
    do {
      n = ::read(fd_, buffer, std::min<size_t>(size, static_cast<size_t>(prefix_left_)));
    } while (n < 0 && errno == EINTR);
    if (n <= 0) {
      return make_error(ErrorKind::kInternal, "'{}': {} bytes short", prefix_.string(), prefix_left_);
    }
    prefix_left_ -= n;
    return static_cast<size_t>(n);
  }

  Descriptor layer_;
  fs::path prefix_;
  int64_t prefix_left_;
  int fd_;
  bool streamed_;
  size_t cap_;
  std::string what_;
  std::mutex mu_;  ///< guards what follows
  std::condition_variable cv_;
  std::deque<std::string> queue_;
  size_t front_at_ = 0;
  size_t queued_ = 0;
  bool closed_ = false;
  bool aborted_ = false;
  bool finished_ = false;
  Result<LayerIndex> result_ = make_error(ErrorKind::kInternal, "not indexed");
  std::thread thread_;  ///< last: started once the rest is in place
};

IndexSink::IndexSink(fs::path dir, uint64_t span, size_t queue_bytes)
    : dir_(std::move(dir)), span_(span), queue_bytes_(queue_bytes) {}

IndexSink::~IndexSink() {
  std::lock_guard lock(mu_);
  jobs_.clear();  // each aborts its thread
}

void IndexSink::on_plan(const PullState& state) {
  std::lock_guard lock(mu_);
  layers_.clear();
  for (const auto& l : state.layers) layers_.push_back(l.blob);
  store_ = state.memory_dir;
}

fs::path IndexSink::on_disk(size_t layer, int64_t bytes) const {
  const std::string& digest = layers_[layer].digest;
  std::vector<fs::path> candidates;
  for (const fs::path& root : {store_, dir_}) {
    if (!root.empty()) candidates.push_back(blob_path(root, digest).string() + ".partial");
  }
  for (const fs::path& root : {dir_, store_}) {
    if (!root.empty()) candidates.push_back(blob_path(root, digest));
  }
  for (const auto& path : candidates) {
    std::error_code ec;
    if (const auto size = fs::file_size(path, ec); !ec && static_cast<int64_t>(size) >= bytes) return path;
  }
  return {};
}

void IndexSink::start(size_t layer, int64_t bytes_on_disk) {
  const Descriptor& d = layers_[layer];
  const std::string what = fmt::format("layer {} ({})", short_digest(d.digest), layer);
  fs::path prefix;
  int fd = -1;
  if (bytes_on_disk > 0) {
    // Opened now, before this call returns: the pull renames the partial
    // blob once it is complete, which may be before the job reads it.
    prefix = on_disk(layer, bytes_on_disk);
    if (!prefix.empty()) fd = ::open(prefix.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      outcomes_.push_back({layer, d.digest, false, false, "its partial blob is not where the pull keeps it"});
      return;
    }
  }
  jobs_[layer] = std::make_unique<Job>(d, prefix, fd, bytes_on_disk, span_, queue_bytes_, what);
}

void IndexSink::on_blob_start(size_t layer, int64_t bytes_on_disk) {
  std::lock_guard lock(mu_);
  if (layer >= layers_.size()) return;
  jobs_.erase(layer);
  std::error_code ec;
  if (bytes_on_disk == layers_[layer].size && fs::exists(index_path(dir_, layers_[layer].digest), ec)) return;
  start(layer, bytes_on_disk);
}

void IndexSink::on_blob_restart(size_t layer) {
  std::lock_guard lock(mu_);
  if (jobs_.erase(layer) == 0) return;
  start(layer, 0);
}

Status IndexSink::on_blob_write(size_t layer, std::string_view chunk) {
  Job* job = nullptr;
  {
    std::lock_guard lock(mu_);
    if (const auto it = jobs_.find(layer); it != jobs_.end()) job = it->second.get();
  }
  // One layer's calls come from one thread, in order: the job stays while this runs.
  if (job != nullptr) job->push(chunk);
  return {};
}

void IndexSink::on_blob_done(size_t layer, const Error* error) {
  std::unique_ptr<Job> job;
  {
    std::lock_guard lock(mu_);
    if (layer >= layers_.size()) return;
    if (const auto it = jobs_.find(layer); it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
    }
  }
  if (error != nullptr) return;  // a failed download: the job (if any) is aborted as it goes
  std::error_code ec;
  if (!job && fs::exists(index_path(dir_, layers_[layer].digest), ec)) return;
  finish(layer, std::move(job));
}

void IndexSink::finish(size_t layer, std::unique_ptr<Job> job) {
  const Descriptor& d = layers_[layer];
  Outcome outcome{layer, d.digest, false, job && job->streamed(), {}};
  Result<LayerIndex> index = make_error(ErrorKind::kInternal, "not indexed");
  if (job) {
    index = job->close();
  } else {
    // There already (no download, so no bytes went by): indexed from its file.
    const fs::path blob = on_disk(layer, d.size);
    index = blob.empty()
                ? make_error(ErrorKind::kInternal, "its blob is not in the layout")
                : build_layer_index(blob, d, span_, fmt::format("layer {} ({})", short_digest(d.digest), layer));
  }
  if (index) {
    const fs::path path = index_path(dir_, d.digest);
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    const Status written = write_file_atomic(path, serialize_index(*index));
    outcome.indexed = static_cast<bool>(written);
    if (!written) outcome.note = written.error().message;
  } else {
    outcome.note = index.error().message;
  }
  std::lock_guard lock(mu_);
  outcomes_.push_back(std::move(outcome));
}

std::vector<IndexSink::Outcome> IndexSink::outcomes() const {
  std::lock_guard lock(mu_);
  return outcomes_;
}

}  // namespace cfmo::oci
