// The pull pipeline against an in-process registry (fake_registry.h): the
// layout, lazy layers and fetch, resume after a drop, a corrupt blob, hot
// layers in the memory store, and a rootfs, without a registry binary. The
// same paths against the real docker-registry are in
// tests/integration/test_cfmo_pull_*.cpp.
#include "fake_registry.h"
#include "oci/blob.h"
#include "oci/cleanup.h"
#include "oci/gzip_index.h"
#include "oci/index_artifact.h"
#include "oci/index_sink.h"
#include "oci/pull.h"
#include "oci/rootfs.h"
#include "support/layer_builder.h"
#include "support/temp_dir.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

/// A scratch directory named for these tests.
class TempDir : public cfmo::testing::ScratchDir {
 public:
  TempDir() : ScratchDir("cfmo-pipeline") {}
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    using namespace cfmo::testing;
    layers_ = {gzip(make_tar({dir("etc"), file("etc/os-release", "ID=fake\n"), file("old", "gone\n")})),
               gzip(make_tar({whiteout("", "old"), dir("lib"), file("lib/big", random_bytes(300000, 5))})),
               gzip(make_tar({dir("app"), file("app/run", "#!/bin/sh\n", 0755)}))};
    std::vector<std::pair<std::string, std::string>> typed;
    for (const auto& layer : layers_) typed.emplace_back(layer, "application/vnd.oci.image.layer.v1.tar+gzip");
    add_image("v1", typed);
    options_.registry.connect = registry_.connector();
    options_.registry.retries = 0;
    options_.platform = host_platform();
    options_.memory_dir = out_.path() / "shm";
    fs::create_directories(options_.memory_dir);
  }

  /// An image of these layers (blob, media type) under `tag` in the registry.
  void add_image(const std::string& tag, const std::vector<std::pair<std::string, std::string>>& layers) {
    const std::string config = R"({"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}})";
    Json manifest = {{"schemaVersion", 2},
                     {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                     {"config",
                      {{"mediaType", "application/vnd.oci.image.config.v1+json"},
                       {"digest", registry_.add_blob(config)},
                       {"size", config.size()}}},
                     {"layers", Json::array()}};
    for (const auto& [blob, type] : layers) {
      manifest["layers"].push_back({{"mediaType", type}, {"digest", registry_.add_blob(blob)}, {"size", blob.size()}});
    }
    registry_.add_manifest(tag, "application/vnd.oci.image.manifest.v1+json", manifest.dump());
  }

  Reference ref() const { return *parse_reference("fake.test/team/app:v1"); }
  std::string digest(size_t layer) const { return sha256_digest(layers_[layer]); }
  fs::path layout() const { return out_.path() / "layout"; }

  TempDir out_;
  testing::FakeRegistry registry_;
  std::vector<std::string> layers_;
  PullOptions options_;
};

TEST_F(Pipeline, AnEagerPullMakesACompleteLayoutFetchingEachBlobOnce) {
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_TRUE(report->complete);
  EXPECT_TRUE(fs::exists(layout() / "index.json"));
  for (size_t i = 0; i < layers_.size(); ++i) {
    EXPECT_EQ(slurp(blob_path(layout(), digest(i))), layers_[i]) << i;
    EXPECT_EQ(registry_.requests(digest(i)).size(), 1u) << i;
    EXPECT_EQ(report->layers[i].state, "fetched") << i;
  }
  // Again: everything is there, nothing is fetched.
  auto again = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_EQ(again->bytes_fetched, 0);
  for (size_t i = 0; i < layers_.size(); ++i) EXPECT_EQ(registry_.requests(digest(i)).size(), 1u) << i;
}

TEST_F(Pipeline, LazyLayersWaitForFetch) {
  options_.cold = ColdStrategy::kLazy;
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_FALSE(report->complete);
  EXPECT_FALSE(fs::exists(layout() / "index.json"));
  for (size_t i = 0; i < layers_.size(); ++i) {
    EXPECT_TRUE(registry_.requests(digest(i)).empty()) << i;
    EXPECT_EQ(report->layers[i].state, "pending") << i;
  }
  FetchOptions fetch;
  fetch.registry = options_.registry;
  auto fetched = fetch_layers(layout(), fetch);
  ASSERT_TRUE(fetched) << fetched.error().message;
  EXPECT_TRUE(fetched->complete);
  EXPECT_TRUE(fs::exists(layout() / "index.json"));
  for (size_t i = 0; i < layers_.size(); ++i) EXPECT_EQ(slurp(blob_path(layout(), digest(i))), layers_[i]) << i;
}

