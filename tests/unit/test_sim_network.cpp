// The simulator's network model: a message takes latency + bytes/bandwidth,
// messages that share a link queue on it, racks pay the spine's share and a
// second latency, and the ring all-reduce takes 2(W-1) steps of B/W bytes.
#include "sim/network.h"

#include <gtest/gtest.h>

namespace cfmo::sim {
namespace {

NetworkOptions options(double bandwidth, double latency, Topology topology = {}) {
  NetworkOptions o;
  o.bandwidth = bandwidth;
  o.latency = latency;
  o.topology = topology;
  return o;
}

TEST(SimNetwork, AMessageTakesItsLatencyAndItsBytesOverTheBandwidth) {
  Network n(4, options(1000, 0.5));
  EXPECT_DOUBLE_EQ(n.deliver(0, 1, 2000, 10.0), 10.0 + 2.0 + 0.5);
  EXPECT_DOUBLE_EQ(n.deliver(2, 2, 2000, 10.0), 10.0);  // to oneself: no link
  EXPECT_EQ(n.host_uplinks().max_bytes, 2000u);
}

TEST(SimNetwork, MessagesOnASharedLinkQueueAndDisjointOnesDoNot) {
  Network n(4, options(1000, 0.0));
  // Two from host 0 at once: the second waits for the first on 0's uplink.
  EXPECT_DOUBLE_EQ(n.deliver(0, 1, 1000, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(n.deliver(0, 2, 1000, 0.0), 2.0);
  // Into host 3 from 1 and 2 at once: they share 3's downlink.
  Network m(4, options(1000, 0.0));
  EXPECT_DOUBLE_EQ(m.deliver(1, 3, 1000, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(m.deliver(2, 3, 1000, 0.0), 2.0);
  // 0 -> 1 and 2 -> 3 share nothing.
  Network d(4, options(1000, 0.0));
  EXPECT_DOUBLE_EQ(d.deliver(0, 1, 1000, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(d.deliver(2, 3, 1000, 0.0), 1.0);
  // A link that was free again takes a later message at once.
  EXPECT_DOUBLE_EQ(d.deliver(0, 1, 1000, 5.0), 6.0);
}

TEST(SimNetwork, RacksShareAnOversubscribedSpine) {
  // 8 hosts in 2 racks of 4, spine share 4 x 1000 / 4 = 1000 bytes/s per rack.
  Network n(8, options(1000, 0.25, {.racks = 2, .oversubscription = 4}));
  EXPECT_EQ(n.rack_of(3), 0);
  EXPECT_EQ(n.rack_of(4), 1);
  EXPECT_DOUBLE_EQ(n.deliver(0, 1, 1000, 0.0), 1.25);  // within a rack: one latency
  // Across: two latencies; two hosts of rack 0 sending out at once queue on its spine link.
  EXPECT_DOUBLE_EQ(n.deliver(0, 4, 1000, 10.0), 11.5);
  EXPECT_DOUBLE_EQ(n.deliver(1, 5, 1000, 10.0), 12.5);
  EXPECT_EQ(n.spine_uplinks().max_bytes, 2000u);
  // Not oversubscribed: each rack's spine share is 4000 bytes/s, the hosts' links are the limit.
  Network wide(8, options(1000, 0.0, {.racks = 2, .oversubscription = 1}));
  EXPECT_DOUBLE_EQ(wide.deliver(0, 4, 1000, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(wide.deliver(1, 5, 1000, 0.0), 1.25);  // 0.25 s behind on the spine, then its own 1 s link
}

TEST(SimNetwork, TheRingAllReduceTakesTwoWMinusOneStepsOfAWthOfTheBytes) {
  Network n(4, options(1000, 0.01));
  // 2 * 3 steps of (0.01 + 1000/4/1000).
  EXPECT_DOUBLE_EQ(n.ring_all_reduce(1000, 1.0), 1.0 + 6 * (0.01 + 0.25));
  EXPECT_EQ(n.host_uplinks().max_bytes, 1500u);  // 2 (W-1)/W of the buffer
  Network one(1, options(1000, 0.01));
  EXPECT_DOUBLE_EQ(one.ring_all_reduce(1000, 1.0), 1.0);
}

TEST(SimNetwork, TopologiesParseAndBadOnesNameTheFlag) {
  EXPECT_EQ(parse_topology("switch")->racks, 1);
  auto racks = parse_topology("racks:8:3.5");
  ASSERT_TRUE(racks);
  EXPECT_EQ(racks->racks, 8);
  EXPECT_DOUBLE_EQ(racks->oversubscription, 3.5);
  EXPECT_EQ(to_string(*racks), "racks:8:3.5");
  for (const char* bad : {"", "ring", "racks:", "racks:0:2", "racks:4:0.5", "racks:4", "racks:x:2", "racks:4:2:1"}) {
    auto t = parse_topology(bad);
    ASSERT_FALSE(t) << bad;
    EXPECT_EQ(t.error().kind, ErrorKind::kUsage);
    EXPECT_NE(t.error().message.find("--topology"), std::string::npos);
  }
}

}  // namespace
}  // namespace cfmo::sim
