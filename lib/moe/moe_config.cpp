#include "moe/moe_config.h"

#include <charconv>

namespace cfmo::moe {
namespace {

Error usage(std::string_view flag, std::string_view what) {
  return make_error(ErrorKind::kUsage, "--{}: {}", flag, what);
}

bool parse_int(std::string_view text, int64_t& out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

void add_moe_options(OptionTable& t, MoeConfig& c) {
  const std::string layer = "Layer";
  t.add("experts", &c.experts, "number of experts, spread over the ranks in contiguous blocks", layer);
  t.add("tokens", &c.tokens, "tokens per rank per iteration", layer);
  t.add("hidden", &c.hidden, "hidden size: floats per token", layer);
  t.add("ffn", &c.ffn, "expert FFN inner size (relu(x W1) W2 by BLAS on the expert's rank); 0: identity experts",
        layer);
  t.add("top_k", &c.top_k, "experts per token", layer);
  t.add("capacity_factor", &c.capacity_factor,
        "slots per expert per source rank = ceil(factor * top_k * tokens / experts)", layer);
  t.add("drop_policy", &c.drop_policy, "over capacity: residual (the token skips that expert) or dropless", layer);
  t.add("routing", &c.routing, "router skew: uniform, balanced, zipf:S or hot:F", layer);
  t.add("dtype", &c.dtype, "payload on the wire: fp32 or bf16", layer);
  t.add("seed", &c.seed, "seed for hidden states, router and expert weights", layer);
  const std::string run = "Run";
  t.add("mode", &c.mode, "sync, async or both (the same inputs, sync then async, and their ratio)", run);
  t.add("warmup", &c.warmup, "iterations before measuring", run);
  t.add("iters", &c.iters, "measured iterations", run);
  t.add("sweep", &c.sweep, "tokens per rank to run, overriding --tokens: N,N,... or MIN:MAX (doubling)", run);
  t.add("deadline", &c.deadline,
        "async: how long an iteration waits for remote results (a duration, or auto: 1.5x the warmup's median)", run);
  t.add("late_policy", &c.late_policy,
        "async: a late token takes its residual path (residual) or its slot's last result (stale)", run);
  t.add("in_flight", &c.in_flight, "async: iterations (micro-batches) in flight at once", run);
  t.add("check", &c.check, "check the last iteration's output against a single-process reference", run);
  t.add("threads", &c.threads, "BLAS threads per rank", run);
  t.add("device", &c.device, "where the experts' GEMMs run: cpu, cuda (each rank its local GPU) or cuda:N", run);
  const std::string ranks = "Ranks";
  t.add("ranks", &c.ranks, "start N ranks on this host (under a launcher, the launcher decides)", ranks);
  t.add("slowdown", &c.slowdown,
        "simulate a slower rank: RANK=FACTOR, repeatable (its compute takes FACTOR times as long)", ranks);
  t.add("straggler", &c.straggler,
        "simulate stragglers: P:FACTOR, an iteration's compute takes FACTOR times as long with probability P", ranks);
  t.add("rendezvous", &c.rendezvous, "rank 0's address host:port under an external launcher (or CFMO_RENDEZVOUS)",
        ranks);
  t.add("peer_timeout", &c.peer_timeout, "seconds of silence after which a peer is lost (exit status 4)", ranks);
  const std::string output = "Output";
  t.add("format", &c.format, "table, json or csv", output);
  t.add("quiet", &c.quiet, "no progress lines on stderr", output);
}

Result<std::vector<int64_t>> parse_sweep(const std::string& text) {
  auto bad = [&] {
    return make_error(ErrorKind::kUsage, "--sweep '{}': expected N,N,... or MIN:MAX with 1 <= MIN <= MAX", text);
  };
  std::vector<int64_t> sizes;
  if (const auto colon = text.find(':'); colon != std::string::npos) {
    int64_t low = 0;
    int64_t high = 0;
    if (!parse_int(std::string_view(text).substr(0, colon), low) ||
        !parse_int(std::string_view(text).substr(colon + 1), high) || low < 1 || high < low) {
      return bad();
    }
    for (int64_t n = low; n <= high; n *= 2) sizes.push_back(n);
    return sizes;
  }
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    int64_t n = 0;
    if (!parse_int(std::string_view(text).substr(start, comma == std::string::npos ? std::string::npos : comma - start),
                   n) ||
        n < 1) {
      return bad();
    }
    sizes.push_back(n);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return sizes;
}

Result<MoePlan> validate(const MoeConfig& c) {
  MoePlan plan;
  if (c.experts < 1 || c.experts > 4096) return usage("experts", "must be in 1..4096");
  if (c.tokens < 1 || c.tokens > (int64_t{1} << 24)) return usage("tokens", "must be in 1..16777216");
  if (c.hidden < 1 || c.hidden > 65536) return usage("hidden", "must be in 1..65536");
  if (c.ffn < 0 || c.ffn > 262144) return usage("ffn", "must be in 0..262144");
  if (c.top_k < 1 || c.top_k > c.experts) return usage("top-k", fmt::format("must be in 1..{} (--experts)", c.experts));
  if (!(c.capacity_factor > 0) || c.capacity_factor > 1e6) return usage("capacity-factor", "must be > 0");
  CFMO_ASSIGN_OR_RETURN(plan.drop_policy, parse_drop_policy(c.drop_policy));
  CFMO_ASSIGN_OR_RETURN(plan.routing, parse_routing(c.routing));
  if (c.dtype == "fp32") {
    plan.dtype = comm::WireDtype::kFp32;
  } else if (c.dtype == "bf16") {
    plan.dtype = comm::WireDtype::kBf16;
  } else {
    return usage("dtype", fmt::format("'{}': expected fp32 or bf16", c.dtype));
  }
  if (c.seed < 0) return usage("seed", "must be >= 0");
  if (c.mode == "sync" || c.mode == "async") {
    plan.modes = {c.mode};
  } else if (c.mode == "both") {
    plan.modes = {"sync", "async"};
  } else {
    return usage("mode", fmt::format("'{}': expected sync, async or both", c.mode));
  }
  if (c.warmup < 0 || c.warmup > 1'000'000) return usage("warmup", "must be in 0..1000000");
  if (c.iters < 1 || c.iters > 1'000'000) return usage("iters", "must be in 1..1000000");
  if (c.sweep.empty()) {
    plan.sizes = {c.tokens};
  } else {
    CFMO_ASSIGN_OR_RETURN(plan.sizes, parse_sweep(c.sweep));
    for (int64_t n : plan.sizes) {
      if (n > (int64_t{1} << 24)) return usage("sweep", "tokens per rank must be at most 16777216");
    }
  }
  if (c.deadline == "auto") {
    plan.deadline_s = -1;
  } else {
    auto seconds = parse_duration(c.deadline);
    if (!seconds) return usage("deadline", seconds.error().message + ", or auto");
    if (!(*seconds > 0)) return usage("deadline", "must be > 0, or auto");
    plan.deadline_s = *seconds;
  }
  if (c.late_policy == "residual") {
    plan.late_policy = LatePolicy::kResidual;
  } else if (c.late_policy == "stale") {
    plan.late_policy = LatePolicy::kStale;
  } else {
    return usage("late-policy", fmt::format("'{}': expected residual or stale", c.late_policy));
  }
  if (c.in_flight < 1 || c.in_flight > 64) return usage("in-flight", "must be in 1..64");
  if (c.threads < 1 || c.threads > 1024) return usage("threads", "must be in 1..1024");
  CFMO_ASSIGN_OR_RETURN(plan.device, tensor::parse_device(c.device));
  if (c.ranks < 1 || c.ranks > 1024) return usage("ranks", "must be in 1..1024");
  if (!(c.peer_timeout > 0)) return usage("peer-timeout", "must be positive");
  if (c.format != "table" && c.format != "json" && c.format != "csv") {
    return usage("format", fmt::format("'{}': expected table, json or csv", c.format));
  }
  return plan;
}

}  // namespace cfmo::moe
