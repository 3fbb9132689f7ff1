#pragma once
/// The process's own memory, bounded: a byte budget that the parallel
/// downloads (their write buffers and the unpackers' queues) draw their
/// buffers from, and the peak resident set size the kernel measured.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace cfmo::oci {

/// A counting semaphore over bytes. acquire() blocks while the budget is
/// spent, so N downloads never hold more than `total` bytes of buffers
/// between them; a request above the total is clipped to it (one download
/// alone may use all of it, never more).
class MemoryBudget {
 public:
  explicit MemoryBudget(size_t total) : total_(total == 0 ? 1 : total) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  /// Bytes given out until released; moves, never copies.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) { other.budget_ = nullptr; }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { release(); }
    size_t bytes() const { return budget_ == nullptr ? 0 : bytes_; }
    void release();

   private:
    friend class MemoryBudget;
    Lease(MemoryBudget* budget, size_t bytes) : budget_(budget), bytes_(bytes) {}
    MemoryBudget* budget_ = nullptr;
    size_t bytes_ = 0;
  };

  /// Waits until `bytes` (clipped to the total) are free and takes them.
  Lease acquire(size_t bytes);
  /// Takes `bytes` only if they are free now.
  Lease try_acquire(size_t bytes);

  /// The share of one of `parties` downloads: total / parties, between
  /// `floor` and `ceiling` (and never above the total).
  size_t share(size_t parties, size_t floor, size_t ceiling) const;

  size_t total() const { return total_; }
  size_t in_use() const;
  size_t peak() const;

 private:
  void give_back(size_t bytes);

  const size_t total_;
  mutable std::mutex mutex_;  ///< guards used_ and peak_
  std::condition_variable freed_;
  size_t used_ = 0;
  size_t peak_ = 0;
};

/// The peak resident set size of this process so far (getrusage), in bytes.
int64_t peak_rss_bytes();

}  // namespace cfmo::oci
