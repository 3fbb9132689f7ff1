#include "oci/unpack.h"

#include "oci/decompress.h"
#include "support/expect_error.h"
#include "support/layer_builder.h"
#include "support/tree_listing.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using testing::dir;
using testing::file;
using testing::hardlink;
using testing::make_tar;
using testing::opaque;
using testing::symlink;
using testing::TarEntry;
using testing::whiteout;

/// A scratch directory with `root/` (the rootfs) and `outside/` beside it,
/// which no layer may touch.
class Scratch {
 public:
  Scratch() {
    std::string pattern = (fs::temp_directory_path() / "cfmo-unpack-XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
    fs::create_directories(root());
    fs::create_directories(outside());
    std::ofstream(outside() / "secret") << "keep me";
  }
  ~Scratch() {
    // Layers leave read-only directories, which a user other than root cannot empty.
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(path_, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      if (it->is_directory(ec) && !it->is_symlink(ec)) ::chmod(it->path().c_str(), 0700);
    }
    fs::remove_all(path_, ec);
  }
  fs::path root() const { return path_ / "root"; }
  fs::path outside() const { return path_ / "outside"; }
  const fs::path& path() const { return path_; }
  /// The outside directory as it was made: its one file unchanged, nothing added.
  bool outside_untouched() const {
    return testing::list_tree(outside()) == "secret file 644 7 " + secret_hash() + "\n";
  }

 private:
  static std::string secret_hash() {
    std::ostringstream s;
    s << std::hex << XXH3_64bits("keep me", 7);
    return s.str();
  }
  fs::path path_;
};

std::string hash_of(std::string_view data) {
  std::ostringstream h;
  h << std::hex << XXH3_64bits(data.data(), data.size());
  return h.str();
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string compress(const std::string& tar, Compression c) {
  switch (c) {
    case Compression::kNone:
      return tar;
    case Compression::kGzip:
      return testing::gzip(tar);
    case Compression::kZstd:
      return testing::zstd(tar);
  }
  return tar;
}

/// Writes `blob` to a file and unpacks it.
Result<UnpackStats> unpack_blob(const Scratch& s, const std::string& blob, Compression c, const UnpackOptions& o = {},
                                const fs::path& root = {}) {
  const fs::path path = s.path() / "blob";
  std::ofstream(path, std::ios::binary) << blob;
  return unpack_layer_file(path, root.empty() ? s.root() : root, c, o, "layer sha256:1234… (0)");
}

Result<UnpackStats> unpack(const Scratch& s, const std::vector<TarEntry>& entries, const UnpackOptions& o = {},
                           Compression c = Compression::kGzip) {
  return unpack_blob(s, compress(make_tar(entries), c), c, o);
}

/// Streams `blob` through a LayerUnpacker in chunks of `chunk` bytes.
Result<UnpackStats> stream(const fs::path& root, const std::string& blob, Compression c, size_t chunk,
                           const UnpackOptions& o = {}) {
  CFMO_ASSIGN_OR_RETURN(auto unpacker, LayerUnpacker::start(root, c, o, "layer sha256:5678… (1)"));
  for (size_t at = 0; at < blob.size(); at += chunk) {
    CFMO_TRY(unpacker->write(std::string_view(blob).substr(at, chunk)));
  }
  return unpacker->finish();
}

struct stat lstat_of(const fs::path& p) {
  struct stat st {};
  ::lstat(p.c_str(), &st);
  return st;
}

TEST(OciUnpack, CompressionFromMediaTypes) {
  EXPECT_EQ(*layer_compression("application/vnd.oci.image.layer.v1.tar"), Compression::kNone);
  EXPECT_EQ(*layer_compression("application/vnd.oci.image.layer.v1.tar+gzip"), Compression::kGzip);
  EXPECT_EQ(*layer_compression("application/vnd.oci.image.layer.v1.tar+zstd"), Compression::kZstd);
  EXPECT_EQ(*layer_compression("application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"), Compression::kGzip);
  EXPECT_EQ(*layer_compression("application/vnd.docker.image.rootfs.diff.tar.gzip"), Compression::kGzip);
  EXPECT_EQ(*layer_compression("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"), Compression::kGzip);
  EXPECT_EQ(*layer_compression("application/vnd.docker.image.rootfs.diff.tar"), Compression::kNone);
  EXPECT_TRUE(fails_with(layer_compression("application/vnd.oci.image.config.v1+json"), ErrorKind::kInput,
                         {"application/vnd.oci.image.config.v1+json"}));
  EXPECT_STREQ(compression_name(Compression::kZstd), "zstd");
}

TEST(OciUnpack, EveryEntryKind) {
  Scratch s;
  TarEntry exe = file("usr/bin/tool", "#!/bin/sh\necho hi\n", 04755);
  exe.mtime = 1600000000;
  TarEntry locked = dir("usr/share/locked", 0555);
  locked.mtime = 1500000000;
  TarEntry fifo;
  fifo.path = "run/pipe";
  fifo.type = AE_IFIFO;
  fifo.perm = 0600;
  TarEntry device;
  device.path = "dev/null";
  device.type = AE_IFCHR;
  device.perm = 0666;
  device.major = 1;
  device.minor = 3;
  TarEntry tagged = file("etc/tagged", "x");
  tagged.xattrs = {{"user.cfmo", "yes"}};
  TarEntry owned = file("home/u/owned", "mine");
  owned.uid = 1234;
  owned.gid = 5678;
  const std::vector<TarEntry> entries = {
      dir("usr"),
      dir("usr/bin"),
      exe,
      dir("usr/share"),
      locked,
      file("usr/share/locked/inside", "ro dir content"),
      symlink("usr/bin/sh", "/bin/busybox"),
      symlink("usr/bin/rel", "tool"),
      hardlink("usr/bin/tool-again", "usr/bin/tool"),
      dir("run"),
      fifo,
      dir("dev"),
      device,
      dir("etc"),
      tagged,
      dir("home"),
      dir("home/u"),
      owned,
      file("./dotted/implicit/parents", "made"),
  };
  auto stats = unpack(s, entries);
  ASSERT_TRUE(stats) << stats.error().message;
  EXPECT_EQ(stats->entries, static_cast<int64_t>(entries.size()));
  EXPECT_GT(stats->compressed_bytes, 0);
  EXPECT_GT(stats->uncompressed_bytes, stats->compressed_bytes);
  const fs::path r = s.root();
  EXPECT_EQ(slurp(r / "usr/bin/tool"), "#!/bin/sh\necho hi\n");
  EXPECT_EQ(lstat_of(r / "usr/bin/tool").st_mode & 07777, 04755u);
  EXPECT_EQ(lstat_of(r / "usr/bin/tool").st_mtim.tv_sec, 1600000000);
  EXPECT_EQ(lstat_of(r / "usr/share/locked").st_mode & 07777, 0555u);
  // A directory's time is set after its content is written.
  EXPECT_EQ(lstat_of(r / "usr/share/locked").st_mtim.tv_sec, 1500000000);
  EXPECT_EQ(slurp(r / "usr/share/locked/inside"), "ro dir content");
  EXPECT_EQ(fs::read_symlink(r / "usr/bin/sh"), "/bin/busybox");
  EXPECT_EQ(fs::read_symlink(r / "usr/bin/rel"), "tool");
  EXPECT_EQ(lstat_of(r / "usr/bin/tool-again").st_ino, lstat_of(r / "usr/bin/tool").st_ino);
  EXPECT_TRUE(S_ISFIFO(lstat_of(r / "run/pipe").st_mode));
  EXPECT_EQ(slurp(r / "dotted/implicit/parents"), "made");
  EXPECT_TRUE(fs::is_directory(r / "dotted/implicit"));
  char value[8] = {};
  if (::getxattr((r / "etc/tagged").c_str(), "user.cfmo", value, sizeof value) >= 0) {
    EXPECT_STREQ(value, "yes");
  }
  if (running_as_root()) {
    EXPECT_TRUE(S_ISCHR(lstat_of(r / "dev/null").st_mode));
    EXPECT_EQ(lstat_of(r / "dev/null").st_rdev, makedev(1, 3));
    EXPECT_EQ(lstat_of(r / "home/u/owned").st_uid, 1234u);
    EXPECT_EQ(lstat_of(r / "home/u/owned").st_gid, 5678u);
    EXPECT_EQ(stats->skipped_devices, 0);
  } else {
    EXPECT_FALSE(fs::exists(fs::symlink_status(r / "dev/null")));
    EXPECT_EQ(stats->skipped_devices, 1);
  }
}

TEST(OciUnpack, DevicesAndOwnersCanBeTurnedOff) {
  Scratch s;
  TarEntry device;
  device.path = "null";
  device.type = AE_IFCHR;
  device.major = 1;
  device.minor = 3;
  TarEntry owned = file("owned", "x");
  owned.uid = 4321;
  UnpackOptions o;
  o.devices = false;
  o.owners = false;
  auto stats = unpack(s, {device, owned}, o);
  ASSERT_TRUE(stats) << stats.error().message;
  EXPECT_EQ(stats->skipped_devices, 1);
  EXPECT_FALSE(fs::exists(fs::symlink_status(s.root() / "null")));
  EXPECT_EQ(lstat_of(s.root() / "owned").st_uid, ::geteuid());
}

TEST(OciUnpack, LongAndUnusualNames) {
  const std::string deep = std::string(120, 'd') + "/" + std::string(150, 'e') + "/" + std::string(200, 'f');
  const std::string link_target = std::string(300, 't');
  for (const auto format : {testing::TarFormat::kPax, testing::TarFormat::kGnu}) {
    Scratch s;
    const std::vector<TarEntry> entries = {
        file(deep, "deep"),
        symlink("long-link", link_target),
        hardlink("short", deep),
        file("spaces and ünïcödé/ file", "u"),
    };
    const std::string blob = testing::gzip(make_tar(entries, format));
    auto stats = unpack_blob(s, blob, Compression::kGzip);
    ASSERT_TRUE(stats) << stats.error().message;
    EXPECT_EQ(slurp(s.root() / deep), "deep");
    EXPECT_EQ(fs::read_symlink(s.root() / "long-link").string(), link_target);
    EXPECT_EQ(lstat_of(s.root() / "short").st_ino, lstat_of(s.root() / deep).st_ino);
    EXPECT_EQ(slurp(s.root() / "spaces and ünïcödé/ file"), "u");
  }
}

TEST(OciUnpack, WhiteoutsAndOpaqueDirectoriesAcrossLayers) {
  Scratch s;
  ASSERT_TRUE(unpack(s, {dir("a"), file("a/x", "x"), file("a/y", "y"), dir("b"), file("b/z", "z"), dir("c"),
                         file("c/old", "old"), dir("c/sub"), file("c/sub/deeper", "d"), dir("d"), file("d/old", "o"),
                         dir("e"), dir("e/sub"), file("e/sub/old", "o"), file("e/other", "o"), file("f", "f")}));
  // Layer 2: the opaque marker of d comes after d's new file, and e's after
  // e/sub/file, whose parent e/sub the layer has no entry for.
  ASSERT_TRUE(unpack(s,
                     {whiteout("a", "x"), whiteout("", "b"), dir("c"), opaque("c"), file("c/new", "new"), dir("d"),
                      file("d/keep", "k"), opaque("d"), file("e/sub/file", "f"), opaque("e"), whiteout("", "absent"),
                      file(".wh..wh.plnk", "")},
                     {}, Compression::kZstd));
  EXPECT_EQ(testing::list_tree(s.root()),
            "a dir 755\n"
            "a/y file 644 1 " +
                hash_of("y") +
                "\n"
                "c dir 755\n"
                "c/new file 644 3 " +
                hash_of("new") +
                "\n"
                "d dir 755\n"
                "d/keep file 644 1 " +
                hash_of("k") +
                "\n"
                "e dir 755\n"
                "e/sub dir 755\n"
                "e/sub/file file 644 1 " +
                hash_of("f") +
                "\n"
                "f file 644 1 " +
                hash_of("f") + "\n");
  // Layer 3 brings back what layer 2 removed; a non-directory replaces a directory and the reverse.
  ASSERT_TRUE(unpack(s, {file("b", "now a file"), dir("f"), file("f/inside", "i")}, {}, Compression::kNone));
  EXPECT_EQ(slurp(s.root() / "b"), "now a file");
  EXPECT_TRUE(fs::is_directory(s.root() / "f"));
}

TEST(OciUnpack, KeepAndOverlayWhiteoutModes) {
  Scratch s;
  UnpackOptions keep;
  keep.whiteouts = WhiteoutMode::kKeep;
  ASSERT_TRUE(unpack(s, {dir("a"), whiteout("a", "x"), opaque("a")}, keep));
  EXPECT_TRUE(fs::is_regular_file(s.root() / "a/.wh.x"));
  EXPECT_TRUE(fs::is_regular_file(s.root() / "a/.wh..wh..opq"));

  UnpackOptions overlay;
  overlay.whiteouts = WhiteoutMode::kOverlay;
  Scratch o;
  auto stats = unpack(o, {dir("a"), whiteout("a", "x"), opaque("a"), whiteout("b/c", "y")}, overlay);
  if (!running_as_root()) {
    EXPECT_TRUE(fails_with(stats, ErrorKind::kUsage, {"root"}));
    return;
  }
  ASSERT_TRUE(stats) << stats.error().message;
  const auto st = lstat_of(o.root() / "a/x");
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  EXPECT_TRUE(S_ISCHR(lstat_of(o.root() / "b/c/y").st_mode));
  char value[4] = {};
  const ssize_t n = ::getxattr((o.root() / "a").c_str(), "trusted.overlay.opaque", value, sizeof value);
  ASSERT_EQ(n, 1) << std::strerror(errno);
  EXPECT_EQ(value[0], 'y');
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.root() / "a/.wh..wh..opq")));
}

