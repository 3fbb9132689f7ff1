#pragma once
/// Which side of a loss goes on. A rank that was stopped or cut off finds,
/// when it resumes, every other rank lost; the others found it lost. Both
/// sides must not go on (two keepers would write the same run directory), so
/// only a majority of the ranks live before goes on, or exactly half of
/// them when it holds the lowest. With two workers, rank 0 goes on.

#include "core/error.h"

#include <algorithm>
#include <string>
#include <vector>

namespace cfmo::train::modes {

/// Ok when the ranks `after` (live now, this rank among them) may go on
/// from `before` (live until now, sorted); else the kPeer error this rank ends with.
inline Status check_quorum(int me, const std::vector<int>& before, const std::vector<int>& after) {
  const size_t was = before.size();
  const size_t left = after.size();
  const bool lowest_left = !before.empty() && std::find(after.begin(), after.end(), before.front()) != after.end();
  if (2 * left > was || (2 * left == was && lowest_left)) return {};
  std::string gone;
  for (const int r : before) {
    if (std::find(after.begin(), after.end(), r) != after.end()) continue;
    gone += (gone.empty() ? "" : ", ") + std::to_string(r);
  }
  return make_error(ErrorKind::kPeer,
                    "rank {} is cut off: {} of the {} ranks it worked with were lost at once (rank {}); the others go "
                    "on without it",
                    me, was - left, was, gone);
}

}  // namespace cfmo::train::modes
