#pragma once
/// Which side of a loss goes on. A rank that was stopped or cut off finds,
/// when it resumes, every other rank lost; the others found it lost. Both
/// sides must not go on (two keepers would write the same run directory), so
/// only a majority of the ranks live before goes on, or exactly half of
/// them when it holds the lowest. With two workers, rank 0 goes on.
///
/// A rank that said goodbye before it was lost (its run failed: it was cut
/// off itself, or failed on its own) goes on nowhere, so it is no other side:
/// the split is judged without it. Otherwise one rank cut off took the last
/// other survivor down with it: of ranks 0 and 2 left after rank 1's loss, a
/// rank 0 cut off (deaf to both) made rank 2, alone of {0, 2} without the
/// lowest, stop too, and the run ended with no rank left.

#include "comm/communicator.h"
#include "core/error.h"

#include <algorithm>
#include <string>
#include <vector>

namespace cfmo::train::modes {

/// Ok when the ranks `after` (live now, this rank among them) may go on
/// from `before` (live until now, sorted); else the kPeer error this rank
/// ends with, naming why `comm` lost each of the others.
inline Status check_quorum(const comm::Communicator& comm, const std::vector<int>& before,
                           const std::vector<int>& after) {
  auto in = [](const std::vector<int>& v, int r) { return std::find(v.begin(), v.end(), r) != v.end(); };
  std::vector<int> sides;  // the ranks that may go on, on this side or another
  for (const int r : before) {
    if (in(after, r) || !comm.said_goodbye(r)) sides.push_back(r);
  }
  const size_t was = sides.size();
  const size_t left = after.size();
  const bool lowest_left = !sides.empty() && in(after, sides.front());
  if (2 * left > was || (2 * left == was && lowest_left)) return {};
  std::string gone;
  std::string reasons;
  for (const int r : sides) {
    if (in(after, r)) continue;
    gone += (gone.empty() ? "" : ", ") + std::to_string(r);
    // Why each was lost: a connection error, a silence, a goodbye; what tells
    // a rank that could not hear (every peer silent at once) from one left alone.
    const std::string reason = comm.lost_reason(r);
    if (!reason.empty()) reasons += fmt::format("; rank {} lost: {}", r, reason);
  }
  return make_error(ErrorKind::kPeer,
                    "rank {} is cut off: {} of the {} ranks it worked with were lost at once (rank {}); the others go "
                    "on without it{}",
                    comm.rank(), was - left, was, gone, reasons);
}

/// The ranks besides this one, as a joiner that waits on them sees them:
/// those not lost and not gone (live, and the lowest of them), and whether
/// one left as the run ended (said goodbye, not lost). None live and none
/// left: every other rank is lost.
struct Others {
  int live = 0;
  int lowest_live = -1;
  bool one_left = false;
};

inline Others others_of(const comm::Communicator& comm) {
  Others o;
  for (int r = comm.size() - 1; r >= 0; --r) {
    if (r == comm.rank()) continue;
    const bool lost = comm.is_lost_rank(r);
    if (comm.said_goodbye(r)) {
      o.one_left = o.one_left || !lost;
    } else if (!lost) {
      ++o.live;
      o.lowest_live = r;
    }
  }
  return o;
}

}  // namespace cfmo::train::modes
