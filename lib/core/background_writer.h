#pragma once
/// A thread of its own that writes what the caller hands it, so a slow disk
/// never stalls the caller (the trainer's checkpoints and deltas). The queue
/// is short and never waited for: when it is full, a new item is skipped or
/// replaces the newest waiting one, and either way counted. The first write
/// error stops further writes and is kept for status().

#include "core/error.h"

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace cfmo {

template <typename Job>
class BackgroundWriter {
 public:
  enum class WhenFull : uint8_t {
    kSkipNew,         ///< the new item is dropped (every waiting one was due first)
    kReplaceWaiting,  ///< the new item takes the newest waiting one's place (only the latest matters)
  };
  /// Runs on the writer's thread, one item at a time, in submission order.
  using Write = std::function<Status(Job&)>;

  BackgroundWriter(size_t capacity, WhenFull when_full, Write write)
      : capacity_(capacity < 1 ? 1 : capacity),
        when_full_(when_full),
        write_(std::move(write)),
        thread_([this] { run(); }) {}
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;
  /// Writes what is queued, then stops the thread.
  ~BackgroundWriter() { close(); }

  /// The same, now; afterwards every submission is skipped.
  void close() {
    {
      std::lock_guard lock(mutex_);
      if (closed_) return;
      stopping_ = true;
      closed_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }

  /// Queues the item `make()` returns, called under the queue's lock and only
  /// when the item is taken (a skipped one costs no copy). True when it was
  /// queued without displacing another.
  template <typename MakeJob>
  bool submit_with(MakeJob&& make) {
    std::lock_guard lock(mutex_);
    if (stopping_ || !status_) {
      ++skipped_;
      return false;
    }
    bool displaced = false;
    if (queue_.size() >= capacity_) {
      ++skipped_;
      if (when_full_ == WhenFull::kSkipNew) return false;
      queue_.pop_back();
      displaced = true;
    }
    queue_.push_back(std::forward<MakeJob>(make)());
    ready_.notify_one();
    return !displaced;
  }
  bool submit(Job job) {
    return submit_with([&job] { return std::move(job); });
  }

  /// The first write error, if any.
  Status status() const {
    std::lock_guard lock(mutex_);
    return status_;
  }
  int64_t written() const {
    std::lock_guard lock(mutex_);
    return written_;
  }
  int64_t skipped() const {
    std::lock_guard lock(mutex_);
    return skipped_;
  }

 private:
  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      Status written = write_(job);
      std::lock_guard lock(mutex_);
      if (written) {
        ++written_;
      } else if (status_) {
        status_ = std::move(written);
      }
    }
  }

  const size_t capacity_;
  const WhenFull when_full_;
  const Write write_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> queue_;  // guarded by mutex_, as are the fields below
  Status status_;
  int64_t written_ = 0;
  int64_t skipped_ = 0;
  bool stopping_ = false;
  bool closed_ = false;  ///< the thread was joined
  std::thread thread_;   ///< last: starts after the members it uses
};

}  // namespace cfmo