TEST(OciUnpack, ForgedOverlayXattrsAreNotSet) {
  if (!running_as_root()) GTEST_SKIP() << "trusted.* xattrs need root";
  Scratch s;
  TarEntry d = dir("a");
  d.xattrs = {{"trusted.overlay.opaque", "y"}};
  auto stats = unpack(s, {d});
  ASSERT_TRUE(stats) << stats.error().message;
  EXPECT_GE(stats->skipped_xattrs, 1);
  char value[4];
  EXPECT_LT(::getxattr((s.root() / "a").c_str(), "trusted.overlay.opaque", value, sizeof value), 0);
}

// Every way out of the root: each is kInput naming the layer and the entry,
// and nothing appears or changes outside.
TEST(OciUnpack, EscapesAreRefused) {
  struct Case {
    const char* name;
    std::vector<std::vector<TarEntry>> layers;  // the last one must fail
    const char* message;
  };
  const std::vector<Case> cases = {
      {"dot-dot", {{file("../outside/evil", "x")}}, "'..'"},
      {"dot-dot inside", {{dir("a"), file("a/../../outside/evil", "x")}}, "'..'"},
      {"absolute", {{file("/tmp/cfmo-evil", "x")}}, "absolute"},
      {"symlink then write", {{symlink("s", "../outside"), file("s/evil", "x")}}, "symlink"},
      {"absolute symlink then write", {{symlink("s", "/"), file("s/tmp/cfmo-evil", "x")}}, "symlink"},
      {"symlink in an earlier layer", {{symlink("s", "../outside")}, {file("s/evil", "x")}}, "symlink"},
      {"directory replaced by a symlink",
       {{dir("d"), file("d/f", "f")}, {symlink("d", "../outside")}, {file("d/evil", "x")}},
       "symlink"},
      {"same layer replaces a directory", {{dir("d"), symlink("d", "../outside"), file("d/evil", "x")}}, "symlink"},
      {"hard link out", {{hardlink("h", "../outside/secret")}}, "'..'"},
      {"hard link absolute", {{hardlink("h", "/etc/passwd")}}, "absolute"},
      {"hard link through a symlink", {{symlink("s", "../outside"), hardlink("h", "s/secret")}}, "symlink"},
      {"hard link to nothing", {{hardlink("h", "absent")}}, "not in the root"},
      {"whiteout through a symlink", {{symlink("s", "../outside")}, {whiteout("s", "secret")}}, "symlink"},
      {"opaque through a symlink", {{symlink("s", "../outside")}, {opaque("s")}}, "symlink"},
      {"parent is a file", {{file("f", "f"), file("f/x", "x")}}, "not a directory"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Scratch s;
    for (size_t i = 0; i + 1 < c.layers.size(); ++i) ASSERT_TRUE(unpack(s, c.layers[i])) << c.name;
    auto stats = unpack(s, c.layers.back());
    EXPECT_TRUE(fails_with(stats, ErrorKind::kInput, {"layer sha256:1234… (0)", "entry '", c.message}));
    EXPECT_TRUE(s.outside_untouched()) << testing::list_tree(s.outside());
    EXPECT_FALSE(fs::exists("/tmp/cfmo-evil"));
  }
}

// A refused hard link is named by its own entry; its target is named as the target.
TEST(OciUnpack, RefusedHardLinkNamesTheEntryAndItsTarget) {
  struct Case {
    std::vector<TarEntry> entries;
    std::string target;
    const char* problem;
  };
  const std::vector<Case> cases = {
      {{hardlink("h", "../outside/secret")}, "hard link target '../outside/secret'", "'..'"},
      {{hardlink("h", "/etc/passwd")}, "hard link target '/etc/passwd'", "absolute"},
      {{symlink("s", "../outside"), hardlink("h", "s/secret")}, "hard link target 's/secret'", "symlink"},
      {{hardlink("h", "absent")}, "hard link to 'absent'", "not in the root"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.target);
    Scratch s;
    auto stats = unpack(s, c.entries);
    EXPECT_TRUE(fails_with(stats, ErrorKind::kInput, {"entry 'h': ", c.target, c.problem}));
    if (!stats) {
      EXPECT_EQ(stats.error().message.find("entry '" + c.entries.back().hardlink), std::string::npos);
    }
  }
}

TEST(OciUnpack, EscapesAreRefusedWithoutOpenat2Too) {
  detail::use_openat2(false);
  struct Restore {
    ~Restore() { detail::use_openat2(true); }
  } restore;
  Scratch s;
  auto first =
      unpack(s, {dir("a"), dir("a/b"), file("a/b/c", "c"), symlink("s", "../outside"), dir("d"), symlink("d/l", "/")});
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(fails_with(unpack(s, {file("s/evil", "x")}), ErrorKind::kInput, {"'s' is a symlink"}));
  EXPECT_TRUE(fails_with(unpack(s, {file("d/l/tmp/cfmo-evil", "x")}), ErrorKind::kInput, {"'d/l' is a symlink"}));
  EXPECT_TRUE(fails_with(unpack(s, {whiteout("s", "secret")}), ErrorKind::kInput, {"symlink"}));
  EXPECT_TRUE(fails_with(unpack(s, {hardlink("h", "s/secret")}), ErrorKind::kInput, {"symlink"}));
  auto second = unpack(s, {file("a/b/c", "new"), file("a/b/d", "d"), whiteout("a", "x"), opaque("d")});
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_EQ(slurp(s.root() / "a/b/c"), "new");
  EXPECT_FALSE(fs::exists(fs::symlink_status(s.root() / "d/l")));
  EXPECT_TRUE(s.outside_untouched());
  EXPECT_FALSE(fs::exists("/tmp/cfmo-evil"));
}

TEST(OciUnpack, EntriesReplaceSymlinksInsteadOfFollowingThem) {
  Scratch s;
  ASSERT_TRUE(unpack(s, {symlink("f", "../outside/secret"), symlink("d", "../outside"), symlink("h", "../outside")}));
  // A file, a directory and a hard link over the symlinks replace them.
  ASSERT_TRUE(unpack(s, {file("f", "new"), dir("d"), file("d/inside", "i"), file("t", "t"), hardlink("h", "t")}));
  EXPECT_TRUE(s.outside_untouched());
  EXPECT_EQ(slurp(s.root() / "f"), "new");
  EXPECT_FALSE(fs::is_symlink(s.root() / "d"));
  EXPECT_EQ(lstat_of(s.root() / "h").st_ino, lstat_of(s.root() / "t").st_ino);
}

TEST(OciUnpack, CompressionsAndGzipImplementationsAgree) {
  const std::vector<TarEntry> entries = {dir("data"), file("data/text", std::string(3u << 20, 'a')),
                                         file("data/random", testing::random_bytes(1u << 20, 7)),
                                         file("data/empty", "")};
  const std::string tar = make_tar(entries);
  std::string expected;
  for (const auto c : {Compression::kNone, Compression::kGzip, Compression::kZstd}) {
    Scratch s;
    auto stats = unpack_blob(s, compress(tar, c), c);
    ASSERT_TRUE(stats) << compression_name(c) << ": " << stats.error().message;
    EXPECT_EQ(stats->uncompressed_bytes, static_cast<int64_t>(tar.size())) << compression_name(c);
    const std::string listing = testing::list_tree(s.root());
    if (expected.empty()) expected = listing;
    EXPECT_EQ(listing, expected) << compression_name(c);
  }
  // igzip and zlib give the same bytes, for one gzip member and several.
  const std::string two_members = testing::gzip(tar.substr(0, 5000)) + testing::gzip(tar.substr(5000));
  for (const bool zlib : {false, true}) {
    for (const std::string* blob : {&two_members}) {
      struct Source : ByteSource {
        std::string_view data;
        size_t chunk;
        Result<std::string_view> next() override {
          const auto piece = data.substr(0, chunk);
          data.remove_prefix(piece.size());
          return piece;
        }
      } source;
      source.data = *blob;
      source.chunk = 777;
      auto decoder = make_gzip_decoder(source, "test", zlib);
      std::string out;
      while (true) {
        auto block = decoder->read();
        ASSERT_TRUE(block) << (zlib ? "zlib: " : "igzip: ") << block.error().message;
        if (block->empty()) break;
        out.append(*block);
      }
      EXPECT_TRUE(out == tar) << (zlib ? "zlib" : "igzip");
      EXPECT_EQ(decoder->compressed_bytes(), static_cast<int64_t>(blob->size()));
    }
  }
  EXPECT_NE(std::string(gzip_implementation()), "");
}

TEST(OciUnpack, TruncatedAndCorruptStreamsAreBadInput) {
  const std::string tar = make_tar({file("a", testing::random_bytes(200000, 3)), file("b", std::string(100000, 'b'))});
  const std::string gz = testing::gzip(tar);
  const std::string zs = testing::zstd(tar);
  struct Case {
    const char* name;
    std::string blob;
    Compression c;
  };
  std::string flipped_gz = gz;
  flipped_gz[gz.size() / 2] ^= 0x10;
  std::string flipped_crc = gz;
  flipped_crc[gz.size() - 6] ^= 1;
  std::string flipped_zs = zs;
  flipped_zs[zs.size() / 2] ^= 0x10;
  std::string bad_header = tar;
  bad_header[148] ^= 7;  // the first header's checksum field
  const std::vector<Case> cases = {
      {"gzip cut in half", gz.substr(0, gz.size() / 2), Compression::kGzip},
      {"gzip without its trailer", gz.substr(0, gz.size() - 4), Compression::kGzip},
      {"gzip with a flipped byte", flipped_gz, Compression::kGzip},
      {"gzip with a wrong CRC", flipped_crc, Compression::kGzip},
      {"gzip followed by garbage", gz + "garbage", Compression::kGzip},
      {"not gzip", tar, Compression::kGzip},
      {"empty gzip", "", Compression::kGzip},
      {"zstd cut in half", zs.substr(0, zs.size() / 2), Compression::kZstd},
      {"zstd with a flipped byte", flipped_zs, Compression::kZstd},
      {"zstd followed by garbage", zs + "garbage", Compression::kZstd},
      {"empty zstd", "", Compression::kZstd},
      {"tar cut mid-file", tar.substr(0, 100000), Compression::kNone},
      {"tar with a bad header", bad_header, Compression::kNone},
      {"not a tar", testing::random_bytes(5000, 1), Compression::kNone},
      {"gzip of a truncated tar", testing::gzip(tar.substr(0, 100000)), Compression::kGzip},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Scratch s;
    EXPECT_TRUE(fails_with(unpack_blob(s, c.blob, c.c), ErrorKind::kInput, {"layer sha256:1234… (0)"}));
    Scratch t;
    EXPECT_TRUE(fails_with(stream(t.root(), c.blob, c.c, 4096), ErrorKind::kInput, {"layer sha256:5678… (1)"}));
  }
}

TEST(OciUnpack, StreamingInTinyAndHugeChunksGivesTheSameTree) {
  const std::vector<TarEntry> entries = {dir("x"), file("x/big", testing::random_bytes(6u << 20, 11)),
                                         file("x/zeros", std::string(9u << 20, '\0')), symlink("x/l", "big"),
                                         hardlink("x/h", "x/big")};
  const std::string tar = make_tar(entries);
  std::string expected;
  {
    Scratch s;
    ASSERT_TRUE(unpack_blob(s, testing::gzip(tar), Compression::kGzip));
    expected = testing::list_tree(s.root());
  }
  for (const auto c : {Compression::kGzip, Compression::kZstd, Compression::kNone}) {
    const std::string blob = compress(tar, c);
    for (const size_t chunk : {size_t{1} << 30, size_t{65536}, size_t{1}}) {
      if (chunk == 1 && c != Compression::kZstd) continue;  // one byte at a time: once is enough
      SCOPED_TRACE(std::string(compression_name(c)) + " chunk " + std::to_string(chunk));
      Scratch s;
      UnpackOptions small;
      small.buffer_bytes = 64u << 10;
      auto stats =
          stream(s.root(), chunk == 1 ? compress(make_tar({file("one", "byte at a time")}), c) : blob, c, chunk, small);
      ASSERT_TRUE(stats) << stats.error().message;
      if (chunk == 1) {
        EXPECT_EQ(slurp(s.root() / "one"), "byte at a time");
      } else {
        EXPECT_EQ(stats->compressed_bytes, static_cast<int64_t>(blob.size()));
        EXPECT_EQ(testing::list_tree(s.root()), expected);
      }
    }
  }
}

TEST(OciUnpack, AStreamingErrorReachesTheWriterAndAbortEndsAtOnce) {
  Scratch s;
  // An escape in the first entry, then many MiB: write() returns the error
  // instead of blocking on the full buffer.
  const std::string blob =
      testing::gzip(make_tar({file("../evil", "x"), file("big", testing::random_bytes(8u << 20, 5))}));
  UnpackOptions small;
  small.buffer_bytes = 64u << 10;
  auto unpacker = LayerUnpacker::start(s.root(), Compression::kGzip, small, "layer sha256:9abc… (2)");
  ASSERT_TRUE(unpacker);
  Status status;
  for (size_t at = 0; at < blob.size() && status; at += 16384) {
    status = (*unpacker)->write(std::string_view(blob).substr(at, 16384));
  }
  EXPECT_TRUE(fails_with(status, ErrorKind::kInput, {"layer sha256:9abc… (2)", "'..'"}));
  EXPECT_TRUE(fails_with((*unpacker)->finish(), ErrorKind::kInput, {"'..'"}));
  EXPECT_TRUE(s.outside_untouched());

  // Abort in the middle of a good stream, and a destructor without finish.
  const std::string good = testing::gzip(make_tar({file("big", testing::random_bytes(4u << 20, 6))}));
  for (const bool explicit_abort : {true, false}) {
    Scratch t;
    auto u = LayerUnpacker::start(t.root(), Compression::kGzip, small, "layer");
    ASSERT_TRUE(u);
    ASSERT_TRUE((*u)->write(std::string_view(good).substr(0, good.size() / 2)));
    if (explicit_abort) {
      (*u)->abort();
      EXPECT_FALSE((*u)->write("more"));
    }
    u->reset();
  }
}

TEST(OciUnpack, ASecondRunOverAPartialLayerIsTheSameAsOne) {
  // A restarted download feeds the same layer again from its first byte.
  const std::vector<TarEntry> entries = {dir("a"),    file("a/x", "x"), hardlink("a/y", "a/x"), symlink("a/z", "x"),
                                         opaque("a"), dir("b", 0500),   file("b/f", "f")};
  Scratch once;
  ASSERT_TRUE(unpack(once, {file("a/lower", "l")}));
  ASSERT_TRUE(unpack(once, entries));
  Scratch twice;
  ASSERT_TRUE(unpack(twice, {file("a/lower", "l")}));
  const std::string tar = make_tar(entries);
  ASSERT_TRUE(unpack_blob(twice, tar.substr(0, 3000), Compression::kNone).error().kind == ErrorKind::kInput);
  ASSERT_TRUE(unpack_blob(twice, tar, Compression::kNone));
  EXPECT_EQ(testing::list_tree(twice.root()), testing::list_tree(once.root()));
}

}  // namespace
}  // namespace cfmo::oci
