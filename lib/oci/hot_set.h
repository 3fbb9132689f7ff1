#pragma once
/// Which layers are hot, and where each layer's blob is kept: hot layers in
/// the memory-backed store while it has room, everything else on disk.
///
/// A layer spec (`--hot`, and the LAYER arguments of `cfmo-pull fetch`) is:
///   sha256:HEX   the layer whose digest starts with HEX (1 to 64 digits;
///                it must name exactly one layer)
///   N, -N        the layer at index N in manifest order (0 is the base
///                layer); -1 is the last (uppermost) layer
///   smallest:N   the N smallest layers (by compressed size; ties: lower index)
///   top:N        the first N layers in manifest order, the top of the list
///                `cfmo-pull inspect` prints: the base of the image (OS,
///                runtime, libraries), which every later layer builds on
///   last:N       the last N layers in manifest order (the uppermost, usually
///                the application)
///   all, none    every layer, no layer

#include "core/error.h"
#include "oci/manifest.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::oci {

struct LayerSpec {
  enum class Kind { kDigest, kIndex, kSmallest, kTop, kLast, kAll, kNone };
  Kind kind = Kind::kNone;
  std::string digest_prefix;  ///< kDigest: "sha256:" and 1..64 lowercase hex digits
  int64_t number = 0;         ///< kIndex (may be negative), kSmallest/kTop/kLast (N >= 0)
  std::string text;           ///< as given, for messages
};

/// Parses one spec; a malformed one is kUsage naming `flag` ("--hot").
Result<LayerSpec> parse_layer_spec(std::string_view text, std::string_view flag);

/// The layers the specs select, as a flag per layer. A digest prefix that
/// matches no layer or several, or an index out of range, is kUsage naming
/// the spec, `flag` and the image's layer count.
Result<std::vector<bool>> select_layers(const std::vector<LayerSpec>& specs, const std::vector<Descriptor>& layers,
                                        std::string_view flag);

enum class Placement { kMemory, kDisk };

struct MemoryPlan {
  std::vector<Placement> placement;   ///< per layer
  int64_t hot_bytes = 0;              ///< the hot layers' sizes, together
  int64_t memory_bytes = 0;           ///< what goes into the memory store
  std::vector<std::string> warnings;  ///< one per hot layer spilled to disk
};

/// Places hot layers in the memory store (capacity `capacity` bytes) in
/// manifest order while they fit; cold layers go to disk. When the hot
/// layers together exceed the capacity it is kUsage naming the sizes, unless
/// `spill`, where a hot layer that does not fit goes to disk with a warning.
/// `cap_text` describes the capacity in messages ("--max-memory 32 MiB ...").
Result<MemoryPlan> plan_memory(const std::vector<Descriptor>& layers, const std::vector<bool>& hot, int64_t capacity,
                               bool spill, const std::string& cap_text);

/// "1.5 MiB", "300 B": sizes in messages.
std::string human_bytes(int64_t bytes);

/// "sha256:1a2b3c4d5e6f": a digest short enough for messages and progress lines.
std::string short_digest(const std::string& digest);

}  // namespace cfmo::oci
