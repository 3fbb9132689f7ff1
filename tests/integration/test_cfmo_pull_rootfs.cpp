// cfmo-pull --output rootfs: against a real docker-registry: the tree equals
// umoci's unpack of the same image (gzip, zstd and plain layers, whiteouts and
// opaque directories across them); malicious layers are refused with exit 3
// and nothing written outside the target; a digest mismatch or a restarted
// download during the streamed unpack (served by the tiny server) leaves no
// complete rootfs.
#include "integration/registry_fixture.h"
#include "support/layer_builder.h"
#include "support/tree_listing.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace cfmo {
namespace {

using namespace cfmo::pulltest;
using testing::dir;
using testing::file;
using testing::hardlink;
using testing::make_tar;
using testing::opaque;
using testing::symlink;
using testing::TarEntry;
using testing::whiteout;

bool have_umoci() { return system("command -v umoci >/dev/null 2>&1") == 0; }

/// Three layers, one of each compression, that exercise what a rootfs must get right.
std::vector<RealLayer> mixed_layers() {
  TarEntry fifo;
  fifo.path = "run/initctl";
  fifo.type = AE_IFIFO;
  fifo.perm = 0600;
  TarEntry exe = file("usr/bin/tool", "#!/bin/sh\necho tool\n", 0755);
  TarEntry setuid = file("usr/bin/su", "su", 04755);
  TarEntry owned = file("home/user/notes", "mine", 0600);
  owned.uid = 1000;
  owned.gid = 1000;
  const std::string long_dir = "usr/share/" + std::string(90, 'l') + "/" + std::string(120, 'm');
  std::vector<TarEntry> base = {dir("bin"),
                                dir("etc"),
                                file("etc/hostname", "cfmo\n"),
                                file("etc/passwd", "root:x:0:0::/root:/bin/sh\n"),
                                dir("usr"),
                                dir("usr/bin"),
                                exe,
                                setuid,
                                hardlink("usr/bin/tool-link", "usr/bin/tool"),
                                symlink("usr/bin/sh", "tool"),
                                symlink("lib", "usr/lib"),
                                dir("usr/lib"),
                                file("usr/lib/libc.so", std::string(200000, 'c')),
                                dir("usr/share"),
                                dir("usr/share/" + std::string(90, 'l')),
                                dir(long_dir),
                                file(long_dir + "/file", "long"),
                                dir("opt"),
                                dir("opt/app"),
                                file("opt/app/old-config", "old"),
                                dir("opt/app/plugins"),
                                file("opt/app/plugins/a", "a"),
                                dir("var"),
                                dir("var/cache"),
                                file("var/cache/big", testing::random_bytes(300000, 4)),
                                file("var/cache/small", "s"),
                                dir("run"),
                                fifo,
                                dir("home", 0755),
                                dir("home/user", 0700),
                                owned,
                                dir("tmp", 01777)};
  std::vector<TarEntry> update = {dir("etc"),
                                  file("etc/hostname", "cfmo-2\n"),
                                  whiteout("etc", "passwd"),
                                  dir("opt/app"),
                                  opaque("opt/app"),
                                  file("opt/app/new-config", "new"),
                                  dir("var/cache"),
                                  whiteout("var/cache", "big"),
                                  dir("usr/bin"),
                                  symlink("usr/bin/tool-link", "tool"),  // a hard link becomes a symlink
                                  file("srv", "a file where layer 0 had nothing")};
  std::vector<TarEntry> top = {dir("srv-dir", 0750), file("srv-dir/index.html", "<html/>"),
                               dir("etc"),           file("etc/passwd", "back again\n", 0640),
                               dir("var"),           whiteout("var", "cache")};
  return {{make_tar(base), "tar+gzip"}, {make_tar(update), "tar+zstd"}, {make_tar(top), "tar"}};
}

/// One registry for the suite, holding the mixed image and the malicious ones.
class RootfsFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kRegistryBinary)) return;
    registry_ = new Registry();
    if (!registry_->start()) {
      setup_error_ = "docker-registry did not start: " + registry_->log();
      return;
    }
    mixed_ = new FixtureImage(make_real_image(mixed_layers()));
    // The same tars without zstd, which umoci 0.4 does not read.
    auto layers = mixed_layers();
    for (auto& layer : layers) {
      if (layer.kind == "tar+zstd") layer.kind = "tar+gzip";
    }
    const FixtureImage gzip_twin = make_real_image(layers);
    if (!push_image(*registry_, "rootfs/mixed", "v1", *mixed_) ||
        !push_image(*registry_, "rootfs/mixed-gzip", "v1", gzip_twin)) {
      setup_error_ = "push failed: " + registry_->log();
    }
  }
  static void TearDownTestSuite() {
    delete registry_;
    registry_ = nullptr;
    delete mixed_;
    mixed_ = nullptr;
  }
  void SetUp() override {
    if (!fs::exists(kRegistryBinary)) GTEST_SKIP() << kRegistryBinary << " not installed (Debian docker-registry)";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }

  std::string ref(const std::string& repository_tag) const { return registry_->host() + "/" + repository_tag; }

  static inline Registry* registry_ = nullptr;
  static inline FixtureImage* mixed_ = nullptr;
  static inline std::string setup_error_;
};

