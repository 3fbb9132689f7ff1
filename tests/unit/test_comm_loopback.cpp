// The loopback transport's own controls: delays, holds, silence, kill and
// drain (the Communicator contract it shares with UCX is tested in
// test_comm_ucx.cpp, over both). No assertion on timing: delays are checked
// by order, silence by what the survivors report.
#include "comm/loopback.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>

namespace cfmo::comm {
namespace {

constexpr Channel kTest{1};

std::vector<std::byte> bytes_of(int value) {
  std::vector<std::byte> out(sizeof value);
  std::memcpy(out.data(), &value, sizeof value);
  return out;
}

int value_of(std::span<const std::byte> payload) {
  int value = 0;
  std::memcpy(&value, payload.data(), sizeof value);
  return value;
}

/// Records (from, value) of every message each rank handles.
struct Recorder {
  explicit Recorder(LoopbackWorld& world) : seen(world.ranks.size()) {
    for (size_t r = 0; r < world.ranks.size(); ++r) {
      world.ranks[r]->on_message(kTest, [this, r](int from, std::span<const std::byte> payload) {
        std::lock_guard lock(mutex);
        seen[r].emplace_back(from, value_of(payload));
      });
    }
  }
  std::vector<std::pair<int, int>> of(size_t r) {
    std::lock_guard lock(mutex);
    return seen[r];
  }
  std::mutex mutex;
  std::vector<std::vector<std::pair<int, int>>> seen;
};

TEST(Loopback, DrainWaitsForEveryMessageAndHandlersRunOnTheProgressThread) {
  auto world = make_loopback_world(3);
  std::thread::id handler_thread;
  std::vector<int> got;
  world.ranks[1]->on_message(kTest, [&](int from, std::span<const std::byte> payload) {
    handler_thread = std::this_thread::get_id();
    got.push_back(from * 1000 + value_of(payload));
  });
  for (int i = 0; i < 100; ++i) {
    world.ranks[0]->post(1, kTest, bytes_of(i));
    world.ranks[1]->post(1, kTest, bytes_of(i));  // to itself: through the progress thread too
  }
  ASSERT_TRUE(world.network->drain());
  EXPECT_NE(handler_thread, std::this_thread::get_id());
  ASSERT_EQ(got.size(), 200u);
  // Each link keeps its order.
  std::vector<int> from0;
  std::vector<int> from1;
  for (int v : got) (v >= 1000 ? from1 : from0).push_back(v % 1000);
  EXPECT_TRUE(std::is_sorted(from0.begin(), from0.end()));
  EXPECT_TRUE(std::is_sorted(from1.begin(), from1.end()));
  // Stats count as UCX's: a post to oneself counts nothing.
  EXPECT_EQ(world.ranks[0]->stats().messages_sent, 100u);
  EXPECT_EQ(world.ranks[1]->stats().messages_received, 100u);
  EXPECT_EQ(world.ranks[1]->stats().bytes_received, 100u * sizeof(int));
}

TEST(Loopback, ADelayedLinkIsOvertakenByAFastOneButKeepsItsOrder) {
  auto world = make_loopback_world(3);
  Recorder recorder(world);
  world.network->set_delay(1, 0, 0.05);
  for (int i = 0; i < 3; ++i) world.ranks[1]->post(0, kTest, bytes_of(i));
  world.ranks[2]->post(0, kTest, bytes_of(9));
  ASSERT_TRUE(world.network->drain());
  const auto seen = recorder.of(0);
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0], std::make_pair(2, 9));  // sent last, on the fast link: first
  for (int i = 0; i < 3; ++i) EXPECT_EQ(seen[static_cast<size_t>(i) + 1], std::make_pair(1, i));
}

TEST(Loopback, AHeldLinkDeliversNothingUntilReleasedThenAllInOrder) {
  auto world = make_loopback_world(2);
  Recorder recorder(world);
  world.network->hold(0, 1);
  for (int i = 0; i < 5; ++i) world.ranks[0]->post(1, kTest, bytes_of(i));
  world.ranks[1]->post(0, kTest, bytes_of(7));  // the other direction is not held
  ASSERT_TRUE(world.network->drain());          // quiet: held messages do not count
  EXPECT_TRUE(recorder.of(1).empty());
  EXPECT_EQ(recorder.of(0).size(), 1u);
  world.network->release(0, 1);
  ASSERT_TRUE(world.network->drain());
  const auto seen = recorder.of(1);
  ASSERT_EQ(seen.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)].second, i);
}