TEST_F(Pipeline, ADroppedBlobResumesFromTheByteReached) {
  registry_.drop_after(digest(1), 100000);
  auto failed = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error().kind, ErrorKind::kPeer) << failed.error().message;
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_EQ(report->layers[1].state, "resumed");
  const auto asked = registry_.requests(digest(1));
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[1].range_start, 100000);
  EXPECT_EQ(slurp(blob_path(layout(), digest(1))), layers_[1]);
}

TEST_F(Pipeline, ACorruptBlobIsRefusedAndNothingOfItKept) {
  registry_.corrupt(digest(2), 10);
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_FALSE(report);
  EXPECT_EQ(report.error().kind, ErrorKind::kInput) << report.error().message;
  EXPECT_FALSE(fs::exists(blob_path(layout(), digest(2))));
  EXPECT_FALSE(fs::exists(blob_path(layout(), digest(2)).string() + ".partial"));
  EXPECT_FALSE(fs::exists(layout() / "index.json"));
}

TEST_F(Pipeline, HotLayersGoToTheMemoryStoreLinkedFromTheLayout) {
  options_.hot = {*parse_layer_spec("0", "--hot")};
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_TRUE(report->layers[0].hot);
  EXPECT_EQ(report->layers[0].location, "memory");
  EXPECT_TRUE(fs::is_symlink(blob_path(layout(), digest(0))));
  EXPECT_EQ(slurp(blob_path(layout(), digest(0))), layers_[0]);
  EXPECT_FALSE(fs::is_symlink(blob_path(layout(), digest(1))));
  ASSERT_TRUE(remove_pull(layout()));
  EXPECT_TRUE(fs::is_empty(options_.memory_dir)) << "rm left the memory store";
}

TEST_F(Pipeline, ARootfsPullUnpacksTheLayersInOrder) {
  RootfsOptions rootfs;
  rootfs.dir = out_.path() / "rootfs";
  auto report = pull_to_rootfs(ref(), options_, out_.path() / "cache", "v1", rootfs);
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_EQ(slurp(rootfs.dir / "etc" / "os-release"), "ID=fake\n");
  EXPECT_EQ(slurp(rootfs.dir / "lib" / "big"), cfmo::testing::random_bytes(300000, 5));
  EXPECT_FALSE(fs::exists(rootfs.dir / "old")) << "the whiteout was not applied";
  EXPECT_EQ(fs::status(rootfs.dir / "app" / "run").permissions() & fs::perms::owner_exec, fs::perms::owner_exec);
  EXPECT_EQ(report->layers.size(), 3u);
  // A drop mid-layer: the unpacker starts the layer again, and the tree is the same.
  registry_.drop_after(digest(1), 70000);
  RootfsOptions second = rootfs;
  second.dir = out_.path() / "rootfs2";
  EXPECT_FALSE(pull_to_rootfs(ref(), options_, out_.path() / "cache2", "v1", second));
  EXPECT_FALSE(fs::exists(second.dir));
  auto resumed = pull_to_rootfs(ref(), options_, out_.path() / "cache2", "v1", second);
  ASSERT_TRUE(resumed) << resumed.error().message;
  EXPECT_EQ(slurp(second.dir / "lib" / "big"), cfmo::testing::random_bytes(300000, 5));
}

// The lazy mount's spans come through the same interface: a Range read, and a
// registry that answers it with the whole blob named as such.
TEST_F(Pipeline, RangeReadsGoThroughTheRegistryInterface) {
  auto client = registry_.connector()(ref(), options_.registry);
  ASSERT_TRUE(client);
  RegistrySource source(**client, digest(1), "layer 1");
  auto got = source.read(10, 100);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(*got, layers_[1].substr(10, 100));
  EXPECT_EQ(source.bytes_fetched(), 100u);
  registry_.refuse_ranges();
  RegistrySource whole(**client, digest(1), "layer 1");
  EXPECT_FALSE(whole.read(0, 1));
  EXPECT_TRUE(whole.ranges_refused());
}

