#pragma once
/// The Mixture-of-Experts MLP of a GPT block (`--model gpt:...,experts=E`):
/// a linear router C -> E (no bias), softmax, each token's top k experts
/// with their probabilities renormalised to sum 1 (Mixtral), and E expert
/// MLPs C -> D -> C with GELU (tanh), each the GPT-2 MLP in Conv1D layout.
///
///   y_t = x_t + sum_j gate_tj * expert_{e_tj}(ln_2(x)_t)
///
/// Capacity as cfmo-moe's (lib/moe: expert_capacity, apply_capacity in
/// GShard's order, plan_dispatch, combine): an assignment over its expert's
/// capacity is dropped and its expert output is zero, the residual carries
/// the token; with dropless nothing is dropped.
///
/// Two auxiliary losses are added to the training loss, each the mean over
/// the model's MoE layers times its coefficient:
///   load balance (Switch Transformer)  E * sum_i f_i P_i, f_i the share of
///     the batch's assignments routed to expert i (before capacity, so it
///     does not depend on drops), P_i the mean router probability of i;
///     1 when perfectly balanced.
///   router z-loss (ST-MoE)  mean over tokens of logsumexp(logits_t)^2.
/// Top-k and capacity are piecewise constant: gradients flow through the
/// gates, the router probabilities and the experts.

#include "model/moe_options.h"
#include "moe/dispatch.h"
#include "moe/router.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace cfmo::model {

class ExpertExchange;

/// One expert's tensors in a flat buffer (parameters or their gradients).
struct ExpertTensors {
  float* fc_w = nullptr;    ///< [C, D]
  float* fc_b = nullptr;    ///< [D]
  float* proj_w = nullptr;  ///< [D, C]
  float* proj_b = nullptr;  ///< [C]
};

/// With expert parallelism (`set_expert_parallel`) a rank holds the experts
/// e with e mod W == rank (moe::ExpertPlacement's strided form) and the
/// `experts` spans below are those, in order; each rank's kept assignments
/// travel to their experts' ranks and the outputs come back through lib/moe's
/// dispatch (exchange_counts, exchange_buffers, plan_dispatch, combine):
/// forward the layout, the rows and the results, backward the results'
/// gradients and the rows' (four all-to-all-v of rows per layer and step,
/// every rank in each). Without it the same code runs with one rank and no
/// communicator.
class MoeMlp {
 public:
  MoeMlp(int dim, int experts, int top_k, int expert_dim, const MoeOptions& options);

  /// The rows travel through `comm`, of options.expert_ranks ranks, this one
  /// options.expert_rank (with one rank: none needed): by its collectives
  /// (sync dispatch), or, given `exchange` (--dispatch async), as block
  /// `layer` of the model's ExpertExchange.
  void set_expert_parallel(comm::Communicator* comm, ExpertExchange* exchange = nullptr, int layer = -1);
  const moe::ExpertPlacement& placement() const { return placement_; }
  /// Experts this rank holds.
  int local_experts() const { return placement_.count(rank_); }

  /// y = residual + the layer's output for x [rows, C] (x = ln_2 of the
  /// residual); keeps what backward needs (until the next forward).
  void forward(const float* x, const float* residual, int rows, const float* router,
               std::span<const ExpertTensors> experts, float* y);
  /// From dy = d loss / d y: dx += d loss / d x, and the router's and the
  /// experts' gradients +=. The auxiliary losses enter the loss as
  /// aux_weight * aux_loss() + z_weight * z_loss().
  void backward(const float* dy, const float* x, const float* router, float* d_router,
                std::span<const ExpertTensors> experts, std::span<const ExpertTensors> d_experts, float* dx,
                float aux_weight, float z_weight);

  /// Of the last forward.
  double aux_loss() const { return aux_loss_; }
  double z_loss() const { return z_loss_; }
  const moe::Routing& routing() const { return routing_; }
  /// Slots per expert in a batch of `rows` tokens (-1: dropless).
  int64_t capacity(int rows) const;

  /// Seconds the last training pass (forward and backward) spent in its
  /// exchanges: dispatch (the layout and the rows out; backward, the
  /// results' gradients out) and combine (the results back; backward, the
  /// rows' gradients back). Zero without a communicator.
  struct Timing {
    double dispatch_s = 0;
    double combine_s = 0;
    int64_t kept = 0;        ///< kept assignments (async dispatch)
    int64_t late = 0;        ///< of those, whose result was late: residual, no gradient
    int64_t late_grads = 0;  ///< on time forward, but the rows' gradient came late (not added to dx)
  };
  const Timing& timing() const { return timing_; }
  bool exchanges() const { return comm_ != nullptr; }

  /// The first failure of an exchange (a lost peer) since the last call;
  /// after one, every token takes the residual path.
  Status take_status() { return std::exchange(status_, Status{}); }

  int experts() const { return experts_; }
  int top_k() const { return top_k_; }
  /// Floats forward and backward keep for `rows` tokens (an upper bound).
  size_t workspace_floats(int rows) const;
  /// Touches the buffers a pass over `rows` tokens can need at most, so that
  /// the first pass does not fault them in (their capacity stays).
  void prepare(int rows);
  /// The most rows a pass over `rows` tokens sends to `experts` experts
  /// (each takes at most its capacity from a rank; dropless: every assignment).
  size_t rows_to(int experts, int rows) const;

