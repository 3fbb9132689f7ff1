// cfmo-pull mount --lazy: a real FUSE mount (skipped where /dev/fuse or the
// right to mount is missing) of an image whose cold layers (gzip, zstd in
// frames or in one, uncompressed) are in a real docker-registry, read
// through a fault-injecting proxy, compared with the rootfs a full pull
// unpacks.
#include "core/fd.h"
#include "integration/fault_proxy.h"
#include "integration/registry_fixture.h"
#include "oci/cleanup.h"
#include "oci/gzip_index.h"
#include "oci/hot_set.h"
#include "oci/index_artifact.h"
#include "oci/lazy_mount.h"
#include "support/tree_listing.h"

#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace cfmo::pulltest {
namespace {

constexpr const char* kImage = "lazy/app";
constexpr const char* kSpan = "64K";

/// Three layers: a gzip base with a file over many spans, hard and symbolic
/// links; a gzip layer with a whiteout; an uncompressed one with an opaque directory.
FixtureImage lazy_image() {
  using namespace cfmo::testing;
  const std::string base =
      make_tar({dir("etc"), file("etc/os-release", "ID=lazy\n"), file("old", "gone soon\n"), dir("opt"),
                file("opt/lower", "lower\n"), symlink("bin", "usr/bin"), dir("usr"), dir("usr/bin"),
                file("usr/bin/tool", "#!/bin/sh\necho tool\n", 0755), file("usr/big", random_bytes(700000, 3)),
                hardlink("usr/big-link", "usr/big"), file("usr/empty", "")});
  const std::string runtime =
      make_tar({whiteout("", "old"), dir("lib"), file("lib/runtime.so", random_bytes(150000, 7)),
                file("lib/text", std::string(200000, 'x'))});
  const std::string app = make_tar({dir("opt"), opaque("opt"), file("opt/app", "app\n")});
  return make_real_image({{base, "tar+gzip"}, {runtime, "tar+gzip"}, {app, "tar"}});
}

/// What a test left of its own: mounts at or under `dir` (or in a memory
/// directory of the tests', /dev/shm/cfmo-test-rw-*), such directories
/// themselves, and processes (a mount's daemon, a background fetch, a
/// container) whose command line names `dir`; empty when nothing is left.
std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> left;
  const std::string under = dir.string() + "/";
  const std::string shm = "/dev/shm/cfmo-test-rw-";
  for (const auto& line : testing::lines(slurp("/proc/self/mountinfo"))) {
    std::istringstream fields(line);
    std::string id, parent, device, root, point;
    fields >> id >> parent >> device >> root >> point;
    if (point == dir.string() || point.rfind(under, 0) == 0 || point.rfind(shm, 0) == 0)
      left.push_back("mounted: " + point);
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    if (e.path().string().rfind(shm, 0) == 0) left.push_back("left in /dev/shm: " + e.path().string());
  }
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos || std::stoi(pid) == ::getpid()) continue;
    std::string cmdline = slurp(e.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(dir.string()) != std::string::npos) left.push_back("running: pid " + pid + ": " + cmdline);
  }
  return left;
}

/// Fails the test for what it left behind, once a daemon or fetcher still
/// ending has had a few seconds (umount waits for the daemon; SIGTERM gives
/// open files a 2 s grace).
void expect_nothing_left(const fs::path& dir) {
  std::vector<std::string> left = leftovers(dir);
  for (int i = 0; i < 100 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    left = leftovers(dir);
  }
  for (const auto& l : left) ADD_FAILURE() << "left behind: " << l;
}

class Lazy : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kRegistryBinary)) return;
    image_ = new FixtureImage(lazy_image());
    setup_error_ = start_suite_registry(registry_, kImage, *image_);
  }
  static void TearDownTestSuite() { delete registry_; }
  void SetUp() override {
    if (!fs::exists(kRegistryBinary) || !fs::exists("/dev/fuse")) GTEST_SKIP() << "no docker-registry or no /dev/fuse";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }
  /// Before the guard: what the test itself left is a failure, not tidied away.
  void TearDown() override { expect_nothing_left(out_.path()); }

  /// A full pull and its indexes (the reference), its rootfs, and a lazy pull
  /// through `host` holding nothing but the manifest, config and indexes.
  void prepare(const std::string& host) {
    const std::string ref = registry_->host() + "/" + kImage + ":v1";
    ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
    const RunResult indexed = pull({"index", (out_ / "full").string(), "--span", kSpan, "-q"});
    ASSERT_EQ(indexed.status, 0) << indexed.err;
    const RunResult rootfs = pull({"pull", ref, "--output", "rootfs:" + (out_ / "rootfs").string(), "--cache",
                                   (out_ / "cache").string(), "--plain-http", "-q"});
    ASSERT_EQ(rootfs.status, 0) << rootfs.err;
    const RunResult lazy = pull({"pull", host + "/" + kImage + ":v1", "--output", "oci:" + lazy_dir().string(),
                                 "--plain-http", "--cold", "lazy", "-q"});
    ASSERT_EQ(lazy.status, 0) << lazy.err;
    fs::copy(out_ / "full" / oci::kIndexDir, lazy_dir() / oci::kIndexDir);
    fs::create_directories(point());
  }

  /// The image pushed to `repository` with its indexes (made from a full pull), for mounts by REF; its REF.
  std::string push_indexed(const std::string& repository) {
    EXPECT_TRUE(push_image(*registry_, repository, "v1", *image_)) << registry_->log();
    const std::string ref = registry_->host() + "/" + repository + ":v1";
    const RunResult full = pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"});
    EXPECT_EQ(full.status, 0) << full.err;
    const RunResult indexed = pull({"index", (out_ / "full").string(), "--span", kSpan, "--push", "-q"});
    EXPECT_EQ(indexed.status, 0) << indexed.err;
    return full.status == 0 && indexed.status == 0 ? ref : "";
  }

  /// An image of one gzip layer holding `file`, pushed as `repo`:v1, and a
  /// lazy pull of it through `host` (the registry's when empty) with the
  /// indexes of a full pull (spans of `span`); the layer in one_layer_.
  void prepare_one_file(const std::string& repo, const std::string& file, const std::string& bytes,
                        const std::string& span, const std::string& host = "") {
    const FixtureImage image = make_real_image({{testing::make_tar({testing::file(file, bytes)}), "tar+gzip"}});
    one_layer_ = image.layers[0];
    ASSERT_TRUE(push_image(*registry_, repo, "v1", image));
    const std::string ref = registry_->host() + "/" + repo + ":v1";
    ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
    ASSERT_EQ(pull({"index", (out_ / "full").string(), "--span", span, "-q"}).status, 0);
    const RunResult lazy = pull({"pull", (host.empty() ? registry_->host() : host) + "/" + repo + ":v1", "--output",
                                 "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "-q"});
    ASSERT_EQ(lazy.status, 0) << lazy.err;
    fs::copy(out_ / "full" / oci::kIndexDir, lazy_dir() / oci::kIndexDir);
    fs::create_directories(point());
  }

  fs::path lazy_dir() const { return out_ / "lazy"; }
  fs::path point() const { return out_ / "mnt"; }

  /// `mount DIR MNT --lazy --json`; skips where FUSE mounts are not allowed.
  Json mount(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "mount", lazy_dir().string(), point().string(), "--lazy", "--json", "--retries", "1", "--retry-delay", "0.01"};
    args.insert(args.end(), extra.begin(), extra.end());
    return mount_with(args);
  }

  /// `mount` with these arguments (a REF mount's); skips where FUSE mounts are not allowed.
  Json mount_with(const std::vector<std::string>& args) {
    const RunResult r = pull(args);
    if (r.status == 2 && r.err.find("FUSE mount failed") != std::string::npos) {
      skipped_ = true;
      return Json();
    }
    EXPECT_EQ(r.status, 0) << r.err;
    Json j = Json::parse(r.out, nullptr, false);
    if (j.is_object()) guard_.pid = j.value("pid", 0);
    guard_.point = point();
    return j;
  }

  std::string log() const { return slurp(lazy_dir() / oci::kLazyLogFile); }

  oci::LazyStats stats() const {
    auto s = oci::read_lazy_stats(lazy_dir());
    return s ? *s : oci::LazyStats{};
  }

  /// Unmounts and ends the daemon whatever the test did.
  struct Guard {
    fs::path point;
    int pid = 0;
    ~Guard() {
      if (!point.empty()) ::umount2(point.c_str(), MNT_DETACH);
      if (pid > 0) ::kill(pid, SIGKILL);
    }
  };

  static bool alive(int pid) {
    return pid > 0 && ::kill(pid, 0) == 0 && !slurp(fmt::format("/proc/{}/stat", pid)).empty() &&
           slurp(fmt::format("/proc/{}/stat", pid)).find(") Z") == std::string::npos;
  }

  void umount() {
    const RunResult r = pull({"umount", point().string()});
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_FALSE(alive(guard_.pid)) << "the daemon outlived umount";
    guard_.point.clear();
    guard_.pid = 0;
  }

  TempDir out_;
  Guard guard_;
  bool skipped_ = false;
  std::string one_layer_;  ///< prepare_one_file's layer
  static inline Registry* registry_ = nullptr;
  static inline FixtureImage* image_ = nullptr;
  static inline std::string setup_error_;
};

#define MOUNT_OR_SKIP(j, ...)                                  \
  const Json j = mount(__VA_ARGS__);                           \
  if (skipped_) GTEST_SKIP() << "FUSE mounts are not allowed"; \
  ASSERT_TRUE(j.is_object())

#define MOUNT_WITH_OR_SKIP(j, args)                            \
  const Json j = mount_with(args);                             \
  if (skipped_) GTEST_SKIP() << "FUSE mounts are not allowed"; \
  ASSERT_TRUE(j.is_object())

/// The tree at a mount point, with the proc, sys and dev the mount supplies checked and left out.
std::string without_runtime_dirs(const fs::path& point) {
  std::string kept;
  for (const auto& line : testing::lines(testing::list_tree(point))) {
    bool supplied = false;
    for (const char* name : {"dev", "proc", "sys"})
      supplied = supplied || line.rfind(std::string(name) + " dir ", 0) == 0;
    if (!supplied) kept += line + "\n";
  }
  for (const char* name : {"dev", "proc", "sys"}) EXPECT_TRUE(fs::is_directory(point / name)) << name;
  return kept;
}

TEST_F(Lazy, TheMountEqualsTheFullPullsRootfsAndFetchesOnlyWhatIsRead) {
  prepare(registry_->host());
  MOUNT_OR_SKIP(j, {"--max-memory", "64M"});
  EXPECT_EQ(j["layers"].size(), 3u);
  for (const auto& l : j["layers"]) EXPECT_EQ(l["local"], false) << l;
  // The tree and metadata come from the indexes: nothing fetched yet.
  EXPECT_TRUE(fs::exists(point() / "usr" / "big"));
  EXPECT_EQ(fs::file_size(point() / "usr" / "big"), 700000u);
  EXPECT_EQ(stats().bytes_fetched, 0);
  // One small file: a span of its layer, not the layer.
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  const int64_t one = stats().bytes_fetched;
  EXPECT_GT(one, 0);
  EXPECT_LT(one, static_cast<int64_t>(image_->layers[0].size()) / 2) << "more than the file's span was fetched";
  // Whiteouts and opaque directories applied; every file's bytes as the full pull's.
  EXPECT_EQ(without_runtime_dirs(point()), testing::list_tree(out_ / "rootfs"));
  EXPECT_FALSE(fs::exists(point() / "old"));
  EXPECT_FALSE(fs::exists(point() / "opt" / "lower"));
  EXPECT_EQ(fs::read_symlink(point() / "bin"), "usr/bin");
  EXPECT_FALSE(std::ofstream(point() / "new").good()) << "the mount is read-only";
  const auto all = stats();
  EXPECT_EQ(all.errors, 0);
  int64_t image_bytes = 0;
  for (const auto& l : image_->layers) image_bytes += static_cast<int64_t>(l.size());
  EXPECT_LE(all.bytes_fetched, image_bytes + 4096);
  // Under --max-memory, the daemon's peak included.
  const std::string status = slurp(fmt::format("/proc/{}/status", j["pid"].get<int>()));
  const auto hwm = status.find("VmHWM:");
  ASSERT_NE(hwm, std::string::npos);
  EXPECT_LT(std::stoll(status.substr(hwm + 6)) * 1024, int64_t{64} << 20) << status.substr(hwm, 30);
  umount();
  EXPECT_TRUE(fs::is_empty(point()));

  // Mounted again, the cache serves: nothing more is fetched.
  MOUNT_OR_SKIP(again);
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  EXPECT_EQ(stats().bytes_fetched, 0) << "the cache was not used";
  // rm refuses while it is mounted.
  const RunResult busy = pull({"rm", lazy_dir().string()});
  EXPECT_EQ(busy.status, 2) << busy.err;
  EXPECT_NE(busy.err.find("mounted at"), std::string::npos) << busy.err;
  umount();
}

