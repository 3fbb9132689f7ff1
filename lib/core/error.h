#pragma once
/// Errors as values: every library function that can fail returns Result<T>.
/// An Error carries the kind (which maps to the shared exit status) and one
/// line of text that names the object at fault ("file 'x': truncated").

#include <fmt/format.h>

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace cfmo {

/// The exit-status table shared by every cfmo tool (ARCHITECTURE.md).
enum class ErrorKind : int {
  kCheckFailed = 1,  ///< a divergence threshold or benchmark target was missed
  kUsage = 2,        ///< bad flag, bad config key or value
  kInput = 3,        ///< unreadable or corrupt input file
  kPeer = 4,         ///< a peer, network or registry failure after retries
  kInternal = 5,     ///< a bug or an unexpected system failure
};

struct Error {
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;

  int exit_status() const { return static_cast<int>(kind); }
};

template <typename... Args>
Error make_error(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  return Error{kind, fmt::format(format, std::forward<Args>(args)...)};
}

/// A minimal std::expected<T, Error> (C++23) for a C++20 toolchain.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}      // NOLINT: implicit by design
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}  // NOLINT

  bool has_value() const { return state_.index() == 0; }
  explicit operator bool() const { return has_value(); }

  T& value() & {
    assert(has_value());
    return std::get<0>(state_);
  }
  const T& value() const& {
    assert(has_value());
    return std::get<0>(state_);
  }
  T&& value() && {
    assert(has_value());
    return std::get<0>(std::move(state_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const Error& error() const& {
    assert(!has_value());
    return std::get<1>(state_);
  }
  Error&& error() && {
    assert(!has_value());
    return std::get<1>(std::move(state_));
  }

 private:
  std::variant<T, Error> state_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT: implicit by design

  bool has_value() const { return ok_; }
  explicit operator bool() const { return ok_; }
  void value() const { assert(ok_); }
  const Error& error() const& {
    assert(!ok_);
    return error_;
  }
  Error&& error() && {
    assert(!ok_);
    return std::move(error_);
  }

 private:
  Error error_;
  bool ok_ = true;
};

using Status = Result<void>;

}  // namespace cfmo

/// Propagates an error from an expression returning Result<T>.
#define CFMO_TRY(expr)                                                 \
  do {                                                                 \
    auto cfmo_try_result_ = (expr);                                    \
    if (!cfmo_try_result_) return std::move(cfmo_try_result_).error(); \
  } while (false)

#define CFMO_CONCAT_INNER(a, b) a##b
#define CFMO_CONCAT(a, b) CFMO_CONCAT_INNER(a, b)
/// Declares `lhs` from a Result<T> expression, or returns its error.
#define CFMO_ASSIGN_OR_RETURN(lhs, expr) CFMO_ASSIGN_OR_RETURN_IMPL(CFMO_CONCAT(cfmo_result_, __LINE__), lhs, expr)
#define CFMO_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp) return std::move(tmp).error();         \
  lhs = std::move(tmp).value()
