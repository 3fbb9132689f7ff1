// Drives the real cfmo-pull binary against a real registry (Debian's
// docker-registry, plain HTTP on a free port, its own storage) holding
// fixture images pushed through the upload API, and against a tiny HTTP
// server for what a well-behaved registry never does (wrong bytes, 503s).
#include "integration/man_page.h"
#include "integration/registry_fixture.h"
#include "oci/gzip_index.h"
#include "support/expect_error.h"

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>

namespace cfmo {
namespace {

using namespace cfmo::pulltest;

TEST(CfmoPullCli, HelpManPageAndConfigListTheSameOptions) {
  const std::regex long_flag(R"((--[a-z][a-z0-9-]*))");
  const RunResult top = pull({"--help"});
  ASSERT_EQ(top.status, 0);
  std::set<std::string> help_flags = matches(top.out, long_flag);
  std::set<std::string> printed_keys;
  const std::regex key(R"((?:^|\n)([a-z_0-9]+) = )");
  for (const char* sub : {"pull", "inspect", "fetch", "status", "mount", "umount", "index", "rm", "prune"}) {
    const RunResult help = pull({sub, "--help"});
    ASSERT_EQ(help.status, 0) << sub;
    for (const auto& f : matches(help.out, long_flag)) help_flags.insert(f);
    const RunResult printed = pull({sub, "--print-config"});
    ASSERT_EQ(printed.status, 0) << sub << ": " << printed.err;
    for (const auto& k : matches(printed.out, key)) printed_keys.insert(k);
    // The shipped file and the printed configuration both load, and print the same again.
    EXPECT_EQ(pull({sub, "--config", (source_root() / "conf/pull.toml").string(), "--print-config"}).status, 0) << sub;
    TempDir dir;
    ASSERT_TRUE(write_file_atomic(dir / "printed.toml", printed.out));
    const RunResult again = pull({sub, "--config", (dir / "printed.toml").string(), "--print-config"});
    EXPECT_EQ(again.out, printed.out) << sub << ": " << again.err;
  }
  const std::string man = slurp(source_root() / "man/cfmo-pull.1.scd");
  ASSERT_FALSE(man.empty()) << "man/cfmo-pull.1.scd missing";
  const std::set<std::string> man_flags = matches(man, std::regex(R"(\*(--[a-z][a-z0-9-]*)\*)"));
  for (const auto& f : help_flags) EXPECT_TRUE(man_flags.count(f)) << f << " is in --help but not in the man page";
  for (const auto& f : man_flags) EXPECT_TRUE(help_flags.count(f)) << f << " is in the man page but not in --help";
  for (const char* section : {"# EXIT STATUS", "# FILES", "# ENVIRONMENT", "# EXAMPLES", "cfmo-pull-state.json"}) {
    EXPECT_NE(man.find(section), std::string::npos) << section;
  }
  // conf/pull.toml sets every key some subcommand knows, and no other.
  EXPECT_EQ(matches(slurp(source_root() / "conf/pull.toml"), key), printed_keys);
}

TEST(CfmoPullCli, GeneratedManPageIsCurrent) { testing::expect_generated_man_page_current(source_root(), "cfmo-pull"); }

TEST(CfmoPullCli, UsageErrorsAreExitTwo) {
  EXPECT_EQ(pull({}).status, 2);
  EXPECT_EQ(pull({"pull", "alpine"}).status, 2);  // no --output
  const RunResult bad_output = pull({"pull", "alpine", "--output", "dir:/tmp/x"});
  EXPECT_EQ(bad_output.status, 2);
  EXPECT_NE(bad_output.err.find("oci:DIR"), std::string::npos) << bad_output.err;
  const RunResult bad_ref = pull({"inspect", "Not/A/Valid/Ref"});
  EXPECT_EQ(bad_ref.status, 2);
  EXPECT_NE(bad_ref.err.find("reference"), std::string::npos) << bad_ref.err;
  EXPECT_EQ(pull({"inspect", "alpine", "--platform", "linux"}).status, 2);
}

TEST_F(PullFixture, PullsAnImageIntoAnOciLayout) {
  TempDir out;
  const auto layout = out / "image";
  const RunResult r = pull({"pull", registry_->host() + "/fixtures/small:v1", "--output", "oci:" + layout.string(),
                            "--plain-http", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto report = Json::parse(r.out);
  EXPECT_EQ(report["manifest_digest"], small_->manifest_digest);
  ASSERT_EQ(report["layers"].size(), 3u);
  EXPECT_EQ(report["layers"][1]["size"], 3u << 20);
  EXPECT_EQ(report["layers"][1]["state"], "fetched");
  EXPECT_GE(report["bytes_fetched"].get<int64_t>(), int64_t{3u << 20});

  EXPECT_EQ(Json::parse(slurp(layout / "oci-layout"))["imageLayoutVersion"], "1.0.0");
  const auto index = Json::parse(slurp(layout / "index.json"));
  ASSERT_EQ(index["manifests"].size(), 1u);
  EXPECT_EQ(index["manifests"][0]["digest"], small_->manifest_digest);
  EXPECT_EQ(index["manifests"][0]["mediaType"], "application/vnd.oci.image.manifest.v1+json");
  EXPECT_EQ(index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"], "v1");
  expect_blob(layout, small_->manifest);
  expect_blob(layout, small_->config);
  for (const auto& layer : small_->layers) expect_blob(layout, layer);
  for (const auto& entry : fs::directory_iterator(layout / "blobs" / "sha256")) {
    EXPECT_EQ(entry.path().extension(), "") << "left behind: " << entry.path();
  }

  // A second pull finds every blob in place and fetches none of them.
  const RunResult again = pull({"pull", registry_->host() + "/fixtures/small:v1", "--output",
                                "oci:" + layout.string() + ":again", "--plain-http", "--json"});
  ASSERT_EQ(again.status, 0) << again.err;
  const auto second = Json::parse(again.out);
  EXPECT_EQ(second["bytes_fetched"], 0);
  for (const auto& layer : second["layers"]) EXPECT_EQ(layer["state"], "present");
  EXPECT_EQ(Json::parse(slurp(layout / "index.json"))["manifests"].size(), 2u);
}

TEST_F(PullFixture, ResumesAPartialBlobLeftByAnEarlierRun) {
  TempDir out;
  const auto layout = out / "image";
  const std::string& big = small_->layers[1];
  const auto partial = layout / "blobs" / "sha256" / (oci::sha256_digest(big).substr(7) + ".partial");
  fs::create_directories(partial.parent_path());
  ASSERT_TRUE(write_file_atomic(partial, big.substr(0, big.size() / 2)));
  const RunResult r = pull({"pull", registry_->host() + "/fixtures/small:v1", "--output", "oci:" + layout.string(),
                            "--plain-http", "--json", "--jobs", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto report = Json::parse(r.out);
  EXPECT_EQ(report["layers"][1]["state"], "resumed");
  EXPECT_LT(report["bytes_fetched"].get<int64_t>(), static_cast<int64_t>(big.size()));
  expect_blob(layout, big);
  EXPECT_FALSE(fs::exists(partial));
}

TEST_F(PullFixture, ADiskTooSmallForALayerIsOneLineBeforeTheDownload) {
  // A 1 MiB tmpfs cannot hold the 3 MiB layer: the reservation before the
  // download fails, the error names the layer and the directory, and no
  // blob is left looking complete.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs";
  TempDir out;
  const auto mountpoint = out / "small-disk";
  fs::create_directories(mountpoint);
  if (::mount("tmpfs", mountpoint.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "this sandbox does not allow a tmpfs mount: " << std::strerror(errno);
  }
  const auto layout = mountpoint / "image";
  const RunResult r = pull({"pull", registry_->host() + "/fixtures/small:v1", "--output", "oci:" + layout.string(),
                            "--plain-http", "--jobs", "1", "--quiet"});
  EXPECT_EQ(r.status, 5) << r.err;
  EXPECT_NE(r.err.find("no space left"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find((layout / "blobs" / "sha256").string()), std::string::npos) << r.err;
  EXPECT_EQ(cfmo::testing::lines(r.err).size(), 1u) << r.err;
  EXPECT_FALSE(fs::exists(layout / "index.json"));
  const std::string big = oci::sha256_digest(small_->layers[1]).substr(7);
  EXPECT_FALSE(fs::exists(layout / "blobs" / "sha256" / big));
  ::umount(mountpoint.c_str());
}

TEST_F(PullFixture, ChoosesThePlatformFromAnIndex) {
  TempDir out;
  const RunResult arm = pull({"pull", registry_->host() + "/fixtures/multi", "--output",
                              "oci:" + (out / "arm").string(), "--plain-http", "--json", "--platform", "linux/arm64"});
  ASSERT_EQ(arm.status, 0) << arm.err;
  EXPECT_EQ(Json::parse(arm.out)["manifest_digest"], arm64_->manifest_digest);
  expect_blob(out / "arm", arm64_->layers[0]);
  const RunResult amd = pull({"pull", registry_->host() + "/fixtures/multi", "--output",
                              "oci:" + (out / "amd").string(), "--plain-http", "--json", "--platform", "linux/amd64"});
  ASSERT_EQ(amd.status, 0) << amd.err;
  EXPECT_EQ(Json::parse(amd.out)["manifest_digest"], amd64_->manifest_digest);
  const RunResult none = pull({"pull", registry_->host() + "/fixtures/multi", "--output",
                               "oci:" + (out / "none").string(), "--plain-http", "--platform", "linux/s390x"});
  EXPECT_EQ(none.status, 3);
  EXPECT_NE(none.err.find("no image for platform linux/s390x"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("linux/arm64"), std::string::npos) << none.err;
}

TEST_F(PullFixture, InspectFetchesNoLayer) {
  const RunResult r = pull({"inspect", registry_->host() + "/fixtures/small:v1", "--plain-http", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = Json::parse(r.out);
  EXPECT_EQ(j["manifest"]["digest"], small_->manifest_digest);
  EXPECT_EQ(j["config"]["config"]["Env"][0], "SEED=1");
  ASSERT_EQ(j["layers"].size(), 3u);
  EXPECT_EQ(j["total_size"], 1000 + (3u << 20));
  const RunResult text = pull({"inspect", registry_->host() + "/fixtures/small:v1", "--plain-http"});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find(small_->manifest_digest), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("layers    3"), std::string::npos) << text.out;
}

TEST_F(PullFixture, UnknownRepositoryIsOneClearLine) {
  TempDir out;
  const RunResult r = pull(
      {"pull", registry_->host() + "/fixtures/absent:v1", "--output", "oci:" + (out / "x").string(), "--plain-http"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_NE(r.err.find("fixtures/absent"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("HTTP 404"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(CfmoPullCli, RegistryDownIsExitFourAfterRetries) {
  TempDir out;
  const int port = testing::free_port();  // nothing listens there
  const RunResult r = pull({"pull", "127.0.0.1:" + std::to_string(port) + "/x/y:1", "--output",
                            "oci:" + (out / "x").string(), "--plain-http", "--retries", "2", "--retry-delay", "0.01"});
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_NE(r.err.find("after 3 attempts"), std::string::npos) << r.err;
}

// What no retry can mend (a registry without a host, a port outside
// 1-65535) is a usage error at once: one line, nothing tried, nothing written.
TEST(CfmoPullCli, AMalformedRegistryIsExitTwoAtOnceNotRetried) {
  TempDir out;
  for (const std::string ref : {":5055/x", "127.0.0.1:99999/x:v1", "127.0.0.1:0/x", "localhost:5x/x", "[::1/x"}) {
    SCOPED_TRACE(ref);
    for (const char* sub : {"pull", "inspect"}) {
      std::vector<std::string> args = {sub, ref, "--plain-http", "--retries", "5"};
      if (std::string(sub) == "pull") {
        args.insert(args.end(), {"--output", "oci:" + (out / "x").string()});
      }
      const RunResult r = pull(args, 60);
      EXPECT_EQ(r.status, 2) << r.err;
      EXPECT_EQ(testing::lines(r.err).size(), 1u) << r.err;
      EXPECT_NE(r.err.find("image reference '" + ref + "': registry"), std::string::npos) << r.err;
      EXPECT_EQ(r.err.find("attempt"), std::string::npos) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(out / "x"));
  // The same rule for the other hosts a pull names.
  const RunResult mirror =
      pull({"pull", "127.0.0.1:5000/x", "--output", "oci:" + (out / "x").string(), "--mirror", "127.0.0.1:70000"});
  EXPECT_EQ(mirror.status, 2) << mirror.err;
  EXPECT_NE(mirror.err.find("--mirror '127.0.0.1:70000': port 70000 is out of range"), std::string::npos) << mirror.err;
}

// cfmo-pull index on a pulled image of a gzip, a zstd and a plain layer:
// each indexed (their files listed with their offsets), the zstd one, of
// one frame, named as not lazily loadable; a damaged index is exit 3.
TEST_F(PullFixture, IndexMakesASeekableIndexOfEachGzipLayer) {
  using namespace cfmo::testing;
  const std::vector<TarEntry> files = {dir("etc"), file("etc/os-release", "ID=fixture\n"),
                                       file("big", random_bytes(300001, 11)), symlink("link", "big")};
  const std::string gz = make_tar(files);
  const std::string plain = make_tar({file("plain", random_bytes(70000, 12))});
  const FixtureImage image = make_real_image({{gz, "tar+gzip"}, {plain, "tar+zstd"}, {plain, "tar"}});
  ASSERT_TRUE(push_image(*registry_, "fixtures/indexed", "v1", image));
  TempDir out;
  const auto dir = out / "image";
  ASSERT_EQ(pull({"pull", registry_->host() + "/fixtures/indexed:v1", "--output", "oci:" + dir.string(), "--plain-http",
                  "-q"})
                .status,
            0);
  const RunResult r = pull({"index", dir.string(), "--span", "64K", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const Json j = Json::parse(r.out);
  ASSERT_EQ(j["layers"].size(), 3u);
  EXPECT_EQ(j["layers"][0]["indexed"], true);
  EXPECT_EQ(j["layers"][0]["entries"], files.size());
  EXPECT_GE(j["layers"][0]["checkpoints"].get<int>(), 2);
  EXPECT_EQ(j["layers"][1]["indexed"], true);
  EXPECT_EQ(j["layers"][1]["checkpoints"], 1);
  EXPECT_NE(j["layers"][1]["note"].get<std::string>().find("one zstd frame"), std::string::npos);
  EXPECT_NE(j["layers"][1]["note"].get<std::string>().find("not lazily loadable"), std::string::npos);
  EXPECT_TRUE(j["layers"][0]["note"].is_null());
  EXPECT_EQ(j["layers"][2]["indexed"], true);
  // The layers are unchanged, and the index is beside them, in DIR/cfmo-index/.
  for (const auto& layer : image.layers) expect_blob(dir, layer);
  const fs::path index = dir / "cfmo-index" / oci::sha256_digest(image.layers[0]).substr(7);
  EXPECT_EQ(j["layers"][0]["index"], index.string());

  const RunResult listed = pull({"index", dir.string(), "--list", "--json"});
  ASSERT_EQ(listed.status, 0) << listed.err;
  const Json l = Json::parse(listed.out);
  ASSERT_EQ(l["layers"].size(), 3u);
  const Json& entries = l["layers"][0]["entries"];
  ASSERT_EQ(entries.size(), files.size());
  EXPECT_EQ(entries[2]["path"], "big");
  EXPECT_EQ(entries[2]["size"], 300001);
  // The offset is where the file's bytes are in the uncompressed tar.
  const uint64_t offset = entries[2]["offset"].get<uint64_t>();
  EXPECT_TRUE(gz.substr(offset, 300001) == files[2].data);
  EXPECT_EQ(entries[3]["type"], "symlink");
  EXPECT_EQ(entries[3]["link"], "big");
  const RunResult text = pull({"index", dir.string(), "--list"});
  EXPECT_NE(text.out.find("etc/os-release"), std::string::npos) << text.out;

  // A damaged index: one line naming it, exit 3.
  std::string bytes = pulltest::slurp(index);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
  ASSERT_TRUE(write_file_atomic(index, bytes));
  const RunResult damaged = pull({"index", dir.string(), "--list"});
  EXPECT_EQ(damaged.status, 3) << damaged.err;
  EXPECT_EQ(testing::lines(damaged.err).size(), 1u) << damaged.err;
  EXPECT_NE(damaged.err.find("index '" + index.string() + "'"), std::string::npos) << damaged.err;
  fs::remove(index);
  const RunResult missing = pull({"index", dir.string(), "--list"});
  EXPECT_EQ(missing.status, 3) << missing.err;
  EXPECT_NE(missing.err.find("has no index"), std::string::npos) << missing.err;
  // Indexing again makes it anew.
  ASSERT_EQ(pull({"index", dir.string(), "-q"}).status, 0);
  EXPECT_EQ(pull({"index", dir.string(), "--list"}).status, 0);

  EXPECT_EQ(pull({"index", (out / "nowhere").string()}).status, 2);
  EXPECT_EQ(pull({"index", dir.string(), "--span", "1K"}).status, 2);
  const RunResult not_a_pull = pull({"index", out.path().string()});
  EXPECT_EQ(not_a_pull.status, 3) << not_a_pull.err;
}

/// "bytes=A-B" of a request's Range header, or {-1, -1}.
std::pair<long, long> range_of(const std::string& request) {
  const auto at = request.find("Range: bytes=");
  if (at == std::string::npos) return {-1, -1};
  const auto dash = request.find('-', at + 13);
  return {std::stol(request.substr(at + 13)), std::stol(request.substr(dash + 1))};
}

// A file of a layer that is not on disk, read through its index with HTTP
// Range requests for the spans holding it (the real registry serves them),
// each span verified by its SHA-256; a registry that ignores Range, and one
// that sends wrong bytes, are refused clearly.
TEST_F(PullFixture, AFileIsReadThroughItsIndexWithRangeRequests) {
  using namespace cfmo::testing;
  const std::vector<TarEntry> files = {file("small", "the first file\n"), file("big", random_bytes(400003, 21)),
                                       file("log", std::string(200000, 'l')), file("last", random_bytes(90001, 22))};
  const std::string tar = make_tar(files);
  const FixtureImage image = make_real_image({{tar, "tar+gzip"}});
  ASSERT_TRUE(push_image(*registry_, "fixtures/ranged", "v1", image));
  TempDir out;
  const auto dir = out / "image";
  ASSERT_EQ(
      pull({"pull", registry_->host() + "/fixtures/ranged:v1", "--output", "oci:" + dir.string(), "--plain-http", "-q"})
          .status,
      0);
  ASSERT_EQ(pull({"index", dir.string(), "--span", "64K", "-q"}).status, 0);
  const std::string digest = oci::sha256_digest(image.layers[0]);
  auto index = oci::read_index(oci::index_path(dir, digest));
  ASSERT_TRUE(index) << index.error().message;
  ASSERT_GE(index->checkpoints.size(), 3u);

  oci::RegistryOptions options;
  options.plain_http = true;
  options.retries = 0;
  auto ref = oci::parse_reference(registry_->host() + "/fixtures/ranged:v1");
  ASSERT_TRUE(ref);
  oci::RegistryClient client(*ref, options, std::nullopt);
  // The first file needs the first span only: a fraction of the layer.
  oci::RegistrySource first(client, digest, "layer 0");
  auto small = oci::read_entry(*index, first, *index->find("small"), "layer 0");
  ASSERT_TRUE(small) << small.error().message;
  EXPECT_EQ(*small, files[0].data);
  EXPECT_EQ(first.bytes_fetched(), index->span_range(0).second - index->span_range(0).first);
  EXPECT_LT(first.bytes_fetched(), image.layers[0].size());
  // Every file, through ranges, equals the tar's.
  for (const auto& f : files) {
    oci::RegistrySource source(client, digest, "layer 0");
    auto bytes = oci::read_entry(*index, source, *index->find(f.path), "layer 0");
    ASSERT_TRUE(bytes) << f.path << ": " << bytes.error().message;
    EXPECT_TRUE(*bytes == f.data) << f.path;
  }

  const std::string blob_path = "/v2/fixtures/ranged/blobs/" + digest;
  {
    TinyServer whole({{blob_path, [&](const std::string&) { return TinyServer::response(200, image.layers[0]); }}});
    auto r = oci::parse_reference(whole.host() + "/fixtures/ranged:v1");
    oci::RegistryClient c(*r, options, std::nullopt);
    oci::RegistrySource source(c, digest, "layer 0");
    const auto got = oci::read_entry(*index, source, *index->find("last"), "layer 0");
    EXPECT_TRUE(fails_with(got, ErrorKind::kPeer, {"layer 0", "does not serve parts of a blob"}));
  }
  {
    TinyServer corrupt({{blob_path, [&](const std::string& request) {
                           const auto [a, b] = range_of(request);
                           std::string part = image.layers[0].substr(a, b - a + 1);
                           part[part.size() / 2] = static_cast<char>(part[part.size() / 2] ^ 1);
                           return TinyServer::response(
                               206, part,
                               fmt::format("Content-Range: bytes {}-{}/{}\r\n", a, b, image.layers[0].size()));
                         }}});
    auto r = oci::parse_reference(corrupt.host() + "/fixtures/ranged:v1");
    oci::RegistryClient c(*r, options, std::nullopt);
    oci::RegistrySource source(c, digest, "layer 0");
    const auto got = oci::read_entry(*index, source, *index->find("big"), "layer 0");
    EXPECT_TRUE(fails_with(got, ErrorKind::kInput, {"layer 0", "span", "SHA-256 mismatch"}));
  }
}

TEST(CfmoPullCli, DigestMismatchIsExitThreeAndKeepsNothing) {
  const auto image = make_image(7, "amd64", {5000});
  std::string wrong = image.layers[0];
  wrong[100] ^= 1;
  std::atomic<int> unavailable{0};
  TinyServer server({
      {"/v2/bad/image/manifests/latest",
       [&](const std::string&) {
         return TinyServer::response(200, image.manifest,
                                     "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n");
       }},
      {"/v2/bad/image/blobs/" + oci::sha256_digest(image.config),
       [&](const std::string&) {
         // One 503 first: a retry must follow, not a failure.
         if (unavailable++ == 0) return TinyServer::response(503, "busy", "Retry-After: 0\r\n");
         return TinyServer::response(200, image.config);
       }},
      {"/v2/bad/image/blobs/" + oci::sha256_digest(image.layers[0]),
       [&](const std::string&) { return TinyServer::response(200, wrong); }},
  });
  TempDir out;
  const auto layout = out / "image";
  const RunResult r = pull({"pull", server.host() + "/bad/image", "--output", "oci:" + layout.string(), "--plain-http",
                            "--retry-delay", "0.01", "--jobs", "1"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_NE(r.err.find("digest mismatch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("layer sha256:"), std::string::npos) << r.err;
  EXPECT_EQ(unavailable.load(), 2);
  const auto blobs = layout / "blobs" / "sha256";
  EXPECT_FALSE(fs::exists(blobs / oci::sha256_digest(image.layers[0]).substr(7)));
  EXPECT_FALSE(fs::exists(blobs / (oci::sha256_digest(image.layers[0]).substr(7) + ".partial")));
  EXPECT_TRUE(fs::exists(blobs / oci::sha256_digest(image.config).substr(7)));
  EXPECT_FALSE(fs::exists(layout / "index.json"));
}

TEST(CfmoPullCli, BearerTokenFlowAndRangeIgnored) {
  // The registry demands a token from a realm it names; the blob server
  // ignores Range and answers 200 with the whole blob.
  const auto image = make_image(8, "amd64", {4000});
  std::atomic<int> token_requests{0};
  std::atomic<int> unauthorized{0};
  std::string realm;
  auto guarded = [&](std::string body, std::string content_type) {
    return [&, body, content_type](const std::string& request) {
      if (request.find("Authorization: Bearer secret-token") == std::string::npos) {
        ++unauthorized;
        return TinyServer::response(401, "{}",
                                    "WWW-Authenticate: Bearer realm=\"" + realm +
                                        "\",service=\"tiny\",scope=\"repository:auth/image:pull\"\r\n");
      }
      return TinyServer::response(200, body, content_type);
    };
  };
  std::map<std::string, TinyServer::Handler> routes{
      {"/v2/auth/image/manifests/latest",
       guarded(image.manifest, "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n")},
      {"/v2/auth/image/blobs/" + oci::sha256_digest(image.config), guarded(image.config, "")},
      {"/v2/auth/image/blobs/" + oci::sha256_digest(image.layers[0]), guarded(image.layers[0], "")},
      {"/token?service=tiny&scope=repository%3Aauth%2Fimage%3Apull",
       [&](const std::string&) {
         ++token_requests;
         return TinyServer::response(200, R"({"token":"secret-token"})");
       }},
  };
  TinyServer server(routes);
  realm = "http://" + server.host() + "/token";
  TempDir out;
  const auto layout = out / "image";
  const auto partial = layout / "blobs" / "sha256" / (oci::sha256_digest(image.layers[0]).substr(7) + ".partial");
  fs::create_directories(partial.parent_path());
  ASSERT_TRUE(write_file_atomic(partial, image.layers[0].substr(0, 1000)));
  const RunResult r = pull(
      {"pull", server.host() + "/auth/image", "--output", "oci:" + layout.string(), "--plain-http", "--jobs", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("secret-token"), std::string::npos);
  EXPECT_EQ(r.err.find("secret-token"), std::string::npos);
  expect_blob(layout, image.layers[0]);
  EXPECT_GE(token_requests.load(), 1);
}

TEST(CfmoPullCli, DroppedConnectionsAndRateLimitsAreRetriedAndResumed) {
  const auto image = make_image(9, "amd64", {200000});
  const std::string& layer = image.layers[0];
  std::vector<long> ranges;  // the Range start of each request for the layer
  std::mutex mutex;
  auto routes = image_routes("flaky/image", image, "application/vnd.oci.image.manifest.v1+json");
  routes["/v2/flaky/image/blobs/" + oci::sha256_digest(layer)] = [&](const std::string& request) {
    std::lock_guard lock(mutex);
    const long start = range_start(request);
    ranges.push_back(start);
    switch (ranges.size()) {
      case 1:  // the whole blob announced, a third of it sent, then the connection drops
        return TinyServer::truncated(layer, layer.size() / 3);
      case 2:
        return TinyServer::response(429, "slow down", "Retry-After: 0\r\n");
      default:
        return TinyServer::response(
            206, layer.substr(static_cast<size_t>(start)),
            fmt::format("Content-Range: bytes {}-{}/{}\r\n", start, layer.size() - 1, layer.size()));
    }
  };
  TinyServer server(routes);
  TempDir out;
  const auto layout = out / "image";
  const RunResult r = pull({"pull", server.host() + "/flaky/image", "--output", "oci:" + layout.string(),
                            "--plain-http", "--retry-delay", "0.01", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  expect_blob(layout, layer);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0], -1);
  EXPECT_EQ(ranges[1], static_cast<long>(layer.size() / 3));
  EXPECT_EQ(ranges[2], static_cast<long>(layer.size() / 3));
  // Fetched once in all: the first third, then the rest.
  const auto report = Json::parse(r.out);
  EXPECT_EQ(report["bytes_fetched"], image.config.size() + layer.size());
}

TEST(CfmoPullCli, RetriesGiveUpWithExitFourAndKeepThePartialBlob) {
  const auto image = make_image(10, "amd64", {10000});
  const std::string& layer = image.layers[0];
  std::atomic<int> requests{0};
  auto routes = image_routes("down/image", image, "application/vnd.docker.distribution.manifest.v2+json");
  routes["/v2/down/image/blobs/" + oci::sha256_digest(layer)] = [&](const std::string& request) {
    if (requests++ == 0 && range_start(request) < 0) {
      return TinyServer::truncated(layer, 4000);
    }
    return TinyServer::response(503, "down");
  };
  TinyServer server(routes);
  TempDir out;
  const auto layout = out / "image";
  const RunResult r = pull({"pull", server.host() + "/down/image", "--output", "oci:" + layout.string(), "--plain-http",
                            "--retries", "2", "--retry-delay", "0.01"});
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_NE(r.err.find("HTTP 503 (after 3 attempts)"), std::string::npos) << r.err;
  EXPECT_EQ(requests.load(), 3);
  const auto partial = layout / "blobs" / "sha256" / (oci::sha256_digest(layer).substr(7) + ".partial");
  EXPECT_TRUE(slurp(partial) == layer.substr(0, 4000)) << "the partial file does not hold the bytes received";
  EXPECT_FALSE(fs::exists(layout / "index.json"));
}

TEST(CfmoPullCli, AuthorizationIsNotSentToAnotherHostOnRedirect) {
  // The registry (Basic auth from a docker config) redirects the layer to an
  // object store on another port, which must see no Authorization header.
  const auto image = make_image(11, "amd64", {3000});
  const std::string& layer = image.layers[0];
  std::string store_request;
  std::mutex mutex;
  TinyServer store({{"/object", [&](const std::string& request) {
                       std::lock_guard lock(mutex);
                       store_request = request;
                       return TinyServer::response(200, layer);
                     }}});
  std::atomic<int> unauthorized{0};
  auto routes = image_routes("auth/redirect", image, "application/vnd.oci.image.manifest.v1+json");
  auto plain = routes;
  for (auto& [path, handler] : routes) {
    handler = [&unauthorized, inner = plain[path]](const std::string& request) {
      if (request.find("Authorization: Basic dTpw") == std::string::npos) {
        ++unauthorized;
        return TinyServer::response(401, "{}", "WWW-Authenticate: Basic realm=\"tiny\"\r\n");
      }
      return inner(request);
    };
  }
  routes["/v2/auth/redirect/blobs/" + oci::sha256_digest(layer)] = [&](const std::string& request) {
    if (request.find("Authorization: Basic dTpw") == std::string::npos) {
      ++unauthorized;
      return TinyServer::response(401, "{}", "WWW-Authenticate: Basic realm=\"tiny\"\r\n");
    }
    return TinyServer::response(307, "", "Location: http://" + store.host() + "/object\r\n");
  };
  TinyServer server(routes);
  TempDir out;
  ASSERT_TRUE(write_file_atomic(out / "config.json", R"({"auths":{")" + server.host() + R"(":{"auth":"dTpw"}}})"));
  const auto layout = out / "image";
  const RunResult r = pull({"pull", server.host() + "/auth/redirect", "--output", "oci:" + layout.string(),
                            "--plain-http", "--authfile", (out / "config.json").string()});
  ASSERT_EQ(r.status, 0) << r.err;
  expect_blob(layout, layer);
  EXPECT_GE(unauthorized.load(), 1);
  std::lock_guard lock(mutex);
  ASSERT_FALSE(store_request.empty());
  EXPECT_EQ(store_request.find("Authorization"), std::string::npos) << store_request;
  EXPECT_EQ(r.err.find("dTpw"), std::string::npos);
}

TEST_F(PullFixture, UmociUnpacksThePulledLayout) {
  if (system("command -v umoci >/dev/null 2>&1") != 0) GTEST_SKIP() << "umoci not installed";
  const auto [layer, diff_id] = tar_gz({{"etc/greeting", "hello from cfmo-pull\n"}, {"bin/tool", "#!/bin/sh\n"}});
  const std::string config = Json{{"architecture", "amd64"},
                                  {"os", "linux"},
                                  {"config", {{"Env", {"PATH=/bin"}}}},
                                  {"rootfs", {{"type", "layers"}, {"diff_ids", {diff_id}}}}}
                                 .dump();
  const std::string manifest =
      Json{{"schemaVersion", 2},
           {"mediaType", "application/vnd.docker.distribution.manifest.v2+json"},
           {"config", descriptor("application/vnd.docker.container.image.v1+json", config)},
           {"layers", {descriptor("application/vnd.docker.image.rootfs.diff.tar.gzip", layer)}}}
          .dump();
  ASSERT_TRUE(registry_->push_blob("fixtures/real", config));
  ASSERT_TRUE(registry_->push_blob("fixtures/real", layer));
  ASSERT_TRUE(registry_->push_manifest("fixtures/real", "v1", manifest,
                                       "application/vnd.docker.distribution.manifest.v2+json"));
  TempDir out;
  const auto layout = out / "layout";
  const RunResult r =
      pull({"pull", registry_->host() + "/fixtures/real:v1", "--output", "oci:" + layout.string(), "--plain-http"});
  ASSERT_EQ(r.status, 0) << r.err;
  // The registry served Docker schema 2; the layout names its OCI conversion.
  const auto index = Json::parse(slurp(layout / "index.json"));
  EXPECT_EQ(index["manifests"][0]["mediaType"], "application/vnd.oci.image.manifest.v1+json");
  EXPECT_NE(index["manifests"][0]["digest"], oci::sha256_digest(manifest));
  const RunResult unpack =
      run({"/bin/sh", "-c",
           "umoci unpack --rootless --image '" + layout.string() + ":v1' '" + (out / "bundle").string() + "' 2>&1"});
  ASSERT_EQ(unpack.status, 0) << unpack.out;
  EXPECT_EQ(slurp(out / "bundle" / "rootfs" / "etc" / "greeting"), "hello from cfmo-pull\n");
}

TEST(CfmoPullCli, TheWholePullTimeoutStopsEndlessRetries) {
  TinyServer server({{"/v2/busy/image/manifests/latest",
                      [](const std::string&) { return TinyServer::response(503, "busy", "Retry-After: 30\r\n"); }}});
  TempDir out;
  const auto start = std::chrono::steady_clock::now();
  const RunResult r = pull({"pull", server.host() + "/busy/image", "--output", "oci:" + (out / "x").string(),
                            "--plain-http", "--retries", "100", "--timeout", "1"},
                           60);
  EXPECT_EQ(r.status, 4) << r.err;
  // Which attempt the deadline cuts short (a wait after a 503, or a request
  // in flight on a loaded machine) depends on timing; the message names it.
  EXPECT_NE(r.err.find("timeout of 1 s ran out"), std::string::npos) << r.err;
  // Not a timing assertion on speed: only that Retry-After: 30 did not outlast the deadline.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30);
}

TEST(CfmoPullCli, AnExpiringTokenIsRenewedBeforeItIsRefused) {
  // Tokens live one second; the config takes longer than that to serve, so
  // the layer's request must carry a new token without a 401 first.
  const auto image = make_image(12, "amd64", {1000});
  std::mutex mutex;
  int tokens_issued = 0;
  std::vector<std::string> seen;  // "path token" per request
  std::string realm;
  auto guarded = [&](const std::string& name, std::string body, std::string extra, double delay_s) {
    return [&, name, body, extra, delay_s](const std::string& request) {
      const auto at = request.find("Authorization: Bearer ");
      const std::string token = at == std::string::npos ? "-" : request.substr(at + 22, 2);
      {
        std::lock_guard lock(mutex);
        seen.push_back(name + " " + token);
      }
      if (token == "-") {
        return TinyServer::response(401, "{}", "WWW-Authenticate: Bearer realm=\"" + realm + "\",service=\"s\"\r\n");
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
      return TinyServer::response(200, body, extra);
    };
  };
  TinyServer server({
      {"/v2/exp/image/manifests/latest",
       guarded("manifest", image.manifest, "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n", 0)},
      {"/v2/exp/image/blobs/" + oci::sha256_digest(image.config), guarded("config", image.config, "", 1.2)},
      {"/v2/exp/image/blobs/" + oci::sha256_digest(image.layers[0]), guarded("layer", image.layers[0], "", 0)},
      {"/token?service=s&scope=repository%3Aexp%2Fimage%3Apull",
       [&](const std::string&) {
         std::lock_guard lock(mutex);
         return TinyServer::response(200, fmt::format(R"({{"token":"t{}","expires_in":1}})", ++tokens_issued));
       }},
  });
  realm = "http://" + server.host() + "/token";
  TempDir out;
  const RunResult r = pull(
      {"pull", server.host() + "/exp/image", "--output", "oci:" + (out / "x").string(), "--plain-http", "--jobs", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::lock_guard lock(mutex);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().substr(0, 7), "layer t") << seen.back();
  EXPECT_EQ(std::count(seen.begin(), seen.end(), "layer -"), 0) << "the layer was first refused";
  EXPECT_NE(seen.back(), "layer t2") << "the worker's first token (t2) was not renewed";
}

}  // namespace
}  // namespace cfmo
