// PeerHealth, the health every transport keeps of its peers: here what a
// join leaves of the loss it ended.
#include "comm/peer_health.h"

#include <gtest/gtest.h>

#include <chrono>

namespace cfmo::comm {
namespace {

// A rank lost and taken back before anyone looked at lost_ranks() again
// (under load the joiner's wait can be shorter than a trainer's step) was
// lost all the same: each join keeps why the process it replaced was lost,
// while the rank itself is live again; a new rank (the world grew) replaced
// nobody.
TEST(PeerHealth, AJoinKeepsWhyTheProcessItReplacedWasLost) {
  PeerHealth health(0, 3);
  health.mark_lost(2, "no message for 5.0s");
  const auto before = std::chrono::steady_clock::now();
  health.rejoined(2);
  const auto after = std::chrono::steady_clock::now();
  EXPECT_TRUE(health.lost_ranks().empty());
  EXPECT_EQ(health.lost_reason(2), "");
  ASSERT_EQ(health.joined_ranks(), std::vector<int>{2});
  EXPECT_EQ(health.replaced_loss(0), "no message for 5.0s");
  health.grow(4);
  health.rejoined(3);
  health.mark_lost(2, "connection error: Connection reset by remote peer");
  health.rejoined(2);
  EXPECT_EQ(health.joined_ranks(), (std::vector<int>{2, 3, 2}));
  EXPECT_EQ(health.replaced_loss(1), "");
  EXPECT_EQ(health.replaced_loss(2), "connection error: Connection reset by remote peer");
  EXPECT_EQ(health.replaced_loss(3), "");  // no such join
  // When each join was taken in, not when a trainer looked: the ranks' times of one join agree.
  EXPECT_GE(health.joined_at(0), before);
  EXPECT_LE(health.joined_at(0), after);
  EXPECT_LE(health.joined_at(0), health.joined_at(1));
  EXPECT_LE(health.joined_at(1), health.joined_at(2));
}

}  // namespace
}  // namespace cfmo::comm
