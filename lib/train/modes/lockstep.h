#pragma once
/// What the lockstep modes (sync, localsgd) share: every worker takes the
/// same steps, and a worker's wish to stop travels with the next collective
/// as a vote, so that all stop at the same step.

#include "train/modes.h"

#include <algorithm>
#include <string>
#include <string_view>

namespace cfmo::train::modes {

/// A lockstep stop vote, carried by a collective as two counts:
/// workers that want to stop for a time limit, and for an interrupt.
struct StopVote {
  bool time_limit = false;
  bool interrupt = false;
  bool agreed = false;
  std::string reason;

  void want(std::string_view why) { (why == "interrupt" ? interrupt : time_limit) = true; }
  void write(float* slots) const {
    slots[0] = time_limit ? 1.0f : 0.0f;
    slots[1] = interrupt ? 1.0f : 0.0f;
  }
  void read(const float* summed) {
    if (summed[0] > 0 || summed[1] > 0) {
      agreed = true;
      reason = summed[1] > 0 ? "interrupt" : "time-limit";
    }
  }
};

/// The first of `members` not lost: the keeper of a lockstep run that survives losses.
inline int first_live(const comm::Communicator& comm, const std::vector<int>& members) {
  const auto lost = comm.lost_ranks();
  for (const int r : members) {
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) return r;
  }
  return comm.rank();
}

/// The base of a lockstep mode: it writes vote_ into each collective's
/// spare slots and reads the sums back.
class LockstepMode : public Mode {
 public:
  bool lockstep() const override { return true; }
  void want_stop(std::string_view reason) override { vote_.want(reason); }
  bool stop_requested() const override { return vote_.agreed; }
  std::string agreed_reason() const override { return vote_.reason; }

 protected:
  StopVote vote_;
};

}  // namespace cfmo::train::modes
