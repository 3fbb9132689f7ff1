#pragma once
/// How workers reconcile: the modes of ALGORITHM.md behind the seam the
/// training loop calls after every step.
///
///   sync      gradients averaged by a blocking ring all-reduce every step
///   localsgd  H local steps, then a blocking all-reduce of the deltas and an
///             outer step (plain averaging, or Nesterov as DiLoCo)
///   asgd      every step's gradient shards go to their owners, which apply
///             them at once (parameter server, no staleness correction)
///   cfmo      H local steps, then each delta shard goes to its owner without
///             waiting; the owner applies it weighted by beta^staleness and
///             sends the fresh shard back; the worker rebases when it arrives
///
/// The modes are one table (mode_table()): its rows give each mode's name,
/// its line of help, its traits (what the trainer needs to know of it before
/// and without asking it) and its factory. Each mode lives in a file of its
/// own under train/modes/ (async_base.h for what cfmo and asgd share, wire.h
/// for their messages). Adding a mode: a ModeKind, a file with its class and
/// factory, and a row in train/modes/table.cpp.
///
/// The protocol, as the trainer drives it each step: on_gradients (if
/// uses_gradients) between backward and the update, the local update unless
/// owns_update, then after_step (with the parameters if needs_params); stop
/// requests through want_stop/stop_requested; after the loop finish, then
/// stats and, for modes with owners, final_state. Checkpoints: rank 0 writes
/// its own parameters when params_are_global, else request_snapshot and later
/// take_snapshot.

#include "comm/codec.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "train/channels.h"
#include "train/checkpoint.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::train {

/// The modes, in the order of mode_table() (and of --compare).
enum class ModeKind : uint8_t { kSync, kLocalSgd, kAsgd, kCfmo };

/// The outer step of localsgd and cfmo on the deltas (see OuterOptimizer).
enum class OuterKind : uint8_t { kAvg, kNesterov };
Result<OuterKind> parse_outer_kind(std::string_view text);  ///< errors name --outer-optimizer
std::string_view to_string(OuterKind kind);

struct ModeSettings {
  ModeKind kind = ModeKind::kSync;
  int sync_interval = 10;           ///< H: local steps between reconciliations
  double staleness_discount = 0.9;  ///< beta
  int max_staleness = 4;            ///< rounds; older contributions are dropped
  /// cfmo, asgd: the ranks that serve the K shards of the global parameters
  /// (shard j by rank j); 0: owner_count's default.
  int owners = 0;
  OuterKind outer_optimizer = OuterKind::kNesterov;
  double outer_lr = 0.5;
  double outer_momentum = 0.8;
  /// nesterov: rounds over which the outer step goes from plain averaging
  /// (lr 1, no momentum) to outer_lr and outer_momentum; 0: none.
  int outer_warmup = 10;
  comm::WireDtype delta_dtype = comm::WireDtype::kBf16;
  int64_t sample_budget = 0;  ///< async modes: stop when all workers together saw this many (0: no budget)
  double peer_timeout_s = 10;
  bool elastic = false;  ///< sync, localsgd: a lost worker leaves the group, the others go on
  /// cfmo: a fixed order of messages. Each owner applies a round's
  /// contributions in rank order once every rank's has arrived, and each
  /// worker waits for its round's replies: a run is bitwise reproducible and
  /// resumable, at the price of the waits (localsgd's). A loss ends it (status 4).
  bool deterministic = false;
  /// cfmo: an owner answers a shard's contributions by rounds, once every
  /// live rank's is in or after H of its own steps (train/modes/reply_hold.h);
  /// false: each at once (--reply-hold off).
  bool hold_replies = true;
  /// Called at each reconciliation (localsgd, cfmo) with this rank's delta
  /// against its global base, on the training thread; empty: not called.
  std::function<void(int64_t round, int64_t step, int64_t base_version, std::span<const float> base,
                     std::span<const float> delta)>
      delta_sink;
};

struct ModeStats {
  double wait_s = 0;         ///< blocked on communication inside the training loop
  double finish_wait_s = 0;  ///< at the end, waiting for the last replies and for the other ranks
  uint64_t contributions_dropped = 0;
  uint64_t contributions_sent = 0;            ///< shards of deltas (cfmo) or gradients (asgd) this rank sent
  uint64_t contributions_applied = 0;         ///< as an owner: contributions from any rank applied to my shard
  uint64_t contributions_received = 0;        ///< as an owner: contributions that arrived (applied or dropped)
  int64_t rounds = 0;                         ///< reconciliations (or gradient pushes for asgd) started
  int64_t deferred = 0;                       ///< cfmo: rounds in which a shard waited, its last delta still in flight
  int64_t replies_held = 0;                   ///< cfmo owner (--reply-hold round): replies that waited for their round
  int64_t reply_rounds_cut = 0;               ///< cfmo owner: rounds answered before whole, after 2H of its steps
  std::vector<uint64_t> staleness_histogram;  ///< [s] = contributions applied s rounds stale
};

