#pragma once
/// The run's clock, and the world its length is planned for: what a process
/// that joins a run under way (--join, a restarted rank) must take from the
/// ranks there before it plans. The clock: the seconds since the run
/// started, which --time-limit, the summary's wall_s and the metrics' wall_s
/// count. Each rank of the start keeps its own (they start together, at the
/// rendezvous); a joiner takes the run's, so that it stops with them at the
/// time limit rather than a whole --time-limit after its own start. The
/// planned world (TrainingRun::planned_world: the ranks the run's schedule,
/// epochs and budget are planned for) is the world the run started with, or
/// a resumed grown run's first_workers: the rendezvous tells a joiner only
/// the world the transport started with, which is the resumed one.
///
/// Messages on channels::kRunClock:
///   []                                 a joiner asks every live rank
///   [f64 seconds][i32 planned world]   a rank's answer: the run's seconds when it answered
///
/// A rank answers once it knows its plan (open, or adopt for a joiner); a
/// question that came before is answered then.
///
/// Threads: the answering handler runs on the communicator's thread; it
/// reads the start and the plan through atomics, and the askers kept for
/// later under the mutex.

#include "comm/communicator.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <vector>

namespace cfmo::train {

class RunClock {
 public:
  using Clock = std::chrono::steady_clock;

  /// Started at `start`; with several ranks, answers joiners' questions from
  /// open on (a joiner's clock and plan are not the run's until adopt).
  RunClock(comm::Communicator* comm, Clock::time_point start);
  RunClock(const RunClock&) = delete;
  RunClock& operator=(const RunClock&) = delete;
  ~RunClock();

  Clock::time_point start() const { return Clock::time_point(Clock::duration(start_.load())); }

  /// A rank of the run's start (or resumed): its plan is `planned_world`;
  /// it answers joiners from now on, those that asked already too.
  void open(int planned_world);

  /// A joiner: asks every live rank for the run's seconds and planned world
  /// and takes the first answer within `timeout_s` as its own; then answers
  /// others too (with `own_plan` where none came). The run's planned world,
  /// or nothing when no answer came (the clock stays this process's own).
  std::optional<int> adopt(double timeout_s, int own_plan);
  /// Every other rank of the run left it (or was lost): none will answer.
  bool all_left() const;

 private:
  void on_message(int from, std::span<const std::byte> m);
  void answer(int to);

  comm::Communicator* comm_;
  std::atomic<Clock::rep> start_;
  std::atomic<int> planned_{0};  ///< the planned world; 0 until open or adopt (no answers until then)
  std::mutex mutex_;
  std::condition_variable answered_;
  std::vector<int> waiting_;                 ///< ranks that asked before this one knew its plan
  std::optional<Clock::time_point> answer_;  ///< the run's start, from the first answer
  int answer_planned_ = 0;                   ///< and its planned world
};

}  // namespace cfmo::train