/// Keeps what a pull feeds it, per layer.
class RecordingSink : public PullSink {
 public:
  Status on_resolved(const ResolvedImage& image) override {
    std::lock_guard lock(mu_);
    events_.push_back("resolved");
    bytes_.assign(image.parsed.layers.size(), "");
    done_.assign(image.parsed.layers.size(), 0);
    return {};
  }
  void on_plan(const PullState&) override {
    std::lock_guard lock(mu_);
    events_.push_back("plan");
  }
  void on_blob_start(size_t layer, int64_t on_disk) override {
    std::lock_guard lock(mu_);
    bytes_[layer] = std::string(static_cast<size_t>(on_disk), '?');
  }
  void on_blob_restart(size_t layer) override {
    std::lock_guard lock(mu_);
    bytes_[layer].clear();
  }
  Status on_blob_write(size_t layer, std::string_view chunk) override {
    std::lock_guard lock(mu_);
    bytes_[layer] += chunk;
    return {};
  }
  void on_blob_done(size_t layer, const Error* error) override {
    std::lock_guard lock(mu_);
    done_[layer] += error == nullptr ? 1 : 100;
  }
  void on_ready(double) override {
    std::lock_guard lock(mu_);
    events_.push_back("ready");
  }

  std::mutex mu_;
  std::vector<std::string> events_;
  std::vector<std::string> bytes_;
  std::vector<int> done_;
};

// Every sink sees the image before any blob, then each layer's bytes as
// they are written, once, and its outcome; a resumed blob starts from what
// is on disk.
TEST_F(Pipeline, SinksAreFedTheImageAndEveryLayersBytes) {
  RecordingSink first;
  RecordingSink second;
  options_.sinks = {&first, &second};
  auto report = pull_to_layout(ref(), options_, layout(), "v1");
  ASSERT_TRUE(report) << report.error().message;
  for (RecordingSink* sink : {&first, &second}) {
    ASSERT_GE(sink->events_.size(), 3u);
    EXPECT_EQ(sink->events_[0], "resolved");
    EXPECT_EQ(sink->events_[1], "plan");
    EXPECT_EQ(sink->events_.back(), "ready");
    for (size_t i = 0; i < layers_.size(); ++i) {
      EXPECT_EQ(sink->bytes_[i], layers_[i]) << i;
      EXPECT_EQ(sink->done_[i], 1) << i;
    }
  }
  // A resumed blob: the sink hears what was on disk, then only the rest.
  registry_.drop_after(digest(1), 65536);
  RecordingSink failed;
  options_.sinks = {&failed};
  EXPECT_FALSE(pull_to_layout(ref(), options_, out_.path() / "second", "v1"));
  EXPECT_EQ(failed.done_[1], 100);
  RecordingSink resumed;
  options_.sinks = {&resumed};
  ASSERT_TRUE(pull_to_layout(ref(), options_, out_.path() / "second", "v1"));
  EXPECT_EQ(resumed.bytes_[1], std::string(65536, '?') + layers_[1].substr(65536));
  EXPECT_EQ(resumed.done_[1], 1);
}

/// Layers an index has to get right: a gzip stream of several members cut
/// at odd places, files of odd sizes crossing 64 KiB spans, zstd in frames,
/// a plain tar.
std::vector<std::pair<std::string, std::string>> indexed_layers() {
  using namespace cfmo::testing;
  const std::string tar = make_tar(
      {dir("etc"), file("etc/one", "x"), file("etc/511", random_bytes(511, 1)), file("etc/513", random_bytes(513, 2)),
       dir("usr"), file("usr/big", random_bytes(300007, 3)), file("usr/text", std::string(250001, 't')),
       hardlink("usr/again", "usr/big"), whiteout("etc", "gone"), file("tail", random_bytes(131073, 4), 0755)});
  std::string members;
  size_t at = 0;
  for (const size_t cut : {size_t{7777}, size_t{123457}, size_t{400001}, tar.size()}) {
    members += gzip(tar.substr(at, cut - at), static_cast<int>(cut % 9) + 1);
    at = cut;
  }
  const std::string small = make_tar({dir("app"), file("app/run", random_bytes(70001, 5), 0755)});
  return {{members, "application/vnd.oci.image.layer.v1.tar+gzip"},
          {gzip(small), "application/vnd.oci.image.layer.v1.tar+gzip"},
          {zstd_frames(tar, 40013), "application/vnd.oci.image.layer.v1.tar+zstd"},
          {small, "application/vnd.oci.image.layer.v1.tar"}};
}

