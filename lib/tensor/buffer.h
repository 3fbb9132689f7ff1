#pragma once
/// Float storage aligned for SIMD loads and BLAS, owned by one object.

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace cfmo::tensor {

template <typename T, size_t Alignment = 64>
struct AlignedAllocator {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = AlignedAllocator<U, Alignment>;
  };
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U, Alignment>&) {}  // NOLINT: allocator conversion

  T* allocate(size_t n) {
    size_t bytes = (n * sizeof(T) + Alignment - 1) / Alignment * Alignment;
    void* p = std::aligned_alloc(Alignment, bytes == 0 ? Alignment : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const AlignedAllocator<U, Alignment>&) const {
    return true;
  }
};

/// A flat, 64-byte aligned float vector: parameters, gradients, optimizer state.
using FloatBuffer = std::vector<float, AlignedAllocator<float>>;

}  // namespace cfmo::tensor
