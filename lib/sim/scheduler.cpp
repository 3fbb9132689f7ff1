#include "sim/scheduler.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <exception>

namespace cfmo::sim {

// A fiber's stack is mapped without reserve (pages are committed as
// touched: thousands of fibers cost their used depth, not their size), with
// a guard page below it. On x86-64 the switch is a few instructions of our
// own (callee-saved registers and the stack pointer): glibc's swapcontext
// also saves the signal mask, a system call per switch that was half the
// simulation's time. Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void cfmo_sim_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl cfmo_sim_switch
.type cfmo_sim_switch, @function
cfmo_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size cfmo_sim_switch, .-cfmo_sim_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#define CFMO_SIM_OWN_SWITCH 1
#endif

struct Scheduler::Fiber {
#ifdef CFMO_SIM_OWN_SWITCH
  void* sp = nullptr;
#else
  ucontext_t context{};
#endif
  void* stack = nullptr;
  size_t mapped = 0;
  std::function<void()> body;
  bool started = false;
  bool finished = false;
  bool suspended = false;  ///< waits for wake()
  bool polling = false;    ///< in a seam wait that a poke ends
  double poll_until = 0;   ///< when that wait ends with no poke
  int timers = 0;          ///< its poll timers in the queue (one, mostly: they are not removed when poked)

  ~Fiber() { release(); }
  void release() {
    if (stack != nullptr) ::munmap(stack, mapped);
    stack = nullptr;
  }
};

/// The slots of std::function events, reused.
class Scheduler::Actions final : public EventTarget {
 public:
  uint64_t add(std::function<void()> action) {
    if (free_.empty()) {
      slots_.push_back(std::move(action));
      return slots_.size() - 1;
    }
    const uint64_t slot = free_.back();
    free_.pop_back();
    slots_[slot] = std::move(action);
    return slot;
  }
  void fire(uint64_t slot) override {
    auto action = std::move(slots_[slot]);
    slots_[slot] = nullptr;
    free_.push_back(slot);
    action();
  }

 private:
  std::vector<std::function<void()>> slots_;
  std::vector<uint64_t> free_;
};

/// The end of a seam wait that no poke ended (arg: the fiber). A poked wait
/// leaves its timer in the queue; the fiber's next wait reuses it (when it
/// fires early, it is pushed again for the wait's end): so the queue holds
/// about one timer per fiber, not one per wait.
class Scheduler::PollTimers final : public EventTarget {
 public:
  explicit PollTimers(Scheduler& s) : s_(s) {}
  void fire(uint64_t arg) override {
    const int fiber = static_cast<int>(arg);
    Fiber& f = *s_.fibers_[static_cast<size_t>(fiber)];
    --f.timers;
    if (!f.polling) return;  // poked
    if (s_.now_ < f.poll_until) {
      if (f.timers == 0) add(fiber, f);
      return;
    }
    f.polling = false;
    s_.resume(fiber);
  }
  void add(int fiber, Fiber& f) {
    ++f.timers;
    s_.push({f.poll_until, 0, this, static_cast<uint64_t>(fiber)});
  }

 private:
  Scheduler& s_;
};

namespace {
thread_local Scheduler* t_running = nullptr;  // for the trampoline, which takes no pointer
}  // namespace

#ifdef CFMO_SIM_OWN_SWITCH
Scheduler::Scheduler(size_t stack_bytes)
    : stack_bytes_(stack_bytes),
      actions_(std::make_unique<Actions>()),
      poll_timers_(std::make_unique<PollTimers>(*this)),
      main_context_(nullptr) {}
Scheduler::~Scheduler() = default;
#else
Scheduler::Scheduler(size_t stack_bytes)
    : stack_bytes_(stack_bytes),
      actions_(std::make_unique<Actions>()),
      poll_timers_(std::make_unique<PollTimers>(*this)),
      main_context_(new ucontext_t{}) {}
Scheduler::~Scheduler() { delete static_cast<ucontext_t*>(main_context_); }
#endif

std::chrono::steady_clock::time_point Scheduler::now() {
  // A fixed origin: what the modes compute is differences and deadlines.
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(now_ + 1.0)));
}

void Scheduler::sleep_for(std::chrono::steady_clock::duration d) {
  if (current_ < 0) return;  // an event's handler cannot wait: it returns at once
  const double seconds = std::max(std::chrono::duration<double>(d).count(), kQuantum);
  if (poll_cap_ <= 0) {
    sleep(seconds);
    return;
  }
  Fiber& f = *fibers_[static_cast<size_t>(current_)];
  f.polling = true;
  f.poll_until = now_ + std::max(seconds, poll_cap_);
  if (f.timers == 0) poll_timers_->add(current_, f);
  switch_to_scheduler();
}

void Scheduler::poke(int fiber) {
  if (fiber < 0 || static_cast<size_t>(fiber) >= fibers_.size()) return;
  Fiber& f = *fibers_[static_cast<size_t>(fiber)];
  if (!f.polling) return;
  f.polling = false;  // its timer finds it so and does nothing
  push({now_, 0, nullptr, static_cast<uint64_t>(fiber)});
}

void Scheduler::push(Event e) {
  e.t = std::max(e.t, now_);
  e.order = next_order_++;
  if (e.t == now_) {
    now_queue_.push_back(e);
    return;
  }
  queue_.push_back(e);
  std::push_heap(queue_.begin(), queue_.end(), Later{});
}

void Scheduler::at(double t, EventTarget* target, uint64_t arg) { push({t, 0, target, arg}); }

