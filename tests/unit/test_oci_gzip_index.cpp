// The layer index against the layer: every file's bytes read through the
// index equal the tar's, for gzip streams of one member and of several
// (split at odd places), plain tars, pax and GNU headers, and spans small
// enough that files cross them; damaged indexes and spans are kInput.
#include "oci/gzip_index.h"

#include "core/atomic_file.h"
#include "oci/registry.h"
#include "support/expect_error.h"
#include "support/layer_builder.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <random>
#include <set>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using namespace cfmo::testing;

constexpr uint64_t kSpan = 64 << 10;
constexpr const char* kGzip = "application/vnd.oci.image.layer.v1.tar+gzip";
constexpr const char* kTar = "application/vnd.oci.image.layer.v1.tar";
constexpr const char* kZstd = "application/vnd.oci.image.layer.v1.tar+zstd";

struct Scratch {
  Scratch() {
    std::string pattern = (fs::temp_directory_path() / "cfmo-index-XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path = pattern;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

std::string text(size_t size) {
  std::string out;
  for (size_t i = 0; out.size() < size; ++i) out += "line " + std::to_string(i * 7919 % 1000) + " of a log\n";
  out.resize(size);
  return out;
}

/// Files of odd sizes (around the 512-byte blocks, and larger than a span,
/// random and compressible), long names, links and whiteouts.
std::vector<TarEntry> entries() {
  std::vector<TarEntry> e = {dir("etc"),
                             file("etc/empty", ""),
                             file("etc/one", "x"),
                             file("etc/511", random_bytes(511, 1)),
                             file("etc/512", random_bytes(512, 2)),
                             file("etc/513", random_bytes(513, 3)),
                             dir("usr"),
                             dir("usr/lib"),
                             file("usr/lib/big.so", random_bytes(300007, 4)),
                             file("usr/lib/log.txt", text(250001)),
                             file("usr/lib/" + std::string(150, 'n') + "/deep", random_bytes(70001, 5)),
                             symlink("lib", "usr/lib"),
                             hardlink("usr/lib/again.so", "usr/lib/big.so"),
                             whiteout("etc", "gone"),
                             opaque("usr"),
                             file("tail", random_bytes(131073, 6), 0755)};
  e[10].path = "usr/lib/" + std::string(150, 'n') + "/deep";
  return e;
}

/// A gzip stream of several members: the tar cut at odd places, each piece compressed on its own.
std::string multi_member(const std::string& tar) {
  std::string out;
  size_t at = 0;
  int level = 1;
  for (const size_t cut : {size_t{7777}, size_t{123457}, size_t{600001}, tar.size()}) {
    out += gzip(tar.substr(at, cut - at), level);
    at = cut;
    level = level % 9 + 2;
  }
  return out;
}

/// A zstd stream of frames of 40013 bytes of the tar each (levels varying),
/// with a skippable frame (as zstd:chunked writes its metadata) after the
/// third; `frames` gets how many frames were written.
std::string multi_frame(const std::string& tar, uint32_t& frames) {
  std::string out;
  frames = 0;
  int level = 1;
  for (size_t at = 0; at < tar.size(); at += 40013) {
    out += zstd(tar.substr(at, 40013), level);
    level = level % 9 + 2;
    if (++frames == 3) {
      const std::string skipped = "metadata a decoder skips";
      const uint32_t magic = 0x184D2A50;
      const auto size = static_cast<uint32_t>(skipped.size());
      for (const uint32_t v : {magic, size}) {
        for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
      }
      out += skipped;
      ++frames;
    }
  }
  return out;
}

struct Layer {
  std::string blob;
  Descriptor descriptor;
  fs::path path;
};

Layer write_layer(const Scratch& s, const std::string& blob, const char* media_type, const std::string& name) {
  Layer layer{blob, {media_type, sha256_digest(blob), static_cast<int64_t>(blob.size()), {}}, s.path / name};
  EXPECT_TRUE(write_file_atomic(layer.path, blob));
  return layer;
}

void expect_every_file_equal(const LayerIndex& index, const Layer& layer, const std::vector<TarEntry>& tar_entries) {
  FileSource source(layer.path);
  for (const auto& t : tar_entries) {
    SCOPED_TRACE(t.path);
    const IndexEntry* e = index.find(t.path);
    ASSERT_NE(e, nullptr);
    if (!t.hardlink.empty()) {
      EXPECT_EQ(e->type, '1');
      EXPECT_EQ(e->link, t.hardlink);
    } else if (t.type == AE_IFREG) {
      EXPECT_EQ(e->type, '0');
      EXPECT_EQ(e->size, t.data.size());
      EXPECT_EQ(e->mode, t.perm);
    } else if (t.type == AE_IFDIR) {
      EXPECT_EQ(e->type, '5');
    } else if (t.type == AE_IFLNK) {
      EXPECT_EQ(e->type, '2');
      EXPECT_EQ(e->link, t.link);
    }
    if (t.type != AE_IFREG) continue;
    auto bytes = read_entry(index, source, *e, "layer");
    ASSERT_TRUE(bytes) << bytes.error().message;
    const std::string& expected =
        t.hardlink.empty() ? t.data : std::find_if(tar_entries.begin(), tar_entries.end(), [&](const TarEntry& o) {
                                        return o.path == t.hardlink;
                                      })->data;
    EXPECT_TRUE(*bytes == expected) << bytes->size() << " bytes, expected " << expected.size();
  }
}

TEST(OciGzipIndex, EveryFileThroughTheIndexEqualsTheTar) {
  const auto tar_entries = entries();
  for (const TarFormat format : {TarFormat::kPax, TarFormat::kGnu}) {
    const std::string tar = make_tar(tar_entries, format);
    uint32_t frames = 0;
    const std::string zstd_frames = multi_frame(tar, frames);
    Scratch s;
    struct Case {
      const char* name;
      std::string blob;
      const char* media_type;
      uint32_t members;
    };
    for (const Case& c : {Case{"one member", gzip(tar), kGzip, 1}, Case{"four members", multi_member(tar), kGzip, 4},
                          Case{"uncompressed", tar, kTar, 0}, Case{"zstd frames", zstd_frames, kZstd, frames}}) {
      SCOPED_TRACE(std::string(c.name) + (format == TarFormat::kPax ? ", pax" : ", gnu"));
      const Layer layer = write_layer(s, c.blob, c.media_type, c.name);
      auto index = build_layer_index(layer.path, layer.descriptor, kSpan, "layer");
      ASSERT_TRUE(index) << index.error().message;
      EXPECT_EQ(index->uncompressed_size, tar.size());
      EXPECT_EQ(index->compressed_size, c.blob.size());
      EXPECT_EQ(index->members, c.members);
      EXPECT_TRUE(index->lazily_loadable());
      // Spans small enough that large files cross their boundaries (a
      // checkpoint waits for a deflate block's end, so spans may be longer).
      ASSERT_GE(index->checkpoints.size(), 4u);
      ASSERT_EQ(index->entries.size(), tar_entries.size());
      size_t crossing = 0;
      for (const auto& e : index->entries) {
        for (const auto& c : index->checkpoints) crossing += c.out > e.offset && c.out < e.offset + e.size ? 1 : 0;
      }
      EXPECT_GE(crossing, 3u);
      expect_every_file_equal(*index, layer, tar_entries);
      // Whiteouts are marked; so is an opaque directory.
      EXPECT_EQ(index->find("etc/.wh.gone")->whiteout, IndexWhiteout::kFile);
      EXPECT_EQ(index->find("usr/.wh..wh..opq")->whiteout, IndexWhiteout::kOpaque);
      EXPECT_EQ(index->find("etc/one")->whiteout, IndexWhiteout::kNone);
      // Each entry's time, as the tar has it (pax and GNU headers alike).
      for (const auto& e : index->entries) EXPECT_EQ(e.mtime, 1700000000) << e.path;
      // Any range of the stream, across spans and members, equals the tar's.
      FileSource source(layer.path);
      std::mt19937_64 rng(7);
      for (int i = 0; i < 40; ++i) {
        const uint64_t offset = rng() % tar.size();
        const uint64_t length = std::min<uint64_t>(rng() % (3 * kSpan), tar.size() - offset);
        auto range = read_range(*index, source, offset, length, "layer");
        ASSERT_TRUE(range) << range.error().message;
        EXPECT_TRUE(*range == tar.substr(offset, length)) << offset << "+" << length;
      }
      // The index survives its own format, whose size is known without making it.
      EXPECT_EQ(serialized_size(*index), serialize_index(*index).size());
      auto parsed = parse_index(serialize_index(*index), "index");
      ASSERT_TRUE(parsed) << parsed.error().message;
      EXPECT_EQ(parsed->checkpoints.size(), index->checkpoints.size());
      EXPECT_EQ(parsed->entries.front().mtime, index->entries.front().mtime);
      expect_every_file_equal(*parsed, layer, tar_entries);
    }
  }
}

// The serialized index of a gzip layer of entries(), written in `s`.
std::string index_bytes(const Scratch& s) {
  const Layer layer = write_layer(s, gzip(make_tar(entries())), kGzip, "layer");
  auto index = build_layer_index(layer.path, layer.descriptor, kSpan, "layer");
  EXPECT_TRUE(index) << index.error().message;
  return index ? serialize_index(*index) : std::string();
}

TEST(OciGzipIndex, ADamagedIndexIsBadInputNamingIt) {
  Scratch s;
  const std::string bytes = index_bytes(s);
  ASSERT_FALSE(bytes.empty());
  for (const size_t at : {size_t{0}, size_t{9}, size_t{40}, bytes.size() / 2, bytes.size() - 1}) {
    std::string damaged = bytes;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x20);
    EXPECT_TRUE(fails_with(parse_index(damaged, "x.idx"), ErrorKind::kInput, {"index 'x.idx'"})) << at;
  }
  EXPECT_TRUE(
      fails_with(parse_index(bytes.substr(0, bytes.size() - 100), "x.idx"), ErrorKind::kInput, {"index 'x.idx'"}));
  EXPECT_TRUE(fails_with(parse_index("", "x.idx"), ErrorKind::kInput, {"not a cfmo layer index"}));
  EXPECT_TRUE(fails_with(read_index(s.path / "absent"), ErrorKind::kInput, {"no such file"}));
}

// index_layer_digest reads the header alone (a lazy pull's check of an
// index whose blob digest it verified): the layer's digest, whatever the
// body; a file that is not an index, or a header cut short, is kInput.
TEST(OciGzipIndex, TheHeaderAloneNamesTheLayer) {
  Scratch s;
  std::string bytes = index_bytes(s);
  ASSERT_FALSE(bytes.empty());
  const std::string layer_digest = sha256_digest(gzip(make_tar(entries())));
  auto digest = index_layer_digest(bytes, "x.idx");
  ASSERT_TRUE(digest) << digest.error().message;
  EXPECT_EQ(*digest, layer_digest);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x20);  // the body: parse_index's to find
  digest = index_layer_digest(bytes, "x.idx");
  ASSERT_TRUE(digest) << digest.error().message;
  EXPECT_EQ(*digest, layer_digest);
  EXPECT_TRUE(fails_with(index_layer_digest("not an index at all, not even close to one", "x.idx"), ErrorKind::kInput,
                         {"index 'x.idx'", "not a cfmo layer index"}));
  EXPECT_TRUE(fails_with(index_layer_digest(bytes.substr(0, 60), "x.idx"), ErrorKind::kInput, {"index 'x.idx'"}));
}

TEST(OciGzipIndex, ASpanWhoseBytesChangedIsRefused) {
  const std::string tar = make_tar(entries());
  Scratch s;
  std::string blob = gzip(tar);
  const Layer layer = write_layer(s, blob, kGzip, "layer");
  auto index = build_layer_index(layer.path, layer.descriptor, kSpan, "layer");
  ASSERT_TRUE(index) << index.error().message;
  ASSERT_GE(index->checkpoints.size(), 3u);
  const auto [begin, end] = index->span_range(1);
  blob[(begin + end) / 2] = static_cast<char>(blob[(begin + end) / 2] ^ 1);
  ASSERT_TRUE(write_file_atomic(layer.path, blob));
  FileSource source(layer.path);
  EXPECT_TRUE(fails_with(read_range(*index, source, index->checkpoints[1].out, 10, "layer 0"), ErrorKind::kInput,
                         {"layer 0", "span 1", "SHA-256 mismatch"}));
  // Other spans are still read.
  EXPECT_TRUE(read_range(*index, source, 0, 100, "layer 0").has_value());
}

TEST(OciGzipIndex, WhatCannotBeIndexedSaysSo) {
  const std::string tar = make_tar(entries());
  Scratch s;
  const Layer zst = write_layer(s, zstd(tar).substr(0, 9000), kZstd, "zst");
  EXPECT_TRUE(fails_with(build_layer_index(zst.path, zst.descriptor, kSpan, "layer 2"), ErrorKind::kInput,
                         {"layer 2", "zstd stream is truncated"}));
  const Layer garbage = write_layer(s, zstd(tar) + "not a frame", kZstd, "garbage");
  EXPECT_TRUE(fails_with(build_layer_index(garbage.path, garbage.descriptor, kSpan, "layer 4"), ErrorKind::kInput,
                         {"layer 4", "not a valid zstd stream"}));
  const Layer gz = write_layer(s, gzip(tar), kGzip, "gz");
  EXPECT_TRUE(fails_with(build_layer_index(gz.path, gz.descriptor, 4096, "layer"), ErrorKind::kUsage, {"--span"}));
  const Layer cut = write_layer(s, gzip(tar).substr(0, 5000), kGzip, "cut");
  EXPECT_TRUE(fails_with(build_layer_index(cut.path, cut.descriptor, kSpan, "layer 1"), ErrorKind::kInput,
                         {"layer 1", "truncated"}));
  const Layer junk = write_layer(s, gzip(random_bytes(100000, 9)), kGzip, "junk");
  EXPECT_TRUE(fails_with(build_layer_index(junk.path, junk.descriptor, kSpan, "layer 3"), ErrorKind::kInput,
                         {"layer 3", "tar header"}));
}

// A zstd layer of one frame has one checkpoint: not lazily loadable (a span
// would be the layer), read from its start instead, in pieces, by LayerStream.
TEST(OciGzipIndex, AZstdLayerOfOneFrameIsNotLazilyLoadableAndStreams) {
  const auto tar_entries = entries();
  const std::string tar = make_tar(tar_entries);
  Scratch s;
  const Layer layer = write_layer(s, zstd(tar), kZstd, "one");
  auto index = build_layer_index(layer.path, layer.descriptor, kSpan, "layer 1");
  ASSERT_TRUE(index) << index.error().message;
  EXPECT_EQ(index->compression, IndexedCompression::kZstd);
  EXPECT_EQ(index->members, 1u);
  ASSERT_EQ(index->checkpoints.size(), 1u);
  EXPECT_FALSE(index->lazily_loadable());
  EXPECT_NE(not_lazily_loadable(*index).find("not lazily loadable"), std::string::npos);
  // Its file table is whole; read_range still works (through the one span).
  expect_every_file_equal(*index, layer, tar_entries);
  FileSource source(layer.path);
  LayerStream stream(*index, source, "layer 1");
  std::string all;
  for (uint64_t piece = 1; all.size() < tar.size(); piece = piece * 3 + 7) {
    auto got = stream.read(piece);
    ASSERT_TRUE(got) << got.error().message;
    ASSERT_FALSE(got->empty());
    all += *got;
    EXPECT_EQ(stream.position(), all.size());
  }
  EXPECT_TRUE(all == tar);
  EXPECT_TRUE(stream.read(100)->empty()) << "past the end";
  // A small one (one span or less) is lazily loadable: its span is small.
  const std::string small = make_tar({file("a", "b")});
  const Layer tiny = write_layer(s, zstd(small), kZstd, "tiny");
  auto tiny_index = build_layer_index(tiny.path, tiny.descriptor, kSpan, "layer 2");
  ASSERT_TRUE(tiny_index) << tiny_index.error().message;
  EXPECT_TRUE(tiny_index->lazily_loadable());
  // The format keeps the compression; a zstd checkpoint with a window is refused.
  auto parsed = parse_index(serialize_index(*index), "index");
  ASSERT_TRUE(parsed) << parsed.error().message;
  EXPECT_EQ(parsed->compression, IndexedCompression::kZstd);
  LayerIndex odd = *index;
  odd.checkpoints[0].window = "x";
  EXPECT_TRUE(fails_with(parse_index(serialize_index(odd), "odd"), ErrorKind::kInput, {"checkpoint 0"}));
}

// The frames' starts are the checkpoints, and a changed byte in one frame's span is caught by its SHA-256.
TEST(OciGzipIndex, ZstdCheckpointsAreFrameStartsAndSpansAreVerified) {
  const std::string tar = make_tar(entries());
  uint32_t frames = 0;
  std::string blob = multi_frame(tar, frames);
  std::set<uint64_t> starts = {0};
  for (size_t at = 0; at < blob.size();) {
    const size_t n = ZSTD_findFrameCompressedSize(blob.data() + at, blob.size() - at);
    ASSERT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
    at += n;
    starts.insert(at);
  }
  Scratch s;
  const Layer layer = write_layer(s, blob, kZstd, "frames");
  auto index = build_layer_index(layer.path, layer.descriptor, kSpan, "layer 3");
  ASSERT_TRUE(index) << index.error().message;
  for (const auto& c : index->checkpoints) {
    EXPECT_EQ(starts.count(c.in), 1u) << c.in << " is not a frame's start";
    EXPECT_NE(c.in, blob.size());
  }
  for (size_t k = 1; k < index->checkpoints.size(); ++k) {
    EXPECT_GE(index->checkpoints[k].out - index->checkpoints[k - 1].out, kSpan);
  }
  const auto [begin, end] = index->span_range(1);
  blob[(begin + end) / 2] = static_cast<char>(blob[(begin + end) / 2] ^ 1);
  ASSERT_TRUE(write_file_atomic(layer.path, blob));
  FileSource source(layer.path);
  EXPECT_TRUE(fails_with(read_range(*index, source, index->checkpoints[1].out, 10, "layer 3"), ErrorKind::kInput,
                         {"layer 3", "span 1", "SHA-256 mismatch"}));
  EXPECT_TRUE(read_range(*index, source, 0, 100, "layer 3").has_value());
}

}  // namespace
}  // namespace cfmo::oci
