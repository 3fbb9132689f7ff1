#pragma once
/// A FIFO in one ring of slots that doubles when full: a destination's
/// messages on their way (sim/sim_communicator.h). Unlike std::deque it
/// allocates only as it grows, never per block as messages come and go
/// (that churn, and the cache misses of a deque's blocks, were a third of
/// a large asynchronous simulation's time), and the next message is the
/// slot after the last one. An insert before the end moves the shorter side.

#include <cstddef>
#include <utility>
#include <vector>

namespace cfmo::sim {

template <typename T>
class Ring {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  /// The i-th from the front.
  T& operator[](size_t i) { return slots_[(head_ + i) & (slots_.size() - 1)]; }
  const T& operator[](size_t i) const { return slots_[(head_ + i) & (slots_.size() - 1)]; }
  T& front() { return slots_[head_]; }
  const T& back() const { return (*this)[size_ - 1]; }

  void pop_front() {
    head_ = (head_ + 1) & (slots_.size() - 1);
    --size_;
  }
  void push_back(T value) { insert(size_, std::move(value)); }
  /// `value` becomes the i-th (0 <= i <= size()).
  void insert(size_t i, T value) {
    if (size_ == slots_.size()) grow();
    if (i < size_ / 2) {
      head_ = (head_ + slots_.size() - 1) & (slots_.size() - 1);
      for (size_t k = 0; k < i; ++k) (*this)[k] = std::move((*this)[k + 1]);
    } else {
      for (size_t k = size_; k > i; --k) (*this)[k] = std::move((*this)[k - 1]);
    }
    (*this)[i] = std::move(value);
    ++size_;
  }

 private:
  void grow() {
    std::vector<T> bigger(slots_.empty() ? 16 : slots_.size() * 2);
    for (size_t k = 0; k < size_; ++k) bigger[k] = std::move((*this)[k]);
    slots_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;  ///< a power of two of them, or none
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace cfmo::sim
