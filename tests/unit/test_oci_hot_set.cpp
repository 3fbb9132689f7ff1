#include "oci/hot_set.h"

#include "support/expect_error.h"

#include <gtest/gtest.h>

namespace cfmo::oci {
namespace {

std::vector<Descriptor> layers_of(std::vector<int64_t> sizes) {
  std::vector<Descriptor> layers;
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Digests that share a prefix ("sha256:aa...") for the ambiguity case.
    const std::string hex = fmt::format("{}{:062x}", i < 2 ? "aa" : "bb", i);
    layers.push_back({"application/vnd.oci.image.layer.v1.tar+gzip", "sha256:" + hex, sizes[i], {}});
  }
  return layers;
}

std::vector<bool> select(const std::vector<std::string>& texts, const std::vector<Descriptor>& layers) {
  std::vector<LayerSpec> specs;
  for (const auto& t : texts) specs.push_back(*parse_layer_spec(t, "--hot"));
  auto chosen = select_layers(specs, layers, "--hot");
  EXPECT_TRUE(chosen.has_value()) << (chosen ? "" : chosen.error().message);
  return chosen ? *chosen : std::vector<bool>{};
}

TEST(OciHotSet, SpecsSelectTheDocumentedLayers) {
  const auto layers = layers_of({500, 100, 300, 100});
  EXPECT_EQ(select({"0"}, layers), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(select({"-1"}, layers), (std::vector<bool>{false, false, false, true}));
  EXPECT_EQ(select({"top:2"}, layers), (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(select({"last:2"}, layers), (std::vector<bool>{false, false, true, true}));
  // Ties go to the lower index.
  EXPECT_EQ(select({"smallest:1"}, layers), (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(select({"smallest:3"}, layers), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(select({"top:9"}, layers), (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(select({"top:0", "none"}, layers), (std::vector<bool>{false, false, false, false}));
  EXPECT_EQ(select({"all"}, layers), (std::vector<bool>{true, true, true, true}));
}

TEST(OciHotSet, DigestPrefixesMustNameOneLayer) {
  const auto layers = layers_of({1, 2, 3});
  EXPECT_EQ(select({"sha256:bb"}, layers), (std::vector<bool>{false, false, true}));
  EXPECT_EQ(select({layers[1].digest}, layers), (std::vector<bool>{false, true, false}));
  EXPECT_TRUE(fails_with(select_layers({*parse_layer_spec("sha256:aa", "--hot")}, layers, "--hot"), ErrorKind::kUsage,
                         {"--hot sha256:aa", "matches 2 layers (0 and 1)"}));
  EXPECT_TRUE(fails_with(select_layers({*parse_layer_spec("sha256:cc", "--hot")}, layers, "--hot"), ErrorKind::kUsage,
                         {"matches none of the image's 3 layer(s)"}));
  EXPECT_TRUE(fails_with(select_layers({*parse_layer_spec("3", "fetch")}, layers, "fetch"), ErrorKind::kUsage,
                         {"fetch 3: no such layer; the image has 3"}));
  EXPECT_TRUE(fails_with(select_layers({*parse_layer_spec("-4", "--hot")}, layers, "--hot"), ErrorKind::kUsage));
}

TEST(OciHotSet, MalformedSpecsAreUsageErrors) {
  for (const char* text : {"", "sha256:", "sha256:XYZ", "sha256:AB", "top:", "top:-1", "smallest:x", "biggest:2", "1.5",
                           "layer_sha256:abc"}) {
    EXPECT_TRUE(fails_with(parse_layer_spec(text, "--hot"), ErrorKind::kUsage, {"--hot '"})) << text;
  }
  EXPECT_TRUE(parse_layer_spec("sha256:" + std::string(64, 'a'), "--hot").has_value());
  EXPECT_FALSE(parse_layer_spec("sha256:" + std::string(65, 'a'), "--hot").has_value());
}

TEST(OciHotSet, MemoryPlanRefusesOrSpillsAHotSetOverTheCap) {
  const auto layers = layers_of({600, 300, 200, 5000});
  const std::vector<bool> hot = {true, true, true, false};
  auto fits = plan_memory(layers, hot, 1100, false, "cap");
  ASSERT_TRUE(fits.has_value());
  EXPECT_EQ(fits->memory_bytes, 1100);
  EXPECT_EQ(fits->placement,
            (std::vector<Placement>{Placement::kMemory, Placement::kMemory, Placement::kMemory, Placement::kDisk}));
  EXPECT_TRUE(fits->warnings.empty());
  EXPECT_TRUE(fails_with(plan_memory(layers, hot, 1000, false, "--max-memory X leaves 1000"), ErrorKind::kUsage,
                         {"the hot layers need 1.1 KiB (1100 bytes: layer 0 600 B, layer 1 300 B, layer 2 200 B)",
                          "--max-memory X leaves 1000", "--spill"}));
  // First fit in manifest order: 600 + 300 fit in 1000, 200 does not.
  auto spilled = plan_memory(layers, hot, 1000, true, "cap");
  ASSERT_TRUE(spilled.has_value());
  EXPECT_EQ(spilled->placement[2], Placement::kDisk);
  EXPECT_EQ(spilled->memory_bytes, 900);
  ASSERT_EQ(spilled->warnings.size(), 1u);
  EXPECT_NE(spilled->warnings[0].find("hot layer 2"), std::string::npos) << spilled->warnings[0];
  // A later layer that still fits goes to memory.
  auto gap = plan_memory(layers, hot, 820, true, "cap");
  ASSERT_TRUE(gap.has_value());
  EXPECT_EQ(gap->placement,
            (std::vector<Placement>{Placement::kMemory, Placement::kDisk, Placement::kMemory, Placement::kDisk}));
}

TEST(OciHotSet, ALayerNamedTwiceIsOneBlob) {
  auto layers = layers_of({100, 200, 300});
  layers[2].digest = layers[0].digest;
  layers[2].size = layers[0].size;
  // Its digest names "one" layer though two indices have it.
  EXPECT_EQ(select({layers[0].digest}, layers), (std::vector<bool>{true, false, true}));
  auto plan = plan_memory(layers, {true, false, true}, 150, false, "cap");
  ASSERT_TRUE(plan.has_value()) << plan.error().message;
  EXPECT_EQ(plan->hot_bytes, 100);
  EXPECT_EQ(plan->placement[2], Placement::kMemory);
}

TEST(OciHotSet, HumanBytes) {
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(1023), "1023 B");
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(human_bytes(int64_t{3} << 30), "3.0 GiB");
}

}  // namespace
}  // namespace cfmo::oci
