#include "oci/hot_set.h"

#include <algorithm>
#include <charconv>
#include <numeric>

namespace cfmo::oci {
namespace {

bool parse_int(std::string_view text, int64_t& out) {
  if (text.empty()) return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size();
}

bool is_hex(std::string_view text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace

std::string human_bytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  for (value /= 1024; value >= 1024 && unit + 1 < std::size(kUnits); value /= 1024) ++unit;
  return fmt::format("{:.1f} {}", value, kUnits[unit]);
}

std::string short_digest(const std::string& digest) { return digest.size() > 19 ? digest.substr(0, 19) + "…" : digest; }

Result<LayerSpec> parse_layer_spec(std::string_view text, std::string_view flag) {
  LayerSpec spec;
  spec.text = std::string(text);
  const auto bad = [&](std::string_view why) {
    return make_error(ErrorKind::kUsage,
                      "{} '{}': {} (expected sha256:HEX, an index N or -N, smallest:N, top:N, last:N, all or none)",
                      flag, text, why);
  };
  if (text == "all") {
    spec.kind = LayerSpec::Kind::kAll;
    return spec;
  }
  if (text == "none") {
    spec.kind = LayerSpec::Kind::kNone;
    return spec;
  }
  if (text.starts_with("sha256:")) {
    const auto hex = text.substr(7);
    if (!is_hex(hex) || hex.size() > 64) return bad("not a digest or lowercase hex prefix of one");
    spec.kind = LayerSpec::Kind::kDigest;
    spec.digest_prefix = std::string(text);
    return spec;
  }
  for (const auto& [prefix, kind] : {std::pair{std::string_view("smallest:"), LayerSpec::Kind::kSmallest},
                                     std::pair{std::string_view("top:"), LayerSpec::Kind::kTop},
                                     std::pair{std::string_view("last:"), LayerSpec::Kind::kLast}}) {
    if (!text.starts_with(prefix)) continue;
    if (!parse_int(text.substr(prefix.size()), spec.number) || spec.number < 0) return bad("N must be a count >= 0");
    spec.kind = kind;
    return spec;
  }
  if (parse_int(text, spec.number)) {
    spec.kind = LayerSpec::Kind::kIndex;
    return spec;
  }
  return bad("not a layer spec");
}

Result<std::vector<bool>> select_layers(const std::vector<LayerSpec>& specs, const std::vector<Descriptor>& layers,
                                        std::string_view flag) {
  const auto count = static_cast<int64_t>(layers.size());
  std::vector<bool> chosen(layers.size(), false);
  for (const auto& spec : specs) {
    switch (spec.kind) {
      case LayerSpec::Kind::kNone:
        break;
      case LayerSpec::Kind::kAll:
        std::fill(chosen.begin(), chosen.end(), true);
        break;
      case LayerSpec::Kind::kDigest: {
        std::vector<size_t> found;
        for (size_t i = 0; i < layers.size(); ++i) {
          if (layers[i].digest.starts_with(spec.digest_prefix)) found.push_back(i);
        }
        if (found.empty()) {
          return make_error(ErrorKind::kUsage, "{} {}: matches none of the image's {} layer(s)", flag, spec.text,
                            count);
        }
        // Layers of one digest (an image may repeat a layer) are one match.
        const auto other = std::find_if(found.begin(), found.end(),
                                        [&](size_t i) { return layers[i].digest != layers[found[0]].digest; });
        if (other != found.end()) {
          return make_error(ErrorKind::kUsage, "{} {}: matches {} layers ({} and {}); give more digits", flag,
                            spec.text, found.size(), found[0], *other);
        }
        for (const size_t i : found) chosen[i] = true;
        break;
      }
      case LayerSpec::Kind::kIndex: {
        const int64_t index = spec.number < 0 ? count + spec.number : spec.number;
        if (index < 0 || index >= count) {
          return make_error(ErrorKind::kUsage, "{} {}: no such layer; the image has {} (0 to {}, or -1 to -{})", flag,
                            spec.text, count, count - 1, count);
        }
        chosen[static_cast<size_t>(index)] = true;
        break;
      }
      case LayerSpec::Kind::kTop:
        for (int64_t i = 0; i < std::min(spec.number, count); ++i) chosen[static_cast<size_t>(i)] = true;
        break;
      case LayerSpec::Kind::kLast:
        for (int64_t i = std::max<int64_t>(0, count - spec.number); i < count; ++i)
          chosen[static_cast<size_t>(i)] = true;
        break;
      case LayerSpec::Kind::kSmallest: {
        std::vector<size_t> order(layers.size());
        std::iota(order.begin(), order.end(), size_t{0});
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return layers[a].size < layers[b].size; });
        for (int64_t i = 0; i < std::min(spec.number, count); ++i) chosen[order[static_cast<size_t>(i)]] = true;
        break;
      }
    }
  }
  return chosen;
}

Result<MemoryPlan> plan_memory(const std::vector<Descriptor>& layers, const std::vector<bool>& hot, int64_t capacity,
                               bool spill, const std::string& cap_text) {
  MemoryPlan plan;
  plan.placement.assign(layers.size(), Placement::kDisk);
  std::string listed;
  size_t hot_count = 0;
  // A digest named by several layers is one blob: counted, and placed, once.
  const auto repeated = [&](size_t i) {
    for (size_t j = 0; j < i; ++j) {
      if (hot[j] && layers[j].digest == layers[i].digest) return true;
    }
    return false;
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!hot[i] || repeated(i)) continue;
    plan.hot_bytes += layers[i].size;
    ++hot_count;
    if (hot_count <= 4) {
      listed += fmt::format("{}layer {} {}", listed.empty() ? "" : ", ", i, human_bytes(layers[i].size));
    }
  }
  if (hot_count > 4) listed += fmt::format(" and {} more", hot_count - 4);
  if (plan.hot_bytes > capacity && !spill) {
    return make_error(ErrorKind::kUsage,
                      "the hot layers need {} ({} bytes: {}) but {} (pass --spill to put the excess on disk, or "
                      "raise --max-memory)",
                      human_bytes(plan.hot_bytes), plan.hot_bytes, listed, cap_text);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (!hot[i]) continue;
    if (repeated(i)) {
      for (size_t j = 0; j < i; ++j) {
        if (hot[j] && layers[j].digest == layers[i].digest) plan.placement[i] = plan.placement[j];
      }
      continue;
    }
    if (plan.memory_bytes + layers[i].size <= capacity) {
      plan.placement[i] = Placement::kMemory;
      plan.memory_bytes += layers[i].size;
    } else {
      plan.warnings.push_back(fmt::format("hot layer {} {} ({}) goes to disk: the memory store holds {} of {}", i,
                                          short_digest(layers[i].digest), human_bytes(layers[i].size),
                                          human_bytes(plan.memory_bytes), human_bytes(capacity)));
    }
  }
  return plan;
}

}  // namespace cfmo::oci
