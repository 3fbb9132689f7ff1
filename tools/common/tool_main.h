#pragma once
// What every cfmo tool does first and last: pick the BLAS kernels, and turn
// a library Error into one line on stderr and the shared exit status.

#include "core/error.h"
#include "tensor/ops.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>

namespace cfmo::tool {

/// OpenBLAS picks its kernels when it is loaded, from OPENBLAS_CORETYPE. When
/// its own detection fell back to the slowest kernels on a CPU it does not
/// know, the process starts itself again once with the right core type.
inline void reexec_for_blas(char** argv) {
  const std::string core = ops::better_blas_coretype();
  if (core.empty() || std::getenv("CFMO_BLAS_REEXEC") != nullptr) return;
  ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  ::setenv("CFMO_BLAS_REEXEC", "1", 1);
  ::execv("/proc/self/exe", argv);
  // If exec fails the run goes on with the slow kernels: correct, only slower.
}

/// Runs a tool's body; an exception that escapes it (out of memory, a
/// library's own throw) becomes one line and exit status 5, not an abort.
template <typename Body>
int guarded(const char* tool, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: out of memory\n", tool);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: internal error: {}\n", tool, e.what());
  }
  return static_cast<int>(ErrorKind::kInternal);
}

inline int fail(const char* tool, const Error& error) {
  fmt::print(stderr, "{}: {}\n", tool, error.message);
  return error.exit_status();
}

}  // namespace cfmo::tool
