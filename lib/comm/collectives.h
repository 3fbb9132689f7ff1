#pragma once
/// The blocking collectives of the Communicator seam, written once over the
/// point-to-point seam (comm/transport.h): every transport gets the same
/// algorithms, and a new one writes only its sends and receives.
///
///   all_reduce_sum  ring: reduce-scatter then all-gather, 2(W-1) exchanges,
///                   each rank sending and receiving 1/W of the data in each
///   barrier         dissemination: in round k each rank tells rank + 2^k and
///                   hears from rank - 2^k, ceil(log2 W) exchanges
///   all_to_all_v    one exchange, peers in pairwise order (rank + 1, rank + 2,
///                   ...) so the ranks do not all start with rank 0's link
///
/// Each exchange gets the next tag of a counter every rank advances alike
/// (collectives are called in the same order everywhere), so a rank that
/// runs ahead into the next exchange never meets a message of the last.
/// Not thread-safe: one collective at a time, as the Communicator says.

#include "comm/transport.h"

#include <span>
#include <vector>

namespace cfmo::comm {

class Collectives {
 public:
  explicit Collectives(PointToPoint& transport) : transport_(transport) {}

  /// Afterwards every rank's `data` holds the element-wise sum over ranks.
  Status all_reduce_sum(std::span<float> data);
  /// `send[p]` goes to rank p, `recv[p]` is filled from rank p (sized by the caller).
  Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                      const std::vector<std::span<std::byte>>& recv);
  /// Returns once every rank has entered it.
  Status barrier();

 private:
  PointToPoint& transport_;
  uint32_t tag_ = 0;
  std::vector<float> scratch_;  ///< the chunk being received during the reduce-scatter
};

}  // namespace cfmo::comm
