#pragma once
/// Where a process is in the world, and how it joins it: the one place that
/// reads the launchers' variables, starts the ranks on one host, and
/// connects a rank to the others.
///
/// Under an existing launcher each process is one rank: RANK/WORLD_SIZE,
/// Slurm's SLURM_PROCID/SLURM_NTASKS or Open MPI's OMPI_COMM_WORLD_RANK/SIZE,
/// with the rendezvous in CFMO_RENDEZVOUS. On one host without a launcher,
/// launch_local() starts the ranks itself (they find CFMO_LAUNCHED, and rank
/// 0 the listening socket in CFMO_RENDEZVOUS_FD). connect_world() then gives
/// the rank its Communicator: UCX through the rendezvous, or the solo one.

#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "core/error.h"

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cfmo::comm {

struct WorldInfo {
  int rank = 0;
  int size = 1;
  std::string source;     ///< which variables said so, for messages
  bool launched = false;  ///< a rank of our own launcher (launch_local; CFMO_LAUNCHED)
  /// This rank's index among its host's ranks: LOCAL_RANK, SLURM_LOCALID or
  /// OMPI_COMM_WORLD_LOCAL_RANK, else the rank (our launcher's ranks are all on one host).
  int local_rank = 0;
};

/// The rank and world size the environment gives, if any; an error when the
/// variables are present but make no sense (naming them).
Result<std::optional<WorldInfo>> world_from_environment();

struct WorldOptions {
  std::string rendezvous;  ///< host:port of rank 0 (--rendezvous); empty: CFMO_RENDEZVOUS. Our launcher's wins.
  double peer_timeout_s = 10;
  /// What the error says to do when several ranks have no rendezvous address.
  std::string rendezvous_hint = "set --rendezvous or CFMO_RENDEZVOUS";
  /// host:port of a running run's rank 0 (--join): this process takes the
  /// place of a lost rank there, whatever the environment says.
  std::string join{};
  /// A --join: how long it asks there while nobody answers or no rank is free.
  double join_timeout_s = 60;
  /// Rank 0: what a joining process is shown; a joiner (or a rank whose run
  /// is already under way): its look at that, an error declining (comm/rendezvous.h).
  std::string description{};
  JoinCheck check{};
  /// The run's mode takes new members: a join when no rank is lost grows the
  /// world by one rank (rendezvous.h's RendezvousConfig::grow).
  bool grow = false;
  /// If given, set to the world's size when the run started (a joiner: as
  /// the leader says; what the modes' fixed parts, e.g. the shard owners, are of).
  int* first_size = nullptr;
  /// The run ends at its first lost rank (UcxOptions::fifos).
  bool fifos = false;
  /// If given, set when this process (--join, or a rank restarted into its
  /// run) came as the run ended: its leader refused it as it shut down. Then
  /// connect_world returns no communicator (null): nothing failed.
  bool* run_ended = nullptr;
};

/// This rank's Communicator in `world` (from world_from_environment): over
/// UCX for a world of several ranks, after the rendezvous (which waits for
/// the others at least 60 s), else the solo one. kUsage when several ranks
/// have no rendezvous address, naming the variables that said how many.
/// With `options.join`, the place of a lost rank in the run there, or a new
/// rank where the run may grow (waiting for an answer and for one
/// `options.join_timeout_s`); its rank and
/// size are the communicator's. Null where the run ended as this process
/// came (`options.run_ended`).
Result<std::unique_ptr<Communicator>> connect_world(const std::optional<WorldInfo>& world, const WorldOptions& options);

/// Starts `workers` copies of this program (argv as given) with RANK,
/// WORLD_SIZE and a rendezvous on 127.0.0.1 whose listening socket rank 0
/// inherits. Their stderr (and the stdout of ranks above 0) goes to `err_fd`
/// line by line, prefixed "[rank K] "; rank 0's stdout goes to `out_fd`.
/// When `interrupt` becomes true each worker gets one SIGINT.
///
/// A rank still there `grace_s` after every other rank ended (stopped, or
/// hung) is ended: SIGTERM (and SIGCONT, so a stopped one can act on it),
/// then SIGKILL 5 s later, and named in one line on `err_fd`. UCX's
/// shared-memory files go to a directory of this run under /dev/shm, removed
/// once every rank ended: a rank that aborts or is killed leaves none behind.
///
/// Returns the run's exit status: 0 when every worker succeeded; else the
/// root cause's: the first rank's failure that is not a peer failure (4), or
/// 4 when there is none (a rank killed, or ended here, counts as 4); 130
/// when interrupted.
Result<int> launch_local(int workers, char** argv, const std::atomic<bool>* interrupt, int out_fd, int err_fd,
                         double grace_s = 10);

/// Runs this program again with `args` (args[0] is ignored), its stderr passed
/// through; returns its exit status and what it wrote on stdout.
Result<std::pair<int, std::string>> run_self(const std::vector<std::string>& args);

}  // namespace cfmo::comm
