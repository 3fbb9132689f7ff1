#pragma once
/// The simulator's network: hosts (one simulated worker each) behind one
/// switch, or in racks whose uplinks to a spine are oversubscribed. Every
/// link is a FIFO server of its bandwidth: a message occupies each link of
/// its path for bytes / bandwidth, from when the link is free and its head
/// has reached it (cut-through), and arrives when its last byte has crossed
/// every link, plus the latency. So messages that share a link queue, and
/// a shared link's bandwidth is divided by the order of arrival.
///
///   switch          host h: an uplink and a downlink of --link-bandwidth
///   racks:R:OVER    hosts split into R racks of consecutive ranks; each rack
///                   has an uplink and a downlink to the spine of
///                   (hosts in the rack x bandwidth) / OVER; a message between
///                   racks crosses both and pays the latency twice
///
/// The collectives are modelled, not sent message by message: a ring
/// all-reduce of B bytes over W hosts in rank order takes 2(W-1) steps of
/// B/W bytes on every ring edge at once, each as long as its slowest edge
/// (an edge between racks runs at min(bandwidth, spine share)).

#include "core/error.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::sim {

struct Topology {
  int racks = 1;                  ///< 1: one switch
  double oversubscription = 1.0;  ///< racks: the spine's share is hosts x bandwidth / this
};

/// "switch" or "racks:R:OVERSUB" (R >= 1, OVERSUB >= 1); errors name --topology.
Result<Topology> parse_topology(std::string_view text);
std::string to_string(const Topology& topology);

struct NetworkOptions {
  double bandwidth = 12.5e9;  ///< bytes/s of each host's link, each way (100 Gb/s)
  double latency = 5e-6;      ///< seconds, one way, between two hosts of a switch
  Topology topology;
};

/// The bytes and busy time of a class of links.
struct LinkLoad {
  uint64_t max_bytes = 0;
  double mean_bytes = 0;
  double max_busy_s = 0;  ///< the busiest link's time transmitting
};

class Network {
 public:
  Network(int hosts, const NetworkOptions& options);

  /// A message of `bytes` leaves `from` for `to` at time `t`: when it
  /// arrives. A message to oneself arrives at `t` and crosses no link.
  double deliver(int from, int to, uint64_t bytes, double t);

  /// All hosts start a ring all-reduce of `bytes` each at `t`: when it ends.
  double ring_all_reduce(uint64_t bytes, double t);
  /// A dissemination barrier started by all at `t`: when it ends.
  double barrier(double t) const;

  LinkLoad host_uplinks() const { return load(host_up_); }
  LinkLoad host_downlinks() const { return load(host_down_); }
  /// Racks' uplinks to the spine (all zero under one switch).
  LinkLoad spine_uplinks() const { return load(rack_up_); }
  int rack_of(int host) const;
  int hosts() const { return hosts_; }

 private:
  struct Link {
    double bandwidth = 0;
    double free_at = 0;
    uint64_t bytes = 0;
    double busy_s = 0;
  };
  static LinkLoad load(const std::vector<Link>& links);
  double through(Link& link, uint64_t bytes, double head, double& last_byte);

  int hosts_;
  NetworkOptions options_;
  std::vector<Link> host_up_, host_down_, rack_up_, rack_down_;
};

}  // namespace cfmo::sim
