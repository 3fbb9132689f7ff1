// Drives the real cfmo-moe binary: its documented contract (--help, man page
// and conf/moe.toml agree; flags, files, exit statuses), its reports, sync
// and async against the reference over several local ranks, and a dead peer.
#include "integration/harness.h"
#include "integration/man_page.h"

#include "core/atomic_file.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>

namespace cfmo {
namespace {

using testing::run;
using testing::RunResult;
using testing::TempDir;
namespace fs = std::filesystem;

std::string binary() { return testing::env_or("CFMO_MOE", "build/tools/cfmo-moe"); }
fs::path source_root() { return testing::env_or("CFMO_SOURCE_ROOT", "."); }

// Small and quick: the layer's arithmetic is the same at any size.
std::vector<std::string> quick(std::vector<std::string> extra) {
  std::vector<std::string> args = {binary(),    "--tokens", "64",       "--hidden", "32",      "--ffn", "48",
                                   "--experts", "6",        "--warmup", "2",        "--iters", "4",     "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::set<std::string> matches(const std::string& text, const std::regex& pattern) {
  std::set<std::string> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it) {
    out.insert((*it)[1]);
  }
  return out;
}

nlohmann::json rows_of(const RunResult& r) {
  EXPECT_EQ(r.status, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_array()) << r.out;
  return j.is_array() ? j : nlohmann::json::array();
}

TEST(CfmoMoeCli, HelpManPageAndConfigListTheSameOptions) {
  const RunResult help = run({binary(), "--help"});
  ASSERT_EQ(help.status, 0);
  const auto help_flags = matches(help.out, std::regex(R"((--[a-z][a-z0-9-]*))"));
  const std::string man = slurp(source_root() / "man/cfmo-moe.1.scd");
  ASSERT_FALSE(man.empty());
  const auto man_flags = matches(man, std::regex(R"(\*(--[a-z][a-z0-9-]*)\*)"));
  for (const auto& f : help_flags) EXPECT_TRUE(man_flags.count(f)) << f << " is in --help but not in the man page";
  for (const auto& f : man_flags) EXPECT_TRUE(help_flags.count(f)) << f << " is in the man page but not in --help";
  for (const char* section : {"# EXIT STATUS", "# FILES", "# ENVIRONMENT", "# EXAMPLES", "srun", "mpirun"}) {
    EXPECT_NE(man.find(section), std::string::npos) << section;
  }
  const RunResult printed = run({binary(), "--print-config"});
  ASSERT_EQ(printed.status, 0) << printed.err;
  const std::regex key(R"((?:^|\n)([a-z_0-9]+) = )");
  EXPECT_EQ(matches(printed.out, key), matches(slurp(source_root() / "conf/moe.toml"), key));
  const RunResult loaded = run({binary(), "--config", (source_root() / "conf/moe.toml").string(), "--print-config"});
  EXPECT_EQ(loaded.status, 0) << loaded.err;
  EXPECT_EQ(loaded.out, printed.out);
}

TEST(CfmoMoeCli, GeneratedManPageIsCurrent) { testing::expect_generated_man_page_current(source_root(), "cfmo-moe"); }

TEST(CfmoMoeCli, FlagsOverrideTheFileWhichOverridesDefaults) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir / "c.toml", "experts = 8\ntop_k = 3\nmode = \"async\"\n"));
  const RunResult r = run({binary(), "--config", (dir / "c.toml").string(), "--top-k", "1", "--print-config"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\nexperts = 8\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\ntop_k = 1\n"), std::string::npos);
  EXPECT_NE(r.out.find("\nmode = 'async'\n"), std::string::npos);
  EXPECT_NE(r.out.find("\nhidden = 512\n"), std::string::npos);
}

TEST(CfmoMoeCli, BadFlagsAndValuesExitTwoWithOneLine) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir / "unknown.toml", "experts = 4\nexpert_count = 4\n"));
  ASSERT_TRUE(write_file_atomic(dir / "type.toml", "seed = \"many\"\n"));
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--config", (dir / "unknown.toml").string()}, "expert_count"},
      {{"--config", (dir / "type.toml").string()}, "seed"},
      {{"--config", (dir / "missing.toml").string()}, "missing.toml"},
      {{"--top-k", "7"}, "--top-k"},
      {{"--mode", "fast"}, "fast"},
      {{"--routing", "zipf:-1"}, "zipf:-1"},
      {{"--drop-policy", "some"}, "--drop-policy"},
      {{"--dtype", "int8"}, "--dtype"},
      {{"--deadline", "soon"}, "--deadline"},
      {{"--late-policy", "never"}, "--late-policy"},
      {{"--sweep", "8:4"}, "--sweep"},
      {{"--capacity-factor", "0"}, "--capacity-factor"},
      {{"--format", "xml"}, "--format"},
      {{"--iters", "0"}, "--iters"},
      {{"--slowdown", "1=0.5"}, "--slowdown"},
      {{"--ranks", "2", "--slowdown", "5=2"}, "5=2"},
      {{"--straggler", "2:3"}, "--straggler"},
  };
  for (const auto& [extra, needle] : cases) {
    const RunResult r = run(quick(extra));
    EXPECT_EQ(r.status, 2) << needle << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  // cfmo-moe has ranks, not workers (issue 19).
  const RunResult beyond = run(quick({"--ranks", "2", "--slowdown", "5=2"}));
  EXPECT_NE(beyond.err.find("no rank 5 in a run of 2 ranks"), std::string::npos) << beyond.err;
  EXPECT_EQ(beyond.err.find("worker"), std::string::npos) << beyond.err;
  EXPECT_EQ(run(quick({"--tokens", "lots"})).status, 2);
  EXPECT_EQ(run(quick({"--no-such-flag"})).status, 2);
  const RunResult world = run(quick({}), 60, {"RANK=0", "WORLD_SIZE=2"});
  EXPECT_EQ(world.status, 2) << world.err;
  EXPECT_NE(world.err.find("CFMO_RENDEZVOUS"), std::string::npos) << world.err;
  EXPECT_EQ(run(quick({}), 60, {"RANK=3", "WORLD_SIZE=2"}).status, 2);
}

