#pragma once
/// The run's clock: the seconds since the run started, which --time-limit,
/// the summary's wall_s and the metrics' wall_s count. Each rank of the
/// start keeps its own (they start together, at the rendezvous); a process
/// that joins a run under way (--join, a restarted rank) takes the run's
/// from the ranks there, so that it stops with them at the time limit rather
/// than a whole --time-limit after its own start.
///
/// Messages on channels::kRunClock:
///   []             a joiner asks every live rank
///   [f64 seconds]  a rank's answer: the run's seconds when it answered
///
/// Threads: the answering handler runs on the communicator's thread; it
/// reads the start through an atomic.

#include "comm/communicator.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

namespace cfmo::train {

class RunClock {
 public:
  using Clock = std::chrono::steady_clock;

  /// Started at `start`; with several ranks, answers joiners' questions at
  /// once, unless `joining` (its clock is not the run's until adopt).
  RunClock(comm::Communicator* comm, Clock::time_point start, bool joining);
  RunClock(const RunClock&) = delete;
  RunClock& operator=(const RunClock&) = delete;
  ~RunClock();

  Clock::time_point start() const { return Clock::time_point(Clock::duration(start_.load())); }

  /// A joiner: asks every live rank for the run's seconds and takes the first
  /// answer within `timeout_s` as its own; then answers others too. False
  /// when none came (the clock stays this process's own).
  bool adopt(double timeout_s);

 private:
  void on_message(int from, std::span<const std::byte> m);

  comm::Communicator* comm_;
  std::atomic<Clock::rep> start_;
  std::atomic<bool> answering_;
  std::mutex mutex_;
  std::condition_variable answered_;
  std::optional<Clock::time_point> answer_;  ///< the run's start, from the first answer
};

}  // namespace cfmo::train
