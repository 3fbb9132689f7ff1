// cfmo-pull's hot and cold layers, mirrors, memory bound and configuration,
// driven through the real binary against a real docker-registry, with a
// fault-injecting TCP proxy (fault_proxy.h) between them where the case is
// a flaky link or a busy registry.
#include "integration/fault_proxy.h"
#include "integration/registry_fixture.h"
#include "oci/cleanup.h"
#include "oci/pull.h"
#include "support/tree_listing.h"

#include <signal.h>
#include <sys/mount.h>

#include <chrono>
#include <thread>

namespace cfmo::pulltest {
namespace {

constexpr const char* kImage = "hc/app";

/// The layer fixtures: three layers of different sizes, small enough for a
/// loaded machine; layer 0 is the smallest.
class HotCold : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kRegistryBinary)) return;
    registry_ = new Registry();
    if (!registry_->start()) {
      setup_error_ = "docker-registry did not start: " + registry_->log();
      return;
    }
    image_ = new FixtureImage(make_image(40, "amd64", {4000, 300000, 200000}));
    if (!push_image(*registry_, kImage, "v1", *image_))
      setup_error_ = "pushing the fixture failed: " + registry_->log();
  }
  static void TearDownTestSuite() {
    delete registry_;
    registry_ = nullptr;
  }
  void SetUp() override {
    if (!fs::exists(kRegistryBinary)) GTEST_SKIP() << kRegistryBinary << " not installed (Debian docker-registry)";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }

  /// `cfmo-pull pull HOST/hc/app:v1 --output oci:DIR --plain-http ...`, its
  /// memory store in the test's own directory under /dev/shm.
  RunResult pull_image(const std::string& host, const fs::path& dir, std::vector<std::string> extra,
                       double timeout_s = 120, const std::function<void(pid_t, double)>& while_running = nullptr) {
    std::vector<std::string> args = {"pull",         host + "/" + kImage + ":v1",
                                     "--output",     "oci:" + dir.string(),
                                     "--plain-http", "--memory-dir",
                                     shm_.string(),  "--retry-delay",
                                     "0.01"};
    args.insert(args.end(), extra.begin(), extra.end());
    return pull(args, timeout_s, while_running);
  }

  static std::string layer_digest(size_t i) { return oci::sha256_digest(image_->layers[i]); }
  static std::string blob_url_part(size_t i) { return "/blobs/" + layer_digest(i); }

  /// A run that completed the image, asking for layer 1 from the `kept` bytes of its partial blob.
  static void expect_resumed(const RunResult& resumed, const fs::path& dir, const FaultProxy& proxy, int64_t kept) {
    ASSERT_EQ(resumed.status, 0) << resumed.err;
    EXPECT_EQ(Json::parse(resumed.out, nullptr, false).value("complete", false), true) << resumed.out;
    for (const auto& layer : image_->layers) expect_blob(dir, layer);
    const auto asked = proxy.requests(blob_url_part(1));
    ASSERT_GE(asked.size(), 2u);
    EXPECT_EQ(asked.back().range_start, kept);
  }

  /// A directory on tmpfs for this test's memory stores, removed at the end.
  struct ShmDir {
    ShmDir() {
      std::string pattern = "/dev/shm/cfmo-hotcold-XXXXXX";
      if (fs::is_directory("/dev/shm") && mkdtemp(pattern.data()) != nullptr) path = pattern;
    }
    ~ShmDir() {
      std::error_code ec;
      if (!path.empty()) fs::remove_all(path, ec);
    }
    std::string string() const { return path.empty() ? std::string("/dev/shm") : path.string(); }
    fs::path path;
  };

  ShmDir shm_;
  static inline Registry* registry_ = nullptr;
  static inline FixtureImage* image_ = nullptr;
  static inline std::string setup_error_;
};

