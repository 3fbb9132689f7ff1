#include "diverge/sources.h"

#include "core/atomic_file.h"
#include "unit/diverge_fixtures.h"

#include <gtest/gtest.h>

#include <limits>

namespace cfmo::diverge {
namespace {

namespace fs = std::filesystem;
using SourcesTest = testing::TempDirTest;

TEST(DeltaPathTest, SixDigitRoundsAndRankDirectories) {
  EXPECT_EQ(ckpt::delta_path("RUN", 3, 12), fs::path("RUN/deltas/rank-3/round-000012.cfd"));
  EXPECT_EQ(ckpt::delta_path("RUN", 0, 1234567), fs::path("RUN/deltas/rank-0/round-1234567.cfd"));
  auto parsed = parse_delta_path("RUN/deltas/rank-3/round-000012.cfd");
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->rank, 3);
  EXPECT_EQ(parsed->round, 12);
  EXPECT_FALSE(parse_delta_path("x/round-000012.cfd"));
  EXPECT_FALSE(parse_delta_path("RUN/deltas/rank-3/round-12.cfd.tmp.77"));
  EXPECT_FALSE(parse_delta_path("RUN/deltas/rank-3/round-x.cfd"));
  EXPECT_FALSE(parse_delta_path("RUN/deltas/rank-99999999999/round-1.cfd"));
}

TEST_F(SourcesTest, ListsARunDirectoryByRoundThenRankIgnoringOtherFiles) {
  const fs::path run = dir_ / "run";
  for (int rank : {1, 0}) {
    for (int64_t round : {2, 1, 10}) testing::write_run_delta(run, rank, round, testing::scaled_delta(0.01f));
  }
  ASSERT_TRUE(write_file_atomic(run / "deltas" / "rank-0" / "round-000003.cfd.tmp.1234", "partial"));
  ASSERT_TRUE(write_file_atomic(run / "deltas" / "rank-0" / "notes.txt", "x"));
  ASSERT_TRUE(write_file_atomic(run / "metrics.jsonl", "{}\n"));
  fs::create_directories(run / "deltas" / "rank-x");
  fs::create_directories(run / "deltas" / "rank-0" / "round-000004.cfd");  // a directory, not a delta

  auto all = list_deltas(run);
  ASSERT_TRUE(all) << all.error().message;
  std::vector<std::pair<int64_t, int>> order;
  for (const auto& d : *all) order.emplace_back(d.round, d.rank);
  EXPECT_EQ(order, (std::vector<std::pair<int64_t, int>>{{1, 0}, {1, 1}, {2, 0}, {2, 1}, {10, 0}, {10, 1}}));
  EXPECT_EQ((*all)[0].path, ckpt::delta_path(run, 0, 1));

  // The deltas directory and a rank directory name parts of the same run; a trailing slash is fine.
  EXPECT_EQ(list_deltas(run / "deltas")->size(), 6u);
  EXPECT_EQ(list_deltas((run / "deltas").string() + "/")->size(), 6u);
  auto rank1 = list_deltas(run / "deltas" / "rank-1");
  ASSERT_TRUE(rank1);
  EXPECT_EQ(rank1->size(), 3u);
  for (const auto& d : *rank1) EXPECT_EQ(d.rank, 1);
}

TEST_F(SourcesTest, MissingOrForeignDirectories) {
  auto missing = list_deltas(dir_ / "nowhere");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().kind, ErrorKind::kInput);
  EXPECT_NE(missing.error().message.find("nowhere"), std::string::npos);
  fs::create_directories(dir_ / "plain");
  auto plain = list_deltas(dir_ / "plain");
  ASSERT_FALSE(plain);
  EXPECT_NE(plain.error().message.find("not a run directory"), std::string::npos);
  auto allowed = list_deltas(dir_ / "plain", /*allow_missing=*/true);
  ASSERT_TRUE(allowed);
  EXPECT_TRUE(allowed->empty());
}

TEST(SelectionTest, RanksAndRounds) {
  auto ranks = parse_ranks({"0,2", "5"});
  ASSERT_TRUE(ranks);
  EXPECT_EQ(*ranks, (std::vector<int>{0, 2, 5}));
  for (const char* bad : {"", "x", "-1", "1,,2", "3000000000", "+1"}) {
    auto r = parse_ranks({bad});
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    EXPECT_NE(r.error().message.find("--rank"), std::string::npos);
  }
  auto rounds = parse_rounds({"7,5..9", "10..", "..4"});
  ASSERT_TRUE(rounds);
  ASSERT_EQ(rounds->size(), 4u);
  EXPECT_EQ((*rounds)[0].first, 7);
  EXPECT_EQ((*rounds)[0].last, 7);
  EXPECT_EQ((*rounds)[1].first, 5);
  EXPECT_EQ((*rounds)[1].last, 9);
  EXPECT_EQ((*rounds)[2].last, std::numeric_limits<int64_t>::max());
  EXPECT_EQ((*rounds)[3].first, 0);
  for (const char* bad : {"..", "9..5", "a..b", "5...", "1.5", "-3"}) {
    auto r = parse_rounds({bad});
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.error().message.find("--round"), std::string::npos);
  }

  Selection s;
  s.ranks = {1};
  s.rounds = {{3, 5}};
  EXPECT_TRUE(s.wants(1, 4));
  EXPECT_FALSE(s.wants(0, 4));
  EXPECT_FALSE(s.wants(1, 6));
}

TEST(SelectionTest, TensorGlobs) {
  Selection s;
  EXPECT_TRUE(s.wants_tensor("anything"));
  s.tensor_globs = {"layers.0.*", "*.bias"};
  EXPECT_TRUE(s.wants_tensor("layers.0.weight"));
  EXPECT_TRUE(s.wants_tensor("layers.2.bias"));
  EXPECT_FALSE(s.wants_tensor("layers.1.weight"));
  s.tensor_globs = {"layers.[12].weight"};
  EXPECT_TRUE(s.wants_tensor("layers.2.weight"));
  EXPECT_FALSE(s.wants_tensor("layers.0.weight"));
}

TEST(SelectionTest, LastCountsRoundsAfterTheOtherFilters) {
  std::vector<DeltaFileRef> deltas;
  for (int64_t round = 1; round <= 5; ++round) {
    for (int rank = 0; rank < 2; ++rank) deltas.push_back({"f", rank, round});
  }
  deltas.push_back({"f", 0, 6});  // rank 1 has not written round 6 yet
  Selection s;
  s.last = 2;
  auto picked = select_deltas(deltas, s);
  ASSERT_EQ(picked.size(), 3u);
  EXPECT_EQ(picked[0].round, 5);
  EXPECT_EQ(picked[2].round, 6);
  s.ranks = {1};
  picked = select_deltas(deltas, s);
  ASSERT_EQ(picked.size(), 2u);
  EXPECT_EQ(picked[0].round, 4);
  EXPECT_EQ(picked[1].round, 5);
  s = {};
  s.rounds = {{2, 3}};
  EXPECT_EQ(select_deltas(deltas, s).size(), 4u);
}

}  // namespace
}  // namespace cfmo::diverge