// The index sink builds each layer's index from the bytes as they download
// (a resumed download: what was on disk, then the rest), and what it builds
// is byte for byte what `cfmo-pull index` builds from the blob afterwards.
TEST_F(Pipeline, TheIndexSinkBuildsWhatIndexingTheBlobBuilds) {
  const auto layers = indexed_layers();
  add_image("v2", layers);
  const Reference v2 = *parse_reference("fake.test/team/app:v2");
  // Every layer's index in `dir` equals the blob's; `sink` built those of `expected` from the download.
  const auto check = [&](const IndexSink& sink, const fs::path& dir, const std::vector<size_t>& expected) {
    const auto outcomes = sink.outcomes();
    ASSERT_EQ(outcomes.size(), expected.size());
    for (const auto& o : outcomes) {
      EXPECT_NE(std::find(expected.begin(), expected.end(), o.layer), expected.end()) << o.layer;
      EXPECT_TRUE(o.indexed) << o.layer << ": " << o.note;
      EXPECT_TRUE(o.streamed) << o.layer;
    }
    for (const auto& [blob, type] : layers) {
      const Descriptor d{type, sha256_digest(blob), static_cast<int64_t>(blob.size()), {}};
      auto built = build_layer_index(blob_path(dir, d.digest), d, 64 << 10, "layer");
      ASSERT_TRUE(built) << built.error().message;
      EXPECT_EQ(slurp(index_path(dir, d.digest)), serialize_index(*built)) << type;
    }
  };
  IndexSink sink(layout(), 64 << 10);
  options_.sinks = {&sink};
  auto report = pull_to_layout(v2, options_, layout(), "v2");
  ASSERT_TRUE(report) << report.error().message;
  check(sink, layout(), {0, 1, 2, 3});
  EXPECT_EQ(read_index(index_path(layout(), sha256_digest(layers[0].first)))->members, 4u);

  // Dropped at an odd byte of the several-member stream, then resumed.
  const fs::path second = out_.path() / "second";
  const std::string dropped = sha256_digest(layers[0].first);
  registry_.drop_after(dropped, 100001);
  IndexSink failed(second, 64 << 10);
  options_.sinks = {&failed};
  EXPECT_FALSE(pull_to_layout(v2, options_, second, "v2"));
  EXPECT_FALSE(fs::exists(index_path(second, dropped)));
  EXPECT_EQ(failed.outcomes().size(), 3u);  // the others came whole
  IndexSink resumed(second, 64 << 10);
  options_.sinks = {&resumed};
  ASSERT_TRUE(pull_to_layout(v2, options_, second, "v2"));
  EXPECT_EQ(registry_.requests(dropped).back().range_start, 100001);
  check(resumed, second, {0});
}

/// Counts the states it is fed; fails the one numbered `fail_at` (0: never).
class StateSink : public PullSink {
 public:
  Status on_state(const PullState& state) override {
    std::lock_guard lock(mu_);
    fetched_.push_back(std::count_if(state.layers.begin(), state.layers.end(),
                                     [](const LayerState& l) { return l.status == LayerStatus::kFetched; }));
    last_ = state;
    if (static_cast<int>(fetched_.size()) == fail_at_) return make_error(ErrorKind::kInternal, "state sink full");
    return {};
  }
  std::mutex mu_;
  std::vector<long> fetched_;
  PullState last_;
  int fail_at_ = 0;
};

// The state file is written by a sink (StateRecorder) like the others are
// fed: every change reaches every sink, the file holds the last, a sink's
// error stops the pull, and a pull without a state file still feeds them.
TEST_F(Pipeline, TheStateFileIsOneOfTheSinks) {
  StateSink seen;
  options_.sinks = {&seen};
  ASSERT_TRUE(pull_to_layout(ref(), options_, layout(), "v1"));
  ASSERT_GE(seen.fetched_.size(), layers_.size() + 2);  // planned, each layer, ready, the end
  EXPECT_EQ(seen.fetched_.front(), 0);
  EXPECT_EQ(seen.fetched_.back(), static_cast<long>(layers_.size()));
  EXPECT_TRUE(std::is_sorted(seen.fetched_.begin(), seen.fetched_.end()));
  auto on_disk = read_state(layout());
  ASSERT_TRUE(on_disk) << on_disk.error().message;
  EXPECT_TRUE(on_disk->complete);
  EXPECT_TRUE(seen.last_.complete);
  EXPECT_EQ(on_disk->fetcher_pid, 0);
  for (size_t i = 0; i < layers_.size(); ++i) EXPECT_EQ(on_disk->layers[i].status, seen.last_.layers[i].status);

  StateSink failing;
  failing.fail_at_ = 2;  // the first layer's outcome
  options_.sinks = {&failing};
  auto stopped = pull_to_layout(ref(), options_, out_.path() / "second", "v1");
  ASSERT_FALSE(stopped);
  EXPECT_EQ(stopped.error().message, "state sink full");

  StateSink cache;
  options_.sinks = {&cache};
  options_.state_file = false;
  ASSERT_TRUE(pull_to_layout(ref(), options_, out_.path() / "cache", "v1"));
  EXPECT_FALSE(fs::exists(state_path(out_.path() / "cache")));
  EXPECT_EQ(cache.fetched_.back(), static_cast<long>(layers_.size()));
}

