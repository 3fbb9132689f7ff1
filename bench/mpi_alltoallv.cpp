// mpi-alltoallv: Open MPI's MPI_Alltoallv at given bytes per peer, the peer
// of cfmo-moe's sync all-to-all-v in bench/moe_vs_mpi.sh. Each rank sends
// SIZE bytes to every rank (itself included, as nccl-tests counts); prints
// one JSON line per size with the slowest rank's mean time and nccl-tests'
// algbw (bytes per rank / time) and busbw (algbw (n-1)/n).
//   --touch F  before each, untimed, write F times the bytes a rank sends to
//              memory of its own and fresh bytes into the send buffer: a
//              layer's own work between its collectives (as bench/comm-a2a)
//
//   mpirun -np 4 mpi-alltoallv [--iters N] [--warmup N] [--touch F] SIZE...
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int iters = 50;
  int warmup = 5;
  double touch = 0;
  std::vector<long> sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
      warmup = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--touch") == 0 && i + 1 < argc) {
      touch = std::atof(argv[++i]);
    } else {
      sizes.push_back(std::atol(argv[i]));
    }
  }
  if (sizes.empty() || iters < 1 || warmup < 0 || touch < 0) {
    if (rank == 0) std::fprintf(stderr, "usage: mpi-alltoallv [--iters N] [--warmup N] [--touch F] SIZE...\n");
    MPI_Finalize();
    return 2;
  }
  for (long size : sizes) {
    std::vector<char> send(static_cast<size_t>(size) * static_cast<size_t>(ranks), static_cast<char>(rank));
    std::vector<char> recv(send.size());
    std::vector<int> counts(static_cast<size_t>(ranks), static_cast<int>(size));
    std::vector<int> displs(static_cast<size_t>(ranks));
    for (int p = 0; p < ranks; ++p) displs[static_cast<size_t>(p)] = static_cast<int>(size) * p;
    std::vector<char> scratch(static_cast<size_t>(touch * static_cast<double>(send.size())));
    double total = 0;
    for (int i = 0; i < warmup + iters; ++i) {
      if (touch > 0) {
        std::memset(scratch.data(), i & 0xFF, scratch.size());
        std::memset(send.data(), i & 0xFF, send.size());
      }
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_BYTE, recv.data(), counts.data(), displs.data(),
                    MPI_BYTE, MPI_COMM_WORLD);
      if (i >= warmup) total += MPI_Wtime() - start;
    }
    double mean = total / iters;
    double slowest = 0;
    MPI_Reduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      const double bytes = static_cast<double>(size) * ranks;
      const double algbw = bytes / slowest / 1e9;
      std::printf("{\"ranks\":%d,\"bytes_per_peer\":%ld,\"time_us\":%.2f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f}\n",
                  ranks, size, slowest * 1e6, algbw, algbw * (ranks - 1) / ranks);
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
