#pragma once
/// `--dispatch async`: the MoE layers' exchanges of an expert-parallel GPT
/// without collectives. Every rank posts its rows to the experts' ranks and
/// never waits for a peer beyond the deadline:
///
///   forward   rows out (a message to every peer, empty when it has none),
///             the own rows computed at once, peers' rows served as they
///             arrive, results taken until the deadline; a peer whose result
///             is late has its assignments take the residual path (expert
///             output zero) and its gradient for them is skipped.
///   backward  the results' gradients out (a skip marker to a late peer),
///             the owners compute the rows' gradients and send them back,
///             taken until the deadline; a late one adds nothing to dx.
///   pass end  an owner waits (to the deadline) for the gradients of the rows
///             it served, then adds the experts' weight gradients, by layer
///             and source rank: the order sync dispatch adds them in, so with
///             no deadline the gradients equal sync's bit for bit.
///
/// Work is served on the training thread, inside these waits (the handler
/// only queues): a rank busy elsewhere serves nothing, so a slow rank is slow
/// at serving too. With no deadline a chunk of a later pass than this rank's
/// waits for this rank to reach that pass, and a pass ends only when every
/// live peer's rows and gradients of it are in: the results are sync's. A
/// lost peer's experts are late from then on (the run goes on). `finish`,
/// after this rank's last pass, serves the others until each has finished.

#include "model/moe_mlp.h"
#include "moe/dispatch.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <vector>

namespace cfmo::model {

class ExpertExchange {
 public:
  /// A layer's expert tensors on this rank (parameters, or `grads`).
  using TensorsOf = std::function<std::vector<ExpertTensors>(int layer, bool grads)>;
  static constexpr double kNoDeadline = std::numeric_limits<double>::infinity();

  /// `deadline_s`: kNoDeadline, a fixed time per exchange, or < 0 adaptive
  /// (no deadline over the first kWarmupPasses training passes, then 1.5 x
  /// the median over peers of each peer's median round trip in them).
  /// `layers` blocks, of which `moe_layers` have experts.
  ExpertExchange(comm::Communicator& comm, moe::ExpertPlacement placement, int layers, std::vector<int> moe_layers, int dim,
                 int expert_dim, double deadline_s, TensorsOf tensors_of);
  ~ExpertExchange();
  ExpertExchange(const ExpertExchange&) = delete;
  ExpertExchange& operator=(const ExpertExchange&) = delete;

  static constexpr int kWarmupPasses = 4;

  /// Before each forward pass (`training`: a backward pass follows).
  void begin_pass(bool training);
  /// Layer `layer`'s forward exchange: x's rows of `plan` to their ranks;
  /// results[p] receives rank p's result rows (fp32, in slot order) and
  /// have[p] whether they came in time.
  void forward(int layer, const float* x, int top_k, const moe::DispatchPlan& plan,
               std::vector<std::vector<std::byte>>& results, std::vector<uint8_t>& have, MoeMlp::Timing& timing);
  /// Its backward: d_out[p] (the gradients of rank p's results, fp32 rows)
  /// to the ranks whose results came (`have`), the rows' gradients back into
  /// d_in[p] (empty when late).
  void backward(int layer, const moe::DispatchPlan& plan, const std::vector<std::vector<std::byte>>& d_out,
                const std::vector<uint8_t>& have, std::vector<std::vector<std::byte>>& d_in, MoeMlp::Timing& timing);
  /// After the pass: the wait for the served rows' gradients, then the weight gradients.
  void end_pass();
  /// After this rank's last pass: serves the others until each has finished or is lost.
  Status finish();

  /// The deadline in force now (kNoDeadline while warming up or without one).
  double deadline_s() const { return deadline_s_; }
  /// Ranks found lost (their experts take the residual path).
  std::vector<int> lost_ranks() const;
  /// Chunks of peers' rows not computed (their deadline had passed) and
  /// served rows whose gradients never came in time (weight gradient skipped).
  int64_t skipped_chunks() const { return skipped_chunks_; }
  int64_t skipped_grads() const { return skipped_grads_; }

 private:
  struct Message {
    int from = -1;
    std::vector<std::byte> bytes;
    std::chrono::steady_clock::time_point arrived;
  };
  /// What this rank computed for a source's rows of one layer, kept for their backward.
  struct Served {
    int64_t pass = -1;      ///< the requester's
    int64_t at_pass = -1;   ///< this rank's when it served them
    bool awaiting = false;  ///< the gradients have not come yet
    std::vector<uint32_t> counts;
    std::vector<float> in, fc, act;
  };
  /// A backward served: its weight gradients wait for the pass end.
  struct Stashed {
    int layer = 0;
    int source = 0;
    int64_t pass = 0;
    std::vector<uint32_t> counts;
    std::vector<float> in, act, d_out, d_act;
  };
  /// The exchange this rank is waiting in: where replies go.
  struct Request {
    uint32_t kind = 0;
    int layer = -1;
    std::vector<std::vector<std::byte>>* results = nullptr;
    std::vector<uint8_t>* have = nullptr;
    std::vector<uint8_t> awaiting;
    std::chrono::steady_clock::time_point start;
  };

  void on_message(int from, std::vector<std::byte> payload);
  /// Serves and takes messages until `done()` or `until`.
  void pump(std::chrono::steady_clock::time_point until, const std::function<bool()>& done);
  /// Serves until the request's replies are in (or lost) or `deadline`; the wait goes to timing.combine_s.
  void await_replies(std::chrono::steady_clock::time_point deadline, MoeMlp::Timing& timing);
  /// One message; false: keep it for a later pass.
  bool handle(Message& m);
  void serve_rows(int source, int layer, int64_t pass, bool eval, std::span<const uint32_t> counts, const float* rows,
                  std::vector<std::byte>* reply, size_t offset);
  void serve_grads(int source, int layer, int64_t pass, const float* d_out, std::vector<std::byte>* reply,
                   size_t offset);
  std::chrono::steady_clock::time_point deadline_from(std::chrono::steady_clock::time_point start) const;
  uint32_t budget_us(std::chrono::steady_clock::time_point deadline) const;
  bool live(int p) const;
  void refresh_lost();
  void note_round_trip(int peer, double seconds);

  comm::Communicator& comm_;
  moe::ExpertPlacement placement_;
  int rank_;
  int ranks_;
  int layers_;
  std::vector<int> moe_layers_;
  int dim_;
  int expert_dim_;
  double setting_s_;   ///< as given (< 0 adaptive)
  double deadline_s_;  ///< in force
  TensorsOf tensors_of_;
  int64_t pass_ = -1;
  bool training_ = false;
  bool finishing_ = false;
  int64_t training_passes_ = 0;

  std::mutex mutex_;  ///< guards inbox_
  std::condition_variable arrived_;
  std::deque<Message> inbox_;
  std::deque<Message> deferred_;  ///< chunks of a later pass (no deadline)

  std::vector<std::vector<Served>> served_;       ///< [source][layer]
  std::vector<std::vector<int64_t>> seen_rows_;   ///< [source][layer]: the latest pass whose rows came
  std::vector<std::vector<int64_t>> seen_grads_;  ///< [source][layer]: the latest pass whose gradients came
  std::vector<Stashed> stash_;
  std::vector<uint8_t> done_, lost_;
  std::vector<std::vector<double>> round_trips_;  ///< [peer] seconds, while warming up
  Request request_;
  double row_cost_s_ = 0;  ///< recent expert compute per row (forward), for skipping hopeless chunks
  int64_t skipped_chunks_ = 0;
  int64_t skipped_grads_ = 0;
  std::vector<float> scratch_;
};

}  // namespace cfmo::model
