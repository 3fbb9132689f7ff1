#include "moe/benchmark.h"

#include "core/heterogeneity.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

namespace cfmo::moe {

Result<Simulation> simulation_for(const MoeConfig& config, int rank, int ranks) {
  CFMO_ASSIGN_OR_RETURN(const Heterogeneity h, parse_heterogeneity(config.slowdown, config.straggler, rank, ranks));
  return Simulation{h.slowdown, h.straggler_p, h.straggler_factor};
}

CheckValues reference_check(const EngineSetup& s, uint64_t seed, int ffn, int64_t iteration, const RankRecord& record) {
  CheckValues check;
  const int hidden = s.inputs->hidden;
  const auto h = static_cast<size_t>(hidden);
  const Routing routing = route_iteration(s, iteration);
  // Every expert in one process: the same blocks (this rank's rows of each
  // expert, in token order) through the same encode, GEMM and decode.
  const ExpertPlacement all{s.placement.experts, 1};
  const DispatchPlan plan = plan_dispatch(routing, all);
  const float* x = s.inputs->batch(iteration);
  const int first_local = s.placement.first(s.comm->rank());
  const int local_count = s.placement.count(s.comm->rank());
  std::vector<const float*> rows(routing.expert.size(), nullptr);
  std::vector<float> decoded(routing.expert.size() * h);
  std::vector<std::vector<std::byte>> outputs(static_cast<size_t>(s.placement.experts));
  std::vector<float> scratch;
  size_t at = 0;
  const size_t bytes = row_bytes(s.dtype, hidden);
  for (int e = 0; e < s.placement.experts; ++e) {
    const uint32_t n = plan.counts[0][static_cast<size_t>(e)];
    const std::span<const int32_t> slots(plan.slots[0].data() + at, n);
    at += n;
    if (n == 0) continue;
    std::vector<std::byte> in;
    encode_rows(x, hidden, s.top_k, slots, s.dtype, in);
    auto& out = outputs[static_cast<size_t>(e)];
    out.resize(n * bytes);
    if (e >= first_local && e < first_local + local_count) {
      compute_block((*s.experts)[static_cast<size_t>(e - first_local)], in.data(), n, s.dtype, hidden, out.data(),
                    scratch);
    } else {
      ExpertFfn expert(seed, e, hidden, ffn);
      compute_block(expert, in.data(), n, s.dtype, hidden, out.data(), scratch);
    }
    locate_results(out, slots, s.dtype, hidden, decoded, rows);
  }
  std::vector<float> reference(static_cast<size_t>(routing.tokens) * h);
  combine(x, routing, rows, hidden, reference.data());
  if (record.last_output.size() != reference.size()) return check;
  for (int64_t t = 0; t < routing.tokens; ++t) {
    bool late = false;
    for (int j = 0; j < routing.top_k; ++j) {
      const auto a = static_cast<size_t>(t * routing.top_k + j);
      late |= a < record.last_late.size() && record.last_late[a] != 0;
    }
    for (size_t i = 0; i < h; ++i) {
      const size_t k = static_cast<size_t>(t) * h + i;
      const double ref = reference[k];
      const double err = std::abs(static_cast<double>(record.last_output[k]) - ref);
      check.max_abs_err = std::max(check.max_abs_err, err);
      if (!late) check.ontime_max_abs_err = std::max(check.ontime_max_abs_err, err);
      check.sq_err += err * err;
      check.sq_ref += ref * ref;
      check.ref_max_abs = std::max(check.ref_max_abs, std::abs(ref));
    }
  }
  check.done = true;
  return check;
}

namespace {

/// 1.5 times the median across ranks of each rank's median warmup round trip:
/// generous for the typical rank, without letting one slow rank set it.
Result<double> auto_deadline(comm::Communicator& comm, const RankRecord& warmup) {
  std::vector<float> medians(static_cast<size_t>(comm.size()), 0.0f);
  medians[static_cast<size_t>(comm.rank())] = static_cast<float>(percentile(warmup.roundtrip_us, 0.5));
  CFMO_TRY(comm.all_reduce_sum(medians));
  std::vector<double> values(medians.begin(), medians.end());
  return 1.5 * percentile(values, 0.5) * 1e-6;
}

}  // namespace

Result<std::vector<ModeSummary>> run_benchmark(const MoeConfig& config, const MoePlan& plan,
                                               const BenchmarkOptions& options) {
  comm::Communicator& comm = *options.comm;
  const int rank = comm.rank();
  const auto seed = static_cast<uint64_t>(config.seed);
  auto note = [&](const std::string& text) {
    if (options.note) options.note(text);
  };
  // Constructed on every rank before the first barrier, so its handler is in
  // place before any rank posts.
  AsyncEngine async_engine(comm);
  const ExpertPlacement placement{config.experts, comm.size()};
  const Router router(seed, config.hidden, config.experts, config.top_k, plan.routing);
  std::vector<ExpertFfn> experts;
  for (int e = placement.first(rank); e < placement.first(rank + 1); ++e) {
    experts.emplace_back(seed, e, config.hidden, config.ffn);
  }
  std::string device = "cpu";
  if (plan.device.is_cuda()) {
    if (!options.place_experts) {
      return make_error(ErrorKind::kInternal, "--device {}: no way to place the experts was given",
                        plan.device.to_string());
    }
    CFMO_ASSIGN_OR_RETURN(
        device, options.place_experts(experts, plan.device, options.local_rank >= 0 ? options.local_rank : rank));
  }
  auto experts_status = [&]() -> Status {
    for (ExpertFfn& e : experts) CFMO_TRY(e.take_status());
    return {};
  };
  std::vector<ModeSummary> summaries;
  for (const int64_t tokens : plan.sizes) {
    const InputPool inputs = make_inputs(seed, rank, tokens, config.hidden, config.warmup + config.iters);
    std::vector<float> sync_output;
    std::optional<double> sync_rate;
    for (const std::string& mode : plan.modes) {
      note(fmt::format("cfmo-moe: {} tokens per rank, {} mode: {} warmup + {} iterations", tokens, mode, config.warmup,
                       config.iters));
      Pacer pacer(options.simulation.slowdown, options.simulation.straggler_p, options.simulation.straggler_factor,
                  seed, rank);
      EngineSetup setup;
      setup.comm = &comm;
      setup.placement = placement;
      setup.router = &router;
      setup.experts = &experts;
      setup.inputs = &inputs;
      setup.pacer = &pacer;
      setup.top_k = config.top_k;
      setup.capacity = plan.drop_policy == DropPolicy::kDropless
                           ? -1
                           : expert_capacity(tokens, config.top_k, config.experts, config.capacity_factor);
      setup.dtype = plan.dtype;
      setup.late_policy = plan.late_policy;
      setup.in_flight = config.in_flight;
      RunSettings settings;
      settings.mode = mode;
      settings.tokens_per_rank = tokens;
      settings.experts = config.experts;
      settings.hidden = config.hidden;
      settings.ffn = config.ffn;
      settings.top_k = config.top_k;
      settings.in_flight = config.in_flight;
      settings.capacity_factor = config.capacity_factor;
      settings.capacity = setup.capacity;
      settings.drop_policy = config.drop_policy;
      settings.routing = to_string(plan.routing);
      settings.dtype = config.dtype;
      settings.late_policy = mode == "async" ? config.late_policy : "none";
      settings.warmup = config.warmup;
      settings.iters = config.iters;
      settings.slowdown = config.slowdown;
      settings.straggler = config.straggler;
      settings.device = device;

      RankRecord record;
      if (mode == "sync") {
        if (config.warmup > 0) CFMO_TRY(run_sync(setup, 0, config.warmup));
        CFMO_ASSIGN_OR_RETURN(record, run_sync(setup, config.warmup, config.iters));
      } else {
        double deadline = plan.deadline_s;
        if (config.warmup > 0) {
          CFMO_ASSIGN_OR_RETURN(const RankRecord warm, async_engine.run(setup, 0, config.warmup, 0));
          if (deadline < 0) {
            CFMO_ASSIGN_OR_RETURN(deadline, auto_deadline(comm, warm));
          }
        }
        settings.deadline_s = std::max(0.0, deadline);
        CFMO_ASSIGN_OR_RETURN(record, async_engine.run(setup, config.warmup, config.iters, settings.deadline_s));
      }
      CFMO_TRY(experts_status());  // a device failure in any block of the run
      CheckValues check;
      if (config.check) check = reference_check(setup, seed, config.ffn, record.last_iteration, record);
      CFMO_ASSIGN_OR_RETURN(ModeSummary summary, summarize(comm, settings, record, check));
      if (mode == "sync") {
        sync_output = record.last_output;
        sync_rate = summary.tokens_per_s;
      } else if (sync_rate) {
        CFMO_ASSIGN_OR_RETURN(const double rel, global_relative_error(comm, record.last_output, sync_output));
        summary.rel_err_vs_sync = rel;
        if (*sync_rate > 0) summary.speedup_vs_sync = summary.tokens_per_s / *sync_rate;
      }
      summaries.push_back(std::move(summary));
    }
  }
  CFMO_TRY(comm.barrier());
  return summaries;
}

}  // namespace cfmo::moe
