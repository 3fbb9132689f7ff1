#pragma once
/// What both dispatch/combine engines share: the layout of one rank's
/// assignments by destination, the rows on the wire (fp32 or bf16), the
/// expert work on the receiving rank, the gate-weighted combine, and the
/// simulated slowness of a rank's compute.

#include "comm/codec.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "moe/experts.h"
#include "moe/router.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace cfmo::moe {

using Clock = std::chrono::steady_clock;
inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// One rank's kept assignments by destination rank: slots[p] in send order
/// (by p's local expert, then token), counts[p][i] rows for p's i-th expert.
struct DispatchPlan {
  std::vector<std::vector<int32_t>> slots;
  std::vector<std::vector<uint32_t>> counts;
};
DispatchPlan plan_dispatch(const Routing& routing, const ExpertPlacement& placement);

/// One all-to-all-v of a byte buffer per rank: out[p] goes to rank p and
/// in[p] (sized by the caller) receives rank p's. With no communicator (a
/// single rank) in[0] takes out[0].
Status exchange_buffers(comm::Communicator* comm, std::vector<std::vector<std::byte>>& out,
                        std::vector<std::vector<std::byte>>& in);

/// The layout of a dispatch: every rank learns how many rows each rank
/// sends it for each of its `local_experts` experts (an all-to-all-v of
/// uint32 counts); [source rank][local expert].
Result<std::vector<std::vector<uint32_t>>> exchange_counts(comm::Communicator* comm, const DispatchPlan& plan,
                                                           int local_experts);

/// Bytes of one row of `hidden` floats on the wire.
size_t row_bytes(comm::WireDtype dtype, int hidden);

/// Appends the rows of x [tokens, hidden] that `slots` name (assignment a is
/// token a / top_k) to `out`, encoded.
void encode_rows(const float* x, int hidden, int top_k, std::span<const int32_t> slots, comm::WireDtype dtype,
                 std::vector<std::byte>& out);

/// One expert block: `count` encoded rows in, `count` encoded results out
/// (fp32: the GEMM reads and writes the wire buffers directly).
void compute_block(ExpertFfn& expert, const std::byte* rows, size_t count, comm::WireDtype dtype, int hidden,
                   std::byte* out, std::vector<float>& scratch);

/// The receiving side: computes `rows` (encoded, counts[i] for local expert
/// i, in order) with `experts` and writes the encoded results to `out` from
/// `offset` on (resized to fit; for fp32 the GEMM writes there directly).
/// `scratch` is the caller's, kept between calls.
void compute_rows(std::span<const std::byte> rows, std::span<const uint32_t> counts, std::vector<ExpertFfn>& experts,
                  comm::WireDtype dtype, int hidden, std::vector<std::byte>& out, size_t offset,
                  std::vector<float>& scratch);

/// Points rows[a] at each result row of `slots` in `results` (encoded);
/// bf16 rows are decoded into `decoded` (assignment-indexed, hidden floats each).
void locate_results(std::span<const std::byte> results, std::span<const int32_t> slots, comm::WireDtype dtype,
                    int hidden, std::vector<float>& decoded, std::vector<const float*>& rows);

/// y_t = x_t + sum over j (in order) of gate[t,j] * rows[t,j]; a null row is
/// the residual path (the assignment contributes nothing).
void combine(const float* x, const Routing& routing, std::span<const float* const> rows, int hidden, float* y);

/// The simulated slowness of this rank (--slowdown, --straggler): compute
/// run through it takes `factor` times its natural time (a sleep after it).
class Pacer {
 public:
  Pacer(double slowdown, double straggler_p, double straggler_factor, uint64_t seed, int rank);
  /// Draws whether this iteration straggles.
  void new_iteration();
  /// Runs `work`, then sleeps so that it took factor times as long; returns the seconds taken in all.
  template <typename Work>
  double run(Work&& work) {
    const auto start = Clock::now();
    work();
    const double natural = seconds_between(start, Clock::now());
    pause(natural);
    return seconds_between(start, Clock::now());
  }

 private:
  void pause(double natural_s);
  double slowdown_;
  double straggler_p_;
  double straggler_factor_;
  double factor_ = 1;
  double owed_s_ = 0;  ///< sleep not taken yet: short sleeps overshoot, so they are gathered
  uint64_t state_;
};

}  // namespace cfmo::moe
