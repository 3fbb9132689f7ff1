#include "oci/blob.h"

#include "core/fd.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <system_error>
#include <thread>
#include <vector>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

struct MdCtxFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

std::string hex_digest(EVP_MD_CTX* ctx) {
  // Finalising a copy leaves the running context usable.
  MdCtx copy(EVP_MD_CTX_new());
  EVP_MD_CTX_copy_ex(copy.get(), ctx);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(copy.get(), md, &length);
  std::string out = "sha256:";
  for (unsigned int i = 0; i < length; ++i) out += fmt::format("{:02x}", md[i]);
  return out;
}

Status pwrite_all(int fd, std::string_view data, int64_t offset, const fs::path& path) {
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd, data.data(), data.size(), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return make_error(ErrorKind::kInternal, "'{}': write failed: {}", path.string(), std::strerror(errno));
    }
    data.remove_prefix(static_cast<size_t>(n));
    offset += n;
  }
  return {};
}

/// Hashes the first `length` bytes of an open file (a partial download being resumed).
Status hash_prefix(int fd, int64_t length, EVP_MD_CTX* ctx, const fs::path& path) {
  std::vector<char> buffer(1 << 20);
  int64_t done = 0;
  while (done < length) {
    const ssize_t n = ::pread(fd, buffer.data(), std::min<int64_t>(length - done, buffer.size()), done);
    if (n <= 0) return make_error(ErrorKind::kInternal, "'{}': read failed while resuming", path.string());
    EVP_DigestUpdate(ctx, buffer.data(), static_cast<size_t>(n));
    done += n;
  }
  return {};
}

/// Makes a growing file durable a piece at a time while it is still being
/// written: an fdatasync on a thread of its own, at most one at a time, so
/// the download never waits for it. The final fsync of a blob waits for the
/// disk's cache flush, and on a virtual disk that flush lasts as long as the
/// host needs to persist what it has buffered: 1.3-1.6 s here when a whole
/// 1.3 GB pull was left to it, while the downloads had kept the host's disk
/// idle. Flushing along the way overlaps the two (a pull to an OCI layout
/// took 2.7-3.3 s instead of 3.7-4.3 s), and a crash mid-download keeps
/// what was flushed for the resume.
class BackgroundSync {
 public:
  explicit BackgroundSync(int fd) : fd_(fd) {}
  ~BackgroundSync() { wait(); }
  BackgroundSync(const BackgroundSync&) = delete;
  BackgroundSync& operator=(const BackgroundSync&) = delete;

  /// Starts an fdatasync unless one is still running (the next one covers
  /// what this one would have).
  void start() {
    if (running_.load(std::memory_order_acquire)) return;
    wait();
    running_.store(true, std::memory_order_relaxed);
    try {
      thread_ = std::thread([this] {
        if (::fdatasync(fd_) != 0 && error_ == 0) error_ = errno;
        running_.store(false, std::memory_order_release);
      });
    } catch (const std::system_error&) {
      running_.store(false, std::memory_order_relaxed);  // no thread to spare: the final fsync does it all
    }
  }

  /// Waits for the one in flight. The errno of a failed one, or 0: the
  /// kernel reports a writeback error to one fsync only, so it is kept here.
  int wait() {
    if (thread_.joinable()) thread_.join();
    return error_;
  }

 private:
  int fd_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  int error_ = 0;  ///< written by the thread, read after the join
};

