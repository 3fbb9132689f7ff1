#pragma once
// What every cfmo tool does first and last: pick the BLAS kernels, and turn
// a library Error into one line on stderr and the shared exit status.

#include "core/error.h"
#include "tensor/ops.h"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace cfmo::tool {

/// OpenBLAS picks its kernels when it is loaded, from OPENBLAS_CORETYPE. When
/// its own detection fell back to the slowest kernels on a CPU it does not
/// know, the process starts itself again once with the right core type.
inline void reexec_for_blas(char** argv) {
  const std::string core = tensor::ops::better_blas_coretype();
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

/// Parses the command line. Returns the status to exit with when the run
/// ends here: 0 after --help or --version, 2 (usage) after a bad command line,
/// which is one line naming the problem and one saying where the help is.
/// `subcommands`: the tool has them, and the hint names both levels of help.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool,
                                             bool subcommands = false) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (subcommands) {
      fmt::print(stderr, "{}: {}\nRun '{} --help' for the subcommands, '{} SUBCOMMAND --help' for their options.\n",
                 tool, e.what(), tool, tool);
    } else {
      fmt::print(stderr, "{}: {}\nRun '{} --help' for the options.\n", tool, e.what(), tool);
    }
    return static_cast<int>(ErrorKind::kUsage);
  }
  return std::nullopt;
}

/// For a tool whose top level has no options that take a value: the first
/// word that is not an option names the subcommand, and a word that names
/// none is one line listing them and exit 2 (CLI11 alone would say only that
/// a subcommand is required, not which word it took for one).
inline std::optional<int> check_subcommand_word(int argc, char** argv, std::span<const std::string_view> names,
                                                const char* tool) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view word(argv[i]);
    if (word.starts_with("-")) continue;
    if (std::find(names.begin(), names.end(), word) != names.end()) return std::nullopt;
    std::string list;
    for (size_t k = 0; k < names.size(); ++k) {
      list += k == 0 ? "" : k + 1 == names.size() ? " or " : ", ";
      list += names[k];
    }
    fmt::print(stderr, "{}: unknown subcommand '{}': expected {} (see --help)\n", tool, word, list);
    return static_cast<int>(ErrorKind::kUsage);
  }
  return std::nullopt;
}

inline int fail(const char* tool, const Error& error) {
  fmt::print(stderr, "{}: {}\n", tool, error.message);
  return error.exit_status();
}

}  // namespace cfmo::tool
