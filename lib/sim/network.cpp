#include "sim/network.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace cfmo::sim {

Result<Topology> parse_topology(std::string_view text) {
  Topology t;
  if (text == "switch") return t;
  const auto bad = [&] {
    return make_error(ErrorKind::kUsage, "--topology '{}': expected switch or racks:R:OVERSUB (R >= 1, OVERSUB >= 1)",
                      text);
  };
  if (!text.starts_with("racks:")) return bad();
  const std::string_view rest = text.substr(6);
  const auto colon = rest.find(':');
  if (colon == std::string_view::npos) return bad();
  const std::string_view racks = rest.substr(0, colon);
  const std::string_view over = rest.substr(colon + 1);
  auto [r_end, r_ec] = std::from_chars(racks.data(), racks.data() + racks.size(), t.racks);
  auto [o_end, o_ec] = std::from_chars(over.data(), over.data() + over.size(), t.oversubscription);
  if (r_ec != std::errc() || r_end != racks.data() + racks.size() || o_ec != std::errc() ||
      o_end != over.data() + over.size() || t.racks < 1 || !std::isfinite(t.oversubscription) ||
      t.oversubscription < 1) {
    return bad();
  }
  return t;
}

std::string to_string(const Topology& t) {
  return t.racks <= 1 ? std::string("switch") : fmt::format("racks:{}:{}", t.racks, t.oversubscription);
}

Network::Network(int hosts, const NetworkOptions& options)
    : hosts_(std::max(hosts, 1)),
      options_(options),
      host_up_(static_cast<size_t>(hosts_), Link{options.bandwidth}),
      host_down_(static_cast<size_t>(hosts_), Link{options.bandwidth}) {
  const int racks = std::clamp(options.topology.racks, 1, hosts_);
  options_.topology.racks = racks;
  if (racks > 1) {
    for (int r = 0; r < racks; ++r) {
      int in_rack = 0;
      for (int h = 0; h < hosts_; ++h) in_rack += rack_of(h) == r ? 1 : 0;
      const double share = in_rack * options.bandwidth / options.topology.oversubscription;
      rack_up_.push_back(Link{share});
      rack_down_.push_back(Link{share});
    }
  }
}

int Network::rack_of(int host) const {
  const int racks = options_.topology.racks;
  return racks <= 1 ? 0 : static_cast<int>(static_cast<int64_t>(host) * racks / hosts_);
}

double Network::through(Link& link, uint64_t bytes, double head, double& last_byte) {
  const double start = std::max(head, link.free_at);
  const double busy = static_cast<double>(bytes) / link.bandwidth;
  link.free_at = start + busy;
  link.bytes += bytes;
  link.busy_s += busy;
  last_byte = std::max(last_byte, link.free_at);
  return start;
}

double Network::deliver(int from, int to, uint64_t bytes, double t) {
  if (from == to) return t;
  double last = t;
  double head = through(host_up_[static_cast<size_t>(from)], bytes, t, last);
  double latency = options_.latency;
  const int rf = rack_of(from);
  const int rt = rack_of(to);
  if (rf != rt) {
    head = through(rack_up_[static_cast<size_t>(rf)], bytes, head, last);
    head = through(rack_down_[static_cast<size_t>(rt)], bytes, head, last);
    latency *= 2;
  }
  through(host_down_[static_cast<size_t>(to)], bytes, head, last);
  return last + latency;
}

double Network::ring_all_reduce(uint64_t bytes, double t) {
  if (hosts_ == 1) return t;
  const double w = hosts_;
  const double chunk = static_cast<double>(bytes) / w;
  const int racks = options_.topology.racks;
  // The slowest ring edge sets each step: an edge between racks shares its
  // rack's spine link with no other ring edge (racks are consecutive ranks).
  double bandwidth = options_.bandwidth;
  double latency = options_.latency;
  if (racks > 1) {
    for (const auto& l : rack_up_) bandwidth = std::min(bandwidth, l.bandwidth);
    latency *= 2;
  }
  const double steps = 2 * (w - 1);
  const double done = t + steps * (latency + chunk / bandwidth);
  const auto sent = static_cast<uint64_t>(steps * chunk);
  auto account = [&](std::vector<Link>& links, double bw) {
    for (auto& l : links) {
      l.bytes += sent;
      l.busy_s += steps * chunk / bw;
      l.free_at = std::max(l.free_at, done);
    }
  };
  account(host_up_, options_.bandwidth);
  account(host_down_, options_.bandwidth);
  if (racks > 1) {
    account(rack_up_, bandwidth);
    account(rack_down_, bandwidth);
  }
  return done;
}

double Network::barrier(double t) const {
  const double rounds = std::ceil(std::log2(std::max(hosts_, 1)));
  return t + rounds * options_.latency * (options_.topology.racks > 1 ? 2 : 1);
}

LinkLoad Network::load(const std::vector<Link>& links) {
  LinkLoad out;
  if (links.empty()) return out;
  double sum = 0;
  for (const auto& l : links) {
    out.max_bytes = std::max(out.max_bytes, l.bytes);
    out.max_busy_s = std::max(out.max_busy_s, l.busy_s);
    sum += static_cast<double>(l.bytes);
  }
  out.mean_bytes = sum / static_cast<double>(links.size());
  return out;
}

}  // namespace cfmo::sim