/// Streams a blob body into the partial file, hashing as it goes. It lives
/// across retries: each attempt asks for the bytes after those already
/// received. Received bytes wait in `buffer_` until it is full (or the
/// transfer ends), so a chunk of a few KiB costs a memcpy, not a syscall.
class PartialFileSink : public BodySink {
 public:
  PartialFileSink(int fd, fs::path path, int64_t expected, std::string what, const BlobFetchOptions& options)
      : fd_(fd),
        path_(std::move(path)),
        expected_(expected),
        what_(std::move(what)),
        options_(options),
        ctx_(EVP_MD_CTX_new()) {
    EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr);
    buffer_.reserve(options.buffer_bytes);
  }

  Status resume_from(int64_t length) {
    CFMO_TRY(hash_prefix(fd_, length, ctx_.get(), path_));
    written_ = length;
    on_disk_ = length;
    flushed_ = length;
    synced_ = length;
    report(true);
    return {};
  }

  std::vector<std::string> extra_headers() override {
    if (written_ == 0) return {};
    return {fmt::format("Range: bytes={}-", written_)};
  }

  Status begin(long status) override {
    if (status == 206 || written_ == 0) return {};
    // The server ignored Range and sends the whole blob: start over.
    buffer_.clear();
    if (::ftruncate(fd_, 0) != 0) {
      return make_error(ErrorKind::kInternal, "'{}': truncate failed: {}", path_.string(), std::strerror(errno));
    }
    EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr);
    written_ = 0;
    on_disk_ = 0;
    flushed_ = 0;
    synced_ = 0;
    if (options_.observer != nullptr) options_.observer->on_restart();
    return {};
  }

  Status write(std::string_view chunk) override {
    if (written_ + static_cast<int64_t>(chunk.size()) > expected_) {
      return make_error(ErrorKind::kInput, "{}: size mismatch: the registry sends more than the {} bytes declared",
                        what_, expected_);
    }
    EVP_DigestUpdate(ctx_.get(), chunk.data(), chunk.size());
    if (buffer_.capacity() > 0 && chunk.size() < buffer_.capacity()) {
      if (buffer_.size() + chunk.size() > buffer_.capacity()) CFMO_TRY(flush());
      buffer_.insert(buffer_.end(), chunk.begin(), chunk.end());
    } else {
      CFMO_TRY(flush());
      CFMO_TRY(pwrite_all(fd_, chunk, on_disk_, path_));
      on_disk_ += static_cast<int64_t>(chunk.size());
      write_back();
      if (options_.observer != nullptr) CFMO_TRY(options_.observer->on_write(chunk));
    }
    written_ += static_cast<int64_t>(chunk.size());
    fetched_ += static_cast<int64_t>(chunk.size());
    report(false);
    return {};
  }

  /// Writes what waits in the buffer; after a failed attempt too, so the
  /// partial file holds every byte received and verified by TCP.
  Status flush() {
    if (buffer_.empty()) return {};
    const std::string_view bytes(buffer_.data(), buffer_.size());
    CFMO_TRY(pwrite_all(fd_, bytes, on_disk_, path_));
    on_disk_ += static_cast<int64_t>(bytes.size());
    write_back();
    // The observer hears of bytes once they are in the file (an unpacker may read them back from it).
    Status seen = options_.observer != nullptr ? options_.observer->on_write(bytes) : Status{};
    buffer_.clear();
    return seen;
  }

  /// Starts writing back what is on disk so far, and now and then makes it
  /// durable (see BackgroundSync), so the fsync at the end waits for the
  /// last few MiB rather than the whole blob.
  void write_back() {
    if (on_disk_ - flushed_ >= kWritebackStep) {
      ::sync_file_range(fd_, flushed_, on_disk_ - flushed_, SYNC_FILE_RANGE_WRITE);
      flushed_ = on_disk_;
    }
    if (on_disk_ - synced_ >= kSyncStep) {
      sync_.start();
      synced_ = on_disk_;
    }
  }

  /// Makes the whole file durable: waits for the background flush, then fsyncs.
  Status sync() {
    const int background = sync_.wait();
    if (background != 0 || ::fsync(fd_) != 0) {
      return make_error(ErrorKind::kInternal, "'{}': fsync failed: {}", path_.string(),
                        std::strerror(background != 0 ? background : errno));
    }
    return {};
  }

  void report(bool force) {
    if (!options_.on_bytes) return;
    if (force || written_ - reported_ >= (256 << 10) || written_ == expected_) {
      reported_ = written_;
      options_.on_bytes(written_);
    }
  }

  int64_t written() const { return written_; }
  int64_t fetched() const { return fetched_; }
  std::string digest() const { return hex_digest(ctx_.get()); }

 private:
  int fd_;
  fs::path path_;
  int64_t expected_;
  std::string what_;
  const BlobFetchOptions& options_;
  MdCtx ctx_;
  std::vector<char> buffer_;
  int64_t written_ = 0;  ///< received: on disk plus buffered
  int64_t on_disk_ = 0;
  int64_t fetched_ = 0;
  int64_t reported_ = -1;
  int64_t flushed_ = 0;  ///< bytes handed to writeback
  int64_t synced_ = 0;   ///< bytes covered by a background flush, started or done
  BackgroundSync sync_{fd_};
  static constexpr int64_t kWritebackStep = 8 << 20;
  static constexpr int64_t kSyncStep = 32 << 20;
};

}  // namespace

fs::path blob_path(const fs::path& layout, const std::string& digest) {
  return layout / "blobs" / "sha256" / digest.substr(7);
}

