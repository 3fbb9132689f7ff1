#pragma once
// How every cfmo tool stops cleanly: the first SIGINT or SIGTERM sets a flag
// that the library polls (a trainer writes its checkpoint, a pull keeps its
// partial blobs and says so in its state file), and the tool then exits
// 128 + the signal's number, as shells report a process the signal ended.
// A second signal gets the default action and ends the process at once.

#include <atomic>
#include <csignal>

namespace cfmo::tool {

namespace detail {
inline std::atomic<bool> stop_flag{false};
inline std::atomic<int> stop_signal_number{0};

inline void on_stop_signal(int signal_number) {
  // Only lock-free atomics and signal(): async-signal-safe.
  int expected = 0;
  stop_signal_number.compare_exchange_strong(expected, signal_number);
  stop_flag.store(true);
  std::signal(signal_number, SIG_DFL);
}
}  // namespace detail

/// Installs the handler for SIGINT and SIGTERM.
inline void catch_stop_signals() {
  std::signal(SIGINT, detail::on_stop_signal);
  std::signal(SIGTERM, detail::on_stop_signal);
}

/// Set by the first signal; what the library's `stop` options point at.
inline std::atomic<bool>& stop_requested() { return detail::stop_flag; }

/// The first signal that asked, or 0.
inline int stop_signal() { return detail::stop_signal_number.load(); }

/// SIGINT or SIGTERM, for messages.
inline const char* stop_signal_name() { return stop_signal() == SIGTERM ? "SIGTERM" : "SIGINT"; }

/// The status a run stopped by a signal exits with: 130 for SIGINT, 143 for SIGTERM.
inline int stop_status() { return 128 + (stop_signal() == 0 ? SIGINT : stop_signal()); }

}  // namespace cfmo::tool
