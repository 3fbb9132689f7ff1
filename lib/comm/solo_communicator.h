#pragma once
/// The transport seam for a world of one rank: collectives are copies,
/// a message to itself goes straight to its handler. Lets code written
/// against Communicator run alone without special cases.

#include "comm/communicator.h"

#include <memory>

namespace cfmo::comm {

std::unique_ptr<Communicator> make_solo_communicator();

}  // namespace cfmo::comm
