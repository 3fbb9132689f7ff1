// cfmo's owners answering by rounds (train/modes/reply_hold.h): when a held
// reply becomes due. The protocol over the loopback transport is in
// test_train_mode_protocols.cpp (CfmoReplyHold).
#include "train/modes/reply_hold.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace cfmo::train::modes {
namespace {

using Due = ReplyHold::Due;

std::vector<int> to_ranks(const std::vector<Due>& due, int shard) {
  std::vector<int> out;
  for (const auto& d : due) {
    if (d.shard == shard) out.push_back(d.reply.to);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(ReplyHold, ARoundIsAnsweredOnceEveryRanksContributionIsIn) {
  ReplyHold hold(2, 3, 20, true);
  hold.tick(5);
  EXPECT_TRUE(hold.applied(0, {1, 0, false}).empty());
  EXPECT_TRUE(hold.applied(0, {0, 1, false}).empty());
  EXPECT_TRUE(hold.applied(1, {0, 0, false}).empty());  // another shard, its own round
  const auto due = hold.applied(0, {2, 0, true});
  EXPECT_EQ(to_ranks(due, 0), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(to_ranks(due, 1).empty());
  // What each contribution said comes back with its reply.
  for (const auto& d : due) {
    EXPECT_EQ(d.reply.staleness, d.reply.to == 0 ? 1 : 0);
    EXPECT_EQ(d.reply.dropped, d.reply.to == 2);
  }
  EXPECT_EQ(hold.whole_rounds(), 1);
  EXPECT_EQ(hold.cut_rounds(), 0);
  EXPECT_EQ(hold.held(), 2);  // the last waited for nobody
}

TEST(ReplyHold, AHeldReplyIsDueAfterTheBoundInTheOwnersSteps) {
  ReplyHold hold(1, 3, 20, true);
  hold.tick(10);
  EXPECT_TRUE(hold.applied(0, {1, 0, false}).empty());
  hold.tick(15);
  EXPECT_TRUE(hold.applied(0, {0, 0, false}).empty());
  EXPECT_TRUE(hold.tick(29).empty());  // 19 steps since the first
  const auto due = hold.tick(30);
  EXPECT_EQ(to_ranks(due, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(hold.cut_rounds(), 1);
  EXPECT_EQ(hold.held(), 2);
  EXPECT_EQ(hold.held_steps(), 40);
  // The late rank's contribution starts the next round.
  EXPECT_TRUE(hold.applied(0, {2, 0, false}).empty());
}

TEST(ReplyHold, AFinishedOrLostRankIsNoLongerWaitedFor) {
  ReplyHold hold(2, 3, 20, true);
  EXPECT_TRUE(hold.applied(0, {0, 0, false}).empty());
  EXPECT_TRUE(hold.applied(0, {1, 0, false}).empty());
  EXPECT_TRUE(hold.applied(1, {0, 0, false}).empty());
  const auto due = hold.finished(2);
  EXPECT_EQ(to_ranks(due, 0), (std::vector<int>{0, 1}));  // whole without rank 2
  EXPECT_TRUE(to_ranks(due, 1).empty());
  EXPECT_TRUE(hold.finished(2).empty());  // said twice: once
  EXPECT_EQ(to_ranks(hold.applied(1, {1, 0, false}), 1), (std::vector<int>{0, 1}));
  // Back (a join): rounds wait for it again.
  hold.rejoined(2);
  EXPECT_TRUE(hold.applied(0, {0, 0, false}).empty());
  EXPECT_TRUE(hold.applied(0, {1, 0, false}).empty());
  EXPECT_EQ(to_ranks(hold.applied(0, {2, 0, false}), 0), (std::vector<int>{0, 1, 2}));
}

TEST(ReplyHold, ASecondContributionOfOneRankAnswersTheRoundSoFarFirst) {
  ReplyHold hold(1, 3, 20, true);
  EXPECT_TRUE(hold.applied(0, {0, 0, false}).empty());
  EXPECT_TRUE(hold.applied(0, {1, 0, false}).empty());
  const auto due = hold.applied(0, {0, 0, false});
  EXPECT_EQ(to_ranks(due, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(hold.cut_rounds(), 1);
}

TEST(ReplyHold, ReleaseAllAnswersEverythingAndHoldsNothingAfter) {
  ReplyHold hold(2, 2, 20, true);
  EXPECT_TRUE(hold.applied(0, {0, 0, false}).empty());
  EXPECT_TRUE(hold.applied(1, {1, 0, false}).empty());
  const auto due = hold.release_all();
  EXPECT_EQ(to_ranks(due, 0), (std::vector<int>{0}));
  EXPECT_EQ(to_ranks(due, 1), (std::vector<int>{1}));
  EXPECT_FALSE(hold.holding());
  EXPECT_EQ(hold.applied(0, {1, 0, false}).size(), 1u);
}

TEST(ReplyHold, OffAnswersEachContributionAtOnce) {
  ReplyHold hold(1, 3, 20, false);
  EXPECT_EQ(to_ranks(hold.applied(0, {2, 0, false}), 0), (std::vector<int>{2}));
  EXPECT_EQ(hold.held(), 0);
}

}  // namespace
}  // namespace cfmo::train::modes