/// The global state of an asynchronous run, assembled on rank 0 from the
/// owners' shards: what a checkpoint of cfmo or asgd holds.
struct GlobalState {
  std::vector<float> params;          ///< the global parameters
  std::vector<float> outer_momentum;  ///< cfmo with nesterov: the owners' outer momentum; else empty
  /// asgd: the owners' optimizer state, one vector per state buffer of the
  /// optimizer (in Optimizer::state() order), each over the whole vector.
  std::vector<std::vector<float>> owner_state;
  std::vector<int64_t> owner_steps;  ///< asgd: each owner's optimizer steps
  std::vector<TrainPosition> ranks;  ///< each rank's position, as last reported
  std::vector<int64_t> versions;     ///< each shard's version
  /// cfmo with nesterov: the owners' round in progress, its weighted sum over
  /// the whole vector and, per shard, its contributions so far; else empty.
  std::vector<float> outer_round_sum;
  std::vector<int64_t> outer_in_round;
};

/// What a resumed run hands its mode (from the checkpoint; empty: start afresh).
struct ModeResume {
  std::vector<float> outer_momentum;            ///< over the whole vector
  std::vector<float> outer_round_sum;           ///< cfmo: the owners' pending round, as in GlobalState
  std::vector<int64_t> outer_in_round;          ///< cfmo: per shard
  std::vector<int64_t> versions;                ///< cfmo, asgd: each shard's version (the staleness counters)
  std::vector<float> wire_residual;             ///< cfmo: this rank's error feedback of a lossy --delta-dtype
  std::vector<std::vector<float>> owner_state;  ///< asgd: the owners' optimizer state, as in GlobalState
  std::vector<int64_t> owner_steps;             ///< asgd
  std::vector<TrainPosition> ranks;             ///< rank 0, async: the budget keeper's start
  /// This rank's position's samples at its start (a resumed run's; else 0):
  /// what it trains in this run counts from there (localsgd --elastic's tally).
  int64_t start_samples = 0;
};

/// What a joiner's Mode::join came to.
enum class Joined {
  kTakenIn,   ///< it has the run's state and trains
  kRunEnded,  ///< the run ended before the others took it in: nothing to train
};

