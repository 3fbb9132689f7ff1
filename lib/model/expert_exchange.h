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
/// Threads. Peers' rows and gradients are served on the exchange's own
/// thread ("cfmo-experts"), whatever the training thread is doing (its
/// attention, its optimizer step, a collective, a --slowdown sleep), so a
/// rank never waits for a peer to finish computing before its rows are
/// served. The server computes with a copy of this rank's expert parameters
/// taken at begin_pass (and at finish) under `snapshot_mutex_`, never with
/// the parameters the optimizer writes; the training thread computes its own
/// rows with the same copy. With no deadline a chunk of a later pass than the
/// copy's waits for this rank to reach that pass, and a pass ends only when
/// every live peer's rows and gradients of it are served and stashed: the
/// results are sync's. A lost peer's experts are late from then on (the run
/// goes on). `finish`, after this rank's last pass, serves the others until
/// each has finished.

#include "model/moe_mlp.h"
#include "moe/dispatch.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
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
  /// `layers` blocks, of which `moe_layers` have experts. `slowdown`: each
  /// peer's chunk takes that many times its compute time (--slowdown).
  ExpertExchange(comm::Communicator& comm, moe::ExpertPlacement placement, int layers, std::vector<int> moe_layers,
                 int dim, int expert_dim, double deadline_s, double slowdown, TensorsOf tensors_of);
  ~ExpertExchange();
  ExpertExchange(const ExpertExchange&) = delete;
  ExpertExchange& operator=(const ExpertExchange&) = delete;

  static constexpr int kWarmupPasses = 4;

  /// Before the training loop: the memory of a pass in which every peer
  /// sends up to `rows_per_peer` rows to this rank's experts (what the
  /// server keeps and answers, the rows this rank sends), allocated and
  /// freed once on the server's heap and the caller's. glibc keeps it
  /// (expert-parallel runs raise its trim threshold), so the first passes
  /// no longer fault their buffers in inside the loop (bench/RESULTS.md).
  void prepare(size_t rows_per_peer);

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
  int64_t skipped_chunks() const { return skipped_chunks_.load(); }
  int64_t skipped_grads() const { return skipped_grads_.load(); }

 private:
  struct Message {
    int from = -1;
    std::vector<std::byte> bytes;
    std::chrono::steady_clock::time_point arrived;
    bool awaited = false;  ///< a reply the open request awaited (set on arrival, under mutex_)
  };
  /// What this rank computed for a source's rows of one layer, kept for their
  /// backward. The vectors belong to the thread that serves the source (the
  /// server for peers, the training thread for this rank); `pass`,
  /// `at_pass` and `awaiting` are written under mutex_, as end_pass reads them.
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
  /// The exchange the training thread is waiting in: where replies go.
  /// Opened and closed by the training thread under mutex_; `awaiting` is
  /// cleared by the progress thread as each awaited reply arrives (under
  /// mutex_), so the training thread is woken once, by the last of them,
  /// not by each (every wake-up is a turn on a shared core).
  struct Request {
    uint32_t kind = 0;
    int layer = -1;
    uint32_t pass = 0;  ///< low 32 bits, as in the header
    std::vector<std::vector<std::byte>>* results = nullptr;
    std::vector<uint8_t>* have = nullptr;
    std::vector<uint8_t> awaiting;
    int pending = 0;  ///< awaiting's ones
    std::chrono::steady_clock::time_point start;
  };

  /// The progress thread's handler: requests to the server, replies to the training thread.
  void on_message(int from, std::vector<std::byte> payload);

  // ---- the training thread ----
  /// Takes replies until `done()` (called under mutex_) or `until`.
  /// `watch_served`: done() reads what the server serves, so it wakes this
  /// thread after each chunk (otherwise only the last awaited reply does).
  void pump(std::chrono::steady_clock::time_point until, const std::function<bool()>& done, bool watch_served);
  /// Opens the request (under mutex_) before its messages go out: a reply may come back at once.
  void open_request(uint32_t kind, int layer, std::vector<std::vector<std::byte>>* results, std::vector<uint8_t>* have,
                    std::vector<uint8_t> awaiting, std::chrono::steady_clock::time_point start);
  void close_request();
  /// Takes replies until the request's are in (or lost) or `deadline`; the wait goes to timing.combine_s.
  void await_replies(std::chrono::steady_clock::time_point deadline, MoeMlp::Timing& timing);
  void take_reply(const Message& m);
  /// Copies this rank's expert parameters for the server; from now on it
  /// serves `pass_` (`finishing`: and every pass, as they no longer change).
  void take_snapshot(bool finishing);

  // ---- the server thread ----
  void serve_loop();
  /// One request, its answer (if any) to post into `reply`; false: keep it for a later pass.
  bool serve(const Message& m, std::vector<std::byte>& reply);

  /// The experts' forward on a source's rows, into `out`, kept in served_ for their backward.
  void serve_rows(int source, int layer, int64_t pass, int64_t at_pass, bool eval, std::span<const uint32_t> counts,
                  const float* rows, float* out);
  /// Their inputs' gradients into `dx`; what the weights' gradients need goes to stash_.
  void serve_grads(int source, int layer, int64_t pass, const float* d_out, float* dx);
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
  double setting_s_;  ///< as given (< 0 adaptive)
  TensorsOf tensors_of_;

  // The training thread's.
  double deadline_s_;  ///< in force
  int64_t pass_ = -1;
  bool training_ = false;
  int64_t training_passes_ = 0;
  bool finished_ = false;  ///< finish() was called
  std::vector<uint8_t> lost_;
  std::vector<std::vector<double>> round_trips_;  ///< [peer] seconds, while warming up
  std::vector<std::byte> own_rows_;  ///< this rank's rows for its own experts (a buffer kept between passes)

  /// Held by the server while it computes with snapshot_, by the training
  /// thread while it writes it. Taken before mutex_ when both are.
  std::mutex snapshot_mutex_;
  std::vector<float> snapshot_;                          ///< this rank's experts' parameters, every MoE layer
  std::vector<std::vector<ExpertTensors>> snapshot_of_;  ///< [layer]: views into snapshot_

  std::mutex mutex_;                   ///< guards everything below but the server's own
  std::condition_variable requested_;  ///< the server: a request, a new snapshot, stop
  std::condition_variable answered_;   ///< the training thread: a reply, a served chunk, a peer done
  std::deque<Message> requests_;       ///< rows, gradients and `done`s of peers, in order
  std::deque<Message> replies_;        ///< results and rows' gradients for this rank
  std::deque<Message> deferred_;       ///< the server's: chunks of a later pass (no deadline)
  Request request_;                    ///< see Request for who writes what
  bool watch_served_ = false;          ///< pump(watch_served): the server wakes the training thread
  int64_t snapshot_pass_ = -1;         ///< the pass of snapshot_ (-1: none yet)
  uint64_t snapshots_ = 0;             ///< snapshots taken: deferred chunks are tried again after each
  bool no_deadline_ = true;            ///< as of the snapshot
  bool finishing_ = false;
  bool stop_ = false;
  size_t warm_bytes_ = 0;  ///< prepare(): the server touches this much of its heap, then sets it 0
  uint32_t mxcsr_ = 0;     ///< the training thread's floating-point mode (flush to zero), for the server
  std::vector<std::vector<Served>> served_;       ///< [source][layer]
  std::vector<std::vector<int64_t>> seen_rows_;   ///< [source][layer]: the latest pass whose rows were served
  std::vector<std::vector<int64_t>> seen_grads_;  ///< [source][layer]: the latest pass whose gradients were served
  std::vector<Stashed> stash_;
  std::vector<uint8_t> done_;
  double row_cost_s_ = 0;  ///< recent expert compute per row (forward), for skipping hopeless chunks

  moe::Pacer pacer_;  ///< the server's

  std::atomic<int64_t> skipped_chunks_{0};
  std::atomic<int64_t> skipped_grads_{0};
  std::thread server_;  ///< last: started once everything above exists
};

}  // namespace cfmo::model
