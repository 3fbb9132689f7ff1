#include "oci/mount.h"

#include "core/dir_lock.h"
#include "oci/blob.h"
#include "oci/cleanup.h"
#include "oci/hot_set.h"
#include "oci/lazy_mount.h"
#include "oci/pull.h"
#include "oci/pull_state.h"
#include "oci/registry.h"
#include "oci/unpack.h"

#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMountSource = "cfmo-pull";  ///< how umount tells our mounts from others
constexpr int kCapSysAdmin = 21;

/// /proc/self/mountinfo's escapes (\040 for a space...) undone.
std::string unescape(const std::string& field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size()) {
      const std::string octal = field.substr(i + 1, 3);
      if (octal.size() == 3 && std::all_of(octal.begin(), octal.end(), [](char c) { return c >= '0' && c <= '7'; })) {
        out += static_cast<char>(std::stoi(octal, nullptr, 8));
        i += 3;
        continue;
      }
    }
    out += field[i];
  }
  return out;
}

struct MountEntry {
  fs::path point;
  std::string fstype;
  std::string source;
  std::string super_options;
};

std::vector<MountEntry> mounts() {
  std::vector<MountEntry> out;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string w; fields >> w;) f.push_back(w);
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || std::distance(dash, f.end()) < 4) continue;
    out.push_back({unescape(f[4]), *(dash + 1), unescape(*(dash + 2)), *(dash + 3)});
  }
  return out;
}

/// The last mount at `point` (the one a path lookup sees).
std::optional<MountEntry> mount_at(const fs::path& point) {
  std::optional<MountEntry> found;
  for (auto& m : mounts()) {
    if (m.point == point) found = std::move(m);
  }
  return found;
}

bool has_cap_sys_admin() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("CapEff:")) continue;
    const uint64_t caps = std::stoull(line.substr(7), nullptr, 16);
    return (caps >> kCapSysAdmin) & 1u;
  }
  return false;
}

bool kernel_has_overlay() {
  std::ifstream in("/proc/filesystems");
  std::string line;
  while (std::getline(in, line)) {
    if (line.ends_with("\toverlay") || line == "nodev\toverlay") return true;
  }
  return false;
}

/// The directory a layer is unpacked into under `root` (DIR, or the memory store).
fs::path layer_dir(const fs::path& root, WhiteoutMode mode, const std::string& digest) {
  return root / "layers" / (mode == WhiteoutMode::kOverlay ? "overlay" : "oci") / digest.substr(7);
}

/// Unpacks `blob` into `target` through a temporary sibling renamed at the end.
Result<UnpackStats> unpack_into(const fs::path& blob, const fs::path& target, const Descriptor& layer,
                                WhiteoutMode mode, const std::string& what) {
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  if (ec) {
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", target.parent_path().string(), ec.message());
  }
  const fs::path temp = target.string() + ".partial-" + std::to_string(::getpid());
  remove_tree(temp);
  if (::mkdir(temp.c_str(), 0755) != 0) {
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", temp.string(), std::strerror(errno));
  }
  CFMO_ASSIGN_OR_RETURN(const Compression compression, layer_compression(layer.media_type));
  UnpackOptions options;
  options.whiteouts = mode;
  auto stats = unpack_layer_file(blob, temp, compression, options, what);
  if (!stats) {
    remove_tree(temp);
    return stats;
  }
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    const int error = errno;
    remove_tree(temp);
    // Another mount unpacked the same layer meanwhile: theirs is as good.
    if ((error == ENOTEMPTY || error == EEXIST) && fs::is_directory(target)) return stats;
    return make_error(ErrorKind::kInternal, "'{}': cannot rename into place: {}", target.string(),
                      std::strerror(error));
  }
  return stats;
}

/// The directories a container runtime mounts over. A minimal image may
/// lack them, and on a read-only root the runtime cannot make them
/// (crun: "cannot mkdir proc").
constexpr std::array<std::pair<const char*, mode_t>, 3> kRuntimeMountPoints = {
    {{"proc", 0555}, {"sys", 0555}, {"dev", 0755}}};

/// DIR/layers/runtime: a layer of those directories, empty, for the bottom
/// of the stack, so that the image's own (with its modes) win where it has them.
Result<fs::path> runtime_mount_points(const fs::path& dir) {
  const fs::path base = dir / "layers" / "runtime";
  std::error_code ec;
  fs::create_directories(base, ec);
  if (ec) return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", base.string(), ec.message());
  for (const auto& [name, mode] : kRuntimeMountPoints) {
    const fs::path path = base / name;
    if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
      return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", path.string(), std::strerror(errno));
    }
    ::chmod(path.c_str(), mode);  // the umask may have narrowed it
  }
  return base;
}

