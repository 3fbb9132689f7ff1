#pragma once
/// The two dispatch/combine engines over the transport seam.
///
/// Sync (what standard libraries do): every iteration exchanges the routing
/// counts (the layout), then a blocking all-to-all-v dispatch, the expert
/// compute, and a blocking all-to-all-v combine; every rank waits for every
/// other at each of the three.
///
/// Async (eventually consistent): no layout round trip (each message says
/// its own counts); the dispatch is posted without blocking; the rank's own
/// tokens for its own experts are computed at once, other ranks' tokens as
/// they arrive, results combined as they come back; up to `in_flight`
/// iterations overlap; after the deadline a missing result is late and its
/// token takes the residual path or its slot's last result (stale).
///
/// Both compute each (source rank, expert) block with one GEMM in token
/// order, the same blocks a single process computes, so their outputs equal
/// the reference bit for bit when nothing is late. A CUDA backend (NCCL
/// grouped send/recv for sync) fits behind the same two entry points.

#include "comm/communicator.h"
#include "moe/dispatch.h"
#include "moe/moe_config.h"

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>

namespace cfmo::moe {

/// This rank's input batches: iteration i uses batch i % count.
struct InputPool {
  int64_t tokens = 0;
  int hidden = 0;
  std::vector<std::vector<float>> batches;
  const float* batch(int64_t iteration) const {
    return batches[static_cast<size_t>(iteration % static_cast<int64_t>(batches.size()))].data();
  }
};
InputPool make_inputs(uint64_t seed, int rank, int64_t tokens, int hidden, int64_t iterations);

/// What one rank of one run needs; pointers are the caller's and outlive the run.
struct EngineSetup {
  comm::Communicator* comm = nullptr;
  ExpertPlacement placement;
  const Router* router = nullptr;
  std::vector<ExpertFfn>* experts = nullptr;  ///< this rank's, in expert order
  const InputPool* inputs = nullptr;
  Pacer* pacer = nullptr;
  int top_k = 1;
  int64_t capacity = -1;  ///< per expert per source rank; < 0: dropless
  comm::WireDtype dtype = comm::WireDtype::kFp32;
  LatePolicy late_policy = LatePolicy::kResidual;
  int in_flight = 2;
};

/// Routes iteration `iteration` of this rank: the router, then capacity.
Routing route_iteration(const EngineSetup& setup, int64_t iteration);

/// One rank's measurements of one run.
struct RankRecord {
  std::vector<double> dispatch_us;  ///< per iteration (see the man page for each mode's definition)
  std::vector<double> combine_us;
  std::vector<double> a2a_us;        ///< sync: the data all-to-all-v alone; async: the round trip
  std::vector<double> roundtrip_us;  ///< dispatch start to the last result (or the deadline)
  std::vector<double> iteration_us;
  double wall_s = 0;
  int64_t iterations = 0;
  int64_t tokens = 0;
  int64_t assignments = 0;
  int64_t dropped = 0;
  int64_t late = 0;          ///< kept assignments whose result missed the deadline
  int64_t stale = 0;         ///< late ones that used their slot's last result
  double staleness_sum = 0;  ///< iterations of age, over the stale ones
  int64_t staleness_max = 0;
  int64_t late_arrivals = 0;   ///< results that came after their iteration was combined
  int64_t skipped_chunks = 0;  ///< peers' chunks not computed: combined already, or past the deadline (residual)
  double compute_s = 0;        ///< routing and expert compute, simulated slowness included
  double overlapped_s = 0;     ///< compute while results of this rank were in flight
  double dispatch_bytes = 0;   ///< payload dispatched, this rank's own share included
  double peer_bytes = 0;       ///< the part sent to other ranks
  std::vector<int64_t> load;   ///< per expert, this rank's assignments before capacity
  int64_t last_iteration = -1;
  std::vector<float> last_output;  ///< [tokens, hidden] of the last iteration
  std::vector<uint8_t> last_late;  ///< [assignment] of the last iteration
};

Result<RankRecord> run_sync(const EngineSetup& setup, int64_t first_iteration, int64_t iterations);

/// Registers its message handler on construction (before any rank posts:
/// construct it on every rank, then meet in a barrier) and removes it on
/// destruction.
class AsyncEngine {
 public:
  explicit AsyncEngine(comm::Communicator& comm);
  ~AsyncEngine();
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  /// Runs iterations [first, first + iterations); deadline_s <= 0 waits for
  /// every result. Every rank calls run() the same number of times; each
  /// call starts with a barrier and ends when every rank is done.
  Result<RankRecord> run(const EngineSetup& setup, int64_t first_iteration, int64_t iterations, double deadline_s);

 private:
  struct Message {
    int from = -1;
    std::vector<std::byte> bytes;
    Clock::time_point arrived;
  };
  void on_message(int from, std::vector<std::byte> payload);

  comm::Communicator& comm_;
  uint32_t run_ = 0;
  std::atomic<uint32_t> accepted_run_{0};  ///< messages of other runs are dropped on arrival
  std::mutex mutex_;                       ///< guards inbox_
  std::condition_variable arrived_;
  std::deque<Message> inbox_;
  // The slots' last results for --late-policy stale, kept across runs of one size.
  std::vector<float> stale_rows_;
  std::vector<int64_t> stale_iteration_;
};

}  // namespace cfmo::moe
