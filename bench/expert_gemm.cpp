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
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// Expert rows computed in `seconds` by one process.
double run_one(int first_expert, int experts, int hidden, int ffn, int rows, double seconds) {
  cfmo::tensor::ops::set_num_threads(1);
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
  int processes = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  int ranks = 4, experts = 12, tokens = 512, top_k = 2, hidden = 512, ffn = 1024, rows = 0;
  double seconds = 3;
  CLI::App app{"expert-gemm: the experts' GEMMs alone on every core, cfmo-moe's compute ceiling"};
  app.add_option("--processes", processes, "processes at once (one per core)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--ranks", ranks, "ranks the experts are spread over")->check(CLI::Range(1, 1 << 20));
  app.add_option("--experts", experts, "experts in all")->check(CLI::Range(1, 1 << 20));
  app.add_option("--tokens", tokens, "tokens per rank (for the default --rows)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--top-k", top_k, "experts per token")->check(CLI::Range(1, 1 << 20));
  app.add_option("--hidden", hidden, "hidden size")->check(CLI::Range(1, 1 << 20));
  app.add_option("--ffn", ffn, "expert FFN size")->check(CLI::Range(1, 1 << 20));
  app.add_option("--rows", rows, "rows a call (default tokens * top-k / experts)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--seconds", seconds, "how long each process computes")->check(CLI::Range(0.1, 3600.0));
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "expert-gemm")) return *done;
  if (experts < ranks) {
    std::fprintf(stderr, "expert-gemm: --experts %d is fewer than --ranks %d\n", experts, ranks);
    return 2;
  }
  if (rows == 0) rows = std::max(1, tokens * top_k / experts);
  // Each child leaves its rate here.
  auto* rates = static_cast<double*>(mmap(nullptr, sizeof(double) * static_cast<size_t>(processes),
                                          PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (rates == MAP_FAILED) {
    std::perror("expert-gemm: mmap");
    return 5;
  }
  const cfmo::moe::ExpertPlacement placement{experts, ranks};
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