TEST_F(Lazy, ReadsStayRightWhileTheirSpansAreEvictedFromASmallCache) {
  // A file of 20 spans through a 16M cache: reading it pushes its first
  // spans out (their open descriptors dropped with them), and reading it
  // again backwards, past the kernel's page cache, makes them again.
  const std::string bytes = testing::random_bytes(20 << 20, 11);
  ASSERT_NO_FATAL_FAILURE(prepare_one_file("lazy/big", "big", bytes, "1M"));
  MOUNT_OR_SKIP(j, {"--cache-size", "16M"});
  EXPECT_EQ(slurp(point() / "big"), bytes);
  const auto first = stats();
  EXPECT_LE(first.cache_bytes, int64_t{16} << 20);
  EXPECT_GE(first.requests, 20);  // a Range request a span (counted before the read is answered)
  {
    Fd fd(::open((point() / "big").c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd);
    ASSERT_EQ(::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
    std::string block(1 << 20, '\0');
    for (size_t at = bytes.size(); at > 0;) {
      const size_t n = std::min(block.size(), at);
      at -= n;
      ASSERT_EQ(::pread(fd.get(), block.data(), n, static_cast<off_t>(at)), static_cast<ssize_t>(n)) << at;
      ASSERT_EQ(block.compare(0, n, bytes, at, n), 0) << "bytes " << at << "+" << n;
    }
  }
  const auto second = stats();
  EXPECT_GT(second.requests, first.requests) << "the evicted spans were fetched again";
  EXPECT_EQ(second.errors, 0) << log();
  EXPECT_LE(second.cache_bytes, int64_t{16} << 20);
  umount();
}

TEST_F(Lazy, ConcurrentReadersGetTheRightBytesColdCachedAndWhileEvicted) {
  // Eight readers at once, at seeded offsets and sizes, past the page cache:
  // the session threads answer side by side, the workers fetch the same
  // spans at once (one makes it, the others wait for its bytes), and a
  // cache of 32 of its 40 spans evicts (and drops the descriptors of) spans
  // other readers are using. Then a new mount over what the cache kept.
  const std::string bytes = testing::random_bytes(20 << 20, 23);
  ASSERT_NO_FATAL_FAILURE(prepare_one_file("lazy/many", "f", bytes, "512K"));
  auto readers = [&](uint64_t seed) {
    std::vector<std::thread> threads;
    std::vector<std::string> wrong(8);
    for (size_t t = 0; t < wrong.size(); ++t) {
      threads.emplace_back([&, t] {
        Fd fd(::open((point() / "f").c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd) return (void)(wrong[t] = "open failed");
        uint64_t state = seed * 31 + t;
        auto next = [&state] { return (state = state * 6364136223846793005u + 1442695040888963407u) >> 33; };
        std::string block;
        for (int i = 0; i < 40 && wrong[t].empty(); ++i) {
          if (i % 10 == 0) (void)::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
          const size_t at = next() % bytes.size();
          const size_t n = std::min<size_t>(1 + next() % (600 << 10), bytes.size() - at);
          block.resize(n);
          const ssize_t got = ::pread(fd.get(), block.data(), n, static_cast<off_t>(at));
          if (got != static_cast<ssize_t>(n) || block.compare(0, n, bytes, at, n) != 0)
            wrong[t] = fmt::format("bytes {}+{}: read {}", at, n, got);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& w : wrong) EXPECT_TRUE(w.empty()) << w;
  };
  MOUNT_OR_SKIP(j, {"--cache-size", "16M", "--max-memory", "48M"});
  readers(1);
  readers(2);
  const auto cold = stats();
  EXPECT_EQ(cold.errors, 0) << log();
  EXPECT_LE(cold.cache_bytes, int64_t{16} << 20);
  umount();
  MOUNT_OR_SKIP(again, {"--cache-size", "16M", "--max-memory", "48M"});
  readers(3);
  EXPECT_EQ(stats().errors, 0) << log();
  umount();
}

TEST_F(Lazy, ACorruptSpanIsEioLoggedNotCachedAndTheNextReadRetries) {
  FaultProxy proxy(registry_->host());
  prepare(proxy.host());
  MOUNT_OR_SKIP(j);
  const std::string blob = "/blobs/" + oci::sha256_digest(image_->layers[1]);
  // Every answer corrupt while the file is read (the kernel tries a failed page again itself).
  proxy.add(FaultProxy::corrupt(blob, 100, 1, 0));
  std::ifstream first(point() / "lib" / "runtime.so", std::ios::binary);
  char byte = 0;
  first.read(&byte, 1);
  EXPECT_FALSE(first.good()) << "a corrupt span was served";
  const std::string logged = log();
  EXPECT_NE(logged.find("layer " + oci::short_digest(oci::sha256_digest(image_->layers[1])) + " (1) span 0"),
            std::string::npos)
      << logged;
  EXPECT_NE(logged.find("SHA-256 mismatch"), std::string::npos) << logged;
  EXPECT_GE(stats().errors, 1);
  EXPECT_FALSE(fs::exists(lazy_dir() / oci::kLazyCacheDir / oci::sha256_digest(image_->layers[1]).substr(7) / "0"));
  // Nothing of it was kept: the next read asks again, and gets the right bytes.
  proxy.clear();
  EXPECT_EQ(slurp(point() / "lib" / "runtime.so"), testing::random_bytes(150000, 7));
  umount();
}

/// Which pages of `path` (of `size` bytes) are in its page cache: mincore over a mapping of it, which reads nothing.
std::vector<bool> resident_pages(const fs::path& path, size_t size) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<bool> out;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return out;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return out;
  std::vector<unsigned char> in((size + page - 1) / page);
  if (::mincore(map, size, in.data()) == 0) {
    for (const unsigned char c : in) out.push_back((c & 1) != 0);
  }
  ::munmap(map, size);
  return out;
}

/// A 4 KiB pread of the mount's `path` at `at` equals `bytes` there ("" if so, else what went wrong).
std::string pread_matches(const fs::path& path, const std::string& bytes, size_t at) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return "open failed";
  const size_t n = std::min<size_t>(4096, bytes.size() - at);
  std::string block(n, '\0');
  const ssize_t got = ::pread(fd.get(), block.data(), n, static_cast<off_t>(at));
  if (got != static_cast<ssize_t>(n)) return fmt::format("bytes {}+{}: read {} ({})", at, n, got, std::strerror(errno));
  return block == bytes.substr(at, n) ? "" : fmt::format("bytes {}+{}: wrong", at, n);
}

TEST_F(Lazy, RandomReadsStoreTheirSpanInThePageCacheAndOnlyVerifiedBytes) {
  // A file of 6 spans of 1M through a proxy. A second random read in a
  // span stores the file's other pages there into the kernel's page cache
  // (the daemon's fillers); the bytes read through the mount after that, at
  // random offsets and whole, are the file's. A span corrupted on the wire
  // is EIO, and none of its pages reach the page cache; once the registry
  // answers right, the next read gets the right bytes.
  FaultProxy proxy(registry_->host());
  const std::string bytes = testing::random_bytes(6 << 20, 41);
  ASSERT_NO_FATAL_FAILURE(prepare_one_file("lazy/random", "f", bytes, "1M", proxy.host()));
  MOUNT_OR_SKIP(j);
  const fs::path f = point() / "f";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto wait_stored = [&](int64_t more_than) {
    for (int i = 0; i < 500 && stats().page_cache_bytes <= more_than; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return stats().page_cache_bytes;
  };
  EXPECT_EQ(pread_matches(f, bytes, (5 << 20) / 2), "");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(stats().page_cache_bytes, 0) << "a span stored after its first random read";
  EXPECT_EQ(pread_matches(f, bytes, (9 << 20) / 4), "");
  const int64_t first = wait_stored(0);
  EXPECT_GT(first, 512 << 10) << "the span of two random reads was not stored";
  EXPECT_LE(first, (1 << 20) + (256 << 10));  // a span: 1M, to the end of a deflate block
  auto resident = resident_pages(f, bytes.size());
  ASSERT_EQ(resident.size(), bytes.size() / page);
  // Their span (the file's bytes from about 2M to 3M: checkpoints fall at
  // the end of a deflate block, and the tar header shifts the file by 512)
  // is in the page cache, not read page by page; nothing else is.
  EXPECT_TRUE(resident[((2 << 20) + (128 << 10)) / page]);
  EXPECT_TRUE(resident[((3 << 20) - (128 << 10)) / page]);
  EXPECT_FALSE(resident[(5 << 20) / page]);
  EXPECT_FALSE(resident[(1 << 20) / page]);

  // A corrupt span: EIO (twice, at random), logged, nothing of it stored.
  const std::string blob = "/blobs/" + oci::sha256_digest(one_layer_);
  proxy.add(FaultProxy::corrupt(blob, 100, 1, 0));
  const size_t bad = (9 << 20) / 2;
  EXPECT_NE(pread_matches(f, bytes, bad), "") << "a corrupt span was served";
  EXPECT_NE(pread_matches(f, bytes, bad - (256 << 10)), "") << "a corrupt span was served";
  EXPECT_NE(log().find("SHA-256 mismatch"), std::string::npos) << log();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  resident = resident_pages(f, bytes.size());
  for (size_t p = (4 << 20) / page + 1; p < (5 << 20) / page; ++p) ASSERT_FALSE(resident[p]) << "page " << p;
  EXPECT_EQ(stats().page_cache_bytes, first) << "pages stored from a corrupt span";
  proxy.clear();
  EXPECT_EQ(pread_matches(f, bytes, bad), "");

  // Random reads over the whole file, then all of it: the file's bytes, pages stored or not.
  uint64_t state = 7;
  for (int i = 0; i < 300; ++i) {
    state = state * 6364136223846793005u + 1442695040888963407u;
    const size_t at = (state >> 33) % bytes.size();
    ASSERT_EQ(pread_matches(f, bytes, at), "");
  }
  for (int i = 0; i < 500 && std::count(resident.begin(), resident.end(), true) < 6 * 240; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    resident = resident_pages(f, bytes.size());
  }
  EXPECT_GE(std::count(resident.begin(), resident.end(), true), 6 * 240) << "the spans were not stored";
  EXPECT_EQ(slurp(f), bytes);
  {
    Fd fd(::open(f.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd);
    void* map = ::mmap(nullptr, bytes.size(), PROT_READ, MAP_SHARED, fd.get(), 0);
    ASSERT_NE(map, MAP_FAILED);
    EXPECT_EQ(std::memcmp(map, bytes.data(), bytes.size()), 0) << "mapped bytes differ";
    ::munmap(map, bytes.size());
  }
  const auto s = stats();
  EXPECT_LE(s.page_cache_bytes, static_cast<int64_t>(bytes.size())) << "a span was stored twice";
  EXPECT_GE(s.errors, 1);
  umount();
}

TEST_F(Lazy, ARegistryThatDiesMidReadIsEioThenTheNextReadWorks) {
  FaultProxy proxy(registry_->host());
  prepare(proxy.host());
  MOUNT_OR_SKIP(j);
  const std::string blob = "/blobs/" + oci::sha256_digest(image_->layers[0]);
  proxy.add(FaultProxy::drop_after(blob, 1000, 1, 0));  // every try, the client's retry and the kernel's too
  const int fd = ::open((point() / "usr" / "big").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  char buffer[4096];
  EXPECT_EQ(::pread(fd, buffer, sizeof buffer, 0), -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_GE(proxy.requests(blob).size(), 2u) << "the client did not retry";
  proxy.clear();
  EXPECT_EQ(::pread(fd, buffer, sizeof buffer, 0), static_cast<ssize_t>(sizeof buffer));
  ::close(fd);
  EXPECT_NE(log().find("span 0"), std::string::npos) << log();
  umount();
}

TEST_F(Lazy, UnmountWithFilesOpenGivesEioNotAHang) {
  prepare(registry_->host());
  MOUNT_OR_SKIP(j);
  const int pid = j["pid"].get<int>();
  const int fd = ::open((point() / "usr" / "big").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  char buffer[4096];
  ASSERT_EQ(::pread(fd, buffer, sizeof buffer, 0), static_cast<ssize_t>(sizeof buffer));
  const RunResult down = pull({"umount", point().string()}, 60);
  EXPECT_EQ(down.status, 0) << down.err;
  EXPECT_TRUE(fs::is_empty(point())) << "still mounted";
  const ssize_t after = ::pread(fd, buffer, sizeof buffer, 300000);
  const int error = errno;
  EXPECT_EQ(after, -1);
  EXPECT_TRUE(error == EIO || error == ENOTCONN || error == ECONNABORTED) << std::strerror(error);
  ::close(fd);
  for (int i = 0; i < 200 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(pid));
  guard_.point.clear();
  guard_.pid = 0;

  // SIGTERM alone unmounts too.
  MOUNT_OR_SKIP(again);
  ::kill(again["pid"].get<int>(), SIGTERM);
  for (int i = 0; i < 200 && alive(again["pid"].get<int>()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(again["pid"].get<int>()));
  EXPECT_TRUE(fs::is_empty(point()));
  guard_.point.clear();
  guard_.pid = 0;
}

// A read waiting on a registry that stalls mid-span when umount comes: the
// read gets EIO (not a wait for the stall timeout), umount returns, and the
// daemon ends with the worker still in its request.
TEST_F(Lazy, UnmountWhileAReadWaitsOnAStalledRegistryIsEioNotAHang) {
  FaultProxy proxy(registry_->host());
  prepare(proxy.host());
  MOUNT_OR_SKIP(j, {"--stall-timeout", "300"});
  const int pid = j["pid"].get<int>();
  proxy.add(FaultProxy::stall_after("/blobs/" + oci::sha256_digest(image_->layers[0]), 1000, 1, 0));
  struct Read {
    ssize_t got = 0;
    int error = 0;
  };
  auto reader = std::async(std::launch::async, [&] {
    Read r;
    Fd fd(::open((point() / "usr" / "big").c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return Read{-2, errno};
    char buffer[4096];
    r.got = ::pread(fd.get(), buffer, sizeof buffer, 0);
    r.error = errno;
    return r;
  });
  for (int i = 0; i < 400 && !proxy.stalled(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  ASSERT_TRUE(proxy.stalled()) << "the read never reached the registry";
  const RunResult down = pull({"umount", point().string()}, 60);
  EXPECT_EQ(down.status, 0) << down.err;
  const bool ended = reader.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(ended) << "the read still waits after umount";
  proxy.release();  // whatever happened, let it end
  const Read r = reader.get();
  EXPECT_EQ(r.got, -1);
  EXPECT_TRUE(r.error == EIO || r.error == ENOTCONN || r.error == ECONNABORTED) << std::strerror(r.error);
  for (int i = 0; i < 200 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(pid)) << "the daemon waits for its stalled request";
  EXPECT_TRUE(fs::is_empty(point())) << "still mounted";
  guard_.point.clear();
  guard_.pid = 0;
}

// A registry that answers a Range request with the whole blob: the layers
// are fetched whole before the mount, and it says so.
TEST_F(Lazy, ARegistryWithoutRangeSupportFallsBackToWholeLayers) {
  const std::string repository = "norange/app";
  auto routes = image_routes(repository, *image_, "application/vnd.oci.image.manifest.v1+json");
  for (const auto& layer : image_->layers) {
    routes["/v2/" + repository + "/blobs/" + oci::sha256_digest(layer)] = [&layer](const std::string&) {
      return TinyServer::response(200, layer);  // Range ignored, as some servers do
    };
  }
  TinyServer server(routes);
  const std::string ref = registry_->host() + "/" + kImage + ":v1";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  ASSERT_EQ(pull({"index", (out_ / "full").string(), "--span", kSpan, "-q"}).status, 0);
  const RunResult lazy = pull({"pull", server.host() + "/" + repository + ":latest", "--output",
                               "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "-q"});
  ASSERT_EQ(lazy.status, 0) << lazy.err;
  fs::copy(out_ / "full" / oci::kIndexDir, lazy_dir() / oci::kIndexDir);
  fs::create_directories(point());
  MOUNT_OR_SKIP(j);
  ASSERT_EQ(j["notes"].size(), 3u) << j;
  EXPECT_NE(j["notes"][0].get<std::string>().find("does not serve parts of a blob"), std::string::npos) << j;
  for (const auto& l : j["layers"]) EXPECT_EQ(l["local"], true) << l;
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  EXPECT_EQ(stats().bytes_fetched, 0);
  umount();
}

// --record writes what a mount served; --prefetch fetches those first on the
// next one; --background turns the mount into a full local copy meanwhile.
TEST_F(Lazy, RecordPrefetchAndBackgroundFetch) {
  prepare(registry_->host());
  const fs::path recorded = out_ / "served.txt";
  MOUNT_OR_SKIP(first, {"--record", recorded.string()});
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  EXPECT_EQ(slurp(point() / "usr" / "bin" / "tool"), "#!/bin/sh\necho tool\n");
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  umount();
  EXPECT_EQ(slurp(recorded), "/etc/os-release\n/usr/bin/tool\n");

  fs::remove_all(lazy_dir() / oci::kLazyCacheDir);
  MOUNT_OR_SKIP(second, {"--prefetch", recorded.string()});
  for (int i = 0; i < 200 && log().find("prefetched the spans of 2 file(s)") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto prefetched = stats();
  EXPECT_GT(prefetched.bytes_fetched, 0) << log();
  EXPECT_EQ(slurp(point() / "usr" / "bin" / "tool"), "#!/bin/sh\necho tool\n");
  EXPECT_EQ(stats().bytes_fetched, prefetched.bytes_fetched) << "a prefetched file was fetched again";
  umount();

  MOUNT_OR_SKIP(third, {"--background"});
  ASSERT_TRUE(third["background_pid"].is_number()) << third;
  const int fetcher = third["background_pid"].get<int>();
  for (int i = 0; i < 600 && alive(fetcher); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(fetcher));
  const RunResult status = pull({"status", lazy_dir().string()});
  EXPECT_NE(status.out.find("layers    3 of 3 fetched"), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("lazy      "), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("mounted at " + fs::canonical(point()).string()), std::string::npos) << status.out;
  // Fetched whole now: read from the local blobs, nothing by ranges.
  const int64_t before = stats().bytes_fetched;
  EXPECT_EQ(slurp(point() / "lib" / "text"), std::string(200000, 'x'));
  EXPECT_EQ(stats().bytes_fetched, before);
  umount();
}

// --writable: an overlay over the lazy mount, its upper directory on disk
// here (this pull has no memory store) and said so; umount takes the
// overlay, its writes and the lazy mount below away.
TEST_F(Lazy, WritableIsAnOverlayOverTheLazyMountUntilUmount) {
  prepare(registry_->host());
  MOUNT_OR_SKIP(j, {"--writable"});
  ASSERT_TRUE(j["upper"].is_string()) << j;
  EXPECT_EQ(j["upper_in_memory"], false) << j;
  const fs::path upper = j["upper"].get<std::string>();
  std::ofstream(point() / "etc" / "new") << "written\n";
  EXPECT_EQ(slurp(point() / "etc" / "new"), "written\n");
  EXPECT_EQ(slurp(upper / "etc" / "new"), "written\n");
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");  // read through, from the registry
  EXPECT_GT(stats().bytes_fetched, 0);
  umount();
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_FALSE(fs::exists(upper));
  EXPECT_TRUE(oci::mounts_using(lazy_dir()).empty());
}

// pull --build-index against the real registry: each layer's index is built
// from the bytes as they download, equal byte for byte to what `index`
// makes from the blobs afterwards, and a lazy mount of the layout uses it.
TEST_F(Lazy, IndexesBuiltWhilePullingEqualTheIndexCommandsAndServeAMount) {
  const std::string ref = registry_->host() + "/" + kImage + ":v1";
  const fs::path dir = out_ / "built";
  const RunResult pulled = pull(
      {"pull", ref, "--output", "oci:" + dir.string(), "--plain-http", "--build-index", "--span", kSpan, "--json"});
  ASSERT_EQ(pulled.status, 0) << pulled.err;
  const Json report = Json::parse(pulled.out);
  ASSERT_EQ(report["built_indexes"].size(), 3u) << report;
  std::map<std::string, std::string> built;
  for (const auto& l : report["built_indexes"]) {
    EXPECT_EQ(l["indexed"], true) << l;
    EXPECT_EQ(l["streamed"], true) << l;
    const std::string digest = l["digest"];
    built[digest] = slurp(oci::index_path(dir, digest));
  }
  fs::remove_all(dir / oci::kIndexDir);
  const RunResult indexed = pull({"index", dir.string(), "--span", kSpan, "-q"});
  ASSERT_EQ(indexed.status, 0) << indexed.err;
  for (const auto& [digest, bytes] : built) {
    EXPECT_FALSE(bytes.empty()) << digest;
    EXPECT_EQ(bytes, slurp(oci::index_path(dir, digest))) << digest;
  }
  // Without --build-index nothing is indexed; a fetch with it indexes what it fetches.
  const fs::path lazy = out_ / "lazy-built";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + lazy.string(), "--plain-http", "--cold", "lazy", "-q"}).status, 0);
  EXPECT_FALSE(fs::exists(lazy / oci::kIndexDir));
  const RunResult fetched = pull({"fetch", lazy.string(), "--build-index", "--span", kSpan, "--json"});
  ASSERT_EQ(fetched.status, 0) << fetched.err;
  EXPECT_EQ(Json::parse(fetched.out)["built_indexes"].size(), 3u) << fetched.out;
  for (const auto& [digest, bytes] : built) EXPECT_EQ(bytes, slurp(oci::index_path(lazy, digest))) << digest;

  fs::create_directories(point());
  MOUNT_WITH_OR_SKIP(j, (std::vector<std::string>{"mount", lazy.string(), point().string(), "--lazy", "--json"}));
  for (const auto& l : j["layers"]) EXPECT_EQ(l["index_from"], "dir") << l;
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  umount();
  // A rootfs-only pull has no layout for them.
  const RunResult rootfs = pull({"pull", ref, "--output", "rootfs:" + (out_ / "rootfs").string(), "--cache",
                                 (out_ / "cache").string(), "--plain-http", "--build-index"});
  EXPECT_EQ(rootfs.status, 2) << rootfs.err;
  EXPECT_NE(rootfs.err.find("--build-index"), std::string::npos) << rootfs.err;
}

TEST_F(Lazy, AMemoryCapTooSmallForOneSpanIsRefusedBeforeMounting) {
  prepare(registry_->host());
  const RunResult r = pull({"mount", lazy_dir().string(), point().string(), "--lazy", "--max-memory", "20M"});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("--max-memory"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(point()));
}

/// The referrers of `image`'s manifest listed under the OCI 1.1 fallback tag, or null.
Json fallback_listing(const Registry& registry, const std::string& repository, const FixtureImage& image) {
  const std::string tag = "sha256-" + image.manifest_digest.substr(7);
  const HttpResponse r = http("GET", registry.url() + "/v2/" + repository + "/manifests/" + tag, "", "",
                              "application/vnd.oci.image.index.v1+json");
  return r.status == 200 ? Json::parse(r.body, nullptr, false) : Json();
}

// index --push stores the indexes as an artifact of the image; docker-registry
// 2.8 has no referrers API, so they are listed under the fallback tag, which
// a second push extends; a lazy pull finds them by itself and fetches no
// layer to build one.
TEST_F(Lazy, PushedIndexesAreFoundThroughTheFallbackTagByALazyPull) {
  const std::string repository = "pushed/app";
  ASSERT_TRUE(push_image(*registry_, repository, "v1", *image_)) << registry_->log();
  const std::string ref = registry_->host() + "/" + repository + ":v1";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  const RunResult first = pull({"index", (out_ / "full").string(), "--span", kSpan, "--push", "--json"});
  ASSERT_EQ(first.status, 0) << first.err;
  const Json one = Json::parse(first.out);
  EXPECT_EQ(one["pushed"]["referrers_api"], false) << one;
  EXPECT_EQ(one["pushed"]["fallback_tag"], "sha256-" + image_->manifest_digest.substr(7)) << one;
  EXPECT_EQ(one["pushed"]["fallback_entries"], 1) << one;
  EXPECT_EQ(one["pushed"]["layers"], 3) << one;

  // A second push (from REF, pulled whole into a scratch layout) adds to the listing.
  const RunResult second = pull(
      {"index", ref, "--push", "--span", "128K", "--plain-http", "--cache", (out_ / "scratch").string(), "--json"});
  ASSERT_EQ(second.status, 0) << second.err;
  const Json two = Json::parse(second.out);
  EXPECT_EQ(two["pushed"]["fallback_entries"], 2) << two;
  EXPECT_TRUE(fs::is_empty(out_ / "scratch")) << "index REF left its scratch layout";
  const Json listing = fallback_listing(*registry_, repository, *image_);
  ASSERT_TRUE(listing.is_object());
  ASSERT_EQ(listing["manifests"].size(), 2u) << listing;
  EXPECT_EQ(listing["manifests"][0]["digest"], one["pushed"]["artifact"]) << "the first entry was lost";
  EXPECT_EQ(listing["manifests"][1]["digest"], two["pushed"]["artifact"]);
  EXPECT_EQ(listing["manifests"][1]["artifactType"], oci::kIndexArtifactType);

  // A lazy pull through a proxy that counts: the indexes come from the registry, no layer blob.
  FaultProxy proxy(registry_->host());
  const RunResult lazy = pull({"pull", proxy.host() + "/" + repository + ":v1", "--output",
                               "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "--json"});
  ASSERT_EQ(lazy.status, 0) << lazy.err;
  const Json pulled = Json::parse(lazy.out);
  EXPECT_EQ(pulled["indexes"]["artifact"], two["pushed"]["artifact"]) << "not the newest artifact";
  EXPECT_EQ(pulled["indexes"]["via"], "tag sha256-" + image_->manifest_digest.substr(7)) << pulled;
  for (const auto& layer : image_->layers) {
    const std::string digest = oci::sha256_digest(layer);
    EXPECT_TRUE(proxy.requests("/blobs/" + digest).empty()) << "layer data fetched: " << digest;
    auto index = oci::read_index(oci::index_path(lazy_dir(), digest));
    ASSERT_TRUE(index) << index.error().message;
    EXPECT_EQ(index->span, uint64_t{128} << 10);
  }
  fs::create_directories(point());
  MOUNT_OR_SKIP(j);
  EXPECT_TRUE(j["notes"].empty()) << j;
  for (const auto& l : j["layers"]) EXPECT_EQ(l["index_from"], "dir") << l;
  EXPECT_EQ(stats().bytes_fetched, 0);
  // File times come from the index (the fixture's tars are all of one second).
  struct stat st {};
  ASSERT_EQ(::stat((point() / "etc" / "os-release").c_str(), &st), 0);
  EXPECT_EQ(st.st_mtime, 1700000000);
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  umount();
}

// An index artifact whose index is not one: the pull that finds it says so
// in one line and exits 3.
/// Pushes `index` (bytes, whatever they are) as the index artifact of the
/// test image's first layer in `repository`, listed under the fallback tag.
void push_index_artifact_of_first_layer(Registry& registry, const std::string& repository, const FixtureImage& image,
                                        const std::string& index) {
  const std::string empty = "{}";
  ASSERT_TRUE(registry.push_blob(repository, index));
  ASSERT_TRUE(registry.push_blob(repository, empty));
  Json layer = descriptor(oci::kIndexBlobType, index);
  layer["annotations"] = {{oci::kIndexLayerAnnotation, oci::sha256_digest(image.layers[0])}};
  const std::string artifact =
      Json{{"schemaVersion", 2},
           {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
           {"artifactType", oci::kIndexArtifactType},
           {"config", descriptor("application/vnd.oci.empty.v1+json", empty)},
           {"layers", Json::array({layer})},
           {"subject", descriptor("application/vnd.oci.image.manifest.v1+json", image.manifest)}}
          .dump();
  ASSERT_TRUE(registry.push_manifest(repository, oci::sha256_digest(artifact), artifact,
                                     "application/vnd.oci.image.manifest.v1+json"))
      << registry.log();
  Json entry = descriptor("application/vnd.oci.image.manifest.v1+json", artifact);
  entry["artifactType"] = oci::kIndexArtifactType;
  const Json listing = {{"schemaVersion", 2},
                        {"mediaType", "application/vnd.oci.image.index.v1+json"},
                        {"manifests", Json::array({entry})}};
  ASSERT_TRUE(registry.push_manifest(repository, "sha256-" + image.manifest_digest.substr(7), listing.dump(),
                                     "application/vnd.oci.image.index.v1+json"))
      << registry.log();
}

TEST_F(Lazy, ACorruptIndexArtifactIsRefused) {
  const std::string repository = "corrupt/app";
  ASSERT_TRUE(push_image(*registry_, repository, "v1", *image_)) << registry_->log();
  push_index_artifact_of_first_layer(*registry_, repository, *image_, "not an index, whatever its digest says");
  if (HasFatalFailure()) return;

  const RunResult r = pull({"pull", registry_->host() + "/" + repository + ":v1", "--output",
                            "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "-q"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_EQ(testing::lines(r.err).size(), 1u) << r.err;
  EXPECT_NE(r.err.find("index artifact"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(oci::short_digest(oci::sha256_digest(image_->layers[0]))), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(oci::index_path(lazy_dir(), oci::sha256_digest(image_->layers[0]))));
}

// An index whose header is right and whose body is damaged (its blob digest
// matching the damaged bytes): the lazy pull checks only the digest and the
// header, so it keeps it; the mount, which parses every index, refuses it
// in one line naming the file and exits 3, mounting nothing.
TEST_F(Lazy, AnIndexDamagedPastItsHeaderIsRefusedByTheMount) {
  const std::string repository = "damaged/app";
  ASSERT_TRUE(push_image(*registry_, repository, "v1", *image_)) << registry_->log();
  const std::string ref = registry_->host() + "/" + repository + ":v1";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  ASSERT_EQ(pull({"index", (out_ / "full").string(), "--span", kSpan, "-q"}).status, 0);
  const std::string layer = oci::sha256_digest(image_->layers[0]);
  std::string index = slurp(oci::index_path(out_ / "full", layer));
  ASSERT_GT(index.size(), 200u);
  index[index.size() - 40] =
      static_cast<char>(index[index.size() - 40] ^ 0x5a);  // past the header, before the checksum
  push_index_artifact_of_first_layer(*registry_, repository, *image_, index);
  if (HasFatalFailure()) return;

  const RunResult lazy =
      pull({"pull", ref, "--output", "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "-q"});
  ASSERT_EQ(lazy.status, 0) << lazy.err;
  EXPECT_EQ(slurp(oci::index_path(lazy_dir(), layer)), index);
  fs::create_directories(point());
  const RunResult r = pull({"mount", lazy_dir().string(), point().string(), "--lazy", "-q"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_EQ(testing::lines(r.err).size(), 1u) << r.err;
  EXPECT_NE(r.err.find(oci::index_path(lazy_dir(), layer).string()), std::string::npos) << r.err;
  EXPECT_TRUE(oci::mounted_source(fs::canonical(point())).empty());
  EXPECT_TRUE(fs::is_empty(point()));
}

/// Layers that are not gzip: zstd in frames of 64 KiB of tar (a whiteout
/// among them), zstd in one frame, and an uncompressed tar, over a gzip base.
FixtureImage zstd_image() {
  using namespace cfmo::testing;
  const std::string base = make_tar({dir("etc"), file("etc/os-release", "ID=zstd\n"), file("gone", "whited out\n")});
  const std::string framed =
      make_tar({whiteout("", "gone"), dir("data"), file("data/first", random_bytes(200000, 21)),
                file("data/log", std::string(300000, 'z')), file("data/last", random_bytes(250001, 22))});
  const std::string single =
      make_tar({dir("one"), file("one/big", random_bytes(400000, 23)), file("one/small", "small\n")});
  const std::string plain = make_tar({dir("plain"), file("plain/file", random_bytes(150000, 24))});
  return make_real_image({{base, "tar+gzip"}, {framed, "tar+zstd", 64 << 10}, {single, "tar+zstd"}, {plain, "tar"}});
}

// Layers that are not gzip, pushed with their indexes to the real registry:
// the zstd layer of many frames is read by the spans between frames, as gzip
// is; the zstd layer of one frame is named as not lazily loadable and
// fetched whole before the mount, then read from its start; the
// uncompressed tar is read by offsets. The tree and every file equal the
// full pull's rootfs.
TEST_F(Lazy, ZstdFramesAndPlainTarsAreReadBySpansAndOneZstdFrameIsFetchedWhole) {
  const std::string repository = "zstd/app";
  const FixtureImage image = zstd_image();
  ASSERT_TRUE(push_image(*registry_, repository, "v1", image)) << registry_->log();
  const std::string ref = registry_->host() + "/" + repository + ":v1";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  const RunResult indexed = pull({"index", (out_ / "full").string(), "--span", kSpan, "--push", "--json"});
  ASSERT_EQ(indexed.status, 0) << indexed.err;
  const Json idx = Json::parse(indexed.out);
  ASSERT_EQ(idx["layers"].size(), 4u) << idx;
  for (const auto& l : idx["layers"]) EXPECT_EQ(l["indexed"], true) << l;
  EXPECT_GE(idx["layers"][1]["checkpoints"].get<int>(), 5) << "frames of 64K, spans of 64K";
  EXPECT_GE(idx["layers"][1]["members"].get<int>(), 5) << idx["layers"][1];
  EXPECT_TRUE(idx["layers"][1]["note"].is_null()) << idx["layers"][1];
  EXPECT_EQ(idx["layers"][2]["checkpoints"], 1) << idx["layers"][2];
  EXPECT_NE(idx["layers"][2]["note"].get<std::string>().find("not lazily loadable"), std::string::npos);
  EXPECT_EQ(idx["pushed"]["layers"], 4) << idx;
  const RunResult rootfs = pull({"pull", ref, "--output", "rootfs:" + (out_ / "rootfs").string(), "--cache",
                                 (out_ / "cache").string(), "--plain-http", "-q"});
  ASSERT_EQ(rootfs.status, 0) << rootfs.err;

  // A lazy pull through a proxy that counts: the indexes come from the registry.
  FaultProxy proxy(registry_->host());
  const RunResult lazy = pull({"pull", proxy.host() + "/" + repository + ":v1", "--output",
                               "oci:" + lazy_dir().string(), "--plain-http", "--cold", "lazy", "-q"});
  ASSERT_EQ(lazy.status, 0) << lazy.err;
  fs::create_directories(point());
  MOUNT_OR_SKIP(j, {"--max-memory", "64M"});
  ASSERT_EQ(j["layers"].size(), 4u) << j;
  EXPECT_EQ(j["layers"][0]["local"], false) << j;
  EXPECT_EQ(j["layers"][1]["local"], false) << j;
  EXPECT_EQ(j["layers"][2]["local"], true) << "one zstd frame: fetched whole first " << j;
  EXPECT_EQ(j["layers"][3]["local"], false) << j;
  ASSERT_EQ(j["notes"].size(), 1u) << j;
  EXPECT_NE(j["notes"][0].get<std::string>().find("layer 2: one zstd frame"), std::string::npos) << j;
  EXPECT_NE(j["notes"][0].get<std::string>().find("not lazily loadable"), std::string::npos) << j;
  EXPECT_EQ(proxy.requests("/blobs/" + oci::sha256_digest(image.layers[2])).size(), 1u) << "fetched whole, once";
  EXPECT_EQ(stats().bytes_fetched, 0);

  // One file of the framed layer: the spans that hold it, by Range requests.
  const std::string framed_blob = "/blobs/" + oci::sha256_digest(image.layers[1]);
  EXPECT_EQ(slurp(point() / "data" / "last"), testing::random_bytes(250001, 22));
  const int64_t one = stats().bytes_fetched;
  EXPECT_GT(one, 0);
  EXPECT_LT(one, static_cast<int64_t>(image.layers[1].size()) - 150000) << "data/first's spans were fetched too";
  const auto ranged = proxy.requests(framed_blob);
  ASSERT_FALSE(ranged.empty());
  EXPECT_EQ(fs::file_size(point() / "plain" / "file"), 150000u);
  // The one-frame layer, read late first, then early: decoded from its start again, right both times.
  const int fd = ::open((point() / "one" / "big").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::string late(4096, '\0');
  std::string early(4096, '\0');
  EXPECT_EQ(::pread(fd, late.data(), late.size(), 390000), 4096);
  EXPECT_EQ(::pread(fd, early.data(), early.size(), 100), 4096);
  ::close(fd);
  const std::string big = testing::random_bytes(400000, 23);
  EXPECT_TRUE(late == big.substr(390000, 4096));
  EXPECT_TRUE(early == big.substr(100, 4096));
  // Every file, whiteouts applied, as the full pull unpacked them.
  EXPECT_EQ(without_runtime_dirs(point()), testing::list_tree(out_ / "rootfs"));
  EXPECT_FALSE(fs::exists(point() / "gone"));
  const auto all = stats();
  EXPECT_EQ(all.errors, 0) << log();
  int64_t cold_bytes = 0;
  for (const size_t i : {size_t{0}, size_t{1}, size_t{3}}) cold_bytes += static_cast<int64_t>(image.layers[i].size());
  EXPECT_LE(all.bytes_fetched, cold_bytes + 4096) << "a span was fetched twice";
  umount();
  EXPECT_EQ(pull({"rm", (out_ / "full").string(), "-q"}).status, 0);
}

/// The FUSE mounts at `point` in the mount table of process `pid`, as mountinfo lines.
std::vector<std::string> fuse_mounts_at(int pid, const fs::path& point) {
  std::vector<std::string> out;
  const std::string field = fmt::format(" {} ", point.string());
  for (const auto& line : testing::lines(slurp(fmt::format("/proc/{}/mountinfo", pid)))) {
    if (line.find(field) != std::string::npos && line.find(" fuse.") != std::string::npos) out.push_back(line);
  }
  return out;
}

// Without root, the mount goes through fusermount3 (setuid root), as libfuse
// does for a user: the daemon runs as that user, umount and SIGTERM detach
// it with fusermount3 -u, a mount whose daemon was killed is detached by
// umount too, and --writable (an overlay, which needs root) is refused
// without leaving the lazy mount behind. Run as nobody, from root, in a
// mount namespace of the test's own: there /dev/fuse is a node of the test's
// that any user may open, as distributions make it (this machine's is 0600,
// which stops fusermount3 too), and whatever is left mounted goes with the
// namespace.
TEST_F(Lazy, WithoutRootTheMountGoesThroughFusermount3AndLeavesNoMountBehind) {
  if (::geteuid() != 0) GTEST_SKIP() << "the test becomes nobody with setpriv and makes a mount namespace: needs root";
  if (!fs::exists("/usr/bin/fusermount3")) GTEST_SKIP() << "/usr/bin/fusermount3 is not installed (Debian fuse3)";
  if (!fs::exists("/usr/bin/nsenter") || !fs::exists("/usr/bin/unshare")) GTEST_SKIP() << "no nsenter or unshare";
  const passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody";
  const uid_t uid = nobody->pw_uid;
  const gid_t gid = nobody->pw_gid;
  prepare(registry_->host());
  // The lazy pull and the mount point belong to nobody; the way there is open.
  fs::permissions(out_.path(), fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  for (const fs::path& top : {lazy_dir(), point()}) {
    ASSERT_EQ(::lchown(top.c_str(), uid, gid), 0);
    for (const auto& e : fs::recursive_directory_iterator(top))
      ASSERT_EQ(::lchown(e.path().c_str(), uid, gid), 0) << e.path();
  }
  testing::Background holder = testing::spawn({"/usr/bin/unshare", "--mount", "--propagation", "private",
                                               "/usr/bin/setpriv", "--pdeathsig", "KILL", "/bin/sleep", "300"},
                                              {}, "/dev/null", "/dev/null");
  struct Reaper {
    testing::Background& b;
    ~Reaper() { b.reap(); }
  } reaper{holder};
  ASSERT_GT(holder.pid, 0);
  const std::string own_ns = fs::read_symlink("/proc/self/ns/mnt").string();
  for (int i = 0; i < 100; ++i) {
    std::error_code ec;
    const auto ns = fs::read_symlink(fmt::format("/proc/{}/ns/mnt", holder.pid), ec);
    if (!ec && ns.string() != own_ns) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto in_ns = [&](std::vector<std::string> args, bool as_nobody) {
    if (as_nobody) {
      args.insert(args.begin(), {"/usr/bin/setpriv", "--reuid", std::to_string(uid), "--regid", std::to_string(gid),
                                 "--clear-groups", "--"});
    }
    args.insert(args.begin(), {"/usr/bin/nsenter", "-t", std::to_string(holder.pid), "-m", "--"});
    return run(args, 120);
  };
  const fs::path node = out_ / "fuse";
  const RunResult device =
      in_ns({"/bin/sh", "-c",
             fmt::format("mknod -m 666 '{}' c 10 229 && mount --bind '{}' /dev/fuse", node.string(), node.string())},
            false);
  if (device.status != 0) GTEST_SKIP() << "cannot give the namespace a /dev/fuse for users: " << device.err;

  const std::string tool = fs::absolute(binary()).string();
  const std::vector<std::string> mount_args = {
      tool,  "mount", lazy_dir().string(), point().string(), "--lazy", "--json", "--retries", "1", "--retry-delay",
      "0.01"};
  RunResult mounted = in_ns(mount_args, true);
  if (mounted.status == 2 && mounted.err.find("FUSE mount failed") != std::string::npos)
    GTEST_SKIP() << "fusermount3 may not mount here: " << mounted.err << log();
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  guard_.pid = Json::parse(mounted.out).value("pid", 0);
  // The daemon is nobody's, and so is the mount (fusermount3 records the user).
  EXPECT_NE(slurp(fmt::format("/proc/{}/status", guard_.pid)).find(fmt::format("Uid:\t{}\t", uid)), std::string::npos);
  const fs::path where = fs::canonical(point());
  const auto mounts = fuse_mounts_at(holder.pid, where);
  ASSERT_EQ(mounts.size(), 1u) << slurp(fmt::format("/proc/{}/mountinfo", holder.pid));
  EXPECT_NE(mounts[0].find(fmt::format("user_id={}", uid)), std::string::npos) << mounts[0];
  EXPECT_TRUE(fuse_mounts_at(::getpid(), where).empty()) << "the mount leaked out of the namespace";
  // nobody reads a file of a cold layer through it.
  const RunResult cat = in_ns({"/bin/cat", (point() / "etc" / "os-release").string()}, true);
  EXPECT_EQ(cat.status, 0) << cat.err;
  EXPECT_EQ(cat.out, "ID=lazy\n");
  EXPECT_GT(stats().bytes_fetched, 0);
  const RunResult down = in_ns({tool, "umount", point().string()}, true);
  EXPECT_EQ(down.status, 0) << down.err;
  EXPECT_FALSE(alive(guard_.pid)) << "the daemon outlived umount";
  EXPECT_TRUE(fuse_mounts_at(holder.pid, where).empty()) << "umount left the mount behind";

  // SIGTERM alone: the daemon detaches its mount with fusermount3 and ends.
  mounted = in_ns(mount_args, true);
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  guard_.pid = Json::parse(mounted.out).value("pid", 0);
  ::kill(guard_.pid, SIGTERM);
  for (int i = 0; i < 200 && alive(guard_.pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(guard_.pid));
  EXPECT_TRUE(fuse_mounts_at(holder.pid, where).empty()) << "SIGTERM left the mount behind";

  // A daemon killed outright leaves a dead mount: umount, as nobody, detaches it.
  mounted = in_ns(mount_args, true);
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  guard_.pid = Json::parse(mounted.out).value("pid", 0);
  ::kill(guard_.pid, SIGKILL);
  for (int i = 0; i < 200 && alive(guard_.pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(fuse_mounts_at(holder.pid, where).size(), 1u);
  const RunResult dead = in_ns({tool, "umount", point().string()}, true);
  EXPECT_EQ(dead.status, 0) << dead.err;
  EXPECT_TRUE(fuse_mounts_at(holder.pid, where).empty()) << "the dead mount was left behind";

  // --writable needs an overlay, which nobody may not mount: refused, and the lazy mount below goes too.
  std::vector<std::string> writable = mount_args;
  writable.push_back("--writable");
  const RunResult refused = in_ns(writable, true);
  EXPECT_EQ(refused.status, 2) << refused.err;
  EXPECT_EQ(testing::lines(refused.err).size(), 1u) << refused.err;
  EXPECT_NE(refused.err.find("--writable"), std::string::npos) << refused.err;
  for (const auto& line : testing::lines(slurp(fmt::format("/proc/{}/mountinfo", holder.pid))))
    EXPECT_EQ(line.find(lazy_dir().string()), std::string::npos) << "left mounted: " << line;
  EXPECT_TRUE(fuse_mounts_at(holder.pid, where).empty());
  guard_.point.clear();
  guard_.pid = 0;
}

/// What is left under CACHE/lazy: the layouts of mounts by REF.
/// A directory of the test's own on tmpfs (/dev/shm), for memory stores; removed at the end.
struct ShmDir {
  fs::path path;
  ShmDir() {
    std::string name = "/dev/shm/cfmo-test-rw-XXXXXX";
    if (::mkdtemp(name.data()) != nullptr) path = name;
  }
  ~ShmDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

size_t lazy_layouts(const fs::path& cache) {
  std::error_code ec;
  if (!fs::is_directory(cache / "lazy", ec)) return 0;
  return static_cast<size_t>(std::distance(fs::directory_iterator(cache / "lazy"), fs::directory_iterator()));
}

// mount --lazy REF: no pull first. With indexes pushed for the image, the
// mount fetches the manifest, the config and the indexes, no layer; files
// come span by span on first read; the layout stays under --cache for the
// next mount, whose reads the span cache serves; rm takes it away.
TEST_F(Lazy, MountsAnImageStraightFromTheRegistry) {
  const std::string repository = "byref/app";
  ASSERT_TRUE(push_image(*registry_, repository, "v1", *image_)) << registry_->log();
  const std::string ref = registry_->host() + "/" + repository + ":v1";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  ASSERT_EQ(pull({"index", (out_ / "full").string(), "--span", kSpan, "--push", "-q"}).status, 0);
  const RunResult rootfs = pull({"pull", ref, "--output", "rootfs:" + (out_ / "rootfs").string(), "--cache",
                                 (out_ / "blobs").string(), "--plain-http", "-q"});
  ASSERT_EQ(rootfs.status, 0) << rootfs.err;
  fs::create_directories(point());
  const fs::path cache = out_ / "cache";
  FaultProxy proxy(registry_->host());
  const std::vector<std::string> args = {"mount",          "--lazy",       proxy.host() + "/" + repository + ":v1",
                                         point().string(), "--cache",      cache.string(),
                                         "--plain-http",   "--max-memory", "64M",
                                         "--json"};
  MOUNT_WITH_OR_SKIP(j, args);
  EXPECT_EQ(j["image"], proxy.host() + "/" + repository + ":v1") << j;
  const fs::path dir = j["dir"].get<std::string>();
  EXPECT_EQ(dir.parent_path(), fs::absolute(cache / "lazy")) << j;
  EXPECT_NE(dir.filename().string().find(image_->manifest_digest.substr(7, 16)), std::string::npos) << j;
  for (const auto& l : j["layers"]) {
    EXPECT_EQ(l["local"], false) << l;
    EXPECT_EQ(l["index_from"], "dir") << l;
  }
  // Nothing of a layer came before a file was read: one Range request of a
  // byte asks whether the registry serves parts of a blob, and that is all.
  size_t layer_requests = 0;
  for (const auto& layer : image_->layers) {
    for (const auto& seen : proxy.requests("/blobs/" + oci::sha256_digest(layer))) {
      EXPECT_EQ(seen.range_start, 0) << "a layer fetched whole before a read: " << seen.target;
      ++layer_requests;
    }
  }
  EXPECT_LE(layer_requests, 1u);
  auto fetched = [&] {
    auto s = oci::read_lazy_stats(dir);
    return s ? s->bytes_fetched : -1;
  };
  EXPECT_EQ(fetched(), 0);
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  EXPECT_GT(fetched(), 0);
  EXPECT_LT(fetched(), static_cast<int64_t>(image_->layers[0].size()) / 2) << "more than the file's span was fetched";
  EXPECT_EQ(without_runtime_dirs(point()), testing::list_tree(out_ / "rootfs"));
  // Under --max-memory, the daemon's peak included.
  const std::string status = slurp(fmt::format("/proc/{}/status", guard_.pid));
  const auto hwm = status.find("VmHWM:");
  ASSERT_NE(hwm, std::string::npos);
  EXPECT_LT(std::stoll(status.substr(hwm + 6)) * 1024, int64_t{64} << 20) << status.substr(hwm, 30);
  umount();

  // Mounted again by REF: the same layout, whose span cache serves every read.
  MOUNT_WITH_OR_SKIP(second, args);
  EXPECT_EQ(second["dir"], dir.string());
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  EXPECT_EQ(fetched(), 0) << "the span cache of the first mount was not used";
  umount();
  EXPECT_EQ(lazy_layouts(cache), 1u);
  EXPECT_EQ(pull({"rm", dir.string(), "-q"}).status, 0);
  EXPECT_EQ(lazy_layouts(cache), 0u);
}

// mount --lazy REF with the flags a DIR mount has: --record writes what
// the mount served; the next mount by REF with --prefetch fetches those
// spans first; --writable puts an overlay on top whose writes umount drops;
// --background fetches every layer meanwhile, so the mount becomes a full
// local copy without a restart, and status of the layout says so.
TEST_F(Lazy, MountByRefRecordsPrefetchesWritesAndFetchesInTheBackground) {
  const std::string ref = push_indexed("byref/flags");
  if (ref.empty()) return;  // failed, said so
  fs::create_directories(point());
  const fs::path cache = out_ / "cache";
  const fs::path recorded = out_ / "served.txt";
  const auto args = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"mount",        "--lazy",       ref,     point().string(), "--cache",
                                  cache.string(), "--plain-http", "--json"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  MOUNT_WITH_OR_SKIP(first, args({"--record", recorded.string()}));
  const fs::path dir = first["dir"].get<std::string>();
  const auto stats_of = [&] {
    auto s = oci::read_lazy_stats(dir);
    return s ? *s : oci::LazyStats{};
  };
  EXPECT_EQ(slurp(point() / "usr" / "bin" / "tool"), "#!/bin/sh\necho tool\n");
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  umount();
  EXPECT_EQ(slurp(recorded), "/usr/bin/tool\n/etc/os-release\n");

  // Prefetch, writable and background at once; the span cache emptied so the prefetch has work.
  // The writes go to a memory store of the mount's own, in a tmpfs directory of this test's.
  fs::remove_all(dir / oci::kLazyCacheDir);
  const ShmDir shm;
  MOUNT_WITH_OR_SKIP(
      second, args({"--prefetch", recorded.string(), "--writable", "--background", "--memory-dir", shm.path.string()}));
  EXPECT_EQ(second["dir"], dir.string());
  ASSERT_TRUE(second["upper"].is_string()) << second;
  ASSERT_TRUE(second["background_pid"].is_number()) << second;
  const fs::path upper = second["upper"].get<std::string>();
  EXPECT_EQ(upper.string().rfind((shm.path / "cfmo-pull-").string(), 0), 0u) << upper;
  EXPECT_EQ(second["upper_in_memory"], true) << second;
  EXPECT_EQ(slurp(upper.parent_path() / oci::kStoreOwnerFile), dir.string() + "\n");
  const std::string mount_log = (dir / oci::kLazyLogFile).string();
  for (int i = 0; i < 200 && slurp(mount_log).find("prefetched the spans of 2 file(s)") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(slurp(mount_log).find("prefetched the spans of 2 file(s)"), std::string::npos) << slurp(mount_log);
  EXPECT_EQ(slurp(point() / "usr" / "bin" / "tool"), "#!/bin/sh\necho tool\n");
  std::ofstream(point() / "etc" / "new") << "written\n";
  EXPECT_EQ(slurp(point() / "etc" / "new"), "written\n");
  EXPECT_EQ(slurp(upper / "etc" / "new"), "written\n");

  const int fetcher = second["background_pid"].get<int>();
  for (int i = 0; i < 600 && alive(fetcher); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(alive(fetcher)) << slurp(dir / "cfmo-pull.log");
  const RunResult status = pull({"status", dir.string()});
  EXPECT_EQ(status.status, 0) << status.err;
  EXPECT_NE(status.out.find("layers    3 of 3 fetched"), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("mounted at " + fs::canonical(point()).string()), std::string::npos) << status.out;
  const RunResult status_json = pull({"status", dir.string(), "--json"});
  const Json state = Json::parse(status_json.out, nullptr, false);
  ASSERT_TRUE(state.is_object()) << status_json.out;
  EXPECT_EQ(state["bytes_on_disk"], state["bytes_total"]) << state;
  // The whole image is local now: reads take nothing more from the registry.
  const int64_t before = stats_of().bytes_fetched;
  EXPECT_EQ(slurp(point() / "lib" / "text"), std::string(200000, 'x'));
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  EXPECT_EQ(stats_of().bytes_fetched, before);
  umount();
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_FALSE(fs::exists(upper));
  EXPECT_TRUE(fs::is_empty(shm.path)) << "the mount's memory store outlived umount";
  EXPECT_TRUE(oci::mounts_using(dir).empty());

  // The plain line says the writes take memory.
  const RunResult plain = pull({"mount", "--lazy", ref, point().string(), "--cache", cache.string(), "--plain-http",
                                "--writable", "--memory-dir", shm.path.string()});
  ASSERT_EQ(plain.status, 0) << plain.err;
  guard_.point = point();
  EXPECT_NE(plain.out.find("writes kept in memory in " + shm.path.string() + "/cfmo-pull-"), std::string::npos)
      << plain.out;
  umount();
  EXPECT_TRUE(fs::is_empty(shm.path));

  // A daemon killed, its mounts gone without umount (as a mount namespace ending leaves them): prune takes the store.
  MOUNT_WITH_OR_SKIP(killed, args({"--writable", "--memory-dir", shm.path.string()}));
  std::ofstream(point() / "etc" / "lost") << "lost\n";
  ASSERT_EQ(std::distance(fs::directory_iterator(shm.path), fs::directory_iterator()), 1);
  const auto kill_daemon = [&](int pid) {
    ASSERT_GT(pid, 0);
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    for (int i = 0; i < 200 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  // The mounts gone without umount, as a mount namespace ending leaves them.
  const auto detach = [&] {
    ASSERT_EQ(::umount2(point().c_str(), MNT_DETACH), 0) << std::strerror(errno);
    for (const auto& lazy : fs::directory_iterator(dir / "layers" / "lazy")) ::umount2(lazy.path().c_str(), MNT_DETACH);
    guard_.point.clear();
    guard_.pid = 0;
  };
  const auto prune = [&] {
    const RunResult p = pull({"prune", "--memory-dir", shm.path.string(), "--cache", cache.string(), "--json"});
    EXPECT_EQ(p.status, 0) << p.err;
    const Json j = Json::parse(p.out, nullptr, false);
    EXPECT_TRUE(j.is_object()) << p.out;
    return j;
  };
  // The daemon dead, the overlay is there still: the store and the layout are kept.
  kill_daemon(killed["pid"].get<int>());
  const Json while_mounted = prune();
  EXPECT_EQ(while_mounted["removed"].size(), 0u) << while_mounted;
  EXPECT_FALSE(fs::is_empty(shm.path));
  detach();
  const Json pruned = prune();
  ASSERT_TRUE(pruned["removed"].is_array()) << pruned;
  EXPECT_EQ(pruned["removed"].size(), 2u) << pruned;  // the layout and the mount's store
  EXPECT_TRUE(fs::is_empty(shm.path));
  EXPECT_EQ(lazy_layouts(cache), 0u);

  // rm DIR takes such a store too: the dead mount's record names it.
  MOUNT_WITH_OR_SKIP(again, args({"--writable", "--memory-dir", shm.path.string()}));
  EXPECT_EQ(again["dir"], dir.string());
  kill_daemon(again["pid"].get<int>());
  detach();
  const RunResult removed = pull({"rm", dir.string(), "--json"});
  ASSERT_EQ(removed.status, 0) << removed.err;
  EXPECT_EQ(Json::parse(removed.out, nullptr, false)["removed"].size(), 2u) << removed.out;
  EXPECT_TRUE(fs::is_empty(shm.path));
  EXPECT_EQ(lazy_layouts(cache), 0u);
}

// --writable in memory lives under --max-memory with the rest of the mount:
// the writes get a tmpfs of what the process, its indexes and the spans
// being read leave, a write past it fails with ENOSPC (not an OOM) and the
// mount's log says so once; a cap that leaves nothing for them is refused
// before mounting. Nothing stays mounted or in the memory directory.
TEST_F(Lazy, WritesInMemoryStayUnderMaxMemoryAndFailWithEnospcPastIt) {
  const std::string ref = push_indexed("byref/capped");
  if (ref.empty()) return;  // failed, said so
  fs::create_directories(point());
  const fs::path cache = out_ / "cache";
  const ShmDir shm;
  struct Detach {  // whatever the test did: the writes' tmpfs is not left mounted
    const ShmDir& shm;
    ~Detach() {
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(shm.path, ec)) ::umount2(e.path().c_str(), MNT_DETACH);
    }
  } detach{shm};
  const auto args = [&](const std::string& cap) {
    return std::vector<std::string>{"mount",           "--lazy",       ref,      point().string(), "--cache",
                                    cache.string(),    "--plain-http", "--json", "--writable",     "--memory-dir",
                                    shm.path.string(), "--max-memory", cap};
  };
  MOUNT_WITH_OR_SKIP(j, args("32M"));
  ASSERT_TRUE(j["upper_bytes"].is_number()) << j;
  const int64_t cap = int64_t{32} << 20;
  const int64_t writes = j["upper_bytes"].get<int64_t>();
  EXPECT_GT(writes, int64_t{1} << 20) << j;
  EXPECT_LE(writes + j["read_bytes"].get<int64_t>() + oci::kProcessMemory + j["index_bytes"].get<int64_t>(), cap) << j;
  const fs::path upper = j["upper"].get<std::string>();
  struct statvfs space {};
  ASSERT_EQ(::statvfs(upper.c_str(), &space), 0);
  EXPECT_LE(static_cast<int64_t>(space.f_blocks * space.f_frsize), writes + 4096);
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");  // read through, under the same cap

  // Writing twice the share: ENOSPC once it is used up, never more than it.
  const auto fill = [&](const fs::path& path) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    const std::string block(1 << 20, 'w');
    int64_t written = 0;
    int error = 0;
    while (fd >= 0 && written < 2 * writes) {
      const ssize_t n = ::write(fd, block.data(), block.size());
      if (n < 0) {
        error = errno;
        break;
      }
      written += n;
    }
    if (fd >= 0) ::close(fd);
    EXPECT_EQ(error, ENOSPC) << std::strerror(error);
    EXPECT_LE(written, writes);
  };
  const std::string full = "the writes' memory is full";
  const fs::path mount_log = fs::path(j["log"].get<std::string>());
  const auto full_lines = [&] {
    size_t lines = 0;
    for (const auto& line : testing::lines(slurp(mount_log))) lines += line.find(full) != std::string::npos ? 1 : 0;
    return lines;
  };
  // The watcher wakes on the tmpfs's writes (fanotify), not on a clock: each
  // time it fills is one line, however long it stays full.
  const auto expect_lines = [&](size_t want) {
    for (int i = 0; i < 100 && full_lines() < want; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a further line would be there by now
    EXPECT_EQ(full_lines(), want) << slurp(mount_log);
  };
  fill(point() / "big");
  expect_lines(1);
  EXPECT_NE(slurp(mount_log).find("ENOSPC"), std::string::npos);
  // Freed and filled again (through a file in a directory of its own): a second line.
  fs::remove(point() / "big");
  fs::create_directories(point() / "var" / "spool");
  fill(point() / "var" / "spool" / "big");
  expect_lines(2);
  EXPECT_EQ(slurp(mount_log).find("every 250 ms"), std::string::npos) << "fanotify refused: " << slurp(mount_log);
  fs::remove(point() / "var" / "spool" / "big");
  // Room again once the file goes; the mount still reads.
  std::ofstream(point() / "etc" / "new") << "written\n";
  EXPECT_EQ(slurp(upper / "etc" / "new"), "written\n");
  EXPECT_EQ(slurp(point() / "usr" / "bin" / "tool"), "#!/bin/sh\necho tool\n");
  umount();
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_TRUE(fs::is_empty(shm.path)) << "the writes' tmpfs outlived umount";

  // A cap that leaves nothing for the writes: one line naming --max-memory and --writable, nothing mounted.
  const RunResult small = pull(args("25M"));
  EXPECT_EQ(small.status, 2) << small.err;
  EXPECT_EQ(testing::lines(small.err).size(), 1u) << small.err;
  EXPECT_NE(small.err.find("--max-memory"), std::string::npos) << small.err;
  EXPECT_NE(small.err.find("--writable"), std::string::npos) << small.err;
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_TRUE(fs::is_empty(shm.path));
  EXPECT_TRUE(oci::mounted_source(fs::canonical(point())).empty());
  EXPECT_EQ(pull({"rm", j["dir"].get<std::string>(), "-q"}).status, 0);
}

// rm DIR takes a lazy mount's whole footprint: the layout, its span cache
// and its memory store with a --writable mount's upper directory in it.
// prune takes the layouts of mounts by REF once unmounted (kept while
// mounted) and what a mount by REF cut short left; nothing stays behind.
TEST_F(Lazy, RmAndPruneLeaveNothingOfLazyMountsBehind) {
  const std::string ref = registry_->host() + "/" + kImage + ":v1";
  const fs::path shm = out_ / "shm";
  fs::create_directories(shm);
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + (out_ / "full").string(), "--plain-http", "-q"}).status, 0);
  ASSERT_EQ(pull({"index", (out_ / "full").string(), "--span", kSpan, "-q"}).status, 0);
  const fs::path dir = out_ / "hot";
  const RunResult hot = pull({"pull", ref, "--output", "oci:" + dir.string(), "--plain-http", "--cold", "lazy", "--hot",
                              "0", "--memory-dir", shm.string(), "-q"});
  ASSERT_EQ(hot.status, 0) << hot.err;
  fs::copy(out_ / "full" / oci::kIndexDir, dir / oci::kIndexDir);
  fs::create_directories(point());
  MOUNT_WITH_OR_SKIP(
      j, (std::vector<std::string>{"mount", dir.string(), point().string(), "--lazy", "--writable", "--json"}));
  const fs::path upper = j["upper"].get<std::string>();
  ASSERT_EQ(std::distance(fs::directory_iterator(shm), fs::directory_iterator()), 1);
  const fs::path store = *fs::directory_iterator(shm);
  EXPECT_EQ(upper.string().rfind(store.string(), 0), 0u) << upper << " is not in the memory store " << store;
  // The hot layer is read from the memory store: nothing fetched, nothing in the span cache for it.
  ASSERT_EQ(j["layers"].size(), 3u) << j;
  EXPECT_EQ(j["layers"][0]["hot"], true) << j;
  EXPECT_EQ(j["layers"][0]["local"], true) << j;
  const auto fetched = [&] {
    auto s = oci::read_lazy_stats(dir);
    return s ? s->bytes_fetched : -1;
  };
  EXPECT_EQ(slurp(point() / "usr" / "big"), testing::random_bytes(700000, 3));
  EXPECT_EQ(fetched(), 0) << "a hot layer's file came from the registry";
  EXPECT_EQ(slurp(point() / "lib" / "text"), std::string(200000, 'x'));  // a cold layer: into the span cache
  EXPECT_GT(fetched(), 0);
  std::ofstream(point() / "written") << "upper\n";
  EXPECT_FALSE(fs::is_empty(dir / oci::kLazyCacheDir));
  const RunResult busy = pull({"rm", dir.string()});
  EXPECT_EQ(busy.status, 2) << busy.err;
  umount();
  const RunResult removed = pull({"rm", dir.string(), "--json"});
  ASSERT_EQ(removed.status, 0) << removed.err;
  const Json r = Json::parse(removed.out);
  ASSERT_EQ(r["removed"].size(), 2u) << r;
  EXPECT_EQ(r["removed"][0]["path"], store.string()) << r;
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_TRUE(fs::is_empty(shm));

  // Mounted by REF: prune keeps the layout while it is mounted, and takes it after.
  const fs::path cache = out_ / "lazy-cache";
  MOUNT_WITH_OR_SKIP(byref, (std::vector<std::string>{"mount", "--lazy", ref, point().string(), "--cache",
                                                      cache.string(), "--plain-http", "--json"}));
  EXPECT_EQ(slurp(point() / "etc" / "os-release"), "ID=lazy\n");
  const fs::path cut_short = cache / "lazy" / "cut-short";  // a mount by REF killed before its layout was made
  fs::create_directories(cut_short / "blobs" / "sha256");
  const auto prune = [&] {
    const RunResult p = pull({"prune", "--memory-dir", shm.string(), "--cache", cache.string(), "--json"});
    EXPECT_EQ(p.status, 0) << p.err;
    return Json::parse(p.out, nullptr, false);
  };
  const Json first = prune();
  ASSERT_TRUE(first.is_object());
  ASSERT_EQ(first["removed"].size(), 1u) << first;
  EXPECT_EQ(first["removed"][0]["path"], cut_short.string()) << first;
  ASSERT_EQ(first["kept"].size(), 1u) << first;
  EXPECT_NE(first["kept"][0].get<std::string>().find("mounted"), std::string::npos) << first;
  EXPECT_EQ(lazy_layouts(cache), 1u);
  umount();
  const Json second = prune();
  ASSERT_TRUE(second.is_object());
  ASSERT_EQ(second["removed"].size(), 1u) << second;
  EXPECT_EQ(second["removed"][0]["path"], byref["dir"]) << second;
  EXPECT_EQ(lazy_layouts(cache), 0u);
  EXPECT_TRUE(fs::is_empty(shm));
  const RunResult nothing = pull({"prune", "--memory-dir", shm.string(), "--cache", cache.string()});
  EXPECT_NE(nothing.out.find("nothing to prune"), std::string::npos) << nothing.out;
}

// Without indexes in the registry, mount --lazy REF fetches the layers it
// cannot seek whole, indexes them, and says so.
TEST_F(Lazy, MountByRefWithoutPushedIndexesBuildsThem) {
  fs::create_directories(point());
  const fs::path cache = out_ / "cache";
  MOUNT_WITH_OR_SKIP(
      j, (std::vector<std::string>{"mount", "--lazy", registry_->host() + "/" + kImage + ":v1", point().string(),
                                   "--cache", cache.string(), "--plain-http", "--json"}));
  ASSERT_EQ(j["layers"].size(), 3u) << j;
  for (const auto& l : j["layers"]) {
    EXPECT_EQ(l["local"], true) << l;
    EXPECT_EQ(l["index_from"], "built") << l;
    EXPECT_NE(l["note"].get<std::string>().find("no index"), std::string::npos) << l;
  }
  EXPECT_EQ(slurp(point() / "lib" / "runtime.so"), testing::random_bytes(150000, 7));
  EXPECT_FALSE(fs::exists(point() / "old"));
  umount();
  EXPECT_EQ(pull({"rm", j["dir"].get<std::string>(), "-q"}).status, 0);
  EXPECT_EQ(lazy_layouts(cache), 0u);
}

// A tag the registry does not have: exit 3 in one line, nothing mounted,
// no layout left; a REF without --lazy and --cache without REF are usage errors.
TEST_F(Lazy, MountByABadRefFailsCleanly) {
  fs::create_directories(point());
  const fs::path cache = out_ / "cache";
  const RunResult r = pull({"mount", "--lazy", registry_->host() + "/" + kImage + ":nosuchtag", point().string(),
                            "--cache", cache.string(), "--plain-http", "--retries", "0"});
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_EQ(testing::lines(r.err).size(), 1u) << r.err;
  EXPECT_NE(r.err.find("nosuchtag"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_EQ(lazy_layouts(cache), 0u);
  EXPECT_TRUE(oci::mounted_source(fs::canonical(point())).empty());

  // A registry that is not there: exit 4, and nothing left either.
  const RunResult gone = pull({"mount", "--lazy", "127.0.0.1:1/none/app:v1", point().string(), "--cache",
                               cache.string(), "--plain-http", "--retries", "0"});
  EXPECT_EQ(gone.status, 4) << gone.err;
  EXPECT_EQ(testing::lines(gone.err).size(), 1u) << gone.err;
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_EQ(lazy_layouts(cache), 0u);

  // A mount point that is not a directory is refused before anything is fetched.
  const RunResult no_point = pull({"mount", "--lazy", registry_->host() + "/" + kImage + ":v1",
                                   (out_ / "nowhere").string(), "--cache", cache.string(), "--plain-http"});
  EXPECT_EQ(no_point.status, 2) << no_point.err;
  EXPECT_EQ(lazy_layouts(cache), 0u);

  // --writable with a --memory-dir that is not there: refused, one line naming it, nothing left.
  fs::create_directories(point());
  const RunResult no_store =
      pull({"mount", "--lazy", registry_->host() + "/" + kImage + ":v1", point().string(), "--cache", cache.string(),
            "--plain-http", "--writable", "--memory-dir", (out_ / "no-shm").string()});
  EXPECT_EQ(no_store.status, 2) << no_store.err;
  EXPECT_EQ(testing::lines(no_store.err).size(), 1u) << no_store.err;
  EXPECT_NE(no_store.err.find("--memory-dir"), std::string::npos) << no_store.err;
  EXPECT_TRUE(fs::is_empty(point()));
  EXPECT_EQ(lazy_layouts(cache), 0u);
  EXPECT_TRUE(oci::mounted_source(fs::canonical(point())).empty());

  const RunResult not_lazy =
      pull({"mount", registry_->host() + "/" + kImage + ":v1", point().string(), "--cache", cache.string()});
  EXPECT_EQ(not_lazy.status, 2) << not_lazy.err;
  EXPECT_NE(not_lazy.err.find("--cache"), std::string::npos) << not_lazy.err;
}

/// A static busybox, or empty with the reason it cannot be used.
std::string static_busybox(std::string& why) {
  const std::string bytes = slurp("/bin/busybox");
  if (bytes.empty()) why = "/bin/busybox is not installed (Debian busybox-static)";
  // A dynamic executable names its loader; the container has no libc.
  else if (bytes.find("/lib64/ld-linux") != std::string::npos || bytes.find("/lib/ld-linux") != std::string::npos)
    why = "/bin/busybox is dynamically linked (install busybox-static)";
  return why.empty() ? bytes : "";
}

/// A real container (crun) whose root file system is the lazy mount, started
/// before its cold layers are fetched: busybox, in a cold layer, runs.
class LazyContainer : public ::testing::Test {
 protected:
  static constexpr const char* kRepository = "lazy/busybox";

  static void SetUpTestSuite() {
    if (!fs::exists(kRegistryBinary)) return;
    std::string why;
    const std::string busybox = static_busybox(why);
    if (busybox.empty()) return;
    using namespace cfmo::testing;
    // No proc, sys or dev: the mount supplies them. The program is in a cold
    // layer with 4 MiB that nothing reads.
    const std::string base = make_tar({dir("etc"), file("etc/message", "hello from a cold layer\n")});
    const std::string programs = make_tar(
        {dir("bin"), file("bin/busybox", busybox, 0755), dir("data"), file("data/unused", random_bytes(4u << 20, 11))});
    image_ = new FixtureImage(make_real_image({{base, "tar+gzip"}, {programs, "tar+gzip"}}));
    setup_error_ = start_suite_registry(registry_, kRepository, *image_);
  }
  static void TearDownTestSuite() { delete registry_; }

  void SetUp() override {
    if (!fs::exists(kRegistryBinary) || !fs::exists("/dev/fuse")) GTEST_SKIP() << "no docker-registry or no /dev/fuse";
    std::string why;
    if (static_busybox(why).empty()) GTEST_SKIP() << why;
    if (!fs::exists("/usr/bin/crun")) GTEST_SKIP() << "/usr/bin/crun is not installed (Debian crun)";
    if (::geteuid() != 0) GTEST_SKIP() << "crun runs a container with its own namespaces as root only here";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }
  void TearDown() override { expect_nothing_left(out_.path()); }

  /// Deletes the container and unmounts, whatever the test did.
  struct Guard {
    fs::path point;
    int pid = 0;
    fs::path state;
    std::string id;
    ~Guard() {
      if (!id.empty()) run({"/usr/bin/crun", "--root", state.string(), "delete", "--force", id}, 30);
      if (!point.empty()) ::umount2(point.c_str(), MNT_DETACH);
      if (pid > 0) ::kill(pid, SIGKILL);
    }
  };

  /// Runs busybox from the image at `point` in a crun container (read-only
  /// root, the runtime's own proc, dev and sys); `guard` deletes it whatever happens.
  RunResult run_container(const fs::path& point, Guard& guard) {
    // The bundle: the mount as a read-only root, the runtime's own proc, dev and sys on it.
    const fs::path bundle = out_ / "bundle";
    fs::create_directories(bundle);
    const Json config = {
        {"ociVersion", "1.0.2"},
        {"process",
         {{"terminal", false},
          {"user", {{"uid", 0}, {"gid", 0}}},
          {"args",
           {"/bin/busybox", "sh", "-c",
            "/bin/busybox cat /etc/message && /bin/busybox test -r /proc/self/status && echo proc"}},
          {"env", {"PATH=/bin"}},
          {"cwd", "/"},
          {"noNewPrivileges", true}}},
        {"root", {{"path", fs::canonical(point).string()}, {"readonly", true}}},
        {"hostname", "cfmo-lazy"},
        {"mounts", Json::array({{{"destination", "/proc"}, {"type", "proc"}, {"source", "proc"}},
                                {{"destination", "/dev"},
                                 {"type", "tmpfs"},
                                 {"source", "tmpfs"},
                                 {"options", {"nosuid", "strictatime", "mode=755", "size=65536k"}}},
                                {{"destination", "/sys"},
                                 {"type", "sysfs"},
                                 {"source", "sysfs"},
                                 {"options", {"nosuid", "noexec", "nodev", "ro"}}}})},
        {"linux",
         {{"namespaces",
           Json::array({{{"type", "pid"}}, {{"type", "ipc"}}, {{"type", "uts"}}, {{"type", "mount"}}})}}}};
    std::ofstream(bundle / "config.json") << config.dump(2);
    guard.state = out_ / "crun-state";
    guard.id = fmt::format("cfmo-pull-test-{}", ::getpid());
    // This machine mounts cgroup v1 controllers beside a v2 "unified" tree,
    // which crun refuses; in a mount namespace of its own the v2 tree is
    // unmounted and crun runs with no cgroup manager (nothing to limit here).
    const std::string crun = fmt::format(
        "if grep -q ' /sys/fs/cgroup/unified ' /proc/self/mountinfo; then umount /sys/fs/cgroup/unified; fi; "
        "exec /usr/bin/crun --cgroup-manager=disabled --root '{}' run --bundle '{}' '{}'",
        guard.state.string(), bundle.string(), guard.id);
    return run({"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", crun}, 60);
  }

  static oci::LazyStats stats(const fs::path& dir) {
    auto s = oci::read_lazy_stats(dir);
    return s ? *s : oci::LazyStats{};
  }

  /// Runs the container on the lazy mount of the pull in `dir` at `point`,
  /// checks its output and that only spans were fetched, and unmounts.
  void run_and_check(const fs::path& point, const fs::path& dir, Guard& guard) {
    const RunResult container = run_container(point, guard);
    EXPECT_EQ(container.status, 0) << container.err;
    EXPECT_EQ(container.out, "hello from a cold layer\nproc\n") << container.err;
    guard.id.clear();  // crun run deletes what it made

    // busybox and the message were fetched by spans; the 4 MiB nobody read was not.
    const auto fetched = stats(dir);
    EXPECT_EQ(fetched.errors, 0);
    EXPECT_GT(fetched.bytes_fetched, 0);
    int64_t image_bytes = 0;
    for (const auto& l : image_->layers) image_bytes += static_cast<int64_t>(l.size());
    EXPECT_LT(fetched.bytes_fetched, image_bytes - (int64_t{3} << 20))
        << "the unread file was fetched: " << fetched.bytes_fetched << " of " << image_bytes;

    const RunResult down = pull({"umount", point.string()});
    EXPECT_EQ(down.status, 0) << down.err;
    EXPECT_TRUE(fs::is_empty(point));
    guard.point.clear();
    for (int i = 0; i < 200 && ::kill(guard.pid, 0) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  TempDir out_;
  static inline Registry* registry_ = nullptr;
  static inline FixtureImage* image_ = nullptr;
  static inline std::string setup_error_;
};

TEST_F(LazyContainer, CrunRunsAProgramFromAColdLayerOfTheLazyMount) {
  const std::string ref = registry_->host() + "/" + kRepository + ":v1";
  const fs::path full = out_ / "full";
  const fs::path lazy = out_ / "lazy";
  const fs::path point = out_ / "rootfs";
  ASSERT_EQ(pull({"pull", ref, "--output", "oci:" + full.string(), "--plain-http", "-q"}).status, 0);
  // Spans of 256 KiB: busybox's spans hold little of the file after it.
  const RunResult pushed = pull({"index", full.string(), "--push", "--span", "256K", "-q"});
  ASSERT_EQ(pushed.status, 0) << pushed.err;
  const RunResult pulled =
      pull({"pull", ref, "--output", "oci:" + lazy.string(), "--plain-http", "--cold", "lazy", "-q"});
  ASSERT_EQ(pulled.status, 0) << pulled.err;
  fs::create_directories(point);
  const RunResult mounted = pull({"mount", lazy.string(), point.string(), "--lazy", "--json"});
  if (mounted.status == 2 && mounted.err.find("FUSE mount failed") != std::string::npos) {
    GTEST_SKIP() << "FUSE mounts are not allowed";
  }
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  Guard guard;
  guard.point = point;
  guard.pid = Json::parse(mounted.out).value("pid", 0);
  ASSERT_EQ(stats(lazy).bytes_fetched, 0) << "fetched before the container started";

  run_and_check(point, lazy, guard);
  EXPECT_EQ(fs::exists(guard.state) ? std::distance(fs::directory_iterator(guard.state), fs::directory_iterator()) : 0,
            0)
      << "crun left state behind";
  EXPECT_EQ(pull({"rm", lazy.string(), "-q"}).status, 0);
  EXPECT_EQ(pull({"rm", full.string(), "-q"}).status, 0);
}

// The same container on `mount --lazy REF`: no pull before it, the indexes
// from the registry, busybox fetched by spans as crun starts it.
TEST_F(LazyContainer, CrunRunsAProgramFromALazyMountOfARef) {
  const std::string ref = registry_->host() + "/" + kRepository + ":v1";
  const RunResult pushed =
      pull({"index", ref, "--push", "--span", "256K", "--plain-http", "--cache", (out_ / "scratch").string(), "-q"});
  ASSERT_EQ(pushed.status, 0) << pushed.err;
  const fs::path point = out_ / "rootfs";
  const fs::path cache = out_ / "cache";
  fs::create_directories(point);
  const RunResult mounted =
      pull({"mount", "--lazy", ref, point.string(), "--cache", cache.string(), "--plain-http", "--json"});
  if (mounted.status == 2 && mounted.err.find("FUSE mount failed") != std::string::npos) {
    GTEST_SKIP() << "FUSE mounts are not allowed";
  }
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  const Json j = Json::parse(mounted.out);
  Guard guard;
  guard.point = point;
  guard.pid = j.value("pid", 0);
  const fs::path dir = j["dir"].get<std::string>();
  ASSERT_EQ(stats(dir).bytes_fetched, 0) << "fetched before the container started";

  run_and_check(point, dir, guard);
  EXPECT_EQ(pull({"rm", dir.string(), "-q"}).status, 0);
  EXPECT_TRUE(fs::is_empty(cache / "lazy"));
}

/// The largest VmHWM seen of each process, sampled every 10 ms while it
/// lives: the background fetch ends before anyone can read its own figure.
class PeakSampler {
 public:
  explicit PeakSampler(std::vector<int> pids) : pids_(std::move(pids)), peaks_(pids_.size(), 0) {
    thread_ = std::thread([this] {
      while (!stop_) {
        for (size_t i = 0; i < pids_.size(); ++i) peaks_[i] = std::max(peaks_[i], hwm_bytes(pids_[i]));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  ~PeakSampler() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int64_t peak(size_t i) const { return peaks_[i]; }

  /// A process's VmHWM in bytes, or 0 once it is gone.
  static int64_t hwm_bytes(int pid) {
    const std::string status = slurp(fmt::format("/proc/{}/status", pid));
    const auto at = status.find("VmHWM:");
    return at == std::string::npos ? 0 : std::stoll(status.substr(at + 6)) * 1024;
  }

 private:
  std::vector<int> pids_;
  std::vector<int64_t> peaks_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The memory bound, on an image four times the cap (the `slow`
// suite runs it: 256 MiB of files): mount --lazy REF --background with
// --max-memory 96M and a span cache of 64M, every file read through the
// mount while the background fetch turns it into a local copy. The daemon
// stays under 64 MB, and the daemon and the fetch together under the cap
// (the fetch's share is what the mount set aside for it); every byte read
// is the file's, the span cache stays in its size, and nothing is left.
TEST(LazyRss, EveryFileOfAnImageLargerThanTheCapReadThroughTheMountWithItsFetcher) {
  if (!fs::exists(kRegistryBinary) || !fs::exists("/dev/fuse")) GTEST_SKIP() << "no docker-registry or no /dev/fuse";
  Registry registry;
  ASSERT_TRUE(registry.start()) << registry.log();
  // Two gzip layers of 16 files of 8 MiB each, half of them random, half text.
  std::map<std::string, std::string> files;
  std::vector<RealLayer> layers;
  for (int l = 0; l < 2; ++l) {
    std::vector<testing::TarEntry> entries = {testing::dir(fmt::format("layer{}", l))};
    for (int f = 0; f < 16; ++f) {
      const std::string path = fmt::format("layer{}/file{:02}", l, f);
      std::string bytes;
      if (f % 2 == 0) {
        bytes = testing::random_bytes(size_t{8} << 20, static_cast<uint64_t>(100 + l * 16 + f));
      } else {
        bytes.reserve(size_t{8} << 20);
        for (uint64_t k = 0; bytes.size() < (size_t{8} << 20); ++k)
          bytes += fmt::format("{:010} {:x}\n", k, k * 2654435761u);
        bytes.resize(size_t{8} << 20);
      }
      entries.push_back(testing::file(path, bytes));
      files[path] = std::move(bytes);
    }
    layers.push_back({testing::make_tar(entries), "tar+gzip", 0, 1});
  }
  FixtureImage image = make_real_image(layers);
  layers.clear();
  ASSERT_TRUE(push_image(registry, "big/lazy", "v1", image)) << registry.log();
  image.layers.clear();
  TempDir out;
  const std::string ref = registry.host() + "/big/lazy:v1";
  const RunResult pushed =
      pull({"index", ref, "--push", "--plain-http", "--cache", (out / "scratch").string(), "-q"}, 600);
  ASSERT_EQ(pushed.status, 0) << pushed.err;
  const fs::path point = out / "mnt";
  fs::create_directories(point);
  constexpr int64_t kCap = int64_t{96} << 20;
  const RunResult mounted =
      pull({"mount", "--lazy", ref, point.string(), "--cache", (out / "cache").string(), "--plain-http", "--max-memory",
            "96M", "--cache-size", "64M", "--background", "--json"});
  if (mounted.status == 2 && mounted.err.find("FUSE mount failed") != std::string::npos)
    GTEST_SKIP() << "FUSE mounts are not allowed";
  ASSERT_EQ(mounted.status, 0) << mounted.err;
  const Json j = Json::parse(mounted.out);
  struct Unmount {
    fs::path point;
    int pid = 0;
    ~Unmount() {
      ::umount2(point.c_str(), MNT_DETACH);
      if (pid > 0) ::kill(pid, SIGKILL);
    }
  } guard{point, j["pid"].get<int>()};
  ASSERT_TRUE(j["background_pid"].is_number()) << j;
  const int daemon = j["pid"].get<int>();
  const int fetcher = j["background_pid"].get<int>();
  const fs::path dir = j["dir"].get<std::string>();
  EXPECT_GT(j["fetcher_bytes"].get<int64_t>(), 0) << j;
  PeakSampler sampler({daemon, fetcher});

  std::string wrong;
  size_t read = 0;
  for (const auto& [path, bytes] : files) {
    if (slurp(point / path) != bytes) wrong += path + " ";
    ++read;
  }
  EXPECT_EQ(read, 32u);
  EXPECT_TRUE(wrong.empty()) << "wrong bytes: " << wrong;
  for (int i = 0; i < 6000 && PeakSampler::hwm_bytes(fetcher) > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(PeakSampler::hwm_bytes(fetcher), 0) << "the background fetch did not end";
  // Every file again, from the local blobs now.
  for (const auto& [path, bytes] : files) EXPECT_TRUE(slurp(point / path) == bytes) << path;
  sampler.stop();
  const int64_t daemon_peak = std::max(sampler.peak(0), PeakSampler::hwm_bytes(daemon));
  const int64_t fetcher_peak = sampler.peak(1);
  EXPECT_GT(fetcher_peak, 0);
  EXPECT_LT(daemon_peak, int64_t{64} << 20) << "the daemon's VmHWM";
  EXPECT_LE(daemon_peak + fetcher_peak, kCap) << "daemon " << daemon_peak << " + fetcher " << fetcher_peak;
  auto stats = oci::read_lazy_stats(dir);
  ASSERT_TRUE(stats) << stats.error().message;
  EXPECT_EQ(stats->errors, 0) << slurp(dir / oci::kLazyLogFile);
  EXPECT_LE(stats->cache_bytes, int64_t{64} << 20);
  const RunResult status = pull({"status", dir.string()});
  EXPECT_NE(status.out.find("layers    2 of 2 fetched"), std::string::npos) << status.out;
  RecordProperty("daemon_vmhwm_bytes", std::to_string(daemon_peak));
  RecordProperty("fetcher_vmhwm_bytes", std::to_string(fetcher_peak));
  std::cout << "daemon VmHWM " << (daemon_peak >> 20) << " MiB, background fetch " << (fetcher_peak >> 20)
            << " MiB (sampled), --max-memory 96M\n";
  const RunResult down = pull({"umount", point.string()});
  EXPECT_EQ(down.status, 0) << down.err;
  guard.pid = 0;
  EXPECT_EQ(pull({"rm", dir.string(), "-q"}).status, 0);
  expect_nothing_left(out.path());
}

}  // namespace
}  // namespace cfmo::pulltest
