#pragma once
/// Everything a cfmo-moe run is configured by, as one struct whose fields
/// are both flags and TOML keys (see core/config.h), and its validation into
/// a plan with the parsed values.

#include "comm/codec.h"
#include "core/config.h"
#include "core/error.h"
#include "moe/router.h"
#include "tensor/device.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cfmo::moe {

struct MoeConfig {
  // the layer
  int experts = 12;
  int64_t tokens = 512;  ///< tokens per rank per iteration
  int hidden = 512;
  int ffn = 1024;  ///< 0: the experts are the identity (communication only)
  int top_k = 2;
  double capacity_factor = 1.25;
  std::string drop_policy = "residual";
  std::string routing = "uniform";
  std::string dtype = "fp32";
  int64_t seed = 1;
  // the run
  std::string mode = "sync";
  int64_t warmup = 5;
  int64_t iters = 20;
  std::string sweep;
  std::string deadline = "auto";
  std::string late_policy = "residual";
  int in_flight = 4;
  bool check = true;
  int threads = 1;
  std::string device = "cpu";
  // ranks
  int ranks = 1;
  std::vector<std::string> slowdown;
  std::string straggler;
  std::string rendezvous;
  double peer_timeout = 10;
  // output
  std::string format = "table";
  bool quiet = false;
};

enum class LatePolicy : uint8_t { kResidual, kStale };

/// The validated, parsed form of a MoeConfig.
struct MoePlan {
  std::vector<std::string> modes;  ///< "sync", "async", in this order
  std::vector<int64_t> sizes;      ///< tokens per rank, one run per size
  RoutingSkew routing;
  DropPolicy drop_policy = DropPolicy::kResidual;
  comm::WireDtype dtype = comm::WireDtype::kFp32;
  LatePolicy late_policy = LatePolicy::kResidual;
  double deadline_s = -1;  ///< < 0: auto (from the warmup's round trips)
  tensor::Device device;   ///< where the experts' GEMMs run
};

/// Registers every field of `config` in `table` with its help text.
void add_moe_options(OptionTable& table, MoeConfig& config);

/// Range and consistency checks (errors name the flag) and parsing.
Result<MoePlan> validate(const MoeConfig& config);

/// "256", "64,128,512" or "64:4096" (doubling) -> tokens per rank.
Result<std::vector<int64_t>> parse_sweep(const std::string& text);

}  // namespace cfmo::moe
