#pragma once
// What every test of an error path checks: the error's kind (the exit status
// it maps to) and that its one line names the file, flag or tensor at fault.

#include "core/error.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

namespace cfmo {

// Checks the kind, that the message names each part and that it is one line,
// printing the message on failure.
template <typename T>
::testing::AssertionResult fails_with(const Result<T>& result, ErrorKind kind,
                                      std::initializer_list<std::string> parts = {}) {
  if (result.has_value()) return ::testing::AssertionFailure() << "succeeded, expected an error";
  const Error& error = result.error();
  if (error.kind != kind) {
    return ::testing::AssertionFailure() << "kind " << error.exit_status() << ", expected " << static_cast<int>(kind)
                                         << ": " << error.message;
  }
  for (const auto& part : parts) {
    if (error.message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message \"" << error.message << "\" does not name \"" << part << "\"";
    }
  }
  if (error.message.find('\n') != std::string::npos) return ::testing::AssertionFailure() << "more than one line";
  return ::testing::AssertionSuccess() << error.message;
}

}  // namespace cfmo