/// Whatever sits next to the rootfs: no staging or old trees left behind.
std::vector<std::string> siblings(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(RootfsFixture, ARootfsEqualsUmociUnpack) {
  if (!have_umoci()) GTEST_SKIP() << "umoci not installed: nothing to compare with";
  TempDir out;
  // The gzip + gzip + tar image into a layout and a rootfs at once, for umoci to unpack the layout.
  const RunResult r =
      pull({"pull", ref("rootfs/mixed-gzip:v1"), "--plain-http", "--output", "oci:" + (out / "layout").string(),
            "--output", "rootfs:" + (out / "rootfs").string(), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto report = Json::parse(r.out);
  EXPECT_EQ(report["rootfs"]["dir"], (out / "rootfs").string());
  EXPECT_GT(report["rootfs"]["entries"].get<int64_t>(), 30);
  ASSERT_EQ(report["layers"].size(), 3u);
  // The gzip + zstd + tar image of the same tars, into a rootfs alone.
  const RunResult z = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output",
                            "rootfs:" + (out / "rootfs-zstd").string(), "--cache", (out / "cache").string()});
  ASSERT_EQ(z.status, 0) << z.err;

  const bool root = geteuid() == 0;
  const RunResult unpack = run({"/bin/sh", "-c",
                                std::string("umoci unpack ") + (root ? "" : "--rootless ") + "--image '" +
                                    (out / "layout").string() + ":v1' '" + (out / "bundle").string() + "' 2>&1"});
  ASSERT_EQ(unpack.status, 0) << unpack.out;
  testing::ListingOptions options;
  options.owners = root;
  options.mtimes = true;
  const std::string theirs = testing::list_tree(out / "bundle" / "rootfs", options);
  EXPECT_EQ(testing::list_tree(out / "rootfs", options), theirs);
  EXPECT_EQ(testing::list_tree(out / "rootfs-zstd", options), theirs);
  // The whiteouts did what they say.
  EXPECT_EQ(slurp(out / "rootfs/etc/passwd"), "back again\n");
  EXPECT_FALSE(fs::exists(out / "rootfs/opt/app/old-config"));
  EXPECT_FALSE(fs::exists(out / "rootfs/var/cache"));
  EXPECT_EQ(siblings(out.path()), (std::vector<std::string>{"bundle", "cache", "layout", "rootfs", "rootfs-zstd"}));
}

TEST_F(RootfsFixture, ARootfsOnlyPullKeepsItsBlobsInTheCache) {
  TempDir out;
  const auto cache = out / "cache";
  const auto rootfs = out / "rootfs";
  const RunResult first = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output", "rootfs:" + rootfs.string(),
                                "--cache", cache.string(), "--json"});
  ASSERT_EQ(first.status, 0) << first.err;
  for (const auto& layer : mixed_->layers) expect_blob(cache, layer);
  const std::string tree = testing::list_tree(rootfs);
  EXPECT_EQ(slurp(rootfs / "etc/hostname"), "cfmo-2\n");

  // A second pull into a non-empty directory is refused before any download...
  const RunResult refused = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output",
                                  "rootfs:" + rootfs.string(), "--cache", cache.string()});
  EXPECT_EQ(refused.status, 2) << refused.err;
  EXPECT_NE(refused.err.find("--replace"), std::string::npos) << refused.err;
  // ...and with --replace it fetches nothing and swaps in an equal tree.
  std::ofstream(rootfs / "stray") << "from before";
  const RunResult again = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output", "rootfs:" + rootfs.string(),
                                "--cache", cache.string(), "--replace", "--json"});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(Json::parse(again.out)["bytes_fetched"], 0);
  EXPECT_EQ(testing::list_tree(rootfs), tree);
  EXPECT_EQ(siblings(out.path()), (std::vector<std::string>{"cache", "rootfs"}));

  // An empty directory is filled.
  fs::create_directories(out / "empty");
  const RunResult empty = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output",
                                "rootfs:" + (out / "empty").string(), "--cache", cache.string()});
  ASSERT_EQ(empty.status, 0) << empty.err;
  EXPECT_EQ(testing::list_tree(out / "empty"), tree);
}

