#pragma once
/// Rendezvous: rank 0 listens on a TCP address, every rank (rank 0 too) sends
/// it its transport address, and rank 0 answers each with the table of all
/// of them. After that ranks talk directly. Rank 0 keeps listening: a
/// process that comes later (`--join`, or a rank restarted with its launcher's
/// variables) is offered the place of a lost rank (or, in a run that may
/// grow and has none lost, a new rank W of W + 1) and the run's description;
/// it declines (a mismatched flag) or accepts, and then gets the table.
///
/// The exchange (u32 big-endian):
///   hello   [magic "CFMO"][version 2][rank, or ~0 for any][size, or 0][u32 n][address]
///   answer  [0: table][u32 size][size x ([u32 n][address])]               the start
///           [1: offer][u32 rank][u32 size][u32 first size][u32 n][description]  a join;
///               then [u32 1 accept | 0 decline], and after an accept
///               [u32 size][size x ([u32 n][address])][size x u32 lost]
///           [2: refusal][u32 1 retry | 0 final | 2 the run ends][u32 n][reason][u32 n][description]
/// A joiner looks at the description in a refusal too: one that does not fit
/// the run ends at once rather than waiting for a free rank. A refusal
/// because the run ends (its leader shuts down) is no failure of the
/// process that came: Rendezvous::run_ended.

#include "core/error.h"
#include "core/fd.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::comm {

/// A hello's rank when the process takes whichever rank is free (--join).
inline constexpr int kAnyRank = -1;

/// A joining process's look at the run it is offered: an error declines it
/// (the process then ends with that error; the run goes on undisturbed).
using JoinCheck = std::function<Status(std::string_view description)>;

struct RendezvousConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  int listen_fd = -1;       ///< rank 0: an already listening socket (the local launcher passes one)
  double timeout_s = 60;    ///< how long to wait for every rank (a joiner: for an answer, then for a free rank)
  std::string description;  ///< rank 0: what a joiner is shown (cfmo-train: the run's configuration)
  JoinCheck check;          ///< a joiner: looks at the description; none accepts
  /// The run may grow: a join when no rank is lost is a new rank W (the
  /// world becomes W + 1), not refused until one is lost. Only for runs whose
  /// mode takes new members (the leader's side decides).
  bool grow = false;
};

/// What the rendezvous gave this process.
struct Rendezvous {
  int rank = 0;
  int size = 0;
  std::vector<std::vector<std::byte>> addresses;  ///< every rank's, indexed by rank
  std::vector<bool> lost;                         ///< a join: the ranks lost as rank 0 saw them
  bool joined = false;                            ///< the run was under way: this process joined it
  int first_size = 0;  ///< the world's size when the run started (a joiner: as the leader said; it may have grown)
  /// A joiner (or a rank restarted into its run) that the leader refused
  /// because the run is ending: it came too late, through no fault of its
  /// own; no rank, no table.
  bool run_ended = false;
  Fd listener;  ///< rank 0: where later processes ask to join
};

/// Rank 0's side of a join, asked by serve_join.
struct JoinHooks {
  /// Which rank the process may take (`rank` is kAnyRank or the one it asks
  /// for, `size` 0 or its world size): the rank, or a refusal.
  struct Decision {
    int rank = -1;
    std::string refusal;  ///< why not (when rank < 0)
    bool retry = true;    ///< the refusal may pass (a rank not yet found lost)
    int world = 0;        ///< the world's size the process joins: more than now when it grows the world; 0: as now
    bool ended = false;   ///< refused because the run is ending (the process came too late)
  };
  std::function<Decision(int rank, int size)> decide;
  /// Takes the process in as `rank` at `address`; returns every rank's
  /// address and which are lost, as the joiner should see them.
  std::function<Result<std::pair<std::vector<std::vector<std::byte>>, std::vector<bool>>>(
      int rank, const std::vector<std::byte>& address)>
      admit;
};

/// Rank 0: serves one process that connected to `listener` after the start
/// (the caller accepts it): offer, answer, admission. Errors concern that
/// process only.
Status serve_join(int socket, int size, int first_size, const std::string& description, const JoinHooks& hooks,
                  double timeout_s);

/// "host:port" (IPv4, a name, or [IPv6]:port).
Result<RendezvousConfig> parse_rendezvous(const std::string& text);

/// Every rank's address, indexed by rank; rank 0 also keeps the listener.
/// `rank` kAnyRank (and `size` 0): a join, which waits for a free rank until
/// the timeout. A rank whose run is already under way joins it.
Result<Rendezvous> exchange_addresses(const RendezvousConfig& config, int rank, int size,
                                      const std::vector<std::byte>& own_address);

/// A listening TCP socket on host, port 0 = any free port. Returns the fd and the port.
Result<std::pair<int, uint16_t>> listen_tcp(const std::string& host, uint16_t port);

}  // namespace cfmo::comm
