// expert-gemm: the compute ceiling of cfmo-moe's layer on this machine. Forks
// one process per core; each runs the expert FFN (moe::ExpertFfn::forward,
// relu(x W1) W2 through the BLAS seam, as cfmo-moe's experts do) on ROWS rows
// at a time, cycling through the EXPERTS experts one rank of RANKS holds, for
// SECONDS. Prints one JSON line: the GFLOP/s and expert rows (assignments)
// per second of all the processes together, and tokens_per_s, assignments
// over top-k: what no mode that computes every token can pass here, with
// nothing communicated, routed or combined. ROWS defaults to what one source
// rank sends one expert: tokens * top-k / experts.
//
//   expert-gemm [--processes N] [--ranks R] [--experts E] [--tokens T] [--top-k K]
//               [--hidden H] [--ffn F] [--rows N] [--seconds S]
#include "../tools/common/tool_main.h"
#include "moe/experts.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// Expert rows computed in `seconds` by one process.
double run_one(int first_expert, int experts, int hidden, int ffn, int rows, double seconds) {
  cfmo::ops::set_num_threads(1);
  std::vector<cfmo::moe::ExpertFfn> ffns;
  for (int e = 0; e < experts; ++e) ffns.emplace_back(1, first_expert + e, hidden, ffn);
  std::vector<float> x(static_cast<size_t>(rows) * static_cast<size_t>(hidden));
  cfmo::moe::make_hidden_states(1, first_expert, 0, rows, hidden, x.data());
  std::vector<float> out(x.size());
  for (auto& f : ffns) f.forward(x.data(), rows, out.data());  // warm: scratch, pages, caches
  double done = 0;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  while (Clock::now() < end) {
    for (auto& f : ffns) {
      f.forward(x.data(), rows, out.data());
      done += rows;
    }
  }
  return done / std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  cfmo::tool::reexec_for_blas(argv);
  // Every flag takes a number.
  struct Flag {
    const char* name;
    double value;
  };
  Flag flags[] = {{"--processes", static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN))},
                  {"--ranks", 4},
                  {"--experts", 12},
                  {"--tokens", 512},
                  {"--top-k", 2},
                  {"--hidden", 512},
                  {"--ffn", 1024},
                  {"--rows", 0},
                  {"--seconds", 3}};
  bool usage = argc % 2 == 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    Flag* f = std::find_if(std::begin(flags), std::end(flags),
                           [&](const Flag& g) { return std::strcmp(g.name, argv[i]) == 0; });
    if (f == std::end(flags)) {
      usage = true;
    } else {
      f->value = std::atof(argv[i + 1]);
    }
  }
  auto get = [&](int index) { return static_cast<int>(flags[index].value); };
  const int processes = get(0), ranks = get(1), experts = get(2), tokens = get(3), top_k = get(4), hidden = get(5),
            ffn = get(6);
  const double seconds = flags[8].value;
  const int rows = get(7) > 0 ? get(7) : std::max(1, tokens * top_k / std::max(1, experts));
  if (usage || processes < 1 || ranks < 1 || experts < ranks || top_k < 1 || hidden < 1 || ffn < 1 || seconds <= 0) {
    std::fprintf(stderr,
                 "usage: expert-gemm [--processes N] [--ranks R] [--experts E] [--tokens T] [--top-k K] [--hidden H] "
                 "[--ffn F] [--rows N] [--seconds S]\n");
    return 2;
  }
  // Each child leaves its rate here.
  auto* rates = static_cast<double*>(mmap(nullptr, sizeof(double) * static_cast<size_t>(processes),
                                          PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (rates == MAP_FAILED) {
    std::perror("expert-gemm: mmap");
    return 5;
  }
  const cfmo::moe::Placement placement{experts, ranks};
  std::vector<pid_t> children;
  for (int p = 0; p < processes; ++p) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rank = p % ranks;
      rates[p] = run_one(placement.first(rank), placement.count(rank), hidden, ffn, rows, seconds);
      _exit(0);
    }
    children.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    worst = std::max(worst, WIFEXITED(status) ? WEXITSTATUS(status) : 5);
  }
  if (worst != 0) return worst;
  double assignments = 0;
  for (int p = 0; p < processes; ++p) assignments += rates[p];
  const double flops_per_row = 4.0 * hidden * ffn;  // two GEMMs, a multiply and an add each
  std::printf(
      "{\"processes\":%d,\"rows\":%d,\"hidden\":%d,\"ffn\":%d,\"gflops\":%.1f,\"assignments_per_s\":%.0f,"
      "\"tokens_per_s\":%.0f}\n",
      processes, rows, hidden, ffn, assignments * flops_per_row / 1e9, assignments, assignments / top_k);
  return 0;
}