class Mode {
 public:
  virtual ~Mode() = default;
  virtual std::string_view name() const = 0;
  /// Between backward and the update; `count` examples made `grads` (0: none).
  virtual Status on_gradients(std::span<float> /*grads*/, int /*count*/, float /*lr*/) { return {}; }
  /// True when the mode applies updates itself (asgd's owners), not the local optimizer.
  virtual bool owns_update() const { return false; }
  /// After the update (`position` counts it): reconcile, rebase, report progress.
  virtual Status after_step(const TrainPosition& /*position*/, std::span<float> /*params*/,
                            optim::Optimizer& /*optimizer*/) {
    return {};
  }
  /// True when the stop is decided together: this worker's wish to stop
  /// (time limit, Ctrl-C) travels with the next collective, and every worker
  /// stops at the same step. Asynchronous modes stop each worker on its own.
  /// Whether after_step at `position` reads or writes the parameters. When
  /// false, the trainer may pass an empty span (a device engine then copies
  /// nothing to the host), and after_step must leave the parameters alone
  /// even if a reply arrives meanwhile: it waits for the next step.
  virtual bool needs_params(const TrainPosition& /*position*/) const { return true; }
  /// Whether on_gradients reads (or rewrites) the gradients: sync and asgd.
  virtual bool uses_gradients() const { return false; }
  /// Sync: the weighted all-reduce of on_gradients done where the gradients
  /// live (NCCL on GPUs). `extras` are host floats summed with them, extras[0]
  /// this rank's example count; afterwards the gradients are the mean.
  using DeviceReduce = std::function<Status(std::span<float> extras)>;
  virtual void use_device_reduce(DeviceReduce /*reduce*/) {}
  virtual bool lockstep() const { return false; }
  /// This worker wants to stop, for "time-limit" or "interrupt" (lockstep
  /// modes: it keeps stepping until all agree).
  virtual void want_stop(std::string_view /*reason*/) {}
  /// The workers agreed to stop (lockstep), or the budget keeper said so (async).
  virtual bool stop_requested() const { return false; }
  /// Lockstep modes: why the workers stopped ("interrupt" if any worker was
  /// interrupted, else "time-limit"), the same on every rank; empty otherwise.
  virtual std::string agreed_reason() const { return {}; }
  /// After the loop: the last reconciliation and the end handshake. Leaves the
  /// global parameters in `params` on the keeper (on every rank for sync and localsgd).
  virtual Status finish(std::span<float> /*params*/, optim::Optimizer& /*optimizer*/) { return {}; }
  /// True when this rank's parameters are the global ones now (after
  /// after_step): always in sync, right after a round in localsgd, never in
  /// cfmo and asgd, where the owners hold them.
  virtual bool params_are_global() const { return true; }
  /// The outer momentum over the whole vector where this rank holds it
  /// (localsgd with nesterov); empty otherwise.
  virtual std::span<const float> outer_momentum() const { return {}; }
  /// This rank's error feedback of a lossy wire dtype (cfmo), over the whole
  /// vector: part of its state in a checkpoint; empty where none.
  virtual std::span<const float> wire_residual() const { return {}; }
  /// cfmo and asgd, the keeper: asks every owner for its shard (and its owner
  /// state) without waiting; a request supersedes one not yet answered.
  /// False where the mode has no owners.
  virtual bool request_snapshot() { return false; }
  /// The keeper: the global state assembled from every live owner's answer to the
  /// last request, once complete (then only once); every shard is as its
  /// owner held it when the request arrived.
  virtual std::optional<GlobalState> take_snapshot() { return std::nullopt; }
  /// cfmo and asgd, the keeper, after finish: the global state at the end (the
  /// parameters finish left in `params`, with the owners' state and the
  /// ranks' final positions).
  virtual std::optional<GlobalState> final_state() { return std::nullopt; }
  virtual ModeStats stats() const { return {}; }
  /// cfmo and asgd, the keeper, and sync and localsgd with --elastic, every
  /// member: the samples `rank` trained in this run up to its last
  /// contribution that reached the keeper, or its last completed sum (what a
  /// lost rank adds to the run).
  virtual int64_t reconciled_samples(int /*rank*/) const { return 0; }
  /// cfmo, the keeper (sync and localsgd with --elastic, every member): the
  /// samples earlier processes in `rank`'s place trained up to their last
  /// contribution (sum), before a new one joined there.
  virtual int64_t retired_samples(int /*rank*/) const { return 0; }
  /// This rank joined the run under way (Communicator::joined): takes the
  /// global state from the ranks there into `params` and its place's last
  /// position into `position`, before its first step; cfmo (its owners'
  /// shards, its own back from the rank that served it), asgd (the owners'
  /// shards; its own, if it owns one, from the freshest copy a worker holds),
  /// localsgd with --elastic (the group's leader, at its next round) and sync
  /// with --elastic (the leader after its next step: its parameters and the
  /// inner state into `optimizer`, the host's, which the trainer then hands
  /// to its engine). kRunEnded: the run ended before the group took this
  /// rank in (localsgd, sync), or the keeper's end began before it did
  /// (cfmo, asgd: the rank has taken part in the end's handshake): it came
  /// too late, and trains nothing. Fails
  /// (kPeer) when the state does not come within the peer timeout; other
  /// modes take no joins (kUsage).
  virtual Result<Joined> join(std::span<float> /*params*/, optim::Optimizer& /*optimizer*/,
                              TrainPosition& /*position*/) {
    return make_error(ErrorKind::kUsage, "--join: --mode {} takes no joining worker", name());
  }
  /// The rank that keeps the budget and writes the checkpoints, the final
  /// model and the summary: rank 0, or in cfmo and asgd the lowest live rank
  /// (it moves when rank 0 is lost).
  virtual int keeper() const { return 0; }
  /// cfmo, after `rank` was lost: the rank that serves its shard of the global
  /// parameters now; -1 where nobody does (other modes, asgd).
  virtual int shard_served_by(int /*rank*/) const { return -1; }
  /// True when the others go on without a lost worker (cfmo, asgd, localsgd,
  /// sync with --elastic); false when a loss ends the run (exit status 4).
  virtual bool survives_losses() const { return false; }
  /// Lockstep modes that survive losses: the workers of the group now, in
  /// rank order (the trainer's shares of a global batch); cfmo and asgd, the
  /// keeper once its end began: every rank but the joiners it did not take
  /// in; empty: every rank. The keeper waits at the end for these ranks'
  /// reports and last states.
  virtual std::vector<int> members() const { return {}; }
  /// Lockstep modes that survive losses: the members that made the last
  /// reconciliation (a rank taken in at it has nothing of it yet); empty: every rank.
  virtual std::vector<int> round_members() const { return members(); }
};