Json parse_json(const RunResult& r) {
  Json j = Json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

RunResult status_json(const fs::path& dir) { return pull({"status", dir.string(), "--json"}); }

/// Polls `status --json` until `done` holds or `timeout_s` passes.
Json wait_for_status(const fs::path& dir, const std::function<bool(const Json&)>& done, double timeout_s = 60) {
  const auto start = std::chrono::steady_clock::now();
  Json last;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < timeout_s) {
    const RunResult r = status_json(dir);
    if (r.status == 0) {
      last = Json::parse(r.out, nullptr, false);
      if (!last.is_discarded() && done(last)) return last;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return last;
}

/// Kills a process this test started indirectly (the detached fetcher) if it is still there.
struct KillOnExit {
  int pid = 0;
  ~KillOnExit() {
    if (pid > 0) ::kill(pid, SIGKILL);
  }
};

TEST_F(HotCold, HotLayerFirstIntoMemoryThenLazyFetchRoundTrip) {
  TempDir out;
  const auto dir = out / "image";
  const auto ready = out / "ready.json";
  FaultProxy proxy(registry_->host());
  const RunResult r =
      pull_image(proxy.host(), dir, {"--hot", "1", "--cold", "lazy", "--ready-file", ready.string(), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const Json report = parse_json(r);
  ASSERT_EQ(report["layers"].size(), 3u);
  EXPECT_EQ(report["layers"][1]["hot"], true);
  EXPECT_EQ(report["layers"][1]["location"], "memory");
  EXPECT_EQ(report["layers"][1]["state"], "fetched");
  EXPECT_EQ(report["layers"][0]["state"], "pending");
  EXPECT_EQ(report["layers"][2]["state"], "pending");
  EXPECT_EQ(report["complete"], false);
  EXPECT_TRUE(report["ready_s"].is_number());
  EXPECT_GT(report["peak_rss_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(report["bytes_fetched"], image_->config.size() + image_->layers[1].size());
  // Lazy means lazy: the cold blobs were never asked for.
  EXPECT_TRUE(proxy.requests(blob_url_part(0)).empty());
  EXPECT_TRUE(proxy.requests(blob_url_part(2)).empty());
  // The hot blob lives in the memory store; the layout links to it.
  const auto store = fs::path(report["memory_store"]["dir"].get<std::string>());
  EXPECT_EQ(store.parent_path(), shm_.path);
  const auto link = dir / "blobs" / "sha256" / layer_digest(1).substr(7);
  EXPECT_TRUE(fs::is_symlink(link)) << link;
  EXPECT_EQ(fs::read_symlink(link).parent_path().parent_path().parent_path(), store);
  expect_blob(dir, image_->layers[1]);
  // Ready, but no index.json: the layout is not complete yet.
  const Json ready_file = Json::parse(slurp(ready), nullptr, false);
  ASSERT_FALSE(ready_file.is_discarded()) << slurp(ready);
  EXPECT_EQ(ready_file["manifest_digest"], image_->manifest_digest);
  EXPECT_EQ(ready_file["hot"][0], layer_digest(1));
  EXPECT_FALSE(fs::exists(dir / "index.json"));

  const RunResult s = status_json(dir);
  ASSERT_EQ(s.status, 0) << s.err;
  const Json state = parse_json(s);
  EXPECT_EQ(state["ready"], true);
  EXPECT_EQ(state["layers"][0]["state"], "pending");
  EXPECT_EQ(state["layers"][1]["state"], "fetched");
  EXPECT_EQ(state["layers"][1]["location"], "memory");
  EXPECT_EQ(state["fetcher_pid"], 0);

  // fetch brings what it is asked for, then the rest, and completes the layout.
  const RunResult one = pull({"fetch", dir.string(), "sha256:" + layer_digest(2).substr(7, 10), "--json"});
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(parse_json(one)["layers"][2]["state"], "fetched");
  EXPECT_EQ(parse_json(one)["layers"][0]["state"], "pending");
  EXPECT_TRUE(proxy.requests(blob_url_part(0)).empty());
  const RunResult rest = pull({"fetch", dir.string(), "--json"});
  ASSERT_EQ(rest.status, 0) << rest.err;
  const Json done = parse_json(rest);
  EXPECT_EQ(done["complete"], true);
  EXPECT_EQ(done["layers"][0]["state"], "fetched");
  EXPECT_EQ(done["layout_manifest_digest"], image_->manifest_digest);
  for (const auto& layer : image_->layers) expect_blob(dir, layer);
  const auto index = Json::parse(slurp(dir / "index.json"));
  EXPECT_EQ(index["manifests"][0]["digest"], image_->manifest_digest);
  EXPECT_EQ(index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"], "v1");
  // Every blob once: nothing was fetched twice.
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(proxy.requests(blob_url_part(i)).size(), 1u) << i;
  const Json final_state = parse_json(status_json(dir));
  EXPECT_EQ(final_state["complete"], true);
  EXPECT_EQ(final_state["layers_fetched"], 3);
  // Nothing left to do: a second fetch fetches nothing.
  const RunResult again = pull({"fetch", dir.string(), "--json"});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(parse_json(again)["bytes_fetched"], 0);
}

TEST_F(HotCold, ALayerNamedTwiceIsFetchedOnceForBothIndices) {
  // Many images repeat the empty layer: here layer 2 is layer 0 again.
  FixtureImage image = make_image(41, "amd64", {3000, 5000});
  image.layers.push_back(image.layers[0]);
  Json manifest = Json::parse(image.manifest);
  manifest["layers"].push_back(manifest["layers"][0]);
  image.manifest = manifest.dump();
  ASSERT_TRUE(push_image(*registry_, "hc/twice", "v1", image));
  FaultProxy proxy(registry_->host());
  TempDir out;
  const RunResult r = pull({"pull", proxy.host() + "/hc/twice:v1", "--output", "oci:" + (out / "a").string(),
                            "--plain-http", "--memory-dir", shm_.string(), "--hot", "-1", "--cold", "lazy", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const Json j = parse_json(r);
  EXPECT_EQ(j["layers"][0]["state"], "present");  // came with layer 2
  EXPECT_EQ(j["layers"][2]["state"], "fetched");
  EXPECT_EQ(j["layers"][1]["state"], "pending");
  EXPECT_EQ(proxy.requests("/blobs/" + oci::sha256_digest(image.layers[0])).size(), 1u);
  const RunResult rest = pull({"fetch", (out / "a").string(), "--json"});
  ASSERT_EQ(rest.status, 0) << rest.err;
  EXPECT_EQ(parse_json(rest)["complete"], true);
  EXPECT_EQ(proxy.requests("/blobs/" + oci::sha256_digest(image.layers[0])).size(), 1u);
}

TEST_F(HotCold, AHotLayerPulledColdBeforeIsNotFetchedAgain) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  ASSERT_EQ(pull_image(proxy.host(), dir, {"-q"}).status, 0);
  const RunResult r = pull_image(proxy.host(), dir, {"--hot", "1", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const Json j = parse_json(r);
  EXPECT_EQ(j["bytes_fetched"], 0);
  EXPECT_EQ(j["layers"][1]["state"], "present");
  EXPECT_EQ(j["layers"][1]["location"], "disk");
  EXPECT_NE(r.err.find("kept on disk"), std::string::npos) << r.err;
  EXPECT_EQ(proxy.requests(blob_url_part(1)).size(), 1u);
  EXPECT_FALSE(fs::is_symlink(dir / "blobs" / "sha256" / layer_digest(1).substr(7)));
}

TEST_F(HotCold, SelectorsPickTheLayersTheyDocument) {
  struct Case {
    std::vector<std::string> specs;
    std::vector<bool> hot;
  };
  const std::vector<Case> cases = {
      {{"smallest:1"}, {true, false, false}}, {{"top:2"}, {true, true, false}},
      {{"last:1"}, {false, false, true}},     {{"-1", "0"}, {true, false, true}},
      {{"all"}, {true, true, true}},          {{"sha256:" + layer_digest(1).substr(7, 6)}, {false, true, false}},
  };
  for (const auto& c : cases) {
    TempDir out;
    std::vector<std::string> args = {"--cold", "skip", "--json"};
    for (const auto& s : c.specs) {
      args.push_back("--hot");
      args.push_back(s);
    }
    const RunResult r = pull_image(registry_->host(), out / "image", args);
    ASSERT_EQ(r.status, 0) << c.specs[0] << ": " << r.err;
    const Json j = parse_json(r);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(j["layers"][i]["hot"], c.hot[i]) << c.specs[0] << " layer " << i;
      EXPECT_EQ(j["layers"][i]["state"], c.hot[i] ? "fetched" : "skipped") << c.specs[0] << " layer " << i;
    }
  }
  TempDir out;
  const RunResult none = pull_image(registry_->host(), out / "x", {"--hot", "7"});
  EXPECT_EQ(none.status, 2) << none.err;
  EXPECT_NE(none.err.find("--hot 7: no such layer; the image has 3"), std::string::npos) << none.err;
  const RunResult bad = pull_image(registry_->host(), out / "y", {"--hot", "biggest:2"});
  EXPECT_EQ(bad.status, 2) << bad.err;
  EXPECT_NE(bad.err.find("--hot 'biggest:2'"), std::string::npos) << bad.err;
}

TEST_F(HotCold, SkipLeavesTheColdLayersOut) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  const RunResult r = pull_image(proxy.host(), dir, {"--hot", "0", "--cold", "skip"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("cold layers skipped"), std::string::npos) << r.out;
  EXPECT_EQ(proxy.requests(blob_url_part(0)).size(), 1u);
  EXPECT_TRUE(proxy.requests(blob_url_part(1)).empty());
  EXPECT_TRUE(proxy.requests(blob_url_part(2)).empty());
  EXPECT_FALSE(fs::exists(dir / "index.json"));
  const Json state = parse_json(status_json(dir));
  EXPECT_EQ(state["cold"], "skip");
  EXPECT_EQ(state["layers"][1]["state"], "skipped");
  EXPECT_EQ(state["layers"][2]["state"], "skipped");
  EXPECT_EQ(state["complete"], false);
  // The human status names every layer and its state.
  const RunResult text = pull({"status", dir.string()});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("1 of 3 fetched"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("skipped"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(layer_digest(2).substr(0, 19)), std::string::npos) << text.out;
}

TEST_F(HotCold, BackgroundFetchFinishesTheColdLayers) {
  TempDir out;
  const auto dir = out / "image";
  const RunResult r = pull_image(registry_->host(), dir, {"--hot", "0", "--cold", "lazy", "--background", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const Json report = parse_json(r);
  KillOnExit guard{report["background_pid"].is_number() ? report["background_pid"].get<int>() : 0};
  ASSERT_GT(guard.pid, 0) << r.out;
  EXPECT_EQ(report["layers"][0]["state"], "fetched");
  const Json state = wait_for_status(dir, [](const Json& s) { return s["complete"] == true; });
  ASSERT_EQ(state["complete"], true) << state.dump(2) << "\nlog:\n" << slurp(dir / "cfmo-pull.log");
  EXPECT_EQ(state["fetcher_pid"], 0);
  for (const auto& layer : image_->layers) expect_blob(dir, layer);
  EXPECT_TRUE(fs::exists(dir / "index.json"));
  // Its own log, with a line per layer it fetched.
  const std::string log = slurp(dir / "cfmo-pull.log");
  EXPECT_NE(log.find("layer 1 "), std::string::npos) << log;
  EXPECT_NE(log.find("layer 2 "), std::string::npos) << log;
}

TEST_F(HotCold, AnInterruptedBackgroundFetchIsResumedFromItsPartialBlob) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  // 280000 bytes of the 300000 reach the fetcher before the stall; with a
  // 256 KiB buffer budget some of them are already in its partial file.
  proxy.add(FaultProxy::stall_after(blob_url_part(1), 280000));
  const RunResult r =
      pull_image(proxy.host(), dir,
                 {"--hot", "0", "--cold", "lazy", "--background", "--jobs", "1", "--buffer-memory", "256K", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  KillOnExit guard{parse_json(r)["background_pid"].get<int>()};
  const auto start = std::chrono::steady_clock::now();
  while (!proxy.stalled() && std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(proxy.stalled()) << slurp(dir / "cfmo-pull.log");
  // The proxy having sent the bytes is not the fetcher having written them:
  // wait until its partial file holds some (a loaded machine may lag).
  const auto partial = dir / "blobs" / "sha256" / (layer_digest(1).substr(7) + ".partial");
  std::error_code ec;
  while ((!fs::exists(partial, ec) || fs::file_size(partial, ec) == 0) &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(fs::file_size(partial, ec), 0u) << partial << "\n" << slurp(dir / "cfmo-pull.log");
  ::kill(guard.pid, SIGKILL);
  const Json interrupted = wait_for_status(dir, [](const Json& s) { return s["fetcher_alive"] == false; });
  EXPECT_EQ(interrupted["fetcher_alive"], false);
  EXPECT_EQ(interrupted["layers"][1]["state"], "interrupted") << interrupted.dump(2);
  EXPECT_EQ(interrupted["complete"], false);
  proxy.release();
  // What the killed process had written (not what was still in its buffer) is kept, and resumed from.
  const int64_t kept = interrupted["layers"][1]["bytes_on_disk"].get<int64_t>();
  EXPECT_GT(kept, 0);
  EXPECT_LE(kept, 280000);
  expect_resumed(pull({"fetch", dir.string(), "--json", "--retry-delay", "0.01"}), dir, proxy, kept);
}

// SIGINT and SIGTERM stop a pull cleanly, as they stop cfmo-train: the
// download in flight ends, its partial blob stays, the state file says the
// run was interrupted, the status is 128 + the signal, and the same command
// resumes from the partial blob.
TEST_F(HotCold, ASignalStopsThePullCleanlyAndTheSameCommandResumes) {
  for (const int signal_number : {SIGINT, SIGTERM}) {
    const std::string name = signal_number == SIGINT ? "SIGINT" : "SIGTERM";
    SCOPED_TRACE(name);
    TempDir out;
    const auto dir = out / "image";
    FaultProxy proxy(registry_->host());
    proxy.add(FaultProxy::stall_after(blob_url_part(1), 280000));
    const auto partial = dir / "blobs" / "sha256" / (layer_digest(1).substr(7) + ".partial");
    bool sent = false;
    const RunResult r =
        pull_image(proxy.host(), dir, {"--hot", "0", "--jobs", "1", "--buffer-memory", "256K", "--json"}, 120,
                   [&](pid_t pid, double) {
                     std::error_code ec;
                     // Stalled, with some of the layer's bytes in its partial file.
                     if (!sent && proxy.stalled() && fs::exists(partial, ec) && fs::file_size(partial, ec) > 0) {
                       ::kill(pid, signal_number);
                       sent = true;
                     }
                   });
    ASSERT_TRUE(sent) << r.err;
    ASSERT_FALSE(r.timed_out);
    EXPECT_EQ(r.status, 128 + signal_number) << r.err;
    EXPECT_EQ(testing::lines(r.err).size(), 1u) << r.err;
    EXPECT_NE(r.err.find("stopped by " + name), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("resumes"), std::string::npos) << r.err;
    std::error_code ec;
    const int64_t kept = static_cast<int64_t>(fs::file_size(partial, ec));
    ASSERT_FALSE(ec) << "the partial blob is gone";
    EXPECT_GT(kept, 0);
    const Json state = Json::parse(slurp(dir / "cfmo-pull-state.json"));
    EXPECT_EQ(state["interrupted"], true) << state.dump(2);
    EXPECT_EQ(state["fetcher_pid"], 0);
    EXPECT_EQ(state["complete"], false);
    EXPECT_EQ(state["layers"][0]["state"], "fetched");
    EXPECT_EQ(state["layers"][1]["state"], "pending");
    EXPECT_FALSE(state["layers"][1].contains("error")) << state.dump(2);
    EXPECT_EQ(state["layers"][2]["state"], "pending");
    const RunResult shown = pull({"status", dir.string()});
    EXPECT_NE(shown.out.find("stopped   by a signal"), std::string::npos) << shown.out;

    proxy.release();
    expect_resumed(pull_image(proxy.host(), dir, {"--hot", "0", "--json"}), dir, proxy, kept);
    EXPECT_EQ(Json::parse(slurp(dir / "cfmo-pull-state.json"))["interrupted"], false);
  }
}

TEST_F(HotCold, DroppedConnectionsAreResumedThroughTheProxy) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  // Layer 1 is cut twice (at 50000 bytes, then 120000 bytes into the rest); layer 2 once.
  proxy.add(FaultProxy::drop_after(blob_url_part(1), 50000, 1, 1));
  proxy.add(FaultProxy::drop_after(blob_url_part(1), 70000, 2, 1));
  proxy.add(FaultProxy::drop_after(blob_url_part(2), 1000, 1, 1));
  const RunResult r = pull_image(proxy.host(), dir, {"--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  for (const auto& layer : image_->layers) expect_blob(dir, layer);
  const auto asked = proxy.requests(blob_url_part(1));
  ASSERT_EQ(asked.size(), 3u);
  EXPECT_EQ(asked[0].range_start, -1);
  EXPECT_EQ(asked[1].range_start, 50000);
  EXPECT_EQ(asked[2].range_start, 120000);
  EXPECT_EQ(proxy.requests(blob_url_part(2))[1].range_start, 1000);
  // Every byte fetched once.
  int64_t total = static_cast<int64_t>(image_->config.size());
  for (const auto& layer : image_->layers) total += static_cast<int64_t>(layer.size());
  EXPECT_EQ(parse_json(r)["bytes_fetched"], total);

  // With no retries left, the pull fails and a second run resumes from what the first kept.
  TempDir out2;
  FaultProxy flaky(registry_->host());
  flaky.add(FaultProxy::drop_after(blob_url_part(1), 64000, 1, 1));
  const RunResult cut = pull_image(flaky.host(), out2 / "image", {"--retries", "0", "--jobs", "1"});
  EXPECT_EQ(cut.status, 4) << cut.err;
  const RunResult second = pull_image(flaky.host(), out2 / "image", {"--json"});
  ASSERT_EQ(second.status, 0) << second.err;
  EXPECT_EQ(parse_json(second)["layers"][1]["state"], "resumed");
  EXPECT_EQ(flaky.requests(blob_url_part(1)).back().range_start, 64000);
}

TEST_F(HotCold, RateLimitsAndUnavailableAreHonoured) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  proxy.add(FaultProxy::status(blob_url_part(1), 429, "Retry-After: 1\r\n", 1, 1));
  proxy.add(FaultProxy::status(blob_url_part(1), 503, "", 2, 1));
  proxy.add(FaultProxy::status("/manifests/", 503, "", 1, 1));
  const RunResult r = pull_image(proxy.host(), dir, {"--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  expect_blob(dir, image_->layers[1]);
  const auto asked = proxy.requests(blob_url_part(1));
  ASSERT_EQ(asked.size(), 3u);
  EXPECT_EQ(asked[0].status, 429);
  EXPECT_EQ(asked[1].status, 503);
  EXPECT_EQ(asked[2].status, 200);
  // Retry-After: 1 was waited for, though the backoff alone (--retry-delay 0.01) is far shorter:
  // a lower bound the sleep guarantees, not a measure of speed.
  EXPECT_GE(std::chrono::duration<double>(asked[1].at - asked[0].at).count(), 0.9);
  EXPECT_GE(proxy.requests("/manifests/").size(), 2u);

  // A registry that stays at 503 ends in exit 4 after the retries, naming the status.
  TempDir out2;
  FaultProxy busy(registry_->host());
  busy.add(FaultProxy::status(blob_url_part(2), 503, "", 1, 0));
  const RunResult down = pull_image(busy.host(), out2 / "image", {"--retries", "2"});
  EXPECT_EQ(down.status, 4) << down.err;
  EXPECT_NE(down.err.find("HTTP 503 (after 3 attempts)"), std::string::npos) << down.err;
}

TEST_F(HotCold, ACorruptByteIsADigestMismatchAndNothingIsKept) {
  TempDir out;
  const auto dir = out / "image";
  FaultProxy proxy(registry_->host());
  proxy.add(FaultProxy::corrupt(blob_url_part(2), 12345));
  const RunResult r = pull_image(proxy.host(), dir, {"--hot", "2"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_NE(r.err.find("digest mismatch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(layer_digest(2).substr(0, 19)), std::string::npos) << r.err;
  const std::string hex = layer_digest(2).substr(7);
  EXPECT_FALSE(fs::exists(dir / "blobs" / "sha256" / hex));
  EXPECT_FALSE(fs::exists(dir / "blobs" / "sha256" / (hex + ".partial")));
  EXPECT_FALSE(fs::exists(dir / "index.json"));
  const Json state = parse_json(status_json(dir));
  EXPECT_EQ(state["layers"][2]["state"], "failed");
  EXPECT_NE(state["layers"][2]["error"].get<std::string>().find("digest mismatch"), std::string::npos);
  EXPECT_EQ(state["ready"], false);
}

TEST_F(HotCold, AHotSetOverTheCapIsRefusedBeforeAnyDownloadOrSpilled) {
  TempDir out;
  FaultProxy proxy(registry_->host());
  // The three layers are 504000 bytes; 1 MiB with 640 KiB of buffers leaves 384 KiB for the memory store.
  const RunResult refused =
      pull_image(proxy.host(), out / "a", {"--hot", "all", "--max-memory", "1M", "--buffer-memory", "640K"});
  EXPECT_EQ(refused.status, 2) << refused.err;
  EXPECT_NE(refused.err.find("the hot layers need 492.2 KiB (504000 bytes"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("leaves 384.0 KiB for the memory store"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("--spill"), std::string::npos) << refused.err;
  EXPECT_EQ(std::count(refused.err.begin(), refused.err.end(), '\n'), 1) << refused.err;
  for (const auto& seen : proxy.requests()) {
    EXPECT_EQ(seen.target.find("/blobs/"), std::string::npos) << "fetched before refusing: " << seen.target;
  }

  const RunResult spilled = pull_image(
      proxy.host(), out / "b", {"--hot", "all", "--max-memory", "1M", "--buffer-memory", "640K", "--spill", "--json"});
  ASSERT_EQ(spilled.status, 0) << spilled.err;
  EXPECT_NE(spilled.err.find("hot layer 2"), std::string::npos) << spilled.err;
  EXPECT_NE(spilled.err.find("goes to disk"), std::string::npos) << spilled.err;
  const Json j = parse_json(spilled);
  EXPECT_EQ(j["layers"][0]["location"], "memory");
  EXPECT_EQ(j["layers"][1]["location"], "memory");
  EXPECT_EQ(j["layers"][2]["location"], "disk");
  EXPECT_EQ(j["layers"][2]["hot"], true);
  EXPECT_LE(j["memory_store"]["bytes"].get<int64_t>(), j["memory_store"]["capacity"].get<int64_t>());
  EXPECT_FALSE(fs::is_symlink(out / "b" / "blobs" / "sha256" / layer_digest(2).substr(7)));
  EXPECT_TRUE(j["complete"].get<bool>());
}

TEST_F(HotCold, MirrorsAreTriedInOrderThenTheOrigin) {
  // The mirror is a second real registry holding the same image.
  Registry mirror_registry;
  ASSERT_TRUE(mirror_registry.start()) << mirror_registry.log();
  ASSERT_TRUE(push_image(mirror_registry, kImage, "v1", *image_));
  FaultProxy origin(registry_->host());
  FaultProxy mirror(mirror_registry.host());
  const int dead_port = testing::free_port();  // nothing listens there
  TempDir out;
  const RunResult r =
      pull_image(origin.host(), out / "a",
                 {"--mirror", "127.0.0.1:" + std::to_string(dead_port), "--mirror", mirror.host(), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  for (const auto& layer : image_->layers) expect_blob(out / "a", layer);
  EXPECT_TRUE(origin.requests("/blobs/").empty()) << "the origin served blobs a mirror had";
  EXPECT_TRUE(origin.requests("/manifests/").empty());
  EXPECT_EQ(mirror.requests("/blobs/sha256:").size(), 4u);
  EXPECT_NE(r.err.find("mirror 127.0.0.1:" + std::to_string(dead_port) + " skipped"), std::string::npos) << r.err;

  // A mirror without the image (404) falls through to the origin; one that
  // fails a blob (503 after its retry) is skipped for the rest of the pull.
  Registry empty_registry;
  ASSERT_TRUE(empty_registry.start()) << empty_registry.log();
  FaultProxy empty(empty_registry.host());
  FaultProxy origin2(registry_->host());
  const RunResult missing = pull_image(origin2.host(), out / "b", {"--mirror", empty.host(), "--json"});
  ASSERT_EQ(missing.status, 0) << missing.err;
  EXPECT_EQ(empty.requests("/manifests/").size(), 1u);
  EXPECT_FALSE(origin2.requests("/blobs/").empty());

  FaultProxy failing(mirror_registry.host());
  failing.add(FaultProxy::status(blob_url_part(1), 503, "", 1, 0));
  FaultProxy origin3(registry_->host());
  const RunResult fallback =
      pull_image(origin3.host(), out / "c", {"--mirror", failing.host(), "--jobs", "1", "--json"});
  ASSERT_EQ(fallback.status, 0) << fallback.err;
  EXPECT_EQ(failing.requests(blob_url_part(1)).size(), 2u) << "a mirror gets one retry";
  EXPECT_EQ(origin3.requests(blob_url_part(1)).size(), 1u);
  // Skipped from then on: layer 2 came from the origin too.
  EXPECT_TRUE(failing.requests(blob_url_part(2)).empty());
  for (const auto& layer : image_->layers) expect_blob(out / "c", layer);
}

TEST_F(HotCold, InsecureRegistriesArePerHost) {
  TempDir out;
  const std::string ref = registry_->host() + "/" + kImage + ":v1";
  // Without --plain-http the registry is spoken to over HTTPS, which a plain-HTTP registry cannot answer.
  const RunResult https = pull({"pull", ref, "--output", "oci:" + (out / "a").string(), "--retries", "0"});
  EXPECT_EQ(https.status, 4) << https.err;
  const RunResult insecure = pull(
      {"pull", ref, "--output", "oci:" + (out / "b").string(), "--insecure-registry", registry_->host(), "--json"});
  ASSERT_EQ(insecure.status, 0) << insecure.err;
  expect_blob(out / "b", image_->layers[2]);
  // A host without a port covers every port of it; another host does not.
  const RunResult any_port =
      pull({"pull", ref, "--output", "oci:" + (out / "c").string(), "--insecure-registry", "127.0.0.1"});
  EXPECT_EQ(any_port.status, 0) << any_port.err;
  const RunResult other = pull(
      {"pull", ref, "--output", "oci:" + (out / "d").string(), "--insecure-registry", "10.1.2.3", "--retries", "0"});
  EXPECT_EQ(other.status, 4) << other.err;
  // A mirror given with http:// is plain HTTP for that mirror alone.
  FaultProxy mirror(registry_->host());
  const RunResult via_mirror =
      pull({"pull", "127.0.0.1:1/" + std::string(kImage) + ":v1", "--output", "oci:" + (out / "e").string(), "--mirror",
            "http://" + mirror.host(), "--retries", "0"});
  EXPECT_EQ(via_mirror.status, 0) << via_mirror.err;
  EXPECT_FALSE(mirror.requests("/blobs/").empty());
  const RunResult bad = pull({"pull", ref, "--output", "oci:" + (out / "f").string(), "--mirror", "ftp://x/y"});
  EXPECT_EQ(bad.status, 2) << bad.err;
  EXPECT_NE(bad.err.find("--mirror 'ftp://x/y'"), std::string::npos) << bad.err;
}

TEST_F(HotCold, ProgressIsPerLayerOnATerminalAndPlainElsewhere) {
  TempDir out;
  const RunResult tty = pull_image(registry_->host(), out / "a", {"--hot", "0", "--progress", "tty"});
  ASSERT_EQ(tty.status, 0) << tty.err;
  EXPECT_NE(tty.err.find("\033["), std::string::npos) << "no cursor movement: " << tty.err;
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(tty.err.find(layer_digest(i).substr(7, 12)), std::string::npos) << i;
  EXPECT_NE(tty.err.find("ready in"), std::string::npos) << tty.err;

  const RunResult plain = pull_image(registry_->host(), out / "b", {"--hot", "0"});  // stderr is a pipe: plain
  ASSERT_EQ(plain.status, 0) << plain.err;
  EXPECT_EQ(plain.err.find("\033["), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find("layer 0 " + layer_digest(0).substr(7, 12)), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find("(hot, memory)"), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find("ready in"), std::string::npos) << plain.err;

  for (const char* silent : {"--json", "--quiet"}) {
    const RunResult r = pull_image(registry_->host(), out / silent, {"--hot", "0", silent});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << silent << ": " << r.err;
  }
}

/// Three real layers: the second removes a file of the first (a whiteout),
/// the third empties a directory of the lower layers (an opaque whiteout).
FixtureImage whiteout_image() {
  using namespace cfmo::testing;
  const std::string base = make_tar({dir("etc"), file("etc/os-release", "ID=fixture\n"), file("old", "gone soon\n"),
                                     dir("opt"), file("opt/lower", "lower\n"), symlink("bin", "usr/bin"), dir("usr"),
                                     dir("usr/bin"), file("usr/bin/tool", "#!/bin/sh\n", 0755)});
  const std::string runtime =
      make_tar({whiteout("", "old"), dir("lib"), file("lib/runtime.so", random_bytes(50000, 7))});
  const std::string app = make_tar({dir("opt"), opaque("opt"), file("opt/app", "app\n")});
  return make_real_image({{base, "tar+gzip"}, {runtime, "tar+zstd"}, {app, "tar"}});
}

/// Skips (with the reason cfmo-pull gives) where this process may not mount.
#define SKIP_UNLESS_MOUNTED(r)                                                   \
  if ((r).status == 2 && (r).err.find("cannot mount") != std::string::npos) {    \
    GTEST_SKIP() << "this sandbox does not allow an overlay mount: " << (r).err; \
  }

/// Unmounts at the end of a test that mounted, whatever happened.
struct Unmount {
  fs::path point;
  ~Unmount() {
    if (!point.empty()) ::umount2(point.c_str(), MNT_DETACH);
  }
};

/// The tree at a mount point without the empty proc, sys and dev that every
/// mount supplies, after checking that they are there.
std::string without_runtime_mount_points(const fs::path& point) {
  std::string kept;
  for (const auto& line : testing::lines(testing::list_tree(point))) {
    bool supplied = false;
    for (const char* name : {"dev", "proc", "sys"}) {
      supplied = supplied || line.rfind(std::string(name) + " dir ", 0) == 0;
    }
    if (!supplied) kept += line + "\n";
  }
  for (const char* name : {"dev", "proc", "sys"}) {
    EXPECT_TRUE(fs::is_directory(point / name)) << name;
    std::error_code ec;
    EXPECT_TRUE(fs::is_empty(point / name, ec)) << name;
  }
  return kept;
}

TEST_F(HotCold, MountPresentsTheImageAsOneOverlayHotFromMemory) {
  const FixtureImage image = whiteout_image();
  ASSERT_TRUE(push_image(*registry_, "hc/layered", "v1", image));
  const std::string ref = registry_->host() + "/hc/layered:v1";
  TempDir out;
  const auto dir = out / "image";
  const auto point = out / "mnt";
  fs::create_directories(point);
  const RunResult pulled = pull({"pull", ref, "--output", "oci:" + dir.string(), "--plain-http", "--memory-dir",
                                 shm_.string(), "--hot", "1", "--cold", "lazy", "-q"});
  ASSERT_EQ(pulled.status, 0) << pulled.err;
  // Lazy layers are not there yet: mount says so rather than mounting half an image.
  const RunResult early = pull({"mount", dir.string(), point.string()});
  EXPECT_EQ(early.status, 2) << early.err;
  EXPECT_NE(early.err.find("layers 0 and 2 are not fetched yet"), std::string::npos) << early.err;
  EXPECT_NE(early.err.find("--partial"), std::string::npos) << early.err;
  ASSERT_EQ(pull({"fetch", dir.string(), "-q"}).status, 0);

  const RunResult mounted = pull({"mount", dir.string(), point.string(), "--json"});
  SKIP_UNLESS_MOUNTED(mounted);
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  Unmount guard{point};
  const Json j = parse_json(mounted);
  EXPECT_EQ(j["mounted"], true);
  ASSERT_EQ(j["layers"].size(), 3u);
  EXPECT_EQ(j["layers"][1]["memory"], true);
  EXPECT_EQ(fs::path(j["layers"][1]["dir"].get<std::string>()).string().rfind(shm_.string(), 0), 0u)
      << "the hot layer is not in the memory store: " << j["layers"][1]["dir"];
  EXPECT_EQ(j["layers"][0]["memory"], false);
  EXPECT_EQ(fs::path(j["layers"][2]["dir"].get<std::string>()).parent_path().parent_path(), dir / "layers");

  // The overlay shows what a merged rootfs of the same image holds.
  const RunResult rootfs = pull({"pull", ref, "--output", "rootfs:" + (out / "rootfs").string(), "--cache",
                                 (out / "cache").string(), "--plain-http", "-q"});
  ASSERT_EQ(rootfs.status, 0) << rootfs.err;
  // The image has no /proc, /sys or /dev: the mount supplies them, empty, for a container runtime.
  EXPECT_EQ(without_runtime_mount_points(point), testing::list_tree(out / "rootfs"));
  EXPECT_FALSE(fs::exists(point / "old"));
  EXPECT_TRUE(fs::exists(point / "opt" / "app"));
  EXPECT_FALSE(fs::exists(point / "opt" / "lower"));
  EXPECT_EQ(slurp(point / "etc" / "os-release"), "ID=fixture\n");
  // Read-only by default; mounting twice at one point is refused.
  EXPECT_FALSE(std::ofstream(point / "new").good());
  const RunResult twice = pull({"mount", dir.string(), point.string()});
  EXPECT_EQ(twice.status, 2) << twice.err;
  EXPECT_NE(twice.err.find("mounted there already"), std::string::npos) << twice.err;

  const RunResult down = pull({"umount", point.string()});
  ASSERT_EQ(down.status, 0) << down.err;
  guard.point.clear();
  EXPECT_TRUE(fs::is_empty(point));
  const RunResult again = pull({"umount", point.string()});
  EXPECT_EQ(again.status, 2) << again.err;
  EXPECT_NE(again.err.find("nothing is mounted there"), std::string::npos) << again.err;

  // A second mount reuses the unpacked layers; --writable keeps writes in memory until umount.
  const RunResult rw = pull({"mount", dir.string(), point.string(), "--writable", "--json"});
  ASSERT_EQ(rw.status, 0) << rw.err;
  guard.point = point;
  const Json w = parse_json(rw);
  EXPECT_EQ(w["layers"][0]["unpacked_now"], false);
  EXPECT_EQ(w["upper_in_memory"], true);
  const fs::path upper = w["upper"].get<std::string>();
  EXPECT_EQ(upper.string().rfind(shm_.string(), 0), 0u) << upper;
  { std::ofstream(point / "written") << "kept in memory"; }
  EXPECT_TRUE(fs::exists(upper / "written"));
  ASSERT_EQ(pull({"umount", point.string()}).status, 0);
  guard.point.clear();
  EXPECT_FALSE(fs::exists(upper));
}

// Without hot layers there is no memory store: a --writable mount's writes
// go to disk, and the line it prints says so and where.
TEST_F(HotCold, AWritableMountWithoutHotLayersSaysItsWritesGoToDisk) {
  ASSERT_TRUE(push_image(*registry_, "hc/layered3", "v1", whiteout_image()));
  TempDir out;
  const auto dir = out / "image";
  const auto point = out / "mnt";
  fs::create_directories(point);
  ASSERT_EQ(pull({"pull", registry_->host() + "/hc/layered3:v1", "--output", "oci:" + dir.string(), "--plain-http",
                  "--memory-dir", shm_.string(), "-q"})
                .status,
            0);
  const RunResult r = pull({"mount", dir.string(), point.string(), "--writable"});
  SKIP_UNLESS_MOUNTED(r);
  ASSERT_EQ(r.status, 0) << r.err;
  Unmount guard{point};
  EXPECT_NE(r.out.find("writes kept on disk in " + (dir / "layers" / "rw").string()), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("memory until"), std::string::npos) << r.out;
  { std::ofstream(point / "written") << "kept on disk"; }
  bool found = false;
  for (const auto& entry : fs::recursive_directory_iterator(dir / "layers" / "rw")) {
    found = found || entry.path().filename() == "written";
  }
  EXPECT_TRUE(found) << "the write is not under " << dir / "layers" / "rw";
  without_runtime_mount_points(point);
  ASSERT_EQ(pull({"umount", point.string()}).status, 0);
  guard.point.clear();
}

TEST_F(HotCold, SkippedLayersAreLeftOutAndPartialMountsWhatIsThere) {
  const FixtureImage image = whiteout_image();
  ASSERT_TRUE(push_image(*registry_, "hc/layered2", "v1", image));
  TempDir out;
  const auto point = out / "mnt";
  fs::create_directories(point);
  for (const char* cold : {"skip", "lazy"}) {
    SCOPED_TRACE(cold);
    const auto dir = out / cold;
    ASSERT_EQ(pull({"pull", registry_->host() + "/hc/layered2:v1", "--output", "oci:" + dir.string(), "--plain-http",
                    "--memory-dir", shm_.string(), "--hot", "0", "--cold", cold, "-q"})
                  .status,
              0);
    // Skipped layers were left out on purpose; pending ones only with --partial.
    std::vector<std::string> args = {"mount", dir.string(), point.string()};
    if (std::string(cold) == "lazy") args.push_back("--partial");
    const RunResult r = pull(args);
    SKIP_UNLESS_MOUNTED(r);
    ASSERT_EQ(r.status, 0) << r.err;
    Unmount guard{point};
    const std::string note = std::string(cold) == "skip" ? "layers 1 and 2 left out (skipped by the pull)"
                                                         : "layers 1 and 2 not fetched: mounted without them";
    EXPECT_NE(r.err.find(note), std::string::npos) << r.err;
    EXPECT_TRUE(fs::exists(point / "old"));  // the whiteout that removes it is in layer 1
    EXPECT_TRUE(fs::exists(point / "opt" / "lower"));
    EXPECT_FALSE(fs::exists(point / "opt" / "app"));
    ASSERT_EQ(pull({"umount", point.string()}).status, 0);
    guard.point.clear();
  }
}

TEST_F(HotCold, WhereMountIsNotAllowedTheLayerDirectoriesRemain) {
  if (::geteuid() != 0 || !fs::exists("/usr/bin/setpriv")) {
    GTEST_SKIP() << "needs root and setpriv to run cfmo-pull without CAP_SYS_ADMIN";
  }
  const FixtureImage image = whiteout_image();
  ASSERT_TRUE(push_image(*registry_, "hc/layered3", "v1", image));
  TempDir out;
  const auto dir = out / "image";
  fs::create_directories(out / "mnt");
  ASSERT_EQ(pull({"pull", registry_->host() + "/hc/layered3:v1", "--output", "oci:" + dir.string(), "--plain-http",
                  "--memory-dir", shm_.string(), "-q"})
                .status,
            0);
  // As in a container without CAP_SYS_ADMIN.
  const RunResult r = run({"/usr/bin/setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", "--", binary(),
                           "mount", dir.string(), (out / "mnt").string()});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("cannot mount"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("CAP_SYS_ADMIN"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(fs::is_empty(out / "mnt"));
  // The plain directories are there, one per layer, with the OCI whiteouts as files.
  size_t layers = 0;
  for (const auto& entry : fs::directory_iterator(dir / "layers" / "oci")) {
    EXPECT_TRUE(entry.is_directory()) << entry.path();
    ++layers;
  }
  EXPECT_EQ(layers, 3u);
  const auto top = dir / "layers" / "oci" / oci::sha256_digest(image.layers[2]).substr(7);
  EXPECT_TRUE(fs::exists(top / "opt" / "app"));
  EXPECT_TRUE(fs::exists(top / "opt" / ".wh..wh..opq"));
}

TEST_F(HotCold, ALazyRootfsCannotStayLazyAndSaysSo) {
  TempDir out;
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--cold", "lazy"}, {"--cold", "skip"}, {"--hot", "0", "--background"}}) {
    std::vector<std::string> args = {"pull",
                                     registry_->host() + "/" + kImage + ":v1",
                                     "--plain-http",
                                     "--output",
                                     "rootfs:" + (out / "rootfs").string(),
                                     "--cache",
                                     (out / "cache").string()};
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult r = pull(args);
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_NE(r.err.find("cannot stay lazy with --output rootfs:"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("cfmo-pull mount"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out / "rootfs"));
    EXPECT_FALSE(fs::exists(out / "cache" / "blobs")) << "fetched before refusing";
  }
}

// rm takes the layout and its memory store; prune takes the stores whose
// layout went some other way, and leaves a store that names no layout.
TEST_F(HotCold, RmAndPruneLeaveNothingOfAPullInMemory) {
  TempDir out;
  const auto first = out / "first";
  ASSERT_EQ(pull_image(registry_->host(), first, {"--hot", "1", "-q"}).status, 0);
  const fs::path store = oci::memory_store_for(first, shm_.path);
  ASSERT_TRUE(fs::exists(store / "blobs"));
  EXPECT_EQ(slurp(store / oci::kStoreOwnerFile), fs::canonical(first).string() + "\n");
  const RunResult removed = pull({"rm", first.string(), "--json"});
  ASSERT_EQ(removed.status, 0) << removed.err;
  EXPECT_FALSE(fs::exists(first));
  EXPECT_FALSE(fs::exists(store));
  EXPECT_GT(parse_json(removed)["bytes"].get<int64_t>(), 300000);
  const RunResult again = pull({"rm", first.string()});
  EXPECT_EQ(again.status, 3) << again.err;
  EXPECT_NE(again.err.find("no such directory"), std::string::npos) << again.err;

  const auto second = out / "second";
  const auto kept = out / "kept";
  ASSERT_EQ(pull_image(registry_->host(), second, {"--hot", "1", "-q"}).status, 0);
  ASSERT_EQ(pull_image(registry_->host(), kept, {"--hot", "1", "-q"}).status, 0);
  const fs::path orphan = oci::memory_store_for(second, shm_.path);
  fs::remove_all(second);
  fs::create_directories(shm_.path / "cfmo-pull-unknown-000000000000");
  // Its own --cache: prune would otherwise look at this user's lazy layouts.
  const RunResult pruned = pull({"prune", "--memory-dir", shm_.string(), "--cache", (out / "cache").string()});
  ASSERT_EQ(pruned.status, 0) << pruned.err;
  EXPECT_NE(pruned.out.find("pruned " + orphan.string()), std::string::npos) << pruned.out;
  EXPECT_NE(pruned.out.find("names no layout"), std::string::npos) << pruned.out;
  EXPECT_FALSE(fs::exists(orphan));
  EXPECT_TRUE(fs::exists(oci::memory_store_for(kept, shm_.path)));
  EXPECT_TRUE(fs::exists(shm_.path / "cfmo-pull-unknown-000000000000"));
  ASSERT_EQ(pull({"rm", kept.string(), "-q"}).status, 0);
  EXPECT_FALSE(fs::exists(oci::memory_store_for(kept, shm_.path)));
  // Not a pull: refused, nothing removed.
  fs::create_directories(out / "plain");
  EXPECT_EQ(pull({"rm", (out / "plain").string()}).status, 3);
  EXPECT_TRUE(fs::exists(out / "plain"));
}

TEST(CfmoPullConfig, FlagsWinOverTheFileAndTheFileOverDefaults) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir / "pull.toml",
                                "image = 'example.com/team/app:v1'\njobs = 2\ncold = 'skip'\n"
                                "hot = ['top:1']\nmax_memory = '64M'\n"));
  const RunResult r = pull({"pull", "--config", (dir / "pull.toml").string(), "--cold", "lazy", "--print-config"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\ncold = 'lazy'\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\njobs = 2\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nhot = [ 'top:1' ]\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nretries = 5\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nimage = 'example.com/team/app:v1'\n"), std::string::npos) << r.out;
  // The REF argument wins over the file's image; a repeated list flag replaces the file's list.
  const RunResult ref = pull({"pull", "other.io/x:2", "--config", (dir / "pull.toml").string(), "--hot", "0", "--hot",
                              "-1", "--print-config"});
  ASSERT_EQ(ref.status, 0) << ref.err;
  EXPECT_NE(ref.out.find("\nimage = 'other.io/x:2'\n"), std::string::npos) << ref.out;
  EXPECT_NE(ref.out.find("\nhot = [ '0', '-1' ]\n"), std::string::npos) << ref.out;
  // Keys of other subcommands are fine in a shared file; unknown keys and bad values are usage errors.
  const RunResult fetch = pull({"fetch", "--config", (dir / "pull.toml").string(), "--print-config"});
  EXPECT_EQ(fetch.status, 0) << fetch.err;
  ASSERT_TRUE(write_file_atomic(dir / "bad.toml", "hot_patterns = ['0']\n"));
  const RunResult unknown = pull({"pull", "--config", (dir / "bad.toml").string(), "--print-config"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_NE(unknown.err.find("unknown key 'hot_patterns'"), std::string::npos) << unknown.err;
  ASSERT_TRUE(write_file_atomic(dir / "cold.toml", "cold = 'sometimes'\n"));
  const RunResult cold = pull({"pull", "--config", (dir / "cold.toml").string(), "--print-config"});
  EXPECT_EQ(cold.status, 2);
  EXPECT_NE(cold.err.find("--cold 'sometimes'"), std::string::npos) << cold.err;
  const RunResult size = pull({"pull", "x", "--output", "oci:/tmp/x", "--max-memory", "lots"});
  EXPECT_EQ(size.status, 2);
  EXPECT_NE(size.err.find("--max-memory"), std::string::npos) << size.err;
  const RunResult background = pull({"pull", "x", "--output", "oci:/tmp/x", "--cold", "skip", "--background"});
  EXPECT_EQ(background.status, 2);
  EXPECT_NE(background.err.find("--background with --cold skip"), std::string::npos) << background.err;
}

TEST(CfmoPullConfig, StatusAndFetchOfADirectoryThatIsNoPull) {
  TempDir dir;
  const RunResult status = pull({"status", dir.path().string()});
  EXPECT_EQ(status.status, 3);
  EXPECT_NE(status.err.find("not a cfmo-pull directory"), std::string::npos) << status.err;
  const RunResult fetch = pull({"fetch", dir.path().string()});
  EXPECT_EQ(fetch.status, 3);
  ASSERT_TRUE(write_file_atomic(dir / "cfmo-pull-state.json", "{\"format\":\"cfmo-pull-state\",\"version\":1}"));
  const RunResult broken = pull({"status", dir.path().string()});
  EXPECT_EQ(broken.status, 3);
  EXPECT_NE(broken.err.find("'image' missing"), std::string::npos) << broken.err;
  EXPECT_EQ(pull({"status"}).status, 2);
}

/// The bound on the process's own memory, on an image far larger than the
/// memory cap: one 256 MiB layer pulled with --max-memory 32M (the `slow`
/// suite runs it). Both the report's peak_rss_bytes (getrusage) and
/// /usr/bin/time's maximum resident set size must stay under a generous
/// bound that a puller holding the layer in memory could not meet.
TEST(CfmoPullRss, PeakRssStaysBoundedOnALayerLargerThanTheCap) {
  if (!fs::exists(kRegistryBinary)) GTEST_SKIP() << kRegistryBinary << " not installed";
  if (!fs::exists("/usr/bin/time")) GTEST_SKIP() << "/usr/bin/time not installed (Debian time)";
  Registry registry;
  ASSERT_TRUE(registry.start()) << registry.log();
  FixtureImage big = make_image(50, "amd64", {size_t{256} << 20});
  ASSERT_TRUE(push_image(registry, "big/image", "v1", big)) << registry.log();
  const std::string digest = oci::sha256_digest(big.layers[0]);
  big.layers.clear();  // the test itself need not hold it while the pull runs
  TempDir out;
  const RunResult r =
      run({"/usr/bin/time", "-f", "max_rss_kib=%M", binary(), "pull", registry.host() + "/big/image:v1", "--output",
           "oci:" + (out / "image").string(), "--plain-http", "--max-memory", "32M", "--json"},
          600);
  ASSERT_EQ(r.status, 0) << r.err;
  const Json report = Json::parse(r.out);
  const int64_t reported = report["peak_rss_bytes"].get<int64_t>();
  const auto at = r.err.rfind("max_rss_kib=");
  ASSERT_NE(at, std::string::npos) << r.err;
  const int64_t measured = std::stoll(r.err.substr(at + 12)) * 1024;
  constexpr int64_t kBound = int64_t{64} << 20;  // the target; the layer is four times that
  EXPECT_LT(reported, kBound) << "peak_rss_bytes " << reported;
  EXPECT_LT(measured, kBound) << "/usr/bin/time " << measured;
  EXPECT_GT(reported, 0);
  // The two measure the same thing (time's includes the exit), so they agree within a few MiB.
  EXPECT_LT(std::abs(measured - reported), int64_t{8} << 20) << reported << " vs " << measured;
  EXPECT_LE(report["buffer_memory"]["peak"].get<int64_t>(), report["buffer_memory"]["budget"].get<int64_t>());
  EXPECT_EQ(fs::file_size(out / "image" / "blobs" / "sha256" / digest.substr(7)), size_t{256} << 20);
}

}  // namespace
}  // namespace cfmo::pulltest