TEST(CfmoMoeCli, OneRankReportsEveryFormat) {
  const auto rows = rows_of(run(quick({"--mode", "both", "--format", "json"})));
  ASSERT_EQ(rows.size(), 2u);
  for (const char* key : {"mode", "tokens_per_s", "dispatch_p50_us", "dispatch_p99_us", "combine_p50_us",
                          "combine_p99_us", "algbw_gbps", "busbw_gbps", "dropped_frac", "late_frac", "check",
                          "imbalance", "overlap_share", "staleness_mean", "dispatch_min_us", "dispatch_max_us"}) {
    EXPECT_TRUE(rows[0].contains(key)) << key;
  }
  EXPECT_EQ(rows[0]["mode"], "sync");
  EXPECT_EQ(rows[1]["mode"], "async");
  EXPECT_EQ(rows[0]["check"], "pass");
  EXPECT_EQ(rows[1]["check"], "pass");
  EXPECT_TRUE(rows[1]["speedup_vs_sync"].is_number());

  const RunResult csv = run(quick({"--format", "csv", "--sweep", "16,32"}));
  ASSERT_EQ(csv.status, 0) << csv.err;
  std::istringstream lines(csv.out);
  std::string header;
  std::getline(lines, header);
  EXPECT_EQ(header.rfind("mode,ranks,experts,tokens_per_rank", 0), 0u) << header;
  int data = 0;
  for (std::string line; std::getline(lines, line);) ++data;
  EXPECT_EQ(data, 2);

  const RunResult table = run(quick({"--routing", "hot:0.5", "--drop-policy", "dropless"}));
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("# cfmo-moe: 1 ranks, 6 experts"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find(" pass "), std::string::npos) << table.out;
}

// Where no GPU can be used (CI), --device cuda is one line and exit 2 before
// any rank starts; where one can (the GPU machine), the experts run there and
// the output still equals the single-process reference.
TEST(CfmoMoeCli, DeviceCudaRunsOnTheGpuOrSaysThereIsNone) {
  const RunResult r = run(quick({"--device", "cuda", "--ranks", "2", "--mode", "both", "--format", "json"}), 240);
  if (r.status == 2) {
    EXPECT_NE(r.err.find("no CUDA device"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out, "");
    return;
  }
  const auto rows = rows_of(r);
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& row : rows) {
    EXPECT_EQ(row["check"], "pass") << row.dump();
    EXPECT_NE(row["device"].get<std::string>().find("cuda"), std::string::npos) << row.dump();
  }
}

