// The modes' table: make_mode, config validation, --help and --compare read
// it, and a test holds the man page to it. A new mode is a ModeKind, a file
// of its own with its factory, and a row here.
#include "train/modes.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

namespace cfmo::train {
namespace modes {

// Each mode's file defines its factory.
std::unique_ptr<Mode> make_solo(std::string_view name);
Result<std::unique_ptr<Mode>> make_sync(const ModeContext& context);
Result<std::unique_ptr<Mode>> make_localsgd(const ModeContext& context);
Result<std::unique_ptr<Mode>> make_asgd(const ModeContext& context);
Result<std::unique_ptr<Mode>> make_cfmo(const ModeContext& context);

}  // namespace modes

namespace {

// In ModeKind order. Parameter copies: a reduce buffer for sync; the round's
// anchor, delta and outer momentum for localsgd and cfmo; the owners' shards
// and their state for asgd.
const std::array<ModeEntry, 4> kModes = {{
    {ModeKind::kSync,
     "sync",
     "gradients averaged every step",
     {.lockstep = true,
      .reduces_gradients = true,
      .device_reduce = true,
      .evaluates_mid_run = true,
      .parameter_copies = 1},
     modes::make_sync},
    {ModeKind::kLocalSgd,
     "localsgd",
     "deltas averaged every H steps, Local SGD or DiLoCo",
     {.lockstep = true, .writes_deltas = true, .parameter_copies = 3},
     modes::make_localsgd},
    {ModeKind::kAsgd,
     "asgd",
     "gradient shards to their owners every step, asynchronous SGD",
     {.asynchronous = true, .owners_optimize = true, .parameter_copies = 3},
     modes::make_asgd},
    {ModeKind::kCfmo,
     "cfmo",
     "delta shards to their owners every H steps, nobody waits",
     {.asynchronous = true, .writes_deltas = true, .parameter_copies = 3},
     modes::make_cfmo},
}};

}  // namespace

std::span<const ModeEntry> mode_table() { return kModes; }

const ModeEntry& mode_entry(ModeKind kind) { return kModes[static_cast<size_t>(kind)]; }

std::string mode_names() {
  std::string out;
  for (size_t i = 0; i < kModes.size(); ++i) {
    if (i > 0) out += i + 1 == kModes.size() ? " or " : ", ";
    out += kModes[i].name;
  }
  return out;
}

Result<ModeKind> parse_mode(std::string_view name) {
  for (const auto& m : kModes) {
    if (m.name == name) return m.kind;
  }
  return make_error(ErrorKind::kUsage, "--mode: '{}' is not {}", name, mode_names());
}

Result<OuterKind> parse_outer_kind(std::string_view text) {
  if (text == "avg") return OuterKind::kAvg;
  if (text == "nesterov") return OuterKind::kNesterov;
  return make_error(ErrorKind::kUsage, "--outer-optimizer: '{}' is not avg or nesterov", text);
}

std::string_view to_string(OuterKind kind) { return kind == OuterKind::kAvg ? "avg" : "nesterov"; }

int owner_count(const ModeSettings& settings, int world) {
  const int wanted = settings.owners > 0 ? settings.owners : kDefaultOwners;
  return std::max(1, std::min(wanted, world));
}

std::vector<size_t> shard_bounds(size_t size, int shards) {
  std::vector<size_t> bounds(static_cast<size_t>(shards) + 1, size);
  bounds[0] = 0;
  for (int j = 1; j < shards; ++j) {
    const size_t even = size * static_cast<size_t>(j) / static_cast<size_t>(shards);
    bounds[static_cast<size_t>(j)] = std::min(size, (even + 15) / 16 * 16);
  }
  return bounds;
}

Result<std::unique_ptr<Mode>> make_mode(const ModeSettings& settings, comm::Communicator* comm,
                                        const std::vector<model::ParamInfo>& layout, std::span<const float> initial,
                                        const optim::OptimizerConfig& optimizer_config, const ModeResume& resume) {
  (void)layout;
  const ModeEntry& entry = mode_entry(settings.kind);
  if (comm == nullptr || comm->size() == 1) return modes::make_solo(entry.name);
  return entry.make({settings, *comm, initial, optimizer_config, resume});
}

}  // namespace cfmo::train