std::string join_indices(const std::vector<size_t>& indices) {
  std::string out;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (i > 0) out += i + 1 == indices.size() ? " and " : ", ";
    out += std::to_string(indices[i]);
  }
  return out;
}

/// A lazy mount ends by its daemon: SIGTERM, then the mount is gone at once
/// and the daemon within its grace period. A daemon that died left a mount
/// that only answers ENOTCONN: detached here.
Status unmount_lazy(const fs::path& point, const std::string& source) {
  const int pid = lazy_mount_pid(source);
  if (pid <= 0 || !process_alive(pid) || ::kill(pid, SIGTERM) != 0) return detach_mount(point);
  for (int i = 0; i < 600 && process_alive(pid); ++i) ::usleep(50000);
  if (process_alive(pid)) {
    return make_error(ErrorKind::kInternal, "'{}': the mount's daemon (pid {}) did not end within 30 s", point.string(),
                      pid);
  }
  if (const auto still = mount_at(point); still && still->source == source) return detach_mount(point);
  return {};
}

}  // namespace

Status detach_mount(const fs::path& point) {
  if (::umount2(point.c_str(), MNT_DETACH) == 0) return {};
  if (errno != EPERM || ::geteuid() == 0) {
    return make_error(ErrorKind::kInternal, "'{}': umount failed: {}", point.string(), std::strerror(errno));
  }
  // fusermount3 unmounts only a FUSE mount whose user_id is the caller's.
  CFMO_ASSIGN_OR_RETURN(const int status, run_fusermount({"-u", "-q", "-z", "--", point.string()}));
  if (status != 0) {
    return make_error(ErrorKind::kUsage, "'{}': fusermount3 -u refused to unmount it (not this user's mount?)",
                      point.string());
  }
  return {};
}

