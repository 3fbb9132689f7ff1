// The lazy mount's tree, merged from layer indexes as the rootfs unpacker
// applies layers: whiteouts only take lower layers' entries, opaque
// directories keep their own layer's, hard links share a node.
#include "oci/lazy_mount.h"

#include <gtest/gtest.h>

namespace cfmo::oci {
namespace {

IndexEntry entry(std::string path, char type = '0', std::string link = "") {
  IndexEntry e;
  e.path = std::move(path);
  e.type = type;
  e.mode = type == '5' ? 0755 : 0644;
  e.link = std::move(link);
  const std::string_view base = std::string_view(e.path).substr(e.path.rfind('/') + 1);
  if (base == ".wh..wh..opq") {
    e.whiteout = IndexWhiteout::kOpaque;
  } else if (base.starts_with(".wh.")) {
    e.whiteout = IndexWhiteout::kFile;
  }
  return e;
}

LayerIndex layer(std::vector<IndexEntry> entries) {
  LayerIndex index;
  index.layer_digest = "sha256:" + std::string(64, 'a');
  index.entries = std::move(entries);
  return index;
}

TEST(LazyTree, WhiteoutsOpaqueDirectoriesAndHardLinksMergeAsUnpacking) {
  const LayerIndex base =
      layer({entry("etc", '5'), entry("etc/a"), entry("etc/b"), entry("opt", '5'), entry("opt/lower"),
             entry("usr/bin/tool"), entry("usr/link", '1', "usr/bin/tool"), entry("bin", '2', "usr/bin")});
  const LayerIndex middle =
      layer({entry("etc/.wh.a"), entry("etc/new"), entry("etc/.wh.new"), entry("usr/bin/.wh.tool")});
  const LayerIndex top = layer({entry("opt", '5'), entry("opt/mine"), entry("opt/.wh..wh..opq")});
  auto tree = merge_indexes({&base, &middle, &top});
  ASSERT_TRUE(tree) << tree.error().message;
  EXPECT_EQ(tree->resolve("etc/a"), 0u);
  EXPECT_NE(tree->resolve("etc/b"), 0u);
  EXPECT_NE(tree->resolve("etc/new"), 0u) << "a whiteout took its own layer's entry";
  EXPECT_EQ(tree->resolve("opt/lower"), 0u);
  EXPECT_NE(tree->resolve("opt/mine"), 0u) << "the opaque directory took its own layer's entry";
  // The tool's other name keeps the file, now with one link.
  EXPECT_EQ(tree->resolve("usr/bin/tool"), 0u);
  const size_t link = tree->resolve("usr/link");
  ASSERT_NE(link, 0u);
  EXPECT_EQ(tree->node(link).nlink, 1u);
  EXPECT_EQ(tree->path(link), "/usr/bin/tool") << "its first name, where it was first seen";
  EXPECT_EQ(tree->node(tree->resolve("bin")).link, "usr/bin");
  // Implicit parents are directories; proc, sys and dev are supplied.
  EXPECT_EQ(tree->node(tree->resolve("usr/bin")).type, '5');
  for (const char* d : {"proc", "sys", "dev"}) EXPECT_EQ(tree->node(tree->resolve(d)).type, '5') << d;
  EXPECT_EQ(tree->node(1).nlink, 2u + 6u);  // etc, opt, usr, proc, sys, dev
}

TEST(LazyTree, AHardLinkToNothingAndAPathOutOfTheRootAreRefused) {
  const LayerIndex dangling = layer({entry("a", '1', "missing")});
  EXPECT_FALSE(merge_indexes({&dangling}));
  const LayerIndex escape = layer({entry("../etc/passwd")});
  EXPECT_FALSE(merge_indexes({&escape}));
}

}  // namespace
}  // namespace cfmo::oci