void Scheduler::at_order(double t, uint64_t order, EventTarget* target, uint64_t arg) {
  queue_.push_back({std::max(t, now_), order, target, arg});
  std::push_heap(queue_.begin(), queue_.end(), Later{});
}

void Scheduler::at(double t, std::function<void()> action) {
  push({t, 0, actions_.get(), actions_->add(std::move(action))});
}

int Scheduler::spawn(std::function<void()> body) {
  auto fiber = std::make_unique<Fiber>();
  fiber->body = std::move(body);
  const int id = static_cast<int>(fibers_.size());
  fibers_.push_back(std::move(fiber));
  push({now_, 0, nullptr, static_cast<uint64_t>(id)});
  return id;
}

void Scheduler::trampoline() {
  Scheduler& s = *t_running;
  Fiber& f = *s.fibers_[static_cast<size_t>(s.current_)];
  try {
    f.body();
  } catch (const std::exception& e) {
    if (s.failure_.empty()) s.failure_ = fmt::format("simulated worker {} failed: {}", s.current_, e.what());
  }
  f.body = nullptr;
  f.finished = true;
#ifdef CFMO_SIM_OWN_SWITCH
  // Nothing to return to: back to the scheduler, never to come here again.
  s.switch_to_scheduler();
  __builtin_unreachable();
#endif
  // ucontext: uc_link returns to the scheduler.
}

void Scheduler::resume(int id) {
  Fiber& f = *fibers_[static_cast<size_t>(id)];
  if (f.finished) return;
  if (!f.started) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    f.mapped = (stack_bytes_ + page - 1) / page * page + page;
    f.stack = ::mmap(nullptr, f.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f.stack == MAP_FAILED) {
      f.stack = nullptr;
      if (failure_.empty()) failure_ = fmt::format("simulated worker {}: no memory for its stack", id);
      f.finished = true;
      return;
    }
    ::mprotect(f.stack, page, PROT_NONE);  // the guard page: an overflow faults, not corrupts
#ifdef CFMO_SIM_OWN_SWITCH
    // What cfmo_sim_switch pops: six registers, then the address it returns
    // to (the trampoline, entered as if called: rsp = 8 mod 16), then a
    // return address the trampoline never uses.
    auto* top = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(f.stack) + f.mapped) & ~uintptr_t{15});
    top -= 2;
    top[0] = reinterpret_cast<void*>(&Scheduler::trampoline);
    top[1] = nullptr;
    top -= 6;
    for (int i = 0; i < 6; ++i) top[i] = nullptr;
    f.sp = top;
#else
    auto* main = static_cast<ucontext_t*>(main_context_);
    ::getcontext(&f.context);
    f.context.uc_stack.ss_sp = static_cast<char*>(f.stack) + page;
    f.context.uc_stack.ss_size = f.mapped - page;
    f.context.uc_link = main;
    ::makecontext(&f.context, &Scheduler::trampoline, 0);
#endif
    f.started = true;
  }
  current_ = id;
#ifdef CFMO_SIM_OWN_SWITCH
  cfmo_sim_switch(&main_context_, f.sp);
#else
  ::swapcontext(static_cast<ucontext_t*>(main_context_), &f.context);
#endif
  current_ = -1;
  if (f.finished) f.release();
}

void Scheduler::switch_to_scheduler() {
  Fiber& f = *fibers_[static_cast<size_t>(current_)];
#ifdef CFMO_SIM_OWN_SWITCH
  cfmo_sim_switch(&f.sp, main_context_);
#else
  ::swapcontext(&f.context, static_cast<ucontext_t*>(main_context_));
#endif
}

void Scheduler::sleep(double seconds) {
  push({now_ + std::max(seconds, 0.0), 0, nullptr, static_cast<uint64_t>(current_)});
  switch_to_scheduler();
}

void Scheduler::suspend() {
  fibers_[static_cast<size_t>(current_)]->suspended = true;
  switch_to_scheduler();
}

void Scheduler::wake(int fiber, double t) {
  Fiber& f = *fibers_[static_cast<size_t>(fiber)];
  if (!f.suspended) return;
  f.suspended = false;
  push({t, 0, nullptr, static_cast<uint64_t>(fiber)});
}

Status Scheduler::run() {
  Scheduler* outer = t_running;
  TimeSource* outer_source = this_thread_time_source();
  t_running = this;
  this_thread_time_source() = this;
  while ((!queue_.empty() || now_head_ < now_queue_.size()) && failure_.empty()) {
    Event e{};
    if (now_head_ < now_queue_.size() &&
        (queue_.empty() || queue_.front().t > now_ || queue_.front().order > now_queue_[now_head_].order)) {
      e = now_queue_[now_head_++];
      if (now_head_ == now_queue_.size()) {
        now_queue_.clear();
        now_head_ = 0;
      }
    } else {
      std::pop_heap(queue_.begin(), queue_.end(), Later{});
      e = queue_.back();
      queue_.pop_back();
    }
    now_ = e.t;
    ++events_run_;
    if (e.target == nullptr) {
      resume(static_cast<int>(e.arg));
    } else {
      e.target->fire(e.arg);
    }
  }
  t_running = outer;
  this_thread_time_source() = outer_source;
  if (!failure_.empty()) return make_error(ErrorKind::kInternal, "{}", failure_);
  for (size_t i = 0; i < fibers_.size(); ++i) {
    if (fibers_[i]->started && !fibers_[i]->finished) {
      return make_error(ErrorKind::kInternal,
                        "simulation stalled at {:.6f}s: worker {} waits and nothing is left that could wake it", now_,
                        i);
    }
  }
  return {};
}

}  // namespace cfmo::sim
