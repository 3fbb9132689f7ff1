#pragma once
/// Where a worker is in the world, and the embedded launcher for one host.
///
/// Under an existing launcher each process is one rank: RANK/WORLD_SIZE,
/// Slurm's SLURM_PROCID/SLURM_NTASKS or Open MPI's OMPI_COMM_WORLD_RANK/SIZE,
/// with the rendezvous in CFMO_RENDEZVOUS. On one host without a launcher,
/// launch_local() starts the ranks itself.

#include "core/error.h"

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cfmo {

struct WorldInfo {
  int rank = 0;
  int size = 1;
  std::string source;  ///< which variables said so, for messages
};

/// The rank and world size the environment gives, if any; an error when the
/// variables are present but make no sense (naming them).
Result<std::optional<WorldInfo>> world_from_environment();

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

}  // namespace cfmo