Result<int> run_fusermount(const std::vector<std::string>& args, int comm_fd) {
  // The lazy mount's daemon blocks its stop signals; fusermount3 must not inherit that.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  std::vector<std::string> strings = {"fusermount3"};
  strings.insert(strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with("_FUSE_COMMFD=")) env_strings.emplace_back(*e);
  }
  if (comm_fd >= 0) env_strings.push_back("_FUSE_COMMFD=" + std::to_string(comm_fd));
  std::vector<char*> env;
  for (auto& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  pid_t child = 0;
  const int spawned = ::posix_spawnp(&child, argv[0], nullptr, &attr, argv.data(), env.data());
  posix_spawnattr_destroy(&attr);
  if (spawned != 0) {
    return make_error(ErrorKind::kUsage, "FUSE without root needs fusermount3 (Debian fuse3): {}",
                      std::strerror(spawned));
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string mount_unavailable_reason() {
  if (!kernel_has_overlay()) return "the kernel has no overlay file system (modprobe overlay)";
  if (!has_cap_sys_admin()) {
    return ::geteuid() == 0 ? "this process lacks CAP_SYS_ADMIN (a container without it)"
                            : "mounting needs root (CAP_SYS_ADMIN)";
  }
  return "";
}

UpperDir upper_dir_for(const fs::path& dir, const fs::path& store, const fs::path& point) {
  UpperDir u;
  u.base = (store.empty() ? dir / "layers" : store) / "rw" / sha256_digest(point.string()).substr(7, 12);
  u.upper = u.base / "upper";
  u.in_memory = !store.empty() && memory_backed(store);
  return u;
}

UpperDir mount_store_upper(const fs::path& dir, const fs::path& memory_dir, const fs::path& point) {
  UpperDir u;
  std::error_code ec;
  const fs::path store = memory_store_for(dir, fs::weakly_canonical(fs::absolute(memory_dir, ec), ec));
  u.base = store.parent_path() /
           fmt::format("{}-rw-{}", store.filename().string(), sha256_digest(point.string()).substr(7, 12));
  u.upper = u.base / "upper";
  u.in_memory = memory_backed(memory_dir);
  u.own_store = true;
  u.owner = dir;
  return u;
}

bool upper_in_use(const fs::path& base) {
  const std::string key = "upperdir=" + base.string() + "/";
  for (const auto& m : mounts()) {
    if (m.source == kMountSource && m.fstype == "overlay" && m.super_options.find(key) != std::string::npos) {
      return true;
    }
  }
  return false;
}

void remove_upper(const fs::path& base) {
  if (const auto m = mount_at(base); m && m->fstype == "tmpfs" && m->source == kMountSource) {
    ::umount2(base.c_str(), MNT_DETACH);
  }
  remove_tree(base);
}

void detach_unused_uppers(const fs::path& path) {
  const std::string under = path.string() + "/";
  for (const auto& m : mounts()) {
    if (m.fstype != "tmpfs" || m.source != kMountSource) continue;
    if (m.point != path && !m.point.string().starts_with(under)) continue;
    if (!upper_in_use(m.point)) ::umount2(m.point.c_str(), MNT_DETACH);
  }
}

namespace {

/// An empty upper and work directory, marked as ours (so umount may remove
/// them), in a tmpfs of their own when `u.bytes` is set; the overlay's option for them.
Result<std::string> make_upper(const UpperDir& u, const fs::path& point) {
  std::error_code ec;
  remove_upper(u.base);
  fs::create_directories(u.base, ec);
  if (ec) return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", u.base.string(), ec.message());
  if (u.bytes > 0) {
    const std::string size = fmt::format("size={},mode=0755", u.bytes);
    if (::mount(kMountSource, u.base.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, size.c_str()) != 0) {
      const int error = errno;
      remove_tree(u.base);
      return make_error(error == EPERM ? ErrorKind::kUsage : ErrorKind::kInternal,
                        "'{}': the tmpfs for --writable's writes ({}) failed: {}", u.base.string(), size,
                        std::strerror(error));
    }
  }
  fs::create_directories(u.upper, ec);
  fs::create_directories(u.base / "work", ec);
  if (ec) {
    remove_upper(u.base);
    return make_error(ErrorKind::kInternal, "'{}': cannot create: {}", u.base.string(), ec.message());
  }
  std::ofstream(u.base / kRwMarker) << point.string() << "\n";
  if (u.own_store) {
    if (auto marked = mark_memory_store(u.base, u.owner); !marked) {
      remove_upper(u.base);
      return marked.error();
    }
  }
  return ",upperdir=" + u.upper.string() + ",workdir=" + (u.base / "work").string();
}

}  // namespace

Status mount_writable_overlay(const fs::path& lower, const UpperDir& upper, const fs::path& point) {
  CFMO_ASSIGN_OR_RETURN(const std::string upper_option, make_upper(upper, point));
  const std::string data = "lowerdir=" + lower.string() + upper_option;
  if (::mount(kMountSource, point.c_str(), "overlay", 0, data.c_str()) != 0) {
    const int error = errno;
    remove_upper(upper.base);
    return make_error(error == EPERM || error == EACCES ? ErrorKind::kUsage : ErrorKind::kInternal,
                      "mount point '{}': the overlay for --writable failed: {}", point.string(), std::strerror(error));
  }
  return {};
}

Result<MountReport> mount_image(const fs::path& dir, const fs::path& mountpoint, const MountOptions& options) {
  MountReport report;
  CFMO_ASSIGN_OR_RETURN(const PullState state, read_state(dir));
  std::error_code ec;
  const fs::path point = fs::weakly_canonical(fs::absolute(mountpoint, ec), ec);
  if (!fs::is_directory(point, ec)) {
    return make_error(ErrorKind::kUsage, "mount point '{}': not a directory", mountpoint.string());
  }
  if (const auto existing = mount_at(point); existing && existing->source == kMountSource) {
    return make_error(ErrorKind::kUsage, "mount point '{}': a cfmo-pull image is mounted there already ({} umount {})",
                      mountpoint.string(), kMountSource, mountpoint.string());
  }
  std::vector<size_t> missing;
  std::vector<size_t> skipped;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    const auto& l = state.layers[i];
    if (l.status == LayerStatus::kSkipped) {
      skipped.push_back(i);
    } else if (l.status != LayerStatus::kFetched || !fs::exists(blob_path(dir, l.blob.digest))) {
      missing.push_back(i);
    }
  }
  if (!missing.empty() && !options.partial) {
    return make_error(ErrorKind::kUsage,
                      "'{}': layer{} {} {} not fetched yet ({} fetch {} brings them; --partial mounts the layers "
                      "there are, without their files)",
                      dir.string(), missing.size() == 1 ? "" : "s", join_indices(missing),
                      missing.size() == 1 ? "is" : "are", kMountSource, dir.string());
  }
  if (!skipped.empty()) {
    report.notes.push_back(fmt::format("layer{} {} left out (skipped by the pull)", skipped.size() == 1 ? "" : "s",
                                       join_indices(skipped)));
  }
  if (!missing.empty()) {
    report.notes.push_back(fmt::format("layer{} {} not fetched: mounted without {}", missing.size() == 1 ? "" : "s",
                                       join_indices(missing), missing.size() == 1 ? "it" : "them"));
  }

  // Overlay whiteouts (0:0 devices, trusted.* xattrs) need the privileges
  // a mount needs; without them the directories keep OCI's .wh. files.
  const std::string cannot_mount = mount_unavailable_reason();
  const WhiteoutMode mode = cannot_mount.empty() && running_as_root() ? WhiteoutMode::kOverlay : WhiteoutMode::kKeep;
  const fs::path store = state.memory_dir;
  int64_t memory_use = 0;
  if (!store.empty()) memory_use = tree_bytes(store);
  for (size_t i = 0; i < state.layers.size(); ++i) {
    if (std::find(missing.begin(), missing.end(), i) != missing.end() ||
        std::find(skipped.begin(), skipped.end(), i) != skipped.end()) {
      continue;
    }
    const auto& l = state.layers[i];
    MountedLayer m;
    m.index = i;
    m.digest = l.blob.digest;
    m.hot = l.hot;
    const std::string what = fmt::format("layer {} ({})", short_digest(l.blob.digest), i);
    const fs::path blob = blob_path(dir, l.blob.digest);
    const bool in_memory = l.hot && !store.empty() && fs::is_directory(store, ec);
    const fs::path memory_target = in_memory ? layer_dir(store, mode, l.blob.digest) : fs::path();
    const fs::path disk_target = layer_dir(dir, mode, l.blob.digest);
    if (in_memory && fs::is_directory(memory_target, ec)) {
      m.dir = memory_target;
      m.memory = true;
    } else if (fs::is_directory(disk_target, ec)) {
      m.dir = disk_target;
    } else if (in_memory) {
      CFMO_TRY(unpack_into(blob, memory_target, l.blob, mode, what));
      const int64_t bytes = tree_bytes(memory_target);
      if (memory_use + bytes > state.memory_capacity) {
        remove_tree(memory_target);
        const std::string sizes =
            fmt::format("hot layer {} unpacks to {}, and the memory store holds {} of {}", i, human_bytes(bytes),
                        human_bytes(memory_use), human_bytes(state.memory_capacity));
        if (!state.spill) {
          return make_error(ErrorKind::kUsage, "{} (pull with --spill to unpack it on disk instead)", sizes);
        }
        report.notes.push_back(sizes + ": unpacked on disk instead");
        CFMO_TRY(unpack_into(blob, disk_target, l.blob, mode, what));
        m.dir = disk_target;
      } else {
        memory_use += bytes;
        m.dir = memory_target;
        m.memory = true;
      }
      m.unpacked_now = true;
    } else {
      CFMO_TRY(unpack_into(blob, disk_target, l.blob, mode, what));
      m.dir = disk_target;
      m.unpacked_now = true;
    }
    m.bytes = tree_bytes(m.dir);
    report.layers.push_back(std::move(m));
  }
  report.memory_bytes = memory_use;

  if (!cannot_mount.empty()) {
    report.not_mounted = cannot_mount;
    return report;
  }
  // Short names for the lower directories (as docker's overlay2 does), so
  // the mount's options stay within a page for images of many layers.
  const fs::path links = dir / "layers" / "l";
  fs::create_directories(links, ec);
  std::vector<fs::path> lower;
  for (auto it = report.layers.rbegin(); it != report.layers.rend(); ++it) {  // the top layer first
    const fs::path link = links / std::to_string(it->index);
    fs::remove(link, ec);
    fs::create_symlink(fs::absolute(it->dir), link, ec);
    if (ec) return make_error(ErrorKind::kInternal, "'{}': cannot link: {}", link.string(), ec.message());
    lower.push_back(fs::absolute(link));
  }
  CFMO_ASSIGN_OR_RETURN(const fs::path runtime, runtime_mount_points(dir));
  lower.push_back(fs::absolute(runtime));
  // An overlay without an upper directory needs two lower ones.
  if (lower.size() < 2 && !options.writable) {
    const fs::path empty = dir / "layers" / "empty";
    fs::create_directories(empty, ec);
    lower.push_back(fs::absolute(empty));
  }
  std::string data = "lowerdir=";
  for (size_t i = 0; i < lower.size(); ++i) {
    if (i > 0) data += ':';
    data += lower[i].string();
  }
  unsigned long flags = MS_RDONLY;
  if (options.writable) {
    const UpperDir u = upper_dir_for(dir, store, point);
    CFMO_ASSIGN_OR_RETURN(const std::string upper_option, make_upper(u, point));
    data += upper_option;
    report.upper = u.upper;
    report.upper_in_memory = u.in_memory;
    flags = 0;
  }
  if (data.size() >= static_cast<size_t>(::getpagesize())) {
    return make_error(ErrorKind::kUsage, "'{}': {} layers are too many for one overlay mount's options ({} bytes)",
                      dir.string(), report.layers.size(), data.size());
  }
  if (::mount(kMountSource, point.c_str(), "overlay", flags, data.c_str()) != 0) {
    const int error = errno;
    if (error == EPERM || error == EACCES) {
      report.not_mounted = fmt::format("mount(2) refused: {}", std::strerror(error));
      return report;
    }
    return make_error(ErrorKind::kInternal, "mount point '{}': overlay mount failed: {}", mountpoint.string(),
                      std::strerror(error));
  }
  report.mounted = true;
  return report;
}

std::string mounted_source(const fs::path& point) {
  const auto entry = mount_at(point);
  return entry ? entry->source : std::string();
}

std::vector<std::string> mounts_using(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  const fs::path absolute = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  const std::string layers = (absolute / "layers").string() + "/";
  for (const auto& m : mounts()) {
    if (m.source == kMountSource && m.super_options.find(layers) != std::string::npos) out.push_back(m.point.string());
  }
  // A --writable lazy mount is both an overlay and a recorded daemon: named once.
  auto named = [&out](const std::string& p) { return std::find(out.begin(), out.end(), p) != out.end(); };
  for (const auto& record : fs::directory_iterator(absolute / kMountRecordDir, ec)) {
    int pid = 0;
    try {
      pid = std::stoi(record.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    std::ifstream in(record.path());
    std::string point;
    std::getline(in, point);
    if (pid > 0 && process_alive(pid) && mount_at(point) && !named(point)) out.push_back(point);
  }
  return out;
}

Status unmount_image(const fs::path& mountpoint) {
  std::error_code ec;
  // The mount point itself is not looked at: a FUSE mount whose daemon died answers ENOTCONN there.
  fs::path absolute = fs::absolute(mountpoint, ec).lexically_normal();
  if (absolute.has_parent_path() && absolute.filename().empty()) absolute = absolute.parent_path();
  fs::path point = fs::weakly_canonical(absolute.parent_path(), ec) / absolute.filename();
  if (std::error_code link_ec; fs::is_symlink(point, link_ec)) point = fs::weakly_canonical(point, ec);
  const auto entry = mount_at(point);
  if (!entry) return make_error(ErrorKind::kUsage, "'{}': nothing is mounted there", mountpoint.string());
  if (entry->fstype == std::string("fuse.") + kLazySubtype) return unmount_lazy(point, entry->source);
  if (entry->source != kMountSource || entry->fstype != "overlay") {
    return make_error(ErrorKind::kUsage, "'{}': not a cfmo-pull mount ({} from {})", mountpoint.string(), entry->fstype,
                      entry->source);
  }
  if (::umount2(point.c_str(), 0) != 0) {
    const int error = errno;
    if (error == EBUSY) {
      return make_error(ErrorKind::kInternal, "'{}': busy (a process still uses it): {}", mountpoint.string(),
                        std::strerror(error));
    }
    if (error == EPERM) {
      return make_error(ErrorKind::kUsage, "'{}': unmounting needs root (CAP_SYS_ADMIN)", mountpoint.string());
    }
    return make_error(ErrorKind::kInternal, "'{}': umount failed: {}", mountpoint.string(), std::strerror(error));
  }
  // The writes of a --writable mount lived in its upper directory; they go with it.
  const std::string key = "upperdir=";
  if (const auto at = entry->super_options.find(key); at != std::string::npos) {
    const auto end = entry->super_options.find(',', at);
    const fs::path upper =
        unescape(entry->super_options.substr(at + key.size(), end == std::string::npos ? end : end - at - key.size()));
    if (fs::exists(upper.parent_path() / kRwMarker, ec)) remove_upper(upper.parent_path());
  }
  // Over a lazy mount (--lazy --writable), its daemon goes too.
  const std::string lower_key = "lowerdir=";
  if (const auto at = entry->super_options.find(lower_key); at != std::string::npos) {
    const auto end = entry->super_options.find(',', at);
    const fs::path lower = unescape(entry->super_options.substr(
        at + lower_key.size(), end == std::string::npos ? end : end - at - lower_key.size()));
    if (const auto below = mount_at(lower); below && below->fstype == std::string("fuse.") + kLazySubtype) {
      CFMO_TRY(unmount_lazy(lower, below->source));
      fs::remove(lower, ec);
    }
  }
  return {};
}

}  // namespace cfmo::oci
