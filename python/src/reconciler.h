#pragma once
/// The Python module's Reconciler: libcfmo's modes (train/modes.h) over
/// tensors that live in Python (a PyTorch model's CPU parameters), without
/// the trainer. The tensors are read and written in place through raw
/// pointers the bindings take from the buffer protocol; they are gathered
/// into the modes' flat vector only at the steps where the mode works on the
/// parameters (needs_params), so a step that does not reconcile costs a
/// counter and a check. The optimizer's first moments (PyTorch's exp_avg or
/// momentum_buffer) are discounted for staleness by the modes themselves,
/// through an Optimizer whose scale_first_moment scales those buffers.

#include "comm/communicator.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "tensor/buffer.h"
#include "train/checkpoint.h"
#include "train/delta_writer.h"
#include "train/modes.h"
#include "world.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cfmo::python {

/// One tensor of the model, as the bindings found it.
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;
  size_t size = 0;
};

struct ReconcilerSettings {
  train::ModeSettings mode;          ///< name, H, beta, outer step, wire dtype, peer timeout
  optim::OptimizerConfig optimizer;  ///< asgd: what the owners run on their shards
  std::string out;            ///< run directory for the .cfd deltas; empty: none
};

/// The first moment of each tensor (null where there is none), or the
/// gradients; valid for the duration of one call.
using Buffers = std::vector<float*>;

/// What state_dict() carries: the position and the outer state, as
/// cfmo-train's checkpoints keep it (ModeResume's inputs).
struct ReconcilerState {
  std::string mode;
  int world = 1;
  train::TrainPosition position;                ///< this rank's
  bool global = false;                          ///< params hold the global parameters
  std::vector<float> params;                    ///< flat, the Reconciler's layout
  std::vector<float> outer_momentum;            ///< localsgd and cfmo with nesterov; else empty
  std::vector<std::vector<float>> owner_state;  ///< asgd: the owners' optimizer state
  std::vector<int64_t> owner_steps;             ///< asgd
  std::vector<train::TrainPosition> ranks;      ///< cfmo and asgd: every rank's position
  std::vector<int64_t> versions;                ///< cfmo and asgd: each shard's version
};

/// libcfmo's messages name cfmo-train's flags ("--sync-interval: ..."); the
/// module's callers wrote keyword arguments ("sync_interval: ...").
Error as_keyword_error(Error error);

class Reconciler {
 public:
  /// Collective: every rank of the world calls it with tensors of the same
  /// names and shapes (checked: a mismatch is a kUsage error on every rank).
  static Result<std::unique_ptr<Reconciler>> create(std::shared_ptr<World> world, std::vector<TensorView> tensors,
                                                    ReconcilerSettings settings);
  ~Reconciler();
  Reconciler(const Reconciler&) = delete;
  Reconciler& operator=(const Reconciler&) = delete;

  /// One optimizer step was taken over `samples` examples. True when that is
  /// all (the mode needs nothing more); false when it needs the parameters:
  /// then call reconcile() with the first moments.
  bool tick(int64_t samples);
  Status reconcile(const Buffers& moments);
  /// sync: the weighted mean of every rank's gradients, in place; asgd: this
  /// step's gradients to their owners (the owners' update replaces the local one).
  Status reduce_gradients(const Buffers& grads, int count, float lr);
  /// Collective: the last reconciliation and the end handshake. Afterwards
  /// rank 0 holds the global parameters (every rank does in sync and localsgd).
  Status finish(const Buffers& moments);
  bool finished() const { return finished_; }
  /// cfmo and asgd with a sample budget: the budget keeper (rank 0) says the
  /// workers together have seen it.
  bool stop_requested() const { return mode_->stop_requested(); }

  std::string mode_name() const { return std::string(train::mode_entry(settings_.mode.kind).name); }
  bool owns_update() const { return mode_->owns_update(); }
  bool uses_gradients() const { return size() > 1 && mode_->uses_gradients(); }
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  const train::TrainPosition& position() const { return position_; }
  const std::vector<model::ParamInfo>& layout() const { return layout_; }
  std::vector<size_t> shard_bounds() const;
  train::ModeStats mode_stats() const { return mode_->stats(); }
  comm::CommStats comm_stats() const;
  std::vector<int> lost_ranks() const;
  int64_t deltas_written() const;
  int64_t deltas_skipped() const;

  /// cfmo and asgd: rank 0 gathers the owners' shards (waiting up to the peer
  /// timeout); the other ranks return their position only. localsgd: only
  /// right after a reconciling step, when the parameters are the global ones.
  Result<ReconcilerState> state_dict();
  /// Collective, before the first step: every rank loads the same state
  /// (rank 0's), the global parameters are written into the tensors and the
  /// mode starts again from them, as a resumed cfmo-train run does.
  Status load_state_dict(const ReconcilerState& state);

 private:
  Reconciler(std::shared_ptr<World> world, std::vector<TensorView> tensors, ReconcilerSettings settings);
  Status check_same_tensors();
  Status start_mode(std::span<const float> initial, const train::ModeResume& resume);
  void gather();
  void scatter();
  Status failed(Status status);

  std::shared_ptr<World> world_;
  std::vector<TensorView> tensors_;
  ReconcilerSettings settings_;
  std::vector<model::ParamInfo> layout_;
  tensor::FloatBuffer flat_;  ///< the modes' flat vector: filled only when a mode works on it
  train::TrainPosition position_;
  std::unique_ptr<train::DeltaWriter> delta_writer_;
  std::unique_ptr<train::Mode> mode_;
  bool finished_ = false;
};

}  // namespace cfmo::python
