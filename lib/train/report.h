#pragma once
/// What a run reports: each worker's figures (sent to rank 0 as JSON at the
/// end), the run's summary, and the two forms a tool prints it in: one JSON
/// object (--json) or a few lines of text.

#include "core/error.h"
#include "train/modes.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::train {

struct WorkerReport {
  int rank = 0;
  int64_t steps = 0;
  int64_t samples = 0;
  double samples_per_s = 0;       ///< samples / this worker's time in the training loop
  double solo_samples_per_s = 0;  ///< samples / time computing (and simulated slowness), without waits
  double wait_s = 0;              ///< blocked on communication in the training loop
  double finish_wait_s = 0;       ///< after the loop: the last replies and the other ranks
  double dispatch_wait_s = 0;     ///< --expert-parallel: in the MoE layers' exchanges (training passes)
  int64_t peak_rss_bytes = 0;     ///< the process's peak resident memory (getrusage)
  double loop_s = 0;              ///< time in the training loop
  double loop_cpu_s = 0;          ///< the process's CPU time (all its threads) in the training loop
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t contributions_dropped = 0;
  uint64_t contributions_sent = 0;
  uint64_t contributions_applied = 0;   ///< as an owner
  uint64_t contributions_received = 0;  ///< as an owner
  int64_t rounds = 0;
  int64_t deferred = 0;
  int64_t replies_held = 0;
  int64_t reply_rounds_cut = 0;
  std::vector<uint64_t> staleness_histogram;
  double slowdown = 1.0;
  std::string stopped_by;
  int64_t deltas_written = 0;  ///< .cfd files written to RUN/deltas/rank-K/
  int64_t deltas_skipped = 0;  ///< rounds not written because the disk fell behind
  bool joined = false;         ///< this worker joined the run under way (--join, a restarted rank)
  double first_step_s = -1;    ///< a joiner: seconds from its process's start to the end of its first step

  std::string to_json() const;
  static Result<WorkerReport> from_json(std::string_view text);
};

/// A rank this one found lost during the run: when, and what became of its shard.
struct LostRank {
  int rank = 0;
  int64_t step = 0;          ///< this rank's step when it noticed
  double wall_s = 0;         ///< the run's seconds when this rank's transport took the join in
  std::string why;           ///< the transport's reason, e.g. "no message for 10.0s"
  int served_by = -1;        ///< cfmo: the rank serving its shard now; -1 where none does
  std::vector<int> experts;  ///< --expert-parallel: its experts, lost with it (their tokens take the residual)
  /// --expert-parallel with a run directory, the keeper: where model.safetensors
  /// took those experts from, a checkpoint's directory or "initial values"; empty: not written.
  std::string experts_from;
};

/// A rank a new process joined during the run (in the place of a lost one).
struct JoinedRank {
  int rank = 0;
  int64_t step = 0;          ///< this rank's step when it noticed
  double wall_s = 0;         ///< the run's seconds when this rank's transport took the join in
  double first_step_s = -1;  ///< the joiner's own: from its start to the end of its first step (-1: it did not report)
};

struct TrainSummary {
  std::string mode;
  int workers = 1;
  std::string model;
  std::string optimizer;
  std::string data;
  std::string blas;    ///< library and kernel, e.g. "OpenBLAS 0.3.21 SkylakeX"
  std::string device;  ///< where rank 0 trained: "cpu (OpenBLAS ...)" or the GPU's description
  size_t parameters = 0;
  int64_t steps = 0;    ///< total, including steps before a resume
  int64_t samples = 0;  ///< total
  int64_t epochs_completed = 0;
  double wall_s = 0;         ///< this invocation, including evaluation and checkpoints
  double train_s = 0;        ///< this invocation, training steps only
  double eval_s = 0;         ///< this invocation, test-set evaluation
  double samples_per_s = 0;  ///< this invocation's samples / train_s
  double test_accuracy = 0;
  double test_loss = 0;
  double final_train_loss = 0;
  double train_loss = 0;  ///< rank 0's mean loss over the steps of its last log window (--log-every)
  // A language model's figures (context > 0): tokens are samples x context.
  int context = 0;
  int64_t tokens = 0;       ///< training tokens, all workers, including before a resume
  double tokens_per_s = 0;  ///< this invocation's, as samples_per_s
  double val_loss = 0;      ///< mean cross-entropy (nats) over the validation windows' predicted tokens
  double flops_per_example = 0;
  double gflops_per_s = 0;  ///< samples_per_s x flops_per_example / 1e9
  std::string flops_formula;
  /// With --optimizer muon: the tensors Muon updates; AdamW updates the rest.
  std::vector<std::string> muon_tensors;
  std::vector<std::string> adamw_tensors;
  uint64_t bytes_sent = 0;
  /// "epochs", "steps", "time-limit", "interrupt", "peer"; "run-ended": a
  /// joiner that came after the run's last round (it trained nothing)
  std::string stopped_by;
  std::string run_dir;
  std::string resumed_from;
  std::vector<WorkerReport> per_worker;
  int rank = 0;    ///< the rank that made this summary (only the keeper's is complete)
  int keeper = 0;  ///< the rank that kept the run: rank 0, or the lowest live rank in cfmo and asgd (-1: run-ended)
  double efficiency = 0;  ///< total samples/s over the sum of the workers' solo samples/s
  std::vector<int> lost_ranks;
  std::vector<LostRank> lost;      ///< each loss this rank noticed (a rank lost, joined and lost again: twice)
  std::vector<JoinedRank> joined;  ///< each join this rank noticed
  ModeSettings mode_settings;
  std::vector<std::string> slowdown;
  std::string straggler;
  /// Model::run_metrics of this rank's training passes (a MoE's auxiliary
  /// losses and expert load); null for a model without any.
  nlohmann::ordered_json model_metrics;

  std::string to_json() const;
};

/// The summary as the lines cfmo-train prints without --json, each ending in a newline.
std::string summary_text(const TrainSummary& summary);

}  // namespace cfmo::train