TEST_F(RootfsFixture, ALayerNamedTwiceIsFetchedOnceAndAppliedTwice) {
  // Layer 0 and 2 are one blob: a file layer 1 removes comes back.
  const std::string a = make_tar({dir("etc"), file("etc/motd", "hello\n")});
  const std::string b = make_tar({dir("etc"), whiteout("etc", "motd"), file("etc/other", "o")});
  const FixtureImage image = make_real_image({{a, "tar+gzip"}, {b, "tar+gzip"}, {a, "tar+gzip"}});
  ASSERT_TRUE(push_image(*registry_, "rootfs/twice", "v1", image));
  TempDir out;
  const RunResult r = pull({"pull", ref("rootfs/twice:v1"), "--plain-http", "--output",
                            "rootfs:" + (out / "rootfs").string(), "--cache", (out / "cache").string(), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto report = Json::parse(r.out);
  ASSERT_EQ(report["layers"].size(), 3u);
  EXPECT_EQ(report["layers"][2]["digest"], report["layers"][0]["digest"]);
  EXPECT_EQ(report["bytes_fetched"].get<size_t>(),
            image.config.size() + image.layers[0].size() + image.layers[1].size());
  EXPECT_EQ(slurp(out / "rootfs/etc/motd"), "hello\n");
  EXPECT_EQ(slurp(out / "rootfs/etc/other"), "o");
}

TEST_F(RootfsFixture, TwoPullsShareOneCache) {
  // The second waits on the first's lock for each blob it is fetching, then finds it in place.
  TempDir out;
  const auto cache = out / "cache";
  auto background = testing::spawn({binary(), "pull", ref("rootfs/mixed:v1"), "--plain-http", "--output",
                                    "rootfs:" + (out / "one").string(), "--cache", cache.string()},
                                   {}, (out / "one.out").string(), (out / "one.err").string());
  const RunResult two = pull({"pull", ref("rootfs/mixed:v1"), "--plain-http", "--output",
                              "rootfs:" + (out / "two").string(), "--cache", cache.string()});
  ASSERT_TRUE(background.wait(120));
  ASSERT_EQ(background.status, 0) << slurp(out / "one.err");
  ASSERT_EQ(two.status, 0) << two.err;
  EXPECT_EQ(testing::list_tree(out / "one"), testing::list_tree(out / "two"));
  for (const auto& layer : mixed_->layers) expect_blob(cache, layer);
}

TEST(CfmoPullRootfs, OutputFlagsAreChecked) {
  TempDir out;
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--output", "rootfs:"},
           {"--output", "rootfs:" + (out / "a").string(), "--output", "rootfs:" + (out / "b").string()},
           {"--output", "oci:" + (out / "a").string(), "--cache", (out / "c").string()},
           {"--output", "oci:" + (out / "a").string(), "--replace"},
       }) {
    std::vector<std::string> full = {"pull", "127.0.0.1:1/x/y"};
    full.insert(full.end(), args.begin(), args.end());
    const RunResult r = pull(full);
    EXPECT_EQ(r.status, 2) << r.err;
  }
  std::ofstream(out / "file") << "x";
  const RunResult not_dir = pull({"pull", "127.0.0.1:1/x/y", "--output", "rootfs:" + (out / "file").string()});
  EXPECT_EQ(not_dir.status, 2) << not_dir.err;
  EXPECT_NE(not_dir.err.find("not a directory"), std::string::npos) << not_dir.err;
}

