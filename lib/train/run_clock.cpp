#include "train/run_clock.h"

#include "train/channels.h"
#include "train/modes/quorum.h"
#include "train/modes/wire.h"

#include <algorithm>

namespace cfmo::train {

RunClock::RunClock(comm::Communicator* comm, Clock::time_point start)
    : comm_(comm != nullptr && comm->size() > 1 ? comm : nullptr), start_(start.time_since_epoch().count()) {
  if (comm_ != nullptr) {
    comm_->on_message(channels::kRunClock, [this](int from, std::span<const std::byte> m) { on_message(from, m); });
  }
}

RunClock::~RunClock() {
  if (comm_ != nullptr) comm_->on_message(channels::kRunClock, nullptr);
}

void RunClock::answer(int to) {
  std::vector<std::byte> out;
  modes::put(out, std::chrono::duration<double>(Clock::now() - start()).count());
  modes::put(out, static_cast<int32_t>(planned_.load()));
  comm_->post(to, channels::kRunClock, std::move(out));
}

void RunClock::on_message(int from, std::span<const std::byte> m) {
  if (m.empty()) {
    // A joiner asks; one that does not know its plan yet (a rank still
    // setting up, a joiner before adopt) answers once it does.
    {
      std::lock_guard lock(mutex_);
      if (planned_.load() == 0) {
        waiting_.push_back(from);
        return;
      }
    }
    answer(from);
    return;
  }
  double seconds = 0;
  int32_t planned = 0;
  if (!modes::take(m, seconds) || !(seconds >= 0) || !modes::take(m, planned) || planned < 1) return;
  std::lock_guard lock(mutex_);
  if (answer_) return;
  answer_ = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  answer_planned_ = planned;
  answered_.notify_all();
}

void RunClock::open(int planned_world) {
  if (comm_ == nullptr) return;
  std::vector<int> waiting;
  {
    std::lock_guard lock(mutex_);
    planned_ = std::max(1, planned_world);
    waiting.swap(waiting_);
  }
  for (const int r : waiting) answer(r);
}

bool RunClock::all_left() const { return comm_ != nullptr && modes::others_of(*comm_).live == 0; }

std::optional<int> RunClock::adopt(double timeout_s, int own_plan) {
  if (comm_ == nullptr) return std::nullopt;
  const auto lost = comm_->lost_ranks();
  for (int r = 0; r < comm_->size(); ++r) {
    if (r != comm_->rank() && std::find(lost.begin(), lost.end(), r) == lost.end()) {
      comm_->post(r, channels::kRunClock, {});
    }
  }
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::optional<int> planned;
  {
    std::unique_lock lock(mutex_);
    // (Not once every other rank left the run: none will answer.)
    while (!answer_ && Clock::now() < deadline && !all_left()) {
      answered_.wait_for(lock, std::chrono::milliseconds(20));
    }
    if (answer_) {
      start_ = answer_->time_since_epoch().count();
      planned = answer_planned_;
    }
  }
  open(planned.value_or(own_plan));
  return planned;
}

}  // namespace cfmo::train