/// What the trainer needs to know of a mode with several workers, before
/// it is made and without asking its name. (With one worker every mode trains
/// alone: make_mode gives the solo mode whatever the kind.)
struct ModeTraits {
  /// Every worker takes the same steps and the stop is decided together (sync, localsgd).
  bool lockstep = false;
  /// Owners hold the global parameters and workers share a sample budget kept
  /// by rank 0, each at its own pace; checkpoints assemble the owners' shards (cfmo, asgd).
  bool asynchronous = false;
  /// Each reconciliation has a delta against a global base worth writing for cfmo-diverge (localsgd, cfmo).
  bool writes_deltas = false;
  /// The update is the all-reduced gradient's: every worker steps every step,
  /// even on an empty batch (sync).
  bool reduces_gradients = false;
  /// A device engine may reduce the gradients where they live (NCCL), through
  /// Mode::use_device_reduce (sync).
  bool device_reduce = false;
  /// Rank 0's parameters are the global ones at every epoch end, so it
  /// evaluates them there, and the end's evaluation may be the last epoch's (sync).
  bool evaluates_mid_run = false;
  /// The owners run the inner optimizer on their flat shards: element-wise
  /// optimizers only, and a checkpoint's optimizer state is the owners' (asgd).
  bool owners_optimize = false;
  /// Copies of the parameter vector the mode keeps besides the model's (the memory estimate).
  int parameter_copies = 0;
};

/// Everything a mode's factory is given; `comm` has two ranks or more.
struct ModeContext {
  const ModeSettings& settings;
  comm::Communicator& comm;
  std::span<const float> initial;  ///< the parameters every rank starts from (the same everywhere)
  const optim::OptimizerConfig& optimizer_config;
  const ModeResume& resume;
};

/// One row of the modes' table.
struct ModeEntry {
  ModeKind kind;
  std::string_view name;     ///< --mode's value, the summary's "mode"
  std::string_view summary;  ///< a few words for --help
  ModeTraits traits;
  Result<std::unique_ptr<Mode>> (*make)(const ModeContext& context);
};

/// Every mode, in ModeKind order.
std::span<const ModeEntry> mode_table();
const ModeEntry& mode_entry(ModeKind kind);
/// The mode called `name`; an error naming --mode and the modes otherwise.
Result<ModeKind> parse_mode(std::string_view name);
/// "sync, localsgd, asgd or cfmo", from the table.
std::string mode_names();

/// The mode for `settings.kind`; `comm` is null for a single worker.
/// `initial` is the parameters every rank starts from (the same everywhere).
Result<std::unique_ptr<Mode>> make_mode(const ModeSettings& settings, comm::Communicator* comm,
                                        const std::vector<model::ParamInfo>& layout, std::span<const float> initial,
                                        const optim::OptimizerConfig& optimizer_config, const ModeResume& resume = {});

/// The owners' count by default: at most this many shards (see owner_count).
inline constexpr int kDefaultOwners = 16;

/// K, the shards of cfmo and asgd on `world` ranks: `settings.owners`, or
/// min(world, kDefaultOwners), never more than `world`. Each worker sends K
/// messages a round and talks to K owners, not W (a round of W workers is
/// W*K messages, not W^2); each owner still hears from every worker, so it
/// carries W/K times a worker's traffic. Why 16: a shard of a 124M-parameter
/// model is then 7.75M floats (15.5 MB in bf16, 1.2 ms at 100 Gb/s: the
/// microseconds of latency are nothing), up to 16 workers nothing changes,
/// and a simulated round of 4096 workers is 65k messages, not 16.7M (see
/// bench/RESULTS.md). Larger worlds of large models want more owners: their
/// links fill first (cfmo-train simulate shows it); --owners W is every rank.
int owner_count(const ModeSettings& settings, int world);

/// The W contiguous shards of a flat vector of `size` floats, on 16-float
/// boundaries: shard j is [bounds[j], bounds[j + 1]).
std::vector<size_t> shard_bounds(size_t size, int shards);

}  // namespace cfmo::train
