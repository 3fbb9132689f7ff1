#include "oci/pull_state.h"
#include "support/temp_dir.h"

#include "core/atomic_file.h"
#include "support/expect_error.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

/// A scratch directory named for these tests.
class TempDir : public cfmo::testing::ScratchDir {
 public:
  TempDir() : ScratchDir("cfmo-state") {}
};

PullState sample() {
  PullState s;
  s.image = "127.0.0.1:5000/team/app@sha256:" + std::string(64, 'a');
  s.tag = "v1";
  s.output = "oci:/tmp/app";
  s.manifest_digest = "sha256:" + std::string(64, 'a');
  s.manifest_media_type = "application/vnd.oci.image.manifest.v1+json";
  s.config = {"application/vnd.oci.image.config.v1+json", "sha256:" + std::string(64, 'c'), 123, {}};
  s.cold = "lazy";
  s.hosts = {{"mirror.example:5000"}, {"127.0.0.1:5000"}, false};
  s.memory_dir = "/dev/shm/cfmo-pull-app-0123";
  s.memory_capacity = 1 << 30;
  s.ready = true;
  s.ready_s = 0.25;
  s.ready_file = "/run/app.ready";
  s.fetcher_pid = 42;
  for (int i = 0; i < 3; ++i) {
    LayerState l;
    l.blob = {"application/vnd.oci.image.layer.v1.tar+gzip",
              "sha256:" + std::string(63, 'b') + char('0' + i),
              1000 * (i + 1),
              {}};
    l.hot = i == 1;
    l.location = i == 1 ? Placement::kMemory : Placement::kDisk;
    l.status = i == 1 ? LayerStatus::kFetched : (i == 0 ? LayerStatus::kPending : LayerStatus::kFailed);
    if (i == 2) l.error = "layer sha256:bbb…: digest mismatch";
    s.layers.push_back(l);
  }
  return s;
}

TEST(OciPullState, RoundTripsThroughItsFile) {
  TempDir dir;
  PullState s = sample();
  ASSERT_TRUE(write_state(dir.path(), s));
  EXPECT_FALSE(s.updated.empty());
  auto back = read_state(dir.path());
  ASSERT_TRUE(back.has_value()) << back.error().message;
  EXPECT_EQ(state_to_json(*back), state_to_json(s));
  EXPECT_EQ(back->layers[2].error, s.layers[2].error);
  EXPECT_EQ(back->layers[1].location, Placement::kMemory);
  EXPECT_EQ(back->hosts.mirrors, s.hosts.mirrors);
}

TEST(OciPullState, BadFilesNameTheKey) {
  TempDir dir;
  EXPECT_TRUE(fails_with(read_state(dir.path()), ErrorKind::kInput, {"not a cfmo-pull directory"}));
  const auto path = state_path(dir.path());
  ASSERT_TRUE(write_file_atomic(path, "not json"));
  EXPECT_TRUE(fails_with(read_state(dir.path()), ErrorKind::kInput, {"not a cfmo-pull state file"}));
  auto mutate = [&](const std::function<void(nlohmann::json&)>& change) {
    auto j = nlohmann::json::parse(state_to_json(sample()));
    change(j);
    return state_from_json(j.dump(), "s.json");
  };
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["version"] = 2; }), ErrorKind::kInput, {"version 2"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j.erase("cold"); }), ErrorKind::kInput, {"'cold' missing"}));
  EXPECT_TRUE(
      fails_with(mutate([](auto& j) { j["layers"][1]["state"] = "done"; }), ErrorKind::kInput, {"layers[1].state"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["layers"][0]["location"] = "cloud"; }), ErrorKind::kInput,
                         {"layers[0].location"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["layers"][0]["digest"] = "sha256:12"; }), ErrorKind::kInput,
                         {"layers[0].digest"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["layers"][0]["size"] = "big"; }), ErrorKind::kInput,
                         {"layers[0].size' not an integer"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["hosts"]["mirrors"] = {1}; }), ErrorKind::kInput, {"hosts.mirrors"}));
  EXPECT_TRUE(fails_with(mutate([](auto& j) { j["interrupted"] = "yes"; }), ErrorKind::kInput,
                         {"'interrupted' not true or false"}));
  // A file written before "interrupted" existed reads as not interrupted; true survives the round trip.
  auto old = mutate([](auto& j) { j.erase("interrupted"); });
  ASSERT_TRUE(old) << old.error().message;
  EXPECT_FALSE(old->interrupted);
  auto stopped = mutate([](auto& j) { j["interrupted"] = true; });
  ASSERT_TRUE(stopped) << stopped.error().message;
  EXPECT_TRUE(stopped->interrupted);
}

TEST(OciPullState, TheLockIsExclusiveAcrossProcesses) {
  TempDir dir;
  auto lock = lock_layout(dir.path(), std::nullopt);
  ASSERT_TRUE(lock.has_value());
  const pid_t child = fork();
  if (child == 0) {
    // Another process waits, hears the holder's pid, and gives up at its deadline.
    int heard = 0;
    auto second = lock_layout(dir.path(), std::chrono::steady_clock::now() + std::chrono::milliseconds(200),
                              [&](int pid) { heard = pid; });
    _exit(!second.has_value() && second.error().kind == ErrorKind::kPeer && heard == getppid() ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  lock->release();
  EXPECT_TRUE(lock_layout(dir.path(), std::chrono::steady_clock::now()).has_value());
  EXPECT_TRUE(process_alive(getpid()));
  EXPECT_FALSE(process_alive(0));
}

}  // namespace
}  // namespace cfmo::oci