TEST(Loopback, CollectivesTakeTheLinksDelaysAndHolds) {
  auto world = make_loopback_world(3);
  world.network->set_delay(-1, -1, 0.01);
  world.network->hold(2, 0);
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> data(3, std::vector<float>(10));
  std::vector<Status> results(3);
  for (int r = 0; r < 3; ++r) {
    for (size_t i = 0; i < 10; ++i) data[static_cast<size_t>(r)][i] = static_cast<float>(r + 1) * static_cast<float>(i);
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] =
          world.ranks[static_cast<size_t>(r)]->all_reduce_sum(data[static_cast<size_t>(r)]);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  world.network->release(2, 0);  // the ring waits for it, however long
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)]) << results[static_cast<size_t>(r)].error().message;
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(data[static_cast<size_t>(r)][i], 6.0f * static_cast<float>(i));
  }
}

TEST(Loopback, ASilencedRankIsFoundLostAfterThePeerTimeoutByEveryOtherRank) {
  auto world = make_loopback_world(3, {.peer_timeout_s = 0.1});
  Recorder recorder(world);
  world.network->silence(2);
  world.ranks[0]->post(2, kTest, bytes_of(1));  // dropped: nothing reaches it
  world.ranks[2]->post(0, kTest, bytes_of(2));  // dropped: nothing it sends arrives
  // A collective on the silenced rank fails naming it, once it is found lost.
  Status result;
  std::thread survivor([&] { result = world.ranks[1]->barrier(); });
  Status zero = world.ranks[0]->barrier();
  survivor.join();
  ASSERT_FALSE(zero);
  EXPECT_EQ(zero.error().kind, ErrorKind::kPeer);
  EXPECT_NE(zero.error().message.find("rank 2"), std::string::npos) << zero.error().message;
  ASSERT_TRUE(world.network->drain());
  EXPECT_TRUE(recorder.of(2).empty());
  EXPECT_TRUE(recorder.of(0).empty());
  for (int r : {0, 1}) {
    const auto& comm = *world.ranks[static_cast<size_t>(r)];
    // Whichever failed first, both survivors find rank 2 lost by its silence.
    while (comm.lost_ranks().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(comm.lost_ranks(), std::vector<int>{2});
    EXPECT_NE(comm.lost_reason(2).find("no message for"), std::string::npos) << comm.lost_reason(2);
    ASSERT_FALSE(comm.health());
    EXPECT_NE(comm.health().error().message.find("rank 2 lost"), std::string::npos);
  }
  // The silenced rank finds the others lost in turn.
  while (world.ranks[2]->lost_ranks().size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(world.ranks[2]->lost_ranks(), (std::vector<int>{0, 1}));
}

TEST(Loopback, AKilledRankIsFoundLostAtOnceAndALeavingOneIsNot) {
  auto world = make_loopback_world(3);  // a peer timeout of 10 s: not what finds them
  world.network->kill(1);
  while (world.ranks[0]->lost_ranks().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(world.ranks[0]->lost_ranks(), std::vector<int>{1});
  EXPECT_NE(world.ranks[0]->lost_reason(1).find("connection error"), std::string::npos);
  // Rank 2 leaves on purpose: rank 0 is told (a collective with it fails as
  // "left the run", with the root cause it passed on), but does not count it lost.
  world.ranks[2].reset();
  ASSERT_TRUE(world.network->drain());
  EXPECT_EQ(world.ranks[0]->lost_ranks(), std::vector<int>{1});
}

// A process joining in a killed rank's place, as `cfmo-train --join` over
// UCX: the others find the rank live again at once, with the join recorded;
// messages flow both ways; the joiner knows it joined and sees the ranks
// still lost as lost. A rank still in the run, or one whose Communicator
// exists, is not free.
TEST(Loopback, AJoinerTakesAKilledRanksPlaceAndTheOthersFindItLiveAgain) {
  auto world = make_loopback_world(4);
  EXPECT_FALSE(world.network->join(1));  // alive
  world.network->kill(1);
  world.network->kill(3);
  for (size_t r : {0u, 2u}) {
    while (world.ranks[r]->lost_ranks().size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(world.network->join(1));  // its Communicator still exists
  world.ranks[1].reset();
  auto joined = world.network->join(1);
  ASSERT_TRUE(joined) << joined.error().message;
  world.ranks[1] = std::move(*joined);
  EXPECT_TRUE(world.ranks[1]->joined());
  EXPECT_FALSE(world.ranks[0]->joined());
  for (size_t r : {0u, 2u}) {
    EXPECT_EQ(world.ranks[r]->lost_ranks(), std::vector<int>{3});
    EXPECT_EQ(world.ranks[r]->joined_ranks(), std::vector<int>{1});
  }
  Recorder recorder(world);
  world.ranks[0]->post(1, kTest, bytes_of(7));
  world.ranks[1]->post(2, kTest, bytes_of(8));
  world.ranks[1]->post(3, kTest, bytes_of(9));  // lost: dropped
  ASSERT_TRUE(world.network->drain());
  EXPECT_EQ(recorder.of(1), (std::vector<std::pair<int, int>>{{0, 7}}));
  EXPECT_EQ(recorder.of(2), (std::vector<std::pair<int, int>>{{1, 8}}));
  while (world.ranks[1]->lost_ranks().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(world.ranks[1]->lost_ranks(), std::vector<int>{3});
  // Lost again: news again.
  world.network->kill(1);
  while (world.ranks[0]->lost_ranks().size() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(world.ranks[0]->lost_ranks(), (std::vector<int>{1, 3}));
}

// A join with no rank lost, as `cfmo-train --join` over UCX in a run that
// may grow: join(W) gives a new rank W; every rank's world has W + 1 ranks
// and records the join; messages flow both ways with the new rank; the
// collectives stay among the ranks that started; and a rank beyond W is not
// free. A loss of the new rank is news, as any other's.
TEST(Loopback, AJoinWithNoRankLostGrowsTheWorldByANewRank) {
  auto world = make_loopback_world(2);
  EXPECT_FALSE(world.network->join(3));  // not the next rank
  auto joined = world.network->join(2);
  ASSERT_TRUE(joined) << joined.error().message;
  world.ranks.push_back(std::move(*joined));
  EXPECT_TRUE(world.ranks[2]->joined());
  EXPECT_EQ(world.ranks[2]->rank(), 2);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(world.ranks[r]->size(), 3) << r;
    EXPECT_TRUE(world.ranks[r]->lost_ranks().empty()) << r;
  }
  for (size_t r : {0u, 1u}) {
    EXPECT_EQ(world.ranks[r]->joined_ranks(), std::vector<int>{2});
    EXPECT_EQ(world.ranks[r]->joins_of(2), 1u);
    EXPECT_FALSE(world.ranks[r]->is_lost_rank(2));
  }
  Recorder recorder(world);
  world.ranks[0]->post(2, kTest, bytes_of(7));
  world.ranks[2]->post(1, kTest, bytes_of(8));
  ASSERT_TRUE(world.network->drain());
  EXPECT_EQ(recorder.of(2), (std::vector<std::pair<int, int>>{{0, 7}}));
  EXPECT_EQ(recorder.of(1), (std::vector<std::pair<int, int>>{{2, 8}}));
  // The starting ranks' all-reduce is theirs alone: the joiner is not waited for.
  std::vector<std::vector<float>> data(2, std::vector<float>{1.0f});
  std::thread other([&] { EXPECT_TRUE(world.ranks[1]->all_reduce_sum(data[1])); });
  EXPECT_TRUE(world.ranks[0]->all_reduce_sum(data[0]));
  other.join();
  EXPECT_EQ(data[0][0], 2.0f);
  EXPECT_EQ(data[1][0], 2.0f);
  world.network->kill(2);
  for (size_t r : {0u, 1u}) {
    while (!world.ranks[r]->is_lost_rank(2)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(world.ranks[r]->lost_ranks(), std::vector<int>{2});
  }
}

// Once the lowest live rank closed joins (its run ends), a join is refused
// as the rendezvous refuses it ("the run ends"), unless the test asks for a
// process admitted just before the close; a rank below it that is gone does
// not serve joins, and with nobody live nobody takes a joiner in.
TEST(Loopback, AJoinAfterTheLeaderClosedJoinsIsRefusedAsTheRunEnds) {
  auto world = make_loopback_world(3);
  world.ranks[1]->close_joins();  // not the leader: joins go on
  auto grown = world.network->join(3);
  ASSERT_TRUE(grown) << grown.error().message;
  world.ranks.push_back(std::move(*grown));
  world.ranks[0]->close_joins();
  const auto refused = world.network->join(4);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().kind, ErrorKind::kPeer);
  EXPECT_NE(refused.error().message.find("the run ends"), std::string::npos) << refused.error().message;
  auto admitted = world.network->join(4, /*past_close=*/true);
  ASSERT_TRUE(admitted) << admitted.error().message;
  world.ranks.push_back(std::move(*admitted));
  // Rank 0 gone: rank 1 leads, and it closed joins too.
  world.ranks[0].reset();
  EXPECT_FALSE(world.network->join(5));
  for (auto& r : world.ranks) r.reset();
  const auto nobody = world.network->join(5);
  ASSERT_FALSE(nobody);
  EXPECT_NE(nobody.error().message.find("no live rank"), std::string::npos) << nobody.error().message;
}

}  // namespace
}  // namespace cfmo::comm