TEST_F(RootfsFixture, MaliciousLayersAreRefusedAndNothingIsWrittenOutside) {
  struct Case {
    const char* name;
    std::vector<std::vector<TarEntry>> layers;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"path-escape", {{file("../../escaped", "x")}}, "'..'"},
      {"absolute", {{file("/tmp/cfmo-pull-escaped", "x")}}, "absolute"},
      {"symlink-escape", {{symlink("s", "../../outside"), file("s/escaped", "x")}}, "symlink"},
      {"symlink-in-lower-layer",
       {{dir("etc"), symlink("etc/x", "/tmp")}, {file("etc/x/cfmo-pull-escaped", "x")}},
       "symlink"},
      {"hardlink-out", {{hardlink("h", "../../outside/secret")}}, "'..'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<RealLayer> layers;
    for (const auto& l : c.layers) layers.push_back({make_tar(l), "tar+gzip"});
    const FixtureImage image = make_real_image(layers);
    ASSERT_TRUE(push_image(*registry_, std::string("evil/") + c.name, "v1", image));
    TempDir out;
    fs::create_directories(out / "outside");
    std::ofstream(out / "outside" / "secret") << "keep";
    const auto target = out / "a" / "rootfs";
    // --progress none: stderr is a pipe, where plain progress lines would precede the error's one line.
    const RunResult r = pull({"pull", ref(std::string("evil/") + c.name + ":v1"), "--plain-http", "--output",
                              "rootfs:" + target.string(), "--cache", (out / "cache").string(), "--progress", "none"});
    EXPECT_EQ(r.status, 3) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("layer sha256:"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_FALSE(fs::exists(target));
    EXPECT_EQ(siblings(out / "a"), std::vector<std::string>{}) << "staging left behind";
    EXPECT_EQ(siblings(out / "outside"), std::vector<std::string>{"secret"});
    EXPECT_EQ(slurp(out / "outside" / "secret"), "keep");
    EXPECT_FALSE(fs::exists(out / "escaped"));
    EXPECT_FALSE(fs::exists("/tmp/cfmo-pull-escaped"));
  }
}

/// One big gzip layer for the tiny-server tests: several MiB, so the unpacker
/// is well into it when the stream goes wrong.
FixtureImage big_image() {
  return make_real_image({{make_tar({dir("data"), file("data/random", testing::random_bytes(6u << 20, 9)),
                                     file("data/text", std::string(2u << 20, 't'))}),
                           "tar+gzip"}});
}

TEST(CfmoPullRootfs, ADigestMismatchDuringTheStreamedUnpackLeavesNoRootfs) {
  const auto image = big_image();
  std::string wrong = image.layers[0];
  wrong[wrong.size() - 20] ^= 1;  // late in the stream: the unpacker has written most of the tree
  auto routes = image_routes("bad/rootfs", image, "application/vnd.oci.image.manifest.v1+json");
  routes["/v2/bad/rootfs/blobs/" + oci::sha256_digest(image.layers[0])] = [&](const std::string&) {
    return TinyServer::response(200, wrong);
  };
  TinyServer server(routes);
  TempDir out;
  const auto target = out / "rootfs";
  const RunResult r = pull({"pull", server.host() + "/bad/rootfs", "--output", "rootfs:" + target.string(), "--cache",
                            (out / "cache").string(), "--plain-http", "--retry-delay", "0.01"});
  EXPECT_EQ(r.status, 3) << r.err;
  // The corrupt byte sits in the deflate data or the CRC: the gzip check or the digest catches it first.
  EXPECT_TRUE(r.err.find("digest mismatch") != std::string::npos || r.err.find("gzip") != std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(target));
  EXPECT_EQ(siblings(out.path()), std::vector<std::string>{"cache"});
  const auto blobs = out / "cache" / "blobs" / "sha256";
  EXPECT_FALSE(fs::exists(blobs / oci::sha256_digest(image.layers[0]).substr(7)));
}

TEST(CfmoPullRootfs, ResumedAndRestartedDownloadsUnpackTheSameTree) {
  const auto image = big_image();
  const std::string& layer = image.layers[0];
  std::vector<long> ranges;
  std::mutex mutex;
  auto routes = image_routes("flaky/rootfs", image, "application/vnd.oci.image.manifest.v1+json");
  routes["/v2/flaky/rootfs/blobs/" + oci::sha256_digest(layer)] = [&](const std::string& request) {
    std::lock_guard lock(mutex);
    const long start = range_start(request);
    ranges.push_back(start);
    switch (ranges.size()) {
      case 1:  // resuming an earlier run's partial file: the server ignores Range, sends the start, drops
        return TinyServer::truncated(layer, layer.size() / 2);
      default:  // then honours Range
        return TinyServer::response(
            206, layer.substr(static_cast<size_t>(start)),
            fmt::format("Content-Range: bytes {}-{}/{}\r\n", start, layer.size() - 1, layer.size()));
    }
  };
  TinyServer server(routes);
  TempDir out;
  const auto cache = out / "cache";
  const auto partial = cache / "blobs" / "sha256" / (oci::sha256_digest(layer).substr(7) + ".partial");
  fs::create_directories(partial.parent_path());
  ASSERT_TRUE(write_file_atomic(partial, layer.substr(0, layer.size() / 4)));
  const RunResult r = pull({"pull", server.host() + "/flaky/rootfs", "--output", "rootfs:" + (out / "rootfs").string(),
                            "--cache", cache.string(), "--plain-http", "--retry-delay", "0.01"});
  ASSERT_EQ(r.status, 0) << r.err;
  {
    std::lock_guard lock(mutex);
    ASSERT_EQ(ranges.size(), 2u);
    EXPECT_EQ(ranges[0], static_cast<long>(layer.size() / 4));
    EXPECT_EQ(ranges[1], static_cast<long>(layer.size() / 2));
  }
  expect_blob(cache, layer);
  EXPECT_EQ(slurp(out / "rootfs/data/random"), testing::random_bytes(6u << 20, 9));
  EXPECT_EQ(slurp(out / "rootfs/data/text"), std::string(2u << 20, 't'));
}

}  // namespace
}  // namespace cfmo
