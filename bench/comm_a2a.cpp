// comm-a2a: times the UCX communicator's collectives alone, for finding where
// an all-to-all-v's time goes: forks RANKS processes on this host, connects
// them through the rendezvous, and times all_to_all_v at each SIZE bytes per
// peer (and a 1-float all-reduce) over many iterations; rank 0 prints one
// JSON line per size with the slowest rank's p50, mean and p99 in us, and
// busbw (nccl-tests': bytes a rank sends, its own share included, over the
// slowest rank's mean, times (n-1)/n).
//   --barrier  a barrier before each timed all-to-all (as bench/mpi-alltoallv)
//   --layout   a 16-byte all-to-all before each timed one (as cfmo-moe's sync layout)
//   --touch F  before each, untimed, write F times the bytes a rank sends to
//              memory of its own and fresh bytes into the send buffers: a
//              layer's own work between its collectives (as bench/mpi-alltoallv)
//
//   comm-a2a [--ranks N] [--iters N] [--barrier] [--layout] [--touch F] SIZE...
#include "comm/rendezvous.h"
#include "comm/ucx_communicator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

int run_rank(cfmo::comm::Communicator& comm, int iters, bool barrier, bool layout, double touch,
             const std::vector<long>& sizes) {
  const int n = comm.size();
  auto report = [&](const char* what, long size, std::vector<double>& t) {
    double mean = 0;
    for (double x : t) mean += x;
    mean /= static_cast<double>(t.size());
    std::vector<float> stats(static_cast<size_t>(3 * n), 0.0f);
    stats[static_cast<size_t>(3 * comm.rank())] = static_cast<float>(pct(t, 0.5));
    stats[static_cast<size_t>(3 * comm.rank() + 1)] = static_cast<float>(mean);
    stats[static_cast<size_t>(3 * comm.rank() + 2)] = static_cast<float>(pct(t, 0.99));
    if (!comm.all_reduce_sum(stats)) return false;
    if (comm.rank() == 0) {
      float p50 = 0, avg = 0, p99 = 0;
      for (int r = 0; r < n; ++r) {
        p50 = std::max(p50, stats[static_cast<size_t>(3 * r)]);
        avg = std::max(avg, stats[static_cast<size_t>(3 * r + 1)]);
        p99 = std::max(p99, stats[static_cast<size_t>(3 * r + 2)]);
      }
      const double busbw = static_cast<double>(size) * n / (avg * 1e-6) / 1e9 * (n - 1) / n;
      std::printf(
          "{\"op\":\"%s\",\"ranks\":%d,\"bytes_per_peer\":%ld,\"p50_us\":%.1f,\"mean_us\":%.1f,\"p99_us\":%.1f,"
          "\"busbw_gbps\":%.3f}\n",
          what, n, size, p50, avg, p99, busbw);
      std::fflush(stdout);
    }
    return true;
  };
  std::vector<std::vector<std::byte>> layout_out(static_cast<size_t>(n), std::vector<std::byte>(16));
  std::vector<std::vector<std::byte>> layout_in(layout_out);
  const std::vector<std::span<const std::byte>> layout_send(layout_out.begin(), layout_out.end());
  const std::vector<std::span<std::byte>> layout_recv(layout_in.begin(), layout_in.end());
  std::vector<double> t;
  float one = 1;
  for (int i = 0; i < iters + 10; ++i) {
    const auto start = Clock::now();
    if (!comm.all_reduce_sum(std::span<float>(&one, 1))) return 1;
    if (i >= 10) t.push_back(std::chrono::duration<double>(Clock::now() - start).count() * 1e6);
  }
  if (!report("all_reduce_1", 4, t)) return 1;
  for (long size : sizes) {
    std::vector<std::vector<std::byte>> out(static_cast<size_t>(n), std::vector<std::byte>(static_cast<size_t>(size)));
    std::vector<std::vector<std::byte>> in(out);
    std::vector<std::span<const std::byte>> s;
    std::vector<std::span<std::byte>> r;
    for (int p = 0; p < n; ++p) {
      s.emplace_back(out[static_cast<size_t>(p)]);
      r.emplace_back(in[static_cast<size_t>(p)]);
    }
    std::vector<std::byte> scratch(static_cast<size_t>(touch * static_cast<double>(size) * n));
    t.clear();
    for (int i = 0; i < iters + 10; ++i) {
      if (touch > 0) {
        std::memset(scratch.data(), i & 0xFF, scratch.size());
        for (auto& o : out) std::memset(o.data(), i & 0xFF, o.size());
      }
      if (barrier && !comm.barrier()) return 1;
      if (layout && !comm.all_to_all_v(layout_send, layout_recv)) return 1;
      const auto start = Clock::now();
      if (auto st = comm.all_to_all_v(s, r); !st) {
        std::fprintf(stderr, "rank %d: %s\n", comm.rank(), st.error().message.c_str());
        return 1;
      }
      if (i >= 10) t.push_back(std::chrono::duration<double>(Clock::now() - start).count() * 1e6);
    }
    if (!report("all_to_all_v", size, t)) return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4;
  int iters = 200;
  bool barrier = false;
  bool layout = false;
  double touch = 0;
  std::vector<long> sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--barrier") == 0) {
      barrier = true;
    } else if (std::strcmp(argv[i], "--layout") == 0) {
      layout = true;
    } else if (std::strcmp(argv[i], "--touch") == 0 && i + 1 < argc) {
      touch = std::atof(argv[++i]);
    } else {
      sizes.push_back(std::atol(argv[i]));
    }
  }
  if (ranks < 2 || iters < 1 || touch < 0) {
    std::fprintf(stderr, "usage: comm-a2a [--ranks N] [--iters N] [--barrier] [--layout] [--touch F] SIZE...\n");
    return 2;
  }
  auto listener = cfmo::comm::listen_tcp("127.0.0.1", 0);
  if (!listener) {
    std::fprintf(stderr, "%s\n", listener.error().message.c_str());
    return 4;
  }
  std::vector<pid_t> children;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (rank != 0) close(listener->first);
      cfmo::comm::RendezvousConfig config;
      config.port = listener->second;
      config.listen_fd = rank == 0 ? listener->first : -1;
      config.timeout_s = 30;
      auto comm = cfmo::comm::connect_ucx(rank, ranks, config);
      if (!comm) {
        std::fprintf(stderr, "rank %d: %s\n", rank, comm.error().message.c_str());
        _exit(4);
      }
      const int code = run_rank(**comm, iters, barrier, layout, touch, sizes);
      comm->reset();
      std::fflush(stdout);
      _exit(code);
    }
    children.push_back(pid);
  }
  close(listener->first);
  int worst = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    worst = std::max(worst, WIFEXITED(status) ? WEXITSTATUS(status) : 128);
  }
  return worst;
}