// A registry with the OCI 1.1 referrers API (the fake's; docker-registry 2.8,
// the integration tests' registry, has only the fallback tag): index --push's
// artifact is taken with its subject (OCI-Subject), no fallback tag is
// written, and the pull finds the newest artifact through the API, its
// indexes checked. Without the API the same push lists it under the tag.
TEST_F(Pipeline, IndexArtifactsGoThroughTheReferrersApiWhereTheRegistryHasIt) {
  registry_.enable_referrers_api();
  const std::string manifest = registry_.manifest("v1");
  const Descriptor subject{
      "application/vnd.oci.image.manifest.v1+json", sha256_digest(manifest), static_cast<int64_t>(manifest.size()), {}};
  const auto indexes = [&](uint64_t span) {
    std::vector<IndexBlob> blobs;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const fs::path file = out_.path() / fmt::format("layer{}", i);
      std::ofstream(file, std::ios::binary) << layers_[i];
      const Descriptor d{
          "application/vnd.oci.image.layer.v1.tar+gzip", digest(i), static_cast<int64_t>(layers_[i].size()), {}};
      auto index = build_layer_index(file, d, span, "layer");
      EXPECT_TRUE(index) << index.error().message;
      if (index) blobs.push_back({digest(i), serialize_index(*index)});
    }
    return blobs;
  };
  auto client = registry_.connector()(ref(), options_.registry);
  ASSERT_TRUE(client) << client.error().message;
  const auto first = push_index_artifact(**client, subject, indexes(64 << 10));
  ASSERT_TRUE(first) << first.error().message;
  EXPECT_TRUE(first->referrers_api);
  EXPECT_TRUE(first->fallback_tag.empty());
  EXPECT_EQ(first->layers, 3u);
  EXPECT_EQ(registry_.manifest("sha256-" + subject.digest.substr(7)), "") << "a fallback tag beside the API";
  // A second push (other spans) is listed beside the first; the pull takes the newer.
  const auto blobs = indexes(128 << 10);
  const auto second = push_index_artifact(**client, subject, blobs);
  ASSERT_TRUE(second) << second.error().message;
  EXPECT_TRUE(second->referrers_api);
  auto found = find_index_artifact(**client, subject.digest);
  ASSERT_TRUE(found) << found.error().message;
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->via, "the referrers API");
  EXPECT_EQ((*found)->artifact, second->artifact);
  ASSERT_EQ((*found)->blobs.size(), 3u);
  for (size_t i = 0; i < blobs.size(); ++i) {
    EXPECT_EQ((*found)->blobs[i].layer_digest, blobs[i].layer_digest);
    EXPECT_TRUE((*found)->blobs[i].bytes == blobs[i].bytes) << i;
  }
  EXPECT_FALSE(registry_.requests("/referrers/" + subject.digest).empty());
  EXPECT_TRUE(registry_.requests("/manifests/sha256-").empty()) << "the fallback tag was asked for";

  // A registry without the API: the same push lists the artifact under the fallback tag, found through it.
  testing::FakeRegistry plain;
  plain.add_manifest("v1", "application/vnd.oci.image.manifest.v1+json", manifest);
  auto plain_client = plain.connector()(ref(), options_.registry);
  ASSERT_TRUE(plain_client);
  const auto tagged = push_index_artifact(**plain_client, subject, blobs);
  ASSERT_TRUE(tagged) << tagged.error().message;
  EXPECT_FALSE(tagged->referrers_api);
  EXPECT_EQ(tagged->fallback_tag, "sha256-" + subject.digest.substr(7));
  EXPECT_EQ(tagged->fallback_entries, 1u);
  auto through_tag = find_index_artifact(**plain_client, subject.digest);
  ASSERT_TRUE(through_tag) << through_tag.error().message;
  ASSERT_TRUE(through_tag->has_value());
  EXPECT_EQ((*through_tag)->via, "tag sha256-" + subject.digest.substr(7));
  EXPECT_EQ((*through_tag)->artifact, tagged->artifact);
}

}  // namespace
}  // namespace cfmo::oci