 private:
  /// Sends the rows to their experts' ranks, computes the rows received with
  /// `experts` (this rank's) and receives the results into results_.
  Status dispatch_forward(const float* x, std::span<const ExpertTensors> experts);
  /// Rows received from `rank` in the last forward.
  size_t rows_from(size_t rank) const;
  /// Sync dispatch's backward exchanges: the results' gradients to the
  /// owners, the experts' backward there, the rows' gradients into results_.
  void backward_exchange(std::span<const ExpertTensors> experts, std::span<const ExpertTensors> d_experts);

  int dim_;
  int experts_;
  int top_k_;
  int expert_dim_;
  MoeOptions options_;
  int rows_ = 0;
  double aux_loss_ = 0;
  double z_loss_ = 0;
  comm::Communicator* comm_ = nullptr;
  ExpertExchange* exchange_ = nullptr;
  int layer_ = -1;
  std::vector<uint8_t> have_;  ///< async: [rank] its results came in time
  Status status_;
  Timing timing_;
  int rank_ = 0;
  moe::ExpertPlacement placement_;
  moe::Routing routing_;
  moe::DispatchPlan plan_;                       ///< the kept assignments by owner rank, its local expert, token
  std::vector<std::vector<uint32_t>> incoming_;  ///< [source rank][local expert]: rows received
  std::vector<size_t> first_row_;                ///< [source rank]: its first row in in_
  /// Per rank: rows out, rows in, results back; backward reuses them for the gradients.
  std::vector<std::vector<std::byte>> send_, received_, results_;
  std::vector<float> logits_, probs_, lse_;  ///< [rows, E], [rows, E], [rows]
  /// Per received row (by source rank, local expert, token): [R, C], [R, D], [R, D], [R, C]
  std::vector<float> in_, fc_, act_, out_;
  std::vector<float> d_out_, d_act_, d_in_, d_logits_, d_gate_;
  std::vector<int32_t> order_;
};

/// One expert's MLP over `n` rows of x [n, C] (Conv1D layout, GELU tanh),
/// keeping the pre-activation fc [n, D] and activation act [n, D] for backward.
void expert_forward(const float* x, int n, const ExpertTensors& w, int c, int d, float* fc, float* act, float* y);
/// Its backward from dy [n, C]: gradients += into g, dx [n, C] overwritten;
/// d_act [n, D] is scratch. The two halves below, in turn.
void expert_backward(const float* dy, int n, const float* x, const float* fc, const float* act, const ExpertTensors& w,
                     const ExpertTensors& g, int c, int d, float* d_act, float* dx);
/// dx [n, C] (overwritten) from dy, leaving d_act [n, D] (overwritten) for the weights' half.
void expert_backward_inputs(const float* dy, int n, const float* fc, const ExpertTensors& w, int c, int d, float* d_act,
                            float* dx);
/// The weight gradients += into g from dy and the d_act the inputs' half left.
void expert_backward_weights(const float* dy, int n, const float* x, const float* act, const float* d_act,
                             const ExpertTensors& g, int c, int d);

/// What the MoE layers of a run did over a window of training passes, for
/// metrics.jsonl and the summary: per layer the auxiliary losses, the expert
/// load (assignments per expert in a pass, before capacity: each pass's
/// min, mean, max and coefficient of variation, averaged over the passes,
/// so that a pass that sends everything to two experts shows even when the
/// favourites change from pass to pass) and the dropped share.
class MoeStats {
 public:
  /// One training pass over `layers` (the model's MoE layers, in order; `index` their block numbers).
  void add(std::span<const MoeMlp* const> layers, std::span<const int> index);
  /// Its exchanges' times, once its backward pass is done (expert parallelism).
  void add_timing(std::span<const MoeMlp* const> layers);
  bool empty() const { return passes_ == 0; }
  /// Seconds in the exchanges of the passes added (add_timing).
  double wait_s() const { return wait_s_; }
  /// {"aux_loss", "z_loss", "dropped_share", "layers": [{"layer", "aux_loss", "z_loss", "load_min", ...}]};
  /// with expert parallelism also "dispatch": {"dispatch_p50_us", "dispatch_p99_us", "combine_p50_us",
  /// "combine_p99_us", "wait_s", "late_share", "late", "late_grad_share"} (per layer and pass; wait_s
  /// the sum; late: kept assignments whose result missed the deadline, late_grad: whose rows' gradient did).
  nlohmann::ordered_json to_json() const;

 private:
  struct Layer {
    int index = 0;
    double aux = 0, z = 0;
    int64_t assignments = 0, dropped = 0;
    double load_min = 0, load_mean = 0, load_max = 0, load_cv = 0;  ///< summed over passes
  };
  std::vector<Layer> layers_;
  int64_t passes_ = 0;
  bool exchanges_ = false;
  std::vector<double> dispatch_us_, combine_us_;  ///< per pass and layer
  double wait_s_ = 0;
  int64_t kept_ = 0, late_ = 0, late_grads_ = 0;  ///< assignments (async dispatch)
};

}  // namespace cfmo::model