Result<bool> file_matches(const fs::path& path, const std::string& digest, int64_t size) {
  std::error_code ec;
  const auto actual = fs::file_size(path, ec);
  if (ec || static_cast<int64_t>(actual) != size) return false;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return false;
  MdCtx ctx(EVP_MD_CTX_new());
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  CFMO_TRY(hash_prefix(fd.get(), size, ctx.get(), path));
  return hex_digest(ctx.get()) == digest;
}

/// Blobs at least this large have their blocks reserved before the download.
constexpr int64_t kPreallocateFrom = 1 << 20;

Result<BlobResult> fetch_blob(RegistryApi& client, const Descriptor& blob, const fs::path& layout,
                              const std::string& what, const BlobFetchOptions& options) {
  BlobResult result;
  const fs::path final_path = blob_path(layout, blob.digest);
  CFMO_ASSIGN_OR_RETURN(const bool present, file_matches(final_path, blob.digest, blob.size));
  if (present) {
    result.already_present = true;
    return result;
  }
  std::error_code ec;
  fs::create_directories(final_path.parent_path(), ec);
  if (ec) {
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", final_path.parent_path().string(), ec.message());
  }
  const fs::path partial = final_path.string() + ".partial";
  Fd fd(::open(partial.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    return make_error(ErrorKind::kInternal, "'{}': cannot open: {}", partial.string(), std::strerror(errno));
  }
  // Another process fetching the same blob into the same directory (a shared
  // cache) holds the lock until its blob is in place: wait, then look again.
  while (::flock(fd.get(), LOCK_EX) != 0) {
    if (errno != EINTR) {
      return make_error(ErrorKind::kInternal, "'{}': cannot lock: {}", partial.string(), std::strerror(errno));
    }
  }
  CFMO_ASSIGN_OR_RETURN(const bool arrived, file_matches(final_path, blob.digest, blob.size));
  if (arrived) {
    result.already_present = true;
    return result;
  }
  PartialFileSink sink(fd.get(), partial, blob.size, what, options);
  struct stat st {};
  int64_t existing = ::fstat(fd.get(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
  if (existing < 0 || existing > blob.size) {
    existing = 0;
    if (::ftruncate(fd.get(), 0) != 0)
      return make_error(ErrorKind::kInternal, "'{}': truncate failed", partial.string());
  }
  if (existing > 0) {
    CFMO_TRY(sink.resume_from(existing));
    result.resumed = true;
  }
  if (options.observer != nullptr) options.observer->on_start(sink.written());
  // The blob's blocks, reserved before the download: the streams of a
  // parallel pull then get an extent each rather than interleaved pieces
  // (about 5% faster to an OCI layout on this machine's disk), and a disk
  // that cannot hold the blob says so now, not after most of it came.
  // KEEP_SIZE: the file's size stays the bytes received, which a resume
  // reads. A file system without fallocate just goes without.
  if (const int64_t rest = blob.size - sink.written(); rest >= kPreallocateFrom) {
    if (::fallocate(fd.get(), FALLOC_FL_KEEP_SIZE, sink.written(), rest) != 0 && errno == ENOSPC) {
      [[maybe_unused]] const int freed = ::ftruncate(fd.get(), sink.written());  // what it did reserve
      return make_error(ErrorKind::kInternal, "{}: no space left in '{}' for its {} bytes", what,
                        final_path.parent_path().string(), rest);
    }
  }
  if (sink.written() < blob.size || blob.size == 0) {
    auto got = client.get("/v2/" + client.reference().repository + "/blobs/" + blob.digest, {}, sink, what);
    result.bytes_fetched = sink.fetched();
    if (auto flushed = sink.flush(); !flushed) return std::move(flushed).error();
    if (!got) {
      if (got.error().kind == ErrorKind::kInput && got.error().message.find("mismatch") != std::string::npos) {
        fs::remove(partial, ec);
      }
      return std::move(got).error();
    }
  }
  if (sink.written() != blob.size) {
    fs::remove(partial, ec);
    return make_error(ErrorKind::kInput, "{}: size mismatch: {} bytes received, {} declared", what, sink.written(),
                      blob.size);
  }
  if (const auto actual = sink.digest(); actual != blob.digest) {
    // Nothing is kept: a corrupt partial file would only be resumed into another mismatch.
    fs::remove(partial, ec);
    return make_error(ErrorKind::kInput, "{}: digest mismatch: got {}", what, actual);
  }
  CFMO_TRY(sink.sync());
  fs::rename(partial, final_path, ec);
  if (ec) return make_error(ErrorKind::kInternal, "'{}': rename failed: {}", final_path.string(), ec.message());
  return result;
}

}  // namespace cfmo::oci
