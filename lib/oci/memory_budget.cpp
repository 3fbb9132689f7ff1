#include "oci/memory_budget.h"

#include <sys/resource.h>

#include <algorithm>

namespace cfmo::oci {

MemoryBudget::Lease& MemoryBudget::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    budget_ = other.budget_;
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
  }
  return *this;
}

void MemoryBudget::Lease::release() {
  if (budget_ != nullptr) budget_->give_back(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

MemoryBudget::Lease MemoryBudget::acquire(size_t bytes) {
  bytes = std::min(bytes, total_);
  std::unique_lock lock(mutex_);
  freed_.wait(lock, [&] { return total_ - used_ >= bytes; });
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  return Lease(this, bytes);
}

MemoryBudget::Lease MemoryBudget::try_acquire(size_t bytes) {
  bytes = std::min(bytes, total_);
  std::lock_guard lock(mutex_);
  if (total_ - used_ < bytes) return {};
  used_ += bytes;
  peak_ = std::max(peak_, used_);
  return Lease(this, bytes);
}

size_t MemoryBudget::share(size_t parties, size_t floor, size_t ceiling) const {
  const size_t each = total_ / std::max<size_t>(parties, 1);
  return std::min(total_, std::clamp(each, floor, std::max(floor, ceiling)));
}

void MemoryBudget::give_back(size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    used_ -= bytes;
  }
  freed_.notify_all();
}

size_t MemoryBudget::in_use() const {
  std::lock_guard lock(mutex_);
  return used_;
}

size_t MemoryBudget::peak() const {
  std::lock_guard lock(mutex_);
  return peak_;
}

int64_t peak_rss_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace cfmo::oci
