#include "train/train_config.h"

#include "comm/rendezvous.h"
#include "model/factory.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "tensor/device.h"
#include "train/modes.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <limits>

namespace cfmo::train {

namespace {

/// --dispatch-deadline in seconds: < 0 auto, infinity none.
Result<double> parse_dispatch_deadline(const std::string& text) {
  if (text == "auto") return -1.0;
  if (text == "none") return std::numeric_limits<double>::infinity();
  auto seconds = parse_duration(text);
  if (!seconds) {
    return make_error(ErrorKind::kUsage, "--dispatch-deadline: {}, auto or none", seconds.error().message);
  }
  if (!(*seconds > 0)) return make_error(ErrorKind::kUsage, "--dispatch-deadline: must be > 0, auto or none");
  return *seconds;
}

/// --outer-optimizer, auto resolved by the model. A GPT takes plain
/// averaging: Nesterov's steady gain lr / (1 - mu) (2.5 with 0.5 / 0.8)
/// moves its dense parameters further than the workers' own AdamW steps
/// went, and cost the GPT's val_loss at equal tokens what avg does not
/// (bench/RESULTS.md, issue 15); the MLP keeps Nesterov, chosen on
/// Fashion-MNIST (cfmo-train(1), --outer-momentum).
Result<OuterKind> outer_kind_for(const std::string& text, bool language_model) {
  if (text == "auto") return language_model ? OuterKind::kAvg : OuterKind::kNesterov;
  auto kind = parse_outer_kind(text);
  if (!kind) return make_error(ErrorKind::kUsage, "--outer-optimizer: '{}' is not auto, avg or nesterov", text);
  return *kind;
}

}  // namespace

void add_train_options(OptionTable& t, TrainConfig& c) {
  const std::string data = "Data and model";
  t.add("data", &c.data,
        "Fashion-MNIST directory (IDX files, gzip or raw), synthetic[:TRAIN[:TEST]], text:FILE[,FILE...] (one token "
        "per byte) or tokens:GLOB (llm.c token shards)",
        data);
  t.add("val_data", &c.val_data, "token data: validation files, text:... or tokens:... (default: split --data)", data);
  t.add("val_split", &c.val_split, "token data: the last share of the tokens that validates, without --val-data", data);
  t.add("vocab_size", &c.vocab_size, "token data: the vocabulary (0: 256 for text, 50257 for token files)", data);
  t.add("val_tokens", &c.val_tokens, "token data: validate on the first N validation tokens only (0: all)", data);
  t.add("model", &c.model,
        "model: mlp:H1,H2,... (hidden layer widths; ReLU between layers) or gpt:layers=L,heads=H,dim=C,context=T "
        "(GPT-2), with experts=E,top_k=K[,expert_dim=D][,moe_every=M] a Mixture of Experts",
        data);
  t.add("seed", &c.seed, "seed for initialisation, data order and synthetic data", data);

  const std::string moe = "Mixture of Experts";
  t.add("aux_loss", &c.aux_loss, "coefficient of the load-balancing loss E sum_i f_i P_i (Switch)", moe);
  t.add("z_loss", &c.z_loss, "coefficient of the router z-loss, mean logsumexp(logits)^2 (ST-MoE)", moe);
  t.add("capacity_factor", &c.capacity_factor,
        "slots per expert per batch = ceil(factor * top_k * tokens / experts); assignments beyond take the residual",
        moe);
  t.add("drop_policy", &c.drop_policy, "over capacity: residual (the token skips that expert) or dropless", moe);
  t.add("expert_parallel", &c.expert_parallel,
        "expert e lives on worker e mod W only (its parameters and optimizer state); tokens travel to it and back",
        moe);
  t.add("dispatch", &c.dispatch,
        "--expert-parallel's exchanges: sync (every rank waits for every other's tokens) or async (results up to "
        "--dispatch-deadline; late tokens take the residual, their gradient is skipped)",
        moe);
  t.add("dispatch_deadline", &c.dispatch_deadline,
        "async dispatch: how long an exchange waits (a duration, e.g. 20ms), auto (1.5 x the median peer's median "
        "round trip of the first 4 steps) or none",
        moe);

  const std::string optim = "Optimizer";
  t.add("optimizer", &c.optimizer, "inner optimizer: sgd, adam, adamw or muon", optim);
  t.add("lr", &c.lr, "peak learning rate", optim);
  t.add("momentum", &c.momentum, "momentum for sgd and muon", optim);
  t.add("nesterov", &c.nesterov, "Nesterov momentum for sgd and muon", optim);
  t.add("beta1", &c.beta1, "Adam first-moment decay (adam, adamw, and muon's non-matrix parameters)", optim);
  t.add("beta2", &c.beta2, "Adam second-moment decay", optim);
  t.add("eps", &c.eps, "Adam epsilon", optim);
  t.add("weight_decay", &c.weight_decay, "weight decay: L2 for sgd and adam, decoupled for adamw and muon", optim);
  t.add("ns_steps", &c.ns_steps, "Newton-Schulz iterations per muon step", optim);
  t.add("clip_grad_norm", &c.clip_grad_norm, "clip the global gradient norm to this value (0: off)", optim);
  t.add("schedule", &c.schedule, "learning-rate schedule after warmup: constant or cosine", optim);
  t.add("warmup_steps", &c.warmup_steps, "linear warmup steps", optim);
  t.add("min_lr", &c.min_lr, "final learning rate of the cosine schedule", optim);

  const std::string length = "Length";
  t.add("epochs", &c.epochs, "stop after this many epochs (0: no epoch limit)", length);
  t.add("steps", &c.steps, "stop after this many steps in total (0: no step limit)", length);
  t.add("tokens", &c.tokens, "token data: stop after this many training tokens, all workers together (0: no limit)",
        length);
  t.add("time_limit", &c.time_limit, "stop after this long, e.g. 90s, 5m (empty: no time limit)", length);
  t.add("batch_size", &c.batch_size, "examples per step", length);
  t.add("threads", &c.threads, "BLAS threads", length);
  t.add("device", &c.device, "where each worker trains: cpu, cuda (each worker its local GPU) or cuda:N", length);

  const std::string dist = "Workers and modes";
  t.add("workers", &c.workers, "worker processes to start on this host (1: train in this process)", dist);
  std::string modes;
  for (const auto& m : mode_table()) modes += fmt::format("{}{} ({})", modes.empty() ? "" : ", ", m.name, m.summary);
  t.add("mode", &c.mode, "how workers reconcile: " + modes, dist);
  t.add("sync_interval", &c.sync_interval, "H: local steps between reconciliations (localsgd, cfmo)", dist);
  t.add("staleness_discount", &c.staleness_discount,
        "beta: a contribution s rounds stale is weighted beta^s; momentum after a rebase likewise (cfmo)", dist);
  t.add("max_staleness", &c.max_staleness,
        "cfmo: rounds after which a contribution is dropped; asgd: rounds of unanswered pushes before a worker waits",
        dist);
  t.add("owners", &c.owners,
        "cfmo, asgd: K, the ranks 0..K-1 that own the K shards of the global parameters (0: min(workers, 16))", dist);
  t.add("outer_optimizer", &c.outer_optimizer,
        "outer step on the deltas (localsgd, cfmo): nesterov (momentum once per round of W contributions), avg, or "
        "auto (avg for a gpt model, nesterov for the mlp)",
        dist);
  t.add("outer_lr", &c.outer_lr,
        "outer learning rate; 0: the outer step's own, 1 with avg, 0.5 with nesterov (DiLoCo: 0.7 with momentum 0.9)",
        dist);
  t.add("outer_momentum", &c.outer_momentum, "outer Nesterov momentum (DiLoCo's 0.9 is too much for cfmo: see BUGS)",
        dist);
  t.add("outer_warmup", &c.outer_warmup,
        "nesterov: rounds over which the outer step goes from plain averaging (lr 1, no momentum) to "
        "--outer-lr and --outer-momentum (0: none)",
        dist);
  t.add("reply_hold", &c.reply_hold,
        "cfmo: round (an owner answers a shard's contributions once every live rank's is in, or after 2 x "
        "--sync-interval of its own steps: fewer, larger rounds on a slow link) or off (each at once)",
        dist);
  t.add("delta_dtype", &c.delta_dtype, "deltas and gradients on the wire: fp32, bf16 or int8 (with error feedback)",
        dist);
  t.add("slowdown", &c.slowdown, "simulate a slower worker: RANK=FACTOR, repeatable (a sleep after each step)", dist);
  t.add("straggler", &c.straggler,
        "simulate stragglers: P:FACTOR, any step takes FACTOR times as long with probability P", dist);
  t.add("rendezvous", &c.rendezvous, "host:port where rank 0 listens (default: $CFMO_RENDEZVOUS)", dist);
  t.add("peer_timeout", &c.peer_timeout, "seconds of silence after which a peer is lost", dist);
  t.add("elastic", &c.elastic,
        "sync, localsgd: the workers left re-form the group without a lost one and go on (cfmo and asgd always do)",
        dist);
  t.add("keep_global_batch", &c.keep_global_batch,
        "sync --elastic: the workers left raise their batch to keep the global batch a lost worker shrank", dist);
  t.add("deterministic", &c.deterministic,
        "cfmo: owners apply each round in rank order and workers wait for its replies: bitwise reproducible runs "
        "and resumes, stopped by steps; a lost worker ends the run (sync and localsgd always are)",
        dist);
  t.add("join", &c.join,
        "host:port of a running run (its --rendezvous; after rank 0's loss, where the lowest live rank serves joins): "
        "take a lost rank's place there, or with none lost a new rank's (the run grows), with the run's flags "
        "(cfmo, asgd, sync or localsgd with --elastic)",
        dist);
  t.add("join_timeout", &c.join_timeout,
        "--join: seconds to ask there while nobody answers (no run there: it ended, or has not started) or no rank "
        "is free; then exit 4",
        dist);

  const std::string output = "Output";
  t.add("log_every", &c.log_every, "log a metrics line every N steps", output);
  t.add("sample_every", &c.sample_every, "a language model: print a short sample of its text every N steps (0: never)",
        output);
  t.add("out", &c.out, "run directory for metrics.jsonl, checkpoints and the final model (empty: none)", output);
  t.add("checkpoint_every", &c.checkpoint_every, "also checkpoint every N steps (0: at epoch ends and the end only)",
        output);
  t.add("keep_checkpoints", &c.keep_checkpoints, "checkpoints kept in the run directory (the newest)", output);
  t.add("quiet", &c.quiet, "no progress bar or log lines on stderr", output);
}

Status validate(const TrainConfig& c) {
  CFMO_TRY(make_plan(c));
  return {};
}

Result<TrainPlan> make_plan(const TrainConfig& c) {
  TrainPlan plan;
  auto usage = [](std::string_view flag, std::string_view why) {
    return make_error(ErrorKind::kUsage, "--{}: {}", flag, why);
  };
  CFMO_TRY(model::check_model_spec(c.model));
  if (!(c.aux_loss >= 0) || !std::isfinite(c.aux_loss)) return usage("aux-loss", "must be >= 0");
  if (!(c.z_loss >= 0) || !std::isfinite(c.z_loss)) return usage("z-loss", "must be >= 0");
  if (!(c.capacity_factor > 0) || c.capacity_factor > 1e6) return usage("capacity-factor", "must be in (0, 1e6]");
  CFMO_TRY(moe::parse_drop_policy(c.drop_policy));
  if (c.expert_parallel) CFMO_TRY(model::check_expert_parallel(c.model, std::max(1, c.workers)));
  if (c.dispatch != "sync" && c.dispatch != "async") {
    return usage("dispatch", fmt::format("'{}' is not sync or async", c.dispatch));
  }
  CFMO_TRY(parse_dispatch_deadline(c.dispatch_deadline));
  if (c.dispatch == "async" && !c.expert_parallel) {
    return usage("dispatch", "async needs --expert-parallel (without it every worker holds every expert)");
  }
  CFMO_ASSIGN_OR_RETURN(plan.device, tensor::parse_device(c.device));
  plan.context = model::model_context(c.model);
  if (plan.device.is_cuda() && plan.context > 0) {
    return usage("device", fmt::format("{}: the CUDA engine does not run this model yet ({})", c.device, c.model));
  }
  CFMO_ASSIGN_OR_RETURN(plan.optimizer, optim::parse_optimizer_kind(c.optimizer));
  if (!(c.lr > 0) || !std::isfinite(c.lr)) return usage("lr", "must be a positive number");
  if (!(c.momentum >= 0 && c.momentum < 1)) return usage("momentum", "must be in [0, 1)");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return usage("beta1", "must be in [0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return usage("beta2", "must be in [0, 1)");
  if (!(c.eps > 0)) return usage("eps", "must be positive");
  if (!(c.weight_decay >= 0) || !std::isfinite(c.weight_decay)) return usage("weight-decay", "must be >= 0");
  if (c.ns_steps < 1 || c.ns_steps > 100) return usage("ns-steps", "must be in 1..100");
  if (!(c.clip_grad_norm >= 0)) return usage("clip-grad-norm", "must be >= 0");
  CFMO_ASSIGN_OR_RETURN(plan.schedule, optim::Schedule::parse_kind(c.schedule));
  if (c.warmup_steps < 0) return usage("warmup-steps", "must be >= 0");
  if (!(c.min_lr >= 0 && c.min_lr <= c.lr)) return usage("min-lr", "must be in [0, lr]");
  if (c.epochs < 0) return usage("epochs", "must be >= 0");
  if (c.steps < 0) return usage("steps", "must be >= 0");
  if (c.tokens < 0) return usage("tokens", "must be >= 0");
  if (!(c.val_split > 0 && c.val_split < 1)) return usage("val-split", "must be in (0, 1)");
  if (c.vocab_size < 0 || c.vocab_size > 1 << 24) return usage("vocab-size", "must be in 0..16777216");
  if (c.val_tokens < 0) return usage("val-tokens", "must be >= 0");
  if (!c.time_limit.empty()) {
    auto seconds = parse_duration(c.time_limit);
    if (!seconds) return usage("time-limit", seconds.error().message);
    if (!(*seconds > 0)) return usage("time-limit", "must be positive (leave it empty for no limit)");
    plan.time_limit_s = *seconds;
  }
  if (c.epochs == 0 && c.steps == 0 && c.tokens == 0 && c.time_limit.empty()) {
    return usage("epochs", "give --epochs, --steps, --tokens or --time-limit so the run ends");
  }
  if (plan.schedule == optim::Schedule::Kind::kCosine && c.epochs == 0 && c.steps == 0 && c.tokens == 0) {
    return usage("schedule", "cosine needs a known length: --epochs, --steps or --tokens");
  }
  if (c.batch_size < 1 || c.batch_size > 1 << 20) return usage("batch-size", "must be in 1..1048576");
  if (c.threads < 1 || c.threads > 1024) return usage("threads", "must be in 1..1024");
  if (c.workers < 1 || c.workers > 1024) return usage("workers", "must be in 1..1024");
  CFMO_ASSIGN_OR_RETURN(plan.mode, parse_mode(c.mode));
  if (c.expert_parallel && !plan.traits().lockstep) {
    // Sync dispatch is a collective of all ranks per MoE layer: workers that
    // step and stop on their own would wait in it for each other. Async
    // dispatch waits to a deadline, and only cfmo keeps the experts out of
    // its reconciliation (asgd's owners would step every rank's gradients).
    if (plan.mode != ModeKind::kCfmo) {
      return usage("expert-parallel", fmt::format("needs --mode sync, localsgd or cfmo, not {}", c.mode));
    }
    if (c.dispatch != "async") {
      return usage("expert-parallel", "--mode cfmo needs --dispatch async (sync dispatch is a collective every step)");
    }
    if (c.dispatch_deadline == "none") {
      return usage("dispatch-deadline", "none needs a lockstep --mode: cfmo's workers step and stop on their own");
    }
  }
  if (c.expert_parallel && c.elastic) {
    return usage("elastic", "not with --expert-parallel: a lost worker's experts exist nowhere else");
  }
  if (plan.traits().owners_optimize && plan.optimizer == optim::OptimizerKind::kMuon) {
    return usage("optimizer", "muon needs whole matrices; asgd's owners update shards: use sgd, adam or adamw");
  }
  if (c.sync_interval < 1) return usage("sync-interval", "must be >= 1");
  if (!(c.staleness_discount > 0 && c.staleness_discount <= 1)) return usage("staleness-discount", "must be in (0, 1]");
  if (c.max_staleness < 0) return usage("max-staleness", "must be >= 0");
  if (c.owners < 0) return usage("owners", "must be >= 0");
  CFMO_ASSIGN_OR_RETURN(plan.outer_optimizer, outer_kind_for(c.outer_optimizer, plan.context > 0));
  if (!(c.outer_lr >= 0) || !std::isfinite(c.outer_lr)) {
    return usage("outer-lr", "must be positive (or 0: the outer step's own)");
  }
  plan.outer_lr = c.outer_lr > 0 ? c.outer_lr : (plan.outer_optimizer == OuterKind::kAvg ? 1.0 : 0.5);
  if (!(c.outer_momentum >= 0 && c.outer_momentum < 1)) return usage("outer-momentum", "must be in [0, 1)");
  if (c.outer_warmup < 0) return usage("outer-warmup", "must be >= 0");
  auto dtype = comm::parse_wire_dtype(c.delta_dtype);
  if (!dtype) return usage("delta-dtype", fmt::format("'{}' is not fp32, bf16 or int8", c.delta_dtype));
  plan.delta_dtype = *dtype;
  if (c.reply_hold != "round" && c.reply_hold != "off") {
    return usage("reply-hold", fmt::format("'{}' is not round or off", c.reply_hold));
  }
  if (!(c.peer_timeout > 0)) return usage("peer-timeout", "must be positive");
  if (c.keep_global_batch && !c.elastic) return usage("keep-global-batch", "needs --elastic");
  if (c.deterministic && plan.traits().owners_optimize) {
    return usage("deterministic", "not in asgd: its owners apply each gradient as it arrives");
  }
  if (c.deterministic && plan.traits().asynchronous && !c.time_limit.empty()) {
    // Each cfmo worker would stop at its own step, and the rounds and
    // checkpoints every worker meets at would no longer be the same.
    return usage("deterministic", "stops by --steps, --epochs or --tokens, not --time-limit");
  }
  if (!(c.join_timeout > 0)) return usage("join-timeout", "must be positive");
  if (!c.join.empty()) {
    if (auto where = comm::parse_rendezvous(c.join); !where) return usage("join", where.error().message);
    if (!plan.traits().asynchronous && !c.elastic) {
      return usage("join", fmt::format("a worker joins a running run in --mode cfmo or asgd, or sync or localsgd "
                                       "with --elastic; not {}",
                                       c.mode));
    }
    if (c.deterministic) return usage("join", "a --deterministic run takes no joins: a lost worker ends it");
  }
  CFMO_TRY(heterogeneity_for(c, 0));
  if (c.log_every < 1) return usage("log-every", "must be >= 1");
  if (c.sample_every < 0) return usage("sample-every", "must be >= 0");
  if (c.checkpoint_every < 0) return usage("checkpoint-every", "must be >= 0");
  if (c.keep_checkpoints < 1) return usage("keep-checkpoints", "must be >= 1");
  return plan;
}

namespace {

/// "key = value" of each option in OptionTable::to_toml's text, in order.
std::vector<std::pair<std::string, std::string>> option_lines(std::string_view toml) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = 0;
  while (at < toml.size()) {
    size_t end = toml.find('\n', at);
    if (end == std::string_view::npos) end = toml.size();
    const std::string_view line = toml.substr(at, end - at);
    at = end + 1;
    const size_t eq = line.find(" = ");
    if (line.empty() || line.front() == '#' || eq == std::string_view::npos) continue;
    out.emplace_back(std::string(line.substr(0, eq)), std::string(line.substr(eq + 3)));
  }
  return out;
}

}  // namespace

bool takes_new_ranks(const TrainConfig& config) {
  const auto kind = parse_mode(config.mode);
  if (!kind || config.deterministic || config.expert_parallel) return false;
  const ModeTraits& traits = mode_entry(*kind).traits;
  return traits.asynchronous || (traits.lockstep && config.elastic);
}

bool ends_at_a_loss(const TrainConfig& config) {
  const auto kind = parse_mode(config.mode);
  return kind && !mode_entry(*kind).traits.asynchronous && !config.elastic && config.join.empty();
}

void fit_owners_to_run(TrainConfig& config, int first_size) {
  if (first_size < 1) return;
  ModeSettings settings;
  settings.owners = config.owners;
  config.owners = owner_count(settings, first_size);
}

Status check_join_fits(std::string_view run_config, std::string_view own_config) {
  // This process's own: where it writes and logs, how it computes, when it
  // stops on its own, whom it asks; everything else must be the run's.
  static constexpr std::string_view kOwn[] = {
      "out",          "quiet",  "log_every",    "sample_every", "checkpoint_every", "keep_checkpoints",
      "threads",      "device", "time_limit",   "slowdown",     "straggler",        "rendezvous",
      "peer_timeout", "join",   "join_timeout", "workers"};
  const auto theirs = option_lines(run_config);
  if (theirs.empty()) return make_error(ErrorKind::kPeer, "--join: the run sent no configuration");
  for (const auto& [key, value] : option_lines(own_config)) {
    if (std::find(std::begin(kOwn), std::end(kOwn), key) != std::end(kOwn)) continue;
    const auto it = std::find_if(theirs.begin(), theirs.end(), [&](const auto& kv) { return kv.first == key; });
    const std::string flag = OptionTable::flag_for(key);
    if (it == theirs.end()) {
      return make_error(ErrorKind::kUsage, "--join: the run knows no {} (another cfmo-train version?)", flag);
    }
    if (it->second != value) {
      return make_error(ErrorKind::kUsage, "--join: the run trains with {} {}, this worker was started with {} {}",
                        flag, it->second, flag, value);
    }
  }
  return {};
}

optim::OptimizerConfig optimizer_config(const TrainConfig& c, optim::OptimizerKind kind) {
  optim::OptimizerConfig o;
  o.kind = kind;
  o.momentum = c.momentum;
  o.nesterov = c.nesterov;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.weight_decay = c.weight_decay;
  o.ns_steps = c.ns_steps;
  return o;
}

model::MoeOptions moe_options(const TrainConfig& c) {
  model::MoeOptions o;
  o.aux_loss = c.aux_loss;
  o.z_loss = c.z_loss;
  o.capacity_factor = c.capacity_factor;
  const auto policy = moe::parse_drop_policy(c.drop_policy);
  if (policy) o.drop_policy = *policy;
  o.async_dispatch = c.dispatch == "async";
  const auto deadline = parse_dispatch_deadline(c.dispatch_deadline);
  if (deadline) o.dispatch_deadline_s = *deadline;
  return o;
}

Result<Heterogeneity> heterogeneity_for(const TrainConfig& c, int rank) {
  return parse_heterogeneity(c.slowdown, c.straggler, rank, c.workers);
}

}  // namespace cfmo::train