TEST(CfmoMoeCli, SyncOverLocalRanksEqualsTheReference) {
  for (const char* dtype : {"fp32", "bf16"}) {
    const auto rows =
        rows_of(run(quick({"--ranks", "3", "--format", "json", "--routing", "zipf:1", "--dtype", dtype}), 240));
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_EQ(rows[0]["check"], "pass") << rows[0].dump();
    EXPECT_EQ(rows[0]["max_abs_err"], 0.0) << dtype;
    EXPECT_EQ(rows[0]["ranks"], 3);
    EXPECT_GT(rows[0]["dropped_frac"].get<double>(), 0.0);  // zipf overflows expert 0's capacity
    EXPECT_GT(rows[0]["bytes_per_peer"].get<double>(), 0.0);
  }
}

TEST(CfmoMoeCli, AsyncWithAGenerousDeadlineEqualsSync) {
  const auto rows = rows_of(
      run(quick({"--ranks", "3", "--mode", "both", "--deadline", "60s", "--format", "json", "--late-policy", "stale"}),
          240));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1]["late_frac"], 0.0);
  EXPECT_EQ(rows[1]["rel_err_vs_sync"], 0.0);
  EXPECT_EQ(rows[1]["check"], "pass");
  EXPECT_EQ(rows[0]["check"], "pass");
}

TEST(CfmoMoeCli, AsyncWithASlowRankAndATightDeadlineReportsLateTokens) {
  const auto rows = rows_of(run(quick({"--ranks", "2", "--mode", "async", "--deadline", "0.001ms", "--slowdown", "1=4",
                                       "--format", "json", "--ffn", "256"}),
                                240));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_GT(rows[0]["late_frac"].get<double>(), 0.0);
  EXPECT_EQ(rows[0]["check"], "pass");  // the tokens that made it equal the reference
  EXPECT_EQ(rows[0]["slowdown"][0], "1=4");
}

// Ranks started by hand, as a launcher would; one of them killed once the run is under way.
TEST(CfmoMoeCli, ADeadPeerEndsTheRunWithStatusFourNotAHang) {
  for (const char* mode : {"sync", "async"}) {
    SCOPED_TRACE(mode);
    TempDir dir;
    const std::string rendezvous = "CFMO_RENDEZVOUS=127.0.0.1:" + std::to_string(testing::free_port());
    std::vector<testing::Background> ranks;
    for (int r = 0; r < 3; ++r) {
      std::vector<std::string> args = {
          binary(), "--tokens", "64",      "--hidden", "32", "--ffn",          "48", "--experts",  "6",  "--warmup",
          "1",      "--iters",  "1000000", "--mode",   mode, "--peer-timeout", "3",  "--deadline", "60s"};
      ranks.push_back(testing::spawn(args, {"RANK=" + std::to_string(r), "WORLD_SIZE=3", rendezvous},
                                     (dir / fmt::format("out{}", r)).string(),
                                     (dir / fmt::format("err{}", r)).string()));
    }
    // Rank 0 names the mode once every rank has connected.
    bool started = false;
    for (int i = 0; i < 1200 && !started; ++i) {
      started = slurp(dir / "err0").find("mode") != std::string::npos;
      if (!started) usleep(50000);
    }
    ASSERT_TRUE(started) << slurp(dir / "err0");
    usleep(300000);
    kill(ranks[1].pid, SIGKILL);
    for (int r : {0, 2}) {
      const bool ended = ranks[static_cast<size_t>(r)].wait(60);
      EXPECT_TRUE(ended) << "rank " << r << " hangs";
      if (!ended) continue;
      const std::string err = slurp(dir / fmt::format("err{}", r));
      EXPECT_EQ(ranks[static_cast<size_t>(r)].status, 4) << err;
      EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
    }
    for (auto& b : ranks) b.reap();
  }
}

}  // namespace
}  // namespace cfmo
