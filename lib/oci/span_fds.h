#pragma once
/// Internal to `oci` (the lazy mount's read path): the open descriptors of
/// the span files in its cache, least recently used first to go, so that a
/// FUSE read of a cached span reuses one instead of opening the file (an
/// open and a close per 128 KiB read were most of a cached read's time).
/// A descriptor is shared: one dropped (pushed out by newer ones, or its
/// span evicted from the cache and its file unlinked) stays open until the
/// last read holding it ends, and reads what the file held, which never
/// changes (a span is written once, whole, then renamed into place). Not
/// thread-safe: the caller holds its lock around every call.

#include "core/fd.h"

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <utility>

namespace cfmo::oci {

template <typename Key>
class SpanFds {
 public:
  using Handle = std::shared_ptr<const Fd>;

  explicit SpanFds(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  /// The descriptor of `key`, now the most recently used; empty when none is held.
  Handle find(const Key& key) {
    const auto it = held_.find(key);
    if (it == held_.end()) return {};
    order_.splice(order_.begin(), order_, it->second.second);
    return it->second.first;
  }

  /// Holds `fd` for `key` (replacing one held), dropping the least recently used past the capacity.
  void put(const Key& key, Handle fd) {
    drop(key);
    order_.push_front(key);
    held_.emplace(key, std::make_pair(std::move(fd), order_.begin()));
    while (held_.size() > capacity_) drop(order_.back());
  }

  /// Lets go of `key`'s descriptor (closed once no read holds it).
  void drop(const Key& key) {
    const auto it = held_.find(key);
    if (it == held_.end()) return;
    order_.erase(it->second.second);
    held_.erase(it);
  }

  size_t size() const { return held_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::list<Key> order_;  ///< most recently used first
  std::map<Key, std::pair<Handle, typename std::list<Key>::iterator>> held_;
};

}  // namespace cfmo::oci
