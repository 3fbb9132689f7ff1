#pragma once
// The width a tool draws to: COLUMNS when set (as shells export it), else the
// terminal's own on `fd`, else 100 (a pipe, a log file).
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdlib>

namespace cfmo::tool {

inline int terminal_columns(int fd) {
  if (const char* env = std::getenv("COLUMNS")) {
    const int n = std::atoi(env);
    if (n > 20) return n;
  }
  winsize size{};
  if (::isatty(fd) != 0 && ::ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 20) return size.ws_col;
  return 100;
}

}  // namespace cfmo::tool
