// The dispatch/combine engines: alone, and over real UCX between forked
// ranks, against the single-process reference and against each other.
#include "comm/rendezvous.h"
#include "comm/solo_communicator.h"
#include "comm/ucx_communicator.h"
#include "moe/benchmark.h"
#include "moe/dispatch_engines.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>

namespace cfmo::moe {
namespace {

struct Layer {
  int experts = 5;
  int64_t tokens = 37;
  int hidden = 16;
  int ffn = 8;
  int top_k = 2;
  double capacity_factor = 1.0;
  RoutingSkew skew{};
  comm::WireDtype dtype = comm::WireDtype::kFp32;
  LatePolicy late = LatePolicy::kResidual;
};

/// Everything one rank needs to run either engine on `layer`.
struct Rank {
  Rank(comm::Communicator& comm, const Layer& l)
      : router(3, l.hidden, l.experts, l.top_k, l.skew),
        inputs(make_inputs(3, comm.rank(), l.tokens, l.hidden, 6)),
        pacer(1, 0, 1, 3, comm.rank()) {
    const ExpertPlacement placement{l.experts, comm.size()};
    for (int e = placement.first(comm.rank()); e < placement.first(comm.rank() + 1); ++e) {
      experts.emplace_back(3, e, l.hidden, l.ffn);
    }
    setup.comm = &comm;
    setup.placement = placement;
    setup.router = &router;
    setup.experts = &experts;
    setup.inputs = &inputs;
    setup.pacer = &pacer;
    setup.top_k = l.top_k;
    setup.capacity = expert_capacity(l.tokens, l.top_k, l.experts, l.capacity_factor);
    setup.dtype = l.dtype;
    setup.late_policy = l.late;
  }
  Router router;
  InputPool inputs;
  Pacer pacer;
  std::vector<ExpertFfn> experts;
  EngineSetup setup;
};

RunSettings settings_for(const std::string& mode, const Layer& layer) {
  RunSettings s;
  s.mode = mode;
  s.experts = layer.experts;
  s.dtype = layer.dtype == comm::WireDtype::kBf16 ? "bf16" : "fp32";
  return s;
}

/// Runs sync, then async with no deadline, on one rank; true when both
/// match the reference exactly and each other bit for bit.
bool sync_and_async_agree(comm::Communicator& comm, const Layer& layer, std::string& why) {
  Rank rank(comm, layer);
  AsyncEngine engine(comm);
  auto sync = run_sync(rank.setup, 0, 4);
  if (!sync) return why = sync.error().message, false;
  auto async = engine.run(rank.setup, 0, 4, 0);
  if (!async) return why = async.error().message, false;
  const CheckValues check = reference_check(rank.setup, 3, layer.ffn, 3, *sync);
  if (!check.done || check.max_abs_err != 0)
    return why = fmt::format("sync vs reference: {}", check.max_abs_err), false;
  if (async->last_output != sync->last_output) return why = "async differs from sync", false;
  if (async->late != 0) return why = "late results with no deadline", false;
  if (sync->tokens != 4 * layer.tokens || sync->iterations != 4) return why = "wrong counts", false;
  auto summary = summarize(comm, settings_for("sync", layer), *sync, check);
  if (!summary || summary->check != "pass") return why = "summary check", false;
  return true;
}

TEST(MoeEngine, OneRankSyncAndAsyncEqualTheReference) {
  auto comm = comm::make_solo_communicator();
  for (const Layer& layer : {Layer{}, Layer{.skew = {RoutingSkew::Kind::kZipf, 1.5}},
                             Layer{.capacity_factor = 4, .dtype = comm::WireDtype::kBf16}, Layer{.ffn = 0}}) {
    std::string why;
    EXPECT_TRUE(sync_and_async_agree(*comm, layer, why)) << why;
  }
}

TEST(MoeEngine, CapacityDropsAreCountedAndTakeTheResidualPath) {
  auto comm = comm::make_solo_communicator();
  Layer layer;
  layer.skew = {RoutingSkew::Kind::kHot, 1.0};
  layer.capacity_factor = 0.5;
  Rank rank(*comm, layer);
  auto record = run_sync(rank.setup, 0, 1);
  ASSERT_TRUE(record);
  // Every token's first choice is expert 0, which has ceil(0.5 * 2 * 37 / 5) = 8 slots.
  EXPECT_EQ(expert_capacity(37, 2, 5, 0.5), 8);
  EXPECT_GE(record->dropped, 37 - 8);
  const CheckValues check = reference_check(rank.setup, 3, layer.ffn, 0, *record);
  EXPECT_EQ(check.max_abs_err, 0);
}

// Forks `size` ranks that meet over UCX; each runs body and exits 0 on success.
std::vector<int> run_ranks(int size, const std::function<bool(comm::Communicator&, std::string&)>& body) {
  auto listener = comm::listen_tcp("127.0.0.1", 0);
  EXPECT_TRUE(listener);
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (rank != 0) close(listener->first);
      comm::RendezvousConfig config;
      config.port = listener->second;
      config.listen_fd = rank == 0 ? listener->first : -1;
      config.timeout_s = 30;
      auto comm = comm::connect_ucx(rank, size, config);
      if (!comm) _exit(10);
      std::string why;
      const bool ok = body(**comm, why);
      if (!ok) fprintf(stderr, "rank %d: %s\n", rank, why.c_str());
      comm->reset();
      fflush(stderr);
      _exit(ok ? 0 : 11);
    }
    children.push_back(pid);
  }
  close(listener->first);
  std::vector<int> codes;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

TEST(MoeEngine, ThreeRanksOverUcxEqualTheReferenceAndEachOther) {
  auto codes = run_ranks(3, [](comm::Communicator& comm, std::string& why) {
    for (const Layer& layer : {Layer{}, Layer{.experts = 2, .top_k = 1}, Layer{.skew = {RoutingSkew::Kind::kZipf, 2}},
                               Layer{.tokens = 300, .dtype = comm::WireDtype::kBf16}}) {
      if (!sync_and_async_agree(comm, layer, why)) return false;
    }
    return true;
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST(MoeEngine, AsyncWithATinyDeadlineCountsLateTokensAndStaysCorrectForTheRest) {
  auto codes = run_ranks(2, [](comm::Communicator& comm, std::string& why) {
    Layer layer;
    layer.late = LatePolicy::kStale;
    layer.tokens = 200;
    layer.ffn = 64;
    Rank rank(comm, layer);
    // Rank 1 computes 20x slower, so rank 0's results from it miss a 1 us deadline.
    Pacer slow(comm.rank() == 1 ? 20 : 1, 0, 1, 3, comm.rank());
    rank.setup.pacer = &slow;
    AsyncEngine engine(comm);
    auto record = engine.run(rank.setup, 0, 5, 1e-6);
    if (!record) return why = record.error().message, false;
    const CheckValues check = reference_check(rank.setup, 3, layer.ffn, 4, *record);
    if (check.ontime_max_abs_err != 0) return why = "on-time tokens differ from the reference", false;
    auto summary = summarize(comm, settings_for("async", layer), *record, check);
    if (!summary) return why = summary.error().message, false;
    if (summary->late_frac <= 0) return why = "nothing late", false;
    if (summary->check != "pass") return why = "check", false;
    return true;
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST(MoeEngine, AsyncSkipsChunksWhoseResultCouldOnlyBeLate) {
  auto codes = run_ranks(2, [](comm::Communicator& comm, std::string& why) {
    Layer layer;  // residual policy: a late result is never used
    layer.tokens = 200;
    layer.ffn = 64;
    Rank rank(comm, layer);
    Pacer slow(comm.rank() == 1 ? 20 : 1, 0, 1, 3, comm.rank());
    rank.setup.pacer = &slow;
    AsyncEngine engine(comm);
    // A 1 us deadline has passed before any chunk is served: each rank
    // skips the other's chunks instead of computing results nobody reads.
    auto record = engine.run(rank.setup, 0, 5, 1e-6);
    if (!record) return why = record.error().message, false;
    if (record->skipped_chunks == 0) return why = "no chunk skipped", false;
    if (record->late == 0) return why = "nothing late", false;
    const CheckValues check = reference_check(rank.setup, 3, layer.ffn, 4, *record);
    if (check.ontime_max_abs_err != 0) return why = "on-time tokens differ from the reference", false;
    // With no deadline every chunk is served and nothing is late.
    auto full = engine.run(rank.setup, 5, 3, 0);
    if (!full) return why = full.error().message, false;
    if (full->skipped_chunks != 0 || full->late != 0) return why = "skipped or late without a deadline", false;
    return true;
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

}  // namespace
}  // namespace cfmo::moe
