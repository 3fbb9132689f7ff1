// sgemm-peak: one thread's single-precision GEMM rate through cfmo's BLAS
// seam (ops::gemm, the OpenBLAS kernel cfmo-train selects), the ceiling a
// model's GFLOP/s is read against. Multiplies SIZE x SIZE matrices for
// SECONDS after a warm-up and prints one JSON line: the best GFLOP/s of
// the timed calls (a call's FLOPs: 2 * SIZE^3).
//
//   sgemm-peak [--size N] [--seconds S] [--threads T]
#include "../tools/common/tool_main.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  cfmo::tool::reexec_for_blas(argv);
  int size = 1024, threads = 1;
  double seconds = 2;
  CLI::App app{"sgemm-peak: the single-precision GEMM rate of one thread, the ceiling for GFLOP/s"};
  app.add_option("--size", size, "the matrices' side")->check(CLI::Range(16, 8192));
  app.add_option("--seconds", seconds, "how long to multiply")->check(CLI::Range(0.1, 600.0));
  app.add_option("--threads", threads, "BLAS threads")->check(CLI::Range(1, 1024));
  if (auto done = cfmo::tool::parse_command_line(app, argc, argv, "sgemm-peak")) return *done;
  cfmo::tensor::ops::set_num_threads(threads);
  const auto n = static_cast<size_t>(size);
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
    b[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  }
  auto multiply = [&] {
    cfmo::tensor::ops::gemm(cfmo::tensor::ops::Trans::kNo, cfmo::tensor::ops::Trans::kNo, size, size, size, 1.0f,
                            a.data(), size, b.data(), size, 0.0f, c.data(), size);
  };
  multiply();  // warm: pages, caches, the BLAS's own buffers
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  double best = 1e300;
  int calls = 0;
  do {
    const auto t0 = Clock::now();
    multiply();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    ++calls;
  } while (Clock::now() < end);
  std::printf("{\"threads\":%d,\"size\":%d,\"calls\":%d,\"gflops\":%.1f,\"blas\":\"%s\"}\n", threads, size, calls,
              2.0 * size * size * size / best / 1e9, cfmo::tensor::ops::blas_info().c_str());
  return 0;
}
