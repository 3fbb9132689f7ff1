// RankStates over the in-process loopback transport (the real protocol is
// exercised by the multi-process checkpoint tests in test_workers): the
// keeper's request reaches every other rank once, answers to an older
// request are dropped, a lost rank is not waited for, and a rank's last
// state comes unasked.
#include "comm/loopback.h"
#include "train/rank_states.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

namespace cfmo::train {
namespace {

std::vector<std::byte> bytes_of(uint8_t value, size_t n) { return std::vector<std::byte>(n, std::byte{value}); }

TEST(RankStates, TheKeepersRequestIsAnsweredByEveryOtherRankAndOlderAnswersAreDropped) {
  auto world = comm::make_loopback_world(3, {.peer_timeout_s = 0.2});
  std::vector<std::unique_ptr<RankStates>> states;
  for (auto& c : world.ranks) states.push_back(std::make_unique<RankStates>(*c));

  const uint64_t first = states[0]->request();
  ASSERT_TRUE(world.network->drain());
  EXPECT_FALSE(states[0]->take_request()) << "the keeper does not ask itself";
  for (int r : {1, 2}) {
    const auto asked = states[static_cast<size_t>(r)]->take_request();
    ASSERT_TRUE(asked) << r;
    EXPECT_EQ(asked->first, 0);
    EXPECT_EQ(asked->second, first);
    EXPECT_FALSE(states[static_cast<size_t>(r)]->take_request()) << "taken once";
  }
  states[1]->send(0, first, bytes_of(1, 10));
  ASSERT_TRUE(world.network->drain());
  EXPECT_FALSE(states[0]->complete(first, {}));
  EXPECT_TRUE(states[0]->complete(first, {2})) << "a lost rank is not waited for";

  // A newer request: rank 2's late answer to the first one is stale.
  const uint64_t second = states[0]->request();
  states[2]->send(0, first, bytes_of(2, 10));
  states[1]->send(0, second, bytes_of(3, 7));
  states[2]->send(0, second, bytes_of(4, 5));
  ASSERT_TRUE(world.network->drain());
  EXPECT_TRUE(states[0]->complete(second, {}));
  const auto got = states[0]->take(second);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got[0].empty());
  EXPECT_EQ(got[1], bytes_of(3, 7));
  EXPECT_EQ(got[2], bytes_of(4, 5));
  EXPECT_TRUE(states[0]->take(first)[2].empty());

  // The end: every rank's last state, unasked.
  states[1]->send(0, RankStates::kFinal, bytes_of(5, 3));
  world.network->kill(2);
  ASSERT_TRUE(world.network->drain());
  // Rank 0's progress thread finds the kill on its own (drain waits for messages only).
  for (int i = 0; i < 500 && !world.ranks[0]->is_lost_rank(2); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(states[0]->complete(RankStates::kFinal, world.ranks[0]->lost_ranks()));
  EXPECT_EQ(states[0]->take(RankStates::kFinal)[1], bytes_of(5, 3));
  states.clear();
}

}  // namespace
}  // namespace cfmo::train
