#pragma once
/// The byte encoding of the asynchronous modes' messages: fixed-size values
/// in host order (every rank runs the same build), float arrays raw or
/// counted. Each message's layout is documented where it is written
/// (async_base.cpp, cfmo.cpp, asgd.cpp).

#include "train/checkpoint.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace cfmo::train::modes {

// resize + memcpy rather than insert: GCC 12 warns falsely (-Wstringop-overflow)
// about inserting into an empty vector.
inline void put_bytes(std::vector<std::byte>& out, const void* data, size_t size) {
  const size_t at = out.size();
  out.resize(at + size);
  if (size > 0) std::memcpy(out.data() + at, data, size);
}

template <typename T>
void put(std::vector<std::byte>& out, const T& value) {
  put_bytes(out, &value, sizeof(T));
}

/// Reads a T off the front of `in`; false (and `in` untouched) when too short.
template <typename T>
bool take(std::span<const std::byte>& in, T& value) {
  if (in.size() < sizeof(T)) return false;
  std::memcpy(&value, in.data(), sizeof(T));
  in = in.subspan(sizeof(T));
  return true;
}

inline void put_floats(std::vector<std::byte>& out, std::span<const float> values) {
  put_bytes(out, values.data(), values.size_bytes());
}

/// [i64 step][i64 epoch][i64 batch in epoch][i64 samples][f64 train_s][i64 data world]
inline void put_position(std::vector<std::byte>& out, const TrainPosition& p) {
  put(out, p.step);
  put(out, p.epoch);
  put(out, p.batch_in_epoch);
  put(out, p.samples);
  put(out, p.train_s);
  put(out, p.data_world);
}

inline bool take_position(std::span<const std::byte>& in, TrainPosition& p) {
  return take(in, p.step) && take(in, p.epoch) && take(in, p.batch_in_epoch) && take(in, p.samples) &&
         take(in, p.train_s) && take(in, p.data_world);
}

/// [u64 count][count floats]
inline void put_vector(std::vector<std::byte>& out, std::span<const float> values) {
  put(out, static_cast<uint64_t>(values.size()));
  put_floats(out, values);
}

inline bool take_vector(std::span<const std::byte>& in, std::vector<float>& values) {
  uint64_t n = 0;
  if (!take(in, n) || n > in.size() / sizeof(float)) return false;
  values.resize(n);
  std::memcpy(values.data(), in.data(), n * sizeof(float));
  in = in.subspan(n * sizeof(float));
  return true;
}

}  // namespace cfmo::train::modes
