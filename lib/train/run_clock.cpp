#include "train/run_clock.h"

#include "train/channels.h"
#include "train/modes/wire.h"

#include <algorithm>

namespace cfmo::train {

RunClock::RunClock(comm::Communicator* comm, Clock::time_point start, bool joining)
    : comm_(comm != nullptr && comm->size() > 1 ? comm : nullptr),
      start_(start.time_since_epoch().count()),
      answering_(!joining) {
  if (comm_ != nullptr) {
    comm_->on_message(channels::kRunClock, [this](int from, std::span<const std::byte> m) { on_message(from, m); });
  }
}

RunClock::~RunClock() {
  if (comm_ != nullptr) comm_->on_message(channels::kRunClock, nullptr);
}

void RunClock::on_message(int from, std::span<const std::byte> m) {
  if (m.empty()) {
    // A joiner asks; one that has not the run's clock yet cannot tell it.
    if (!answering_.load()) return;
    std::vector<std::byte> out;
    modes::put(out, std::chrono::duration<double>(Clock::now() - start()).count());
    comm_->post(from, channels::kRunClock, std::move(out));
    return;
  }
  double seconds = 0;
  if (!modes::take(m, seconds) || !(seconds >= 0)) return;
  std::lock_guard lock(mutex_);
  if (answer_) return;
  answer_ = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  answered_.notify_all();
}

bool RunClock::adopt(double timeout_s) {
  if (comm_ == nullptr) return false;
  const auto lost = comm_->lost_ranks();
  for (int r = 0; r < comm_->size(); ++r) {
    if (r != comm_->rank() && std::find(lost.begin(), lost.end(), r) == lost.end()) {
      comm_->post(r, channels::kRunClock, {});
    }
  }
  std::unique_lock lock(mutex_);
  const bool got =
      answered_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return answer_.has_value(); });
  if (got) start_ = answer_->time_since_epoch().count();
  answering_ = true;
  return got;
}

}  // namespace cfmo::train
