#pragma once
/// The simulator's discrete-event scheduler: a virtual clock, a queue of
/// events ordered by (time, order of scheduling), and fibers, so that code
/// written for threads that block (a mode waiting in a collective, polling
/// for replies) runs unchanged on one thread in virtual time.
///
///   Scheduler s;
///   s.spawn([&] { s.sleep(0.5); ... });   // a fiber, started at time 0
///   s.at(1.0, [&] { ... });               // an event
///   Status done = s.run();                // until no event is left
///
/// A fiber runs until it sleeps, suspends (until another wakes it) or ends;
/// events and fibers never run at once, so the code they run needs no locks
/// between them (the modes' mutexes are taken and released, never held
/// across a wait). While run() runs, the scheduler is its thread's
/// TimeSource (core/clock.h): SeamClock reads virtual time and a seam wait
/// inside a fiber is a sleep of virtual time (a yield: kQuantum).

#include "core/clock.h"
#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cfmo::sim {

/// What an event calls: arg tells its kind of event apart (a message's slot).
class EventTarget {
 public:
  virtual void fire(uint64_t arg) = 0;

 protected:
  ~EventTarget() = default;
};

class Scheduler final : public TimeSource {
 public:
  /// A busy wait (seam_yield) inside a fiber waits this long in virtual time.
  static constexpr double kQuantum = 10e-6;

  explicit Scheduler(size_t stack_bytes = 256 * 1024);
  ~Scheduler() override;
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Virtual seconds since the start.
  double time() const { return now_; }

  /// target->fire(arg) at virtual time `t` (no earlier than time()).
  void at(double t, EventTarget* target, uint64_t arg);
  /// An event's place among those of the same time, taken now for an event
  /// scheduled later with it: events keep their order of scheduling though
  /// a queue of their own holds them until they are due (SimWorld).
  uint64_t take_order() { return next_order_++; }
  /// As at(), in the place `order` (from take_order) among events of time `t`.
  void at_order(double t, uint64_t order, EventTarget* target, uint64_t arg);
  void at(double t, std::function<void()> action);

  /// A fiber running `body`, started at time(). Its id, from 0.
  int spawn(std::function<void()> body);
  /// The running fiber's id, -1 outside any fiber.
  int current() const { return current_; }

  /// In a fiber: resume at time() + `seconds` (after what is due before).
  void sleep(double seconds);
  /// In a fiber: wait until some event calls wake() for it.
  void suspend();
  /// Resumes a suspended fiber at `t`.
  void wake(int fiber, double t);

  /// Seam waits in fibers become waits for a poke: a fiber's seam_sleep_for
  /// or seam_yield then ends at the next poke() for it, or after the wait's
  /// own length or `cap` (whichever is longer) with none. For code whose
  /// every seam wait polls for what only a message can change (the modes'
  /// loops wait for replies, done and stop, or a deadline of seconds): it
  /// then costs a wakeup per message, not one per quantum of waiting.
  /// 0 (the default): seam waits are plain sleeps.
  void set_poll_cap(double cap) { poll_cap_ = cap; }
  /// Ends `fiber`'s seam wait now (after the running event), if it is in one.
  void poke(int fiber);

  /// Runs events until none is left. kInternal when a fiber failed (threw)
  /// or waits with nothing left that could wake it (a deadlock), naming it.
  Status run();

  uint64_t events_run() const { return events_run_; }
  size_t fibers() const { return fibers_.size(); }

  // TimeSource: virtual time, from a fixed origin.
  std::chrono::steady_clock::time_point now() override;
  void sleep_for(std::chrono::steady_clock::duration d) override;

 private:
  struct Fiber;
  struct Event {
    double t;
    uint64_t order;
    EventTarget* target;  ///< null: resume fiber `arg`
    uint64_t arg;
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const { return a.t > b.t || (a.t == b.t && a.order > b.order); }
  };
  class Actions;
  class PollTimers;

  void push(Event e);
  void resume(int fiber);
  void switch_to_scheduler();
  static void trampoline();

  size_t stack_bytes_;
  double now_ = 0;
  uint64_t next_order_ = 0;
  uint64_t events_run_ = 0;
  std::vector<Event> queue_;  ///< a binary heap under Later
  /// Events of time now_ scheduled by push (a poke, a wake): their orders
  /// grow, so they keep their order in a FIFO and skip the heap; run() takes
  /// the heap's top first only when it is of now_ too and an earlier order.
  std::vector<Event> now_queue_;
  size_t now_head_ = 0;
  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::unique_ptr<Actions> actions_;
  std::unique_ptr<PollTimers> poll_timers_;
  double poll_cap_ = 0;
  int current_ = -1;
  void* main_context_;  ///< the scheduler's own context: its saved stack pointer, or a ucontext_t
  std::string failure_;
};

}  // namespace cfmo::sim
