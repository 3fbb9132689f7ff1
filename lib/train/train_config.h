#pragma once
/// Everything a training run is configured by, as one struct whose fields
/// are both flags and TOML keys (see core/config.h), and the plan it is
/// checked into once (make_plan): the same settings as typed values, which
/// is what the trainer reads.

#include "comm/codec.h"
#include "core/config.h"
#include "core/error.h"
#include "core/heterogeneity.h"
#include "data/dataset.h"
#include "model/moe_options.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "tensor/device.h"
#include "train/modes.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cfmo::train {

struct TrainConfig {
  // data and model
  std::string data = data::kDefaultFashionMnistDir;
  std::string val_data;    ///< token data: validation from other files ("" = the last val_split of --data)
  double val_split = 0.1;  ///< token data: the share of the tokens that validates
  int vocab_size = 0;      ///< token data: 0 = 256 for text, 50257 for llm.c token files
  int64_t val_tokens = 0;  ///< token data: validate on the first N validation tokens (0: all)
  std::string model = "mlp:256,128";
  int64_t seed = 1;
  // Mixture of Experts (a GPT with experts=E)
  double aux_loss = 0.01;
  double z_loss = 0.001;
  double capacity_factor = 1.25;
  std::string drop_policy = "residual";
  bool expert_parallel = false;   ///< expert e lives on rank e mod workers only
  std::string dispatch = "sync";  ///< --expert-parallel's exchanges: sync (collectives) or async (to a deadline)
  std::string dispatch_deadline = "auto";  ///< async: auto (adaptive), none, or a duration
  // inner optimizer
  std::string optimizer = "adamw";
  double lr = 1e-3;
  double momentum = 0.9;
  bool nesterov = false;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int ns_steps = 5;
  double clip_grad_norm = 0.0;
  std::string schedule = "constant";
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  // length
  int64_t epochs = 10;
  int64_t steps = 0;
  int64_t tokens = 0;  ///< token data: a budget of training tokens shared by all workers (0: none)
  std::string time_limit;
  int batch_size = 64;
  int threads = 1;
  std::string device = "cpu";
  // workers and modes
  int workers = 1;
  std::string mode = "sync";
  int sync_interval = 10;
  double staleness_discount = 0.9;
  int max_staleness = 4;
  int owners = 0;  ///< cfmo, asgd: the shards' owners, K (0: owner_count's default)
  /// auto: avg for a GPT (a language model), nesterov for the MLP (make_plan).
  std::string outer_optimizer = "auto";
  double outer_lr = 0;  ///< 0: the outer step's own (1 with avg, 0.5 with nesterov)
  double outer_momentum = 0.8;
  int outer_warmup = 10;  ///< nesterov: rounds from plain averaging to outer_lr and outer_momentum
  std::string delta_dtype = "bf16";
  std::vector<std::string> slowdown;
  std::string straggler;
  std::string rendezvous;
  double peer_timeout = 10;
  bool elastic = false;            ///< sync: go on without a lost worker (cfmo and localsgd always do)
  bool keep_global_batch = false;  ///< sync --elastic: the survivors take a lost worker's share of each batch
  bool deterministic = false;      ///< cfmo: a fixed order of messages (bitwise reproducible, exact resume)
  std::string join;                ///< host:port of a running run's rank 0: take a lost rank's place there
  double join_timeout = 60;        ///< --join: seconds to ask there while nobody answers or no rank is free
  /// cfmo: owners answer by rounds (round) or each contribution at once (off).
  std::string reply_hold = "round";
  // output
  int64_t log_every = 100;
  int64_t sample_every = 0;  ///< a language model: print a short sample every N steps (0: never)
  std::string out;
  int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  bool quiet = false;
};

/// Registers every field of `config` in `table` with its help text.
void add_train_options(OptionTable& table, TrainConfig& config);

/// A TrainConfig checked, with its words parsed into what they name.
struct TrainPlan {
  ModeKind mode = ModeKind::kSync;
  OuterKind outer_optimizer = OuterKind::kNesterov;  ///< --outer-optimizer, auto resolved
  double outer_lr = 0.5;                             ///< --outer-lr, 0 resolved
  optim::OptimizerKind optimizer = optim::OptimizerKind::kAdamW;
  comm::WireDtype delta_dtype = comm::WireDtype::kBf16;
  optim::Schedule::Kind schedule = optim::Schedule::Kind::kConstant;
  tensor::Device device;
  double time_limit_s = 0;  ///< 0: no time limit
  int context = 0;          ///< the model's context (a language model); 0 for the MLP

  const ModeEntry& mode_entry() const { return cfmo::train::mode_entry(mode); }
  const ModeTraits& traits() const { return mode_entry().traits; }
};

/// Range and consistency checks, and the plan; errors are kUsage, one line
/// naming the flag.
Result<TrainPlan> make_plan(const TrainConfig& config);

/// make_plan's checks alone.
Status validate(const TrainConfig& config);

/// A joining worker's look at the run it is offered (--join, a restarted
/// rank): `run_config` is the run's configuration as rank 0 saved it (TOML,
/// OptionTable::to_toml), `own_config` this worker's. kUsage naming the first
/// flag they differ in; the flags that may differ are this process's own
/// (where it writes, how it logs, its threads, device, time limit, simulated
/// slowness, rendezvous, peer timeout).
Status check_join_fits(std::string_view run_config, std::string_view own_config);

/// Whether a run of `config` takes a joiner as a new rank when none is lost
/// (the world grows): the modes whose membership changes at run time (cfmo,
/// asgd; localsgd and sync with --elastic), not with --deterministic (a fixed
/// world's order) or --expert-parallel (experts placed by the world's size).
bool takes_new_ranks(const TrainConfig& config);

/// The run ends at its first lost rank (sync or localsgd without --elastic, not joining).
bool ends_at_a_loss(const TrainConfig& config);

/// A joiner of a run that started with `first_size` ranks (the world may have
/// grown since): its shard owners are the run's, K of the first world, not
/// of the world it joins (--owners set to that K).
void fit_owners_to_run(TrainConfig& config, int first_size);

/// The inner optimizer's settings from the config's flags.
optim::OptimizerConfig optimizer_config(const TrainConfig& config, optim::OptimizerKind kind);

/// How the model's Mixture-of-Experts layers train (--aux-loss, --z-loss,
/// --capacity-factor, --drop-policy, --dispatch, --dispatch-deadline), for
/// make_model; call after validate.
model::MoeOptions moe_options(const TrainConfig& config);

/// parse_heterogeneity (core/heterogeneity.h) of the config's --slowdown and --straggler for `rank`.
Result<Heterogeneity> heterogeneity_for(const TrainConfig& config, int rank);

}  // namespace cfmo::train
