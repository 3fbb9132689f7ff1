// Layer extraction. libarchive reads the tar; every entry is written here,
// relative to a directory fd of the root, never through a path string that
// the kernel could resolve out of it:
//
// - names are cleaned lexically first: absolute paths and `..` are refused,
//   `.` and empty components dropped;
// - an entry's parent directory is opened with openat2(RESOLVE_BENEATH |
//   RESOLVE_NO_SYMLINKS) (or, where the kernel lacks openat2, one
//   O_NOFOLLOW component at a time), so a symlink anywhere above the entry,
//   one planted by an earlier entry or layer included, is an error rather
//   than a detour; image builders write real paths, never through symlinks;
// - the entry itself is created with O_EXCL/O_NOFOLLOW semantics (a symlink
//   or file in the way is removed first, never followed), hard links are
//   linkat() between two such parents, and removals (whiteouts, entries
//   replaced) use unlinkat on fds as well.
//
// libarchive's archive_write_disk with ARCHIVE_EXTRACT_SECURE_* would do
// per-component lstat() checks on path strings; it knows nothing of
// whiteouts, and its error messages name neither layer nor rule, so this
// module does the writing itself and keeps libarchive for what it is best at:
// parsing every tar dialect (ustar, pax, GNU long names, sparse files).
#include "oci/unpack.h"

#include "core/fd.h"
#include "oci/decompress.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

/// A name as it may appear in a one-line message: control bytes replaced, long ones cut.
std::string shown(std::string_view name) {
  std::string out;
  for (const char c : name.substr(0, 200)) out.push_back(static_cast<unsigned char>(c) < 0x20 ? '?' : c);
  if (name.size() > 200) out += "…";
  return out;
}

std::string_view dirname_of(std::string_view path) {
  const auto slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string_view{} : path.substr(0, slash);
}

std::string_view basename_of(std::string_view path) {
  const auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

size_t depth_of(std::string_view path) {
  return path.empty() ? 0 : 1 + static_cast<size_t>(std::count(path.begin(), path.end(), '/'));
}

std::atomic<bool> openat2_missing{false};  // set once when the kernel (or a seccomp filter) refuses openat2

/// Opens `path` (relative, cleaned) beneath `root` without following any
/// symlink; -1 with errno on failure, ENOSYS where openat2 is unavailable.
int open_beneath(int root, const std::string& path, int flags) {
  if (path.empty()) return ::openat(root, ".", flags | O_CLOEXEC);
  if (!openat2_missing) {
    open_how how{};
    how.flags = static_cast<uint64_t>(flags | O_CLOEXEC | O_NOFOLLOW);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    const long fd = ::syscall(SYS_openat2, root, path.c_str(), &how, sizeof how);
    if (fd >= 0) return static_cast<int>(fd);
    if (errno != ENOSYS && errno != EPERM && errno != E2BIG) return -1;
    openat2_missing = true;
  }
  // One component at a time, none of them followed if it is a symlink.
  Fd current(::openat(root, ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!current) return -1;
  size_t start = 0;
  while (true) {
    const size_t slash = path.find('/', start);
    const std::string component = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    const bool last = slash == std::string::npos;
    const int next =
        ::openat(current.get(), component.c_str(), (last ? flags : O_PATH | O_DIRECTORY) | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) return -1;
    // O_PATH | O_NOFOLLOW opens a symlink itself: refuse anything but a directory.
    struct stat st;
    if (::fstat(next, &st) != 0 || !S_ISDIR(st.st_mode)) {
      const bool link = S_ISLNK(st.st_mode);
      ::close(next);
      errno = link ? ELOOP : ENOTDIR;
      return -1;
    }
    current.reset(next);
    if (last) break;
    start = slash + 1;
  }
  return current.release();
}

struct DirFix {
  bool from_tar = false;  ///< the tar gave its mode and times; else its times before this layer are restored
  mode_t mode = 0;
  timespec times[2]{};
};

/// The bytes libarchive reads: decompressed blocks from a Decoder.
struct ReadContext {
  Decoder* decoder = nullptr;
  std::optional<Error> error;
  int64_t uncompressed = 0;
};

la_ssize_t read_callback(archive* a, void* data, const void** buffer) {
  auto* ctx = static_cast<ReadContext*>(data);
  auto block = ctx->decoder->read();
  if (!block) {
    archive_set_error(a, EIO, "%s", block.error().message.c_str());
    ctx->error = std::move(block).error();
    return -1;
  }
  *buffer = block->data();
  ctx->uncompressed += static_cast<int64_t>(block->size());
  return static_cast<la_ssize_t>(block->size());
}

class Extractor {
 public:
  Extractor(int root, const UnpackOptions& options, const std::string& what)
      : root_(root), options_(options), what_(what), root_user_(running_as_root()) {}

  Status run(Decoder& decoder, UnpackStats& stats) {
    ReadContext ctx;
    ctx.decoder = &decoder;
    archive* a = archive_read_new();
    if (a == nullptr) return make_error(ErrorKind::kInternal, "{}: libarchive failed to start", what_);
    struct Closer {
      archive* a;
      ~Closer() { archive_read_free(a); }
    } closer{a};
    archive_read_support_format_tar(a);
    auto archive_error = [&](const char* doing) -> Error {
      if (ctx.error) return *ctx.error;
      const char* message = archive_error_string(a);
      return {ErrorKind::kInput, fmt::format("{}: not a valid tar stream ({}: {})", what_, doing,
                                             message != nullptr ? message : "unknown error")};
    };
    if (archive_read_open(a, &ctx, nullptr, read_callback, nullptr) != ARCHIVE_OK) return archive_error("open");
    Status status;
    while (true) {
      archive_entry* entry = nullptr;
      const int rc = archive_read_next_header(a, &entry);
      if (rc == ARCHIVE_EOF) break;
      if (rc != ARCHIVE_OK && rc != ARCHIVE_WARN) {
        status = archive_error("header");
        break;
      }
      ++stats.entries;
      status = extract(a, entry, stats);
      if (!status) {
        if (ctx.error) status = *ctx.error;  // the stream failed under the entry's data
        break;
      }
    }
    if (status) status = finish_dirs();
    if (!status) return status;
    // What follows the end-of-archive blocks (padding) is read too, so the
    // compressed stream's trailer and checksum are checked.
    while (true) {
      auto block = decoder.read();
      if (!block) return std::move(block).error();
      if (block->empty()) break;
      ctx.uncompressed += static_cast<int64_t>(block->size());
    }
    stats.uncompressed_bytes = ctx.uncompressed;
    stats.compressed_bytes = decoder.compressed_bytes();
    return {};
  }

 private:
  Error input_error(const char* raw, std::string_view problem) const {
    return {ErrorKind::kInput, fmt::format("{}: entry '{}': {}", what_, shown(raw), problem)};
  }
  Error system_error(const char* raw, std::string_view doing) const {
    return {ErrorKind::kInternal,
            fmt::format("{}: entry '{}': {} failed: {}", what_, shown(raw), doing, std::strerror(errno))};
  }

  /// Lexical cleaning: no absolute paths, no `..`; `.` and empty components
  /// dropped. `raw` is the name cleaned; `entry` the entry it belongs to
  /// (itself unless `raw` is a hard link's target), which a refusal names.
  Result<std::string> clean(const char* raw, const char* role, const char* entry = nullptr) const {
    if (raw == nullptr) return make_error(ErrorKind::kInput, "{}: an entry has no {}", what_, role);
    if (entry == nullptr) entry = raw;
    const std::string_view name(raw);
    const std::string named = entry == raw ? std::string(role) : fmt::format("{} '{}'", role, shown(raw));
    if (name.starts_with('/')) return input_error(entry, fmt::format("absolute {}; refused", named));
    std::string out;
    size_t start = 0;
    while (start <= name.size()) {
      size_t slash = name.find('/', start);
      if (slash == std::string_view::npos) slash = name.size();
      const std::string_view component = name.substr(start, slash - start);
      if (component == "..") return input_error(entry, fmt::format("'..' in the {}; refused", named));
      if (!component.empty() && component != ".") {
        if (!out.empty()) out.push_back('/');
        out.append(component);
      }
      start = slash + 1;
    }
    return out;
  }

  /// Opens (and, with `create`, makes) directory `dir` beneath the root one
  /// component at a time, naming the component that is a symlink or a file.
  Result<Fd> walk(const std::string& dir, const char* raw, bool create) {
    Fd current(::openat(root_, ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!current) return system_error(raw, "opening the root");
    std::string so_far;
    size_t start = 0;
    while (start < dir.size()) {
      size_t slash = dir.find('/', start);
      if (slash == std::string::npos) slash = dir.size();
      const std::string component = dir.substr(start, slash - start);
      const std::string parent = so_far;
      if (!so_far.empty()) so_far.push_back('/');
      so_far += component;
      start = slash + 1;
      for (int attempt = 0;; ++attempt) {
        struct stat st;
        if (::fstatat(current.get(), component.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
          if (S_ISLNK(st.st_mode)) {
            return input_error(raw, fmt::format("'{}' is a symlink; writing through it is refused", shown(so_far)));
          }
          if (!S_ISDIR(st.st_mode)) return input_error(raw, fmt::format("'{}' is not a directory", shown(so_far)));
          Fd next(::openat(current.get(), component.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
          if (!next) return system_error(raw, fmt::format("opening '{}'", shown(so_far)));
          current = std::move(next);
          break;
        }
        if (errno != ENOENT) return system_error(raw, fmt::format("stat of '{}'", shown(so_far)));
        if (!create) return Fd();
        if (attempt > 0) return system_error(raw, fmt::format("creating '{}'", shown(so_far)));
        touch(parent, current.get());
        if (::mkdirat(current.get(), component.c_str(), 0755) != 0 && errno != EEXIST) {
          return system_error(raw, fmt::format("creating '{}'", shown(so_far)));
        }
        created(so_far);
      }
    }
    return current;
  }

  /// The O_PATH fd of `path`'s parent directory (cached while entries share
  /// it); with `create`, missing directories are made; without, an absent
  /// parent is -1.
  Result<int> parent_of(const std::string& path, const char* raw, bool create) {
    const std::string_view dir = dirname_of(path);
    if (cached_fd_ && cached_dir_ == dir) return cached_fd_.get();
    std::string dir_string(dir);
    Fd fd(open_beneath(root_, dir_string, O_PATH | O_DIRECTORY));
    if (!fd) {
      CFMO_ASSIGN_OR_RETURN(fd, walk(dir_string, raw, create));
      if (!fd) return -1;
    }
    touch(dir_string, fd.get());
    cached_fd_ = std::move(fd);
    cached_dir_ = std::move(dir_string);
    return cached_fd_.get();
  }

  /// Remembers a directory's times before this layer changes its content, to
  /// restore them at the end (umoci does the same), unless the tar sets them.
  void touch(const std::string& dir, int fd) {
    if (dirs_.count(dir) != 0) return;
    struct stat st;
    if (::fstat(fd, &st) != 0) return;
    DirFix fix;
    fix.times[0] = st.st_atim;
    fix.times[1] = st.st_mtim;
    dirs_.emplace(dir, fix);
  }

  /// Paths this layer wrote (kApply): an opaque directory keeps them.
  void created(std::string_view path) {
    if (options_.whiteouts == WhiteoutMode::kApply) created_.push_back(XXH3_64bits(path.data(), path.size()));
  }
  bool was_created(std::string_view path) {
    if (sorted_ != created_.size()) {
      std::sort(created_.begin(), created_.end());
      created_.erase(std::unique(created_.begin(), created_.end()), created_.end());
      sorted_ = created_.size();
    }
    return std::binary_search(created_.begin(), created_.end(), XXH3_64bits(path.data(), path.size()));
  }

  /// Removes `name` in `parent`, a whole tree if it is a directory, without following symlinks.
  Status remove_tree(int parent, const std::string& name, const char* raw) {
    struct stat st;
    if (::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return {};
      return system_error(raw, fmt::format("stat of '{}'", shown(name)));
    }
    if (!S_ISDIR(st.st_mode)) {
      if (::unlinkat(parent, name.c_str(), 0) != 0 && errno != ENOENT) {
        return system_error(raw, fmt::format("removing '{}'", shown(name)));
      }
      return {};
    }
    Fd dir(::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!dir && errno == EACCES && ::fchmodat(parent, name.c_str(), 0700, 0) == 0) {
      dir.reset(::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    }
    if (!dir) return system_error(raw, fmt::format("opening '{}'", shown(name)));
    if ((st.st_mode & 0300) != 0300 && !root_user_) ::fchmod(dir.get(), 0700);
    CFMO_ASSIGN_OR_RETURN(const auto children, list(dir.get(), raw));
    for (const auto& child : children) CFMO_TRY(remove_tree(dir.get(), child, raw));
    dir.reset();
    if (::unlinkat(parent, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      return system_error(raw, fmt::format("removing '{}'", shown(name)));
    }
    return {};
  }

  Result<std::vector<std::string>> list(int dir, const char* raw) {
    const int copy = ::openat(dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR* d = copy < 0 ? nullptr : ::fdopendir(copy);
    if (d == nullptr) {
      if (copy >= 0) ::close(copy);
      return system_error(raw, "listing a directory");
    }
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
    }
    ::closedir(d);
    return names;
  }

  /// An opaque directory (kApply): everything below it that this layer did
  /// not write goes. Returns whether anything was kept.
  Result<bool> clear_lower(int dir, const std::string& prefix, const char* raw) {
    CFMO_ASSIGN_OR_RETURN(const auto children, list(dir, raw));
    bool kept = false;
    for (const auto& name : children) {
      const std::string path = prefix.empty() ? name : prefix + "/" + name;
      struct stat st;
      if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      const bool ours = was_created(path);
      if (S_ISDIR(st.st_mode)) {
        Fd child(::openat(dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!child) return system_error(raw, fmt::format("opening '{}'", shown(path)));
        touch(path, child.get());
        CFMO_ASSIGN_OR_RETURN(const bool kept_below, clear_lower(child.get(), path, raw));
        if (ours || kept_below) {
          kept = true;
        } else if (::unlinkat(dir, name.c_str(), AT_REMOVEDIR) != 0) {
          return system_error(raw, fmt::format("removing '{}'", shown(path)));
        }
      } else if (ours) {
        kept = true;
      } else if (::unlinkat(dir, name.c_str(), 0) != 0 && errno != ENOENT) {
        return system_error(raw, fmt::format("removing '{}'", shown(path)));
      }
    }
    return kept;
  }

  Status whiteout(const std::string& path, std::string_view base, const char* raw) {
    const bool opaque = base == ".wh..wh..opq";
    if (!opaque && base.starts_with(".wh..wh.")) return {};  // aufs bookkeeping (.wh..wh.plnk and such)
    const std::string victim(opaque ? std::string_view{} : base.substr(4));
    if (!opaque && (victim.empty() || victim == "." || victim == "..")) {
      return input_error(raw, "a whiteout that names no file");
    }
    const bool overlay = options_.whiteouts == WhiteoutMode::kOverlay;
    CFMO_ASSIGN_OR_RETURN(const int parent, parent_of(path, raw, overlay));
    if (parent < 0) return {};  // nothing below to hide
    if (opaque) {
      Fd dir(::openat(parent, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!dir) return system_error(raw, "opening the opaque directory");
      if (overlay) {
        if (::fsetxattr(dir.get(), "trusted.overlay.opaque", "y", 1, 0) != 0) {
          return system_error(raw, "setting trusted.overlay.opaque");
        }
        return {};
      }
      CFMO_TRY(clear_lower(dir.get(), std::string(dirname_of(path)), raw));
      return {};
    }
    if (overlay) {
      CFMO_TRY(make_room(parent, victim, false, raw));
      if (::mknodat(parent, victim.c_str(), S_IFCHR | 0000, makedev(0, 0)) != 0) {
        return system_error(raw, "creating an overlay whiteout");
      }
      return {};
    }
    return remove_tree(parent, victim, raw);
  }

  /// Clears `name` for a new entry: a directory stays when the new entry is one too.
  /// Returns whether a directory is already there.
  Result<bool> make_room(int parent, const std::string& name, bool want_dir, const char* raw) {
    struct stat st;
    if (::fstatat(parent, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return false;
      return system_error(raw, "stat");
    }
    if (want_dir && S_ISDIR(st.st_mode)) return true;
    CFMO_TRY(remove_tree(parent, name, raw));
    return false;
  }

  static void entry_times(archive_entry* e, timespec times[2]) {
    times[1] = {archive_entry_mtime(e), archive_entry_mtime_nsec(e)};
    times[0] =
        archive_entry_atime_is_set(e) != 0 ? timespec{archive_entry_atime(e), archive_entry_atime_nsec(e)} : times[1];
  }

  void set_xattrs(archive_entry* e, int fd, int parent, const std::string& name, UnpackStats& stats) {
    if (!options_.xattrs || archive_entry_xattr_reset(e) == 0) return;
    const char* key = nullptr;
    const void* value = nullptr;
    size_t size = 0;
    while (archive_entry_xattr_next(e, &key, &value, &size) == ARCHIVE_OK) {
      // overlayfs reads trusted.overlay.*: a layer must not forge whiteouts or redirects.
      const std::string_view k(key);
      if (k.starts_with("trusted.overlay.") || (!root_user_ && !k.starts_with("user."))) {
        ++stats.skipped_xattrs;
        continue;
      }
      int rc = 0;
      if (fd >= 0) {
        rc = ::fsetxattr(fd, key, value, size, 0);
      } else {
        const std::string proc = fmt::format("/proc/self/fd/{}/{}", parent, name);
        rc = ::lsetxattr(proc.c_str(), key, value, size, 0);
      }
      if (rc != 0) ++stats.skipped_xattrs;
    }
  }

  void set_owner(int parent, const std::string& name, int fd, archive_entry* e) {
    if (!options_.owners) return;
    const auto uid = static_cast<uid_t>(archive_entry_uid(e));
    const auto gid = static_cast<gid_t>(archive_entry_gid(e));
    if (fd >= 0) {
      (void)::fchown(fd, uid, gid);
    } else {
      (void)::fchownat(parent, name.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW);
    }
  }

  Status write_file(archive* a, archive_entry* e, int parent, const std::string& name, const char* raw,
                    UnpackStats& stats) {
    Fd fd(::openat(parent, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd && errno == EEXIST) {
      CFMO_TRY(make_room(parent, name, false, raw));
      fd.reset(::openat(parent, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    }
    if (!fd) return system_error(raw, "creating the file");
    int64_t end = 0;
    while (true) {
      const void* buffer = nullptr;
      size_t size = 0;
      la_int64_t offset = 0;
      const int rc = archive_read_data_block(a, &buffer, &size, &offset);
      if (rc == ARCHIVE_EOF) break;
      if (rc != ARCHIVE_OK && rc != ARCHIVE_WARN) {
        const char* message = archive_error_string(a);
        return input_error(raw, fmt::format("its data: {}", message != nullptr ? message : "read error"));
      }
      const char* p = static_cast<const char*>(buffer);
      while (size > 0) {
        const ssize_t n = ::pwrite(fd.get(), p, size, offset);
        if (n < 0) {
          if (errno == EINTR) continue;
          return system_error(raw, "writing the file");
        }
        p += n;
        size -= static_cast<size_t>(n);
        offset += n;
      }
      end = std::max<int64_t>(end, offset);
    }
    // A sparse file's hole at its end.
    if (const int64_t size = archive_entry_size(e); size > end && ::ftruncate(fd.get(), size) != 0) {
      return system_error(raw, "extending the file");
    }
    // Start writing large files back now, so a final syncfs finds little left to wait for.
    if (end >= (1 << 20)) ::sync_file_range(fd.get(), 0, 0, SYNC_FILE_RANGE_WRITE);
    set_owner(parent, name, fd.get(), e);
    set_xattrs(e, fd.get(), parent, name, stats);
    if (::fchmod(fd.get(), archive_entry_perm(e)) != 0) return system_error(raw, "chmod");
    timespec times[2];
    entry_times(e, times);
    if (::futimens(fd.get(), times) != 0) return system_error(raw, "setting the times");
    return {};
  }

  Status extract(archive* a, archive_entry* e, UnpackStats& stats) {
    const char* raw = archive_entry_pathname(e);
    if (raw == nullptr) raw = archive_entry_pathname_utf8(e);
    CFMO_ASSIGN_OR_RETURN(const std::string path, clean(raw, "path"));
    const std::string_view base = basename_of(path);
    if (options_.whiteouts != WhiteoutMode::kKeep && base.starts_with(".wh.")) return whiteout(path, base, raw);
    const mode_t type = archive_entry_filetype(e);
    const char* link_raw = archive_entry_hardlink(e);
    if (link_raw == nullptr) link_raw = archive_entry_hardlink_utf8(e);

    if (path.empty()) {  // the root itself ("./")
      if (type != AE_IFDIR || link_raw != nullptr) return input_error(raw, "the root must be a directory");
      set_owner(root_, ".", -1, e);
      DirFix fix{true, archive_entry_perm(e), {}};
      entry_times(e, fix.times);
      dirs_[""] = fix;
      return {};
    }
    if (link_raw == nullptr && (type == AE_IFCHR || type == AE_IFBLK || type == AE_IFSOCK) &&
        (!options_.devices || type == AE_IFSOCK)) {
      ++stats.skipped_devices;
      return {};
    }
    CFMO_ASSIGN_OR_RETURN(const int parent, parent_of(path, raw, true));
    const std::string name(base);
    timespec times[2];
    entry_times(e, times);

    if (link_raw != nullptr) {
      CFMO_ASSIGN_OR_RETURN(const std::string target, clean(link_raw, "hard link target", raw));
      if (target.empty()) return input_error(raw, "a hard link to the root; refused");
      if (target == path) return {};
      Fd target_dir(open_beneath(root_, std::string(dirname_of(target)), O_PATH | O_DIRECTORY));
      if (!target_dir) {
        auto walked = walk(std::string(dirname_of(target)), raw, false);
        if (!walked) {
          Error error = std::move(walked).error();
          error.message += fmt::format(" (on the way to its hard link target '{}')", shown(target));
          return error;
        }
        target_dir = std::move(*walked);
      }
      const std::string target_name(basename_of(target));
      struct stat st;
      if (!target_dir || ::fstatat(target_dir.get(), target_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        return input_error(raw, fmt::format("hard link to '{}', which is not in the root", shown(target)));
      }
      if (S_ISDIR(st.st_mode)) return input_error(raw, fmt::format("hard link to directory '{}'", shown(target)));
      struct stat existing;
      if (::fstatat(parent, name.c_str(), &existing, AT_SYMLINK_NOFOLLOW) == 0) {
        if (existing.st_ino == st.st_ino && existing.st_dev == st.st_dev) return {};
        CFMO_TRY(remove_tree(parent, name, raw));
      }
      if (::linkat(target_dir.get(), target_name.c_str(), parent, name.c_str(), 0) != 0) {
        return system_error(raw, fmt::format("hard link to '{}'", shown(target)));
      }
      created(path);
      return {};
    }

    switch (type) {
      case AE_IFREG:
        CFMO_TRY(write_file(a, e, parent, name, raw, stats));
        break;
      case AE_IFDIR: {
        CFMO_ASSIGN_OR_RETURN(const bool exists, make_room(parent, name, true, raw));
        if (!exists && ::mkdirat(parent, name.c_str(), 0700) != 0) return system_error(raw, "mkdir");
        set_owner(parent, name, -1, e);
        if (options_.xattrs && archive_entry_xattr_count(e) > 0) {
          Fd dir(::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
          if (dir) set_xattrs(e, dir.get(), parent, name, stats);
        }
        DirFix fix{true, archive_entry_perm(e), {times[0], times[1]}};
        dirs_[path] = fix;
        break;
      }
      case AE_IFLNK: {
        const char* target = archive_entry_symlink(e);
        if (target == nullptr) target = archive_entry_symlink_utf8(e);
        if (target == nullptr) return input_error(raw, "a symlink without a target");
        CFMO_TRY(make_room(parent, name, false, raw));
        if (::symlinkat(target, parent, name.c_str()) != 0) return system_error(raw, "symlink");
        set_owner(parent, name, -1, e);
        set_xattrs(e, -1, parent, name, stats);
        if (::utimensat(parent, name.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0) {
          return system_error(raw, "setting the times");
        }
        break;
      }
      case AE_IFCHR:
      case AE_IFBLK:
      case AE_IFIFO: {
        CFMO_TRY(make_room(parent, name, false, raw));
        const dev_t dev = type == AE_IFIFO ? 0 : makedev(archive_entry_rdevmajor(e), archive_entry_rdevminor(e));
        if (::mknodat(parent, name.c_str(), type | (archive_entry_perm(e) & 0777), dev) != 0) {
          if (errno == EPERM && type != AE_IFIFO) {  // a container without CAP_MKNOD
            ++stats.skipped_devices;
            return {};
          }
          return system_error(raw, "mknod");
        }
        set_owner(parent, name, -1, e);
        set_xattrs(e, -1, parent, name, stats);
        if (::fchmodat(parent, name.c_str(), archive_entry_perm(e), 0) != 0) return system_error(raw, "chmod");
        if (::utimensat(parent, name.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0) {
          return system_error(raw, "setting the times");
        }
        break;
      }
      default:
        return input_error(raw, fmt::format("unsupported entry type 0{:o}", static_cast<unsigned>(type)));
    }
    created(path);
    return {};
  }

  /// Directories' modes and times, once their content is written, deepest first.
  Status finish_dirs() {
    cached_fd_.reset();
    cached_dir_.clear();
    std::vector<std::pair<const std::string*, const DirFix*>> order;
    order.reserve(dirs_.size());
    for (const auto& [path, fix] : dirs_) order.emplace_back(&path, &fix);
    std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
      const size_t dx = depth_of(*x.first), dy = depth_of(*y.first);
      return dx != dy ? dx > dy : *x.first < *y.first;
    });
    for (const auto& [path, fix] : order) {
      Fd dir(open_beneath(root_, *path, O_RDONLY | O_DIRECTORY));
      if (!dir) continue;  // removed or replaced later in the layer
      if (fix->from_tar && ::fchmod(dir.get(), fix->mode) != 0) {
        return make_error(ErrorKind::kInternal, "{}: chmod of '{}' failed: {}", what_, shown(*path),
                          std::strerror(errno));
      }
      if (::futimens(dir.get(), fix->times) != 0) {
        return make_error(ErrorKind::kInternal, "{}: setting the times of '{}' failed: {}", what_, shown(*path),
                          std::strerror(errno));
      }
    }
    dirs_.clear();
    return {};
  }

  int root_;
  UnpackOptions options_;
  std::string what_;
  bool root_user_;
  Fd cached_fd_;
  std::string cached_dir_;
  std::unordered_map<std::string, DirFix> dirs_;
  std::vector<uint64_t> created_;  ///< hashes of the paths this layer wrote (kApply)
  size_t sorted_ = 0;
};

/// Compressed layers decompress on a thread of their own, a few blocks ahead
/// of the extraction: inflating and writing files overlap.
std::unique_ptr<Decoder> layer_decoder(Compression compression, ByteSource& source, const std::string& what) {
  auto decoder = make_decoder(compression, source, what);
  if (compression == Compression::kNone) return decoder;
  return make_prefetching(std::move(decoder));
}

Status check_options(const UnpackOptions& options, const std::string& what) {
  if (options.whiteouts == WhiteoutMode::kOverlay && !running_as_root()) {
    return make_error(ErrorKind::kUsage, "{}: overlay whiteouts (0:0 devices, trusted.* xattrs) need root", what);
  }
  return {};
}

Result<Fd> open_root(const fs::path& root, const std::string& what) {
  Fd fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!fd)
    return make_error(ErrorKind::kInternal, "{}: cannot open '{}': {}", what, root.string(), std::strerror(errno));
  return fd;
}

/// A blob file read in 1 MiB chunks.
class FileSource : public ByteSource {
 public:
  FileSource(int fd, std::string what) : fd_(fd), what_(std::move(what)), buffer_(1u << 20) {}
  Result<std::string_view> next() override {
    while (true) {
      const ssize_t n = ::read(fd_, buffer_.data(), buffer_.size());
      if (n >= 0) return std::string_view(buffer_.data(), static_cast<size_t>(n));
      if (errno != EINTR) return make_error(ErrorKind::kInternal, "{}: read failed: {}", what_, std::strerror(errno));
    }
  }

 private:
  int fd_;
  std::string what_;
  std::vector<char> buffer_;
};

}  // namespace

bool running_as_root() { return ::geteuid() == 0; }

void detail::use_openat2(bool enabled) { openat2_missing = !enabled; }

Result<Compression> layer_compression(const std::string& media_type) {
  static const std::pair<const char*, Compression> kTypes[] = {
      {"application/vnd.oci.image.layer.v1.tar", Compression::kNone},
      {"application/vnd.oci.image.layer.v1.tar+gzip", Compression::kGzip},
      {"application/vnd.oci.image.layer.v1.tar+zstd", Compression::kZstd},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar", Compression::kNone},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar+gzip", Compression::kGzip},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar+zstd", Compression::kZstd},
      {"application/vnd.docker.image.rootfs.diff.tar", Compression::kNone},
      {"application/vnd.docker.image.rootfs.diff.tar.gzip", Compression::kGzip},
      {"application/vnd.docker.image.rootfs.diff.tar.zstd", Compression::kZstd},
      {"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", Compression::kGzip},
  };
  for (const auto& [type, compression] : kTypes) {
    if (media_type == type) return compression;
  }
  return make_error(ErrorKind::kInput, "layer media type '{}' is not a tar layer cfmo-pull can unpack", media_type);
}

const char* compression_name(Compression compression) {
  switch (compression) {
    case Compression::kNone:
      return "none";
    case Compression::kGzip:
      return "gzip";
    case Compression::kZstd:
      return "zstd";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// Streaming: a bounded queue of compressed bytes between write() and the
// extraction thread.

struct LayerUnpacker::Impl : ByteSource {
  Fd root;
  Compression compression = Compression::kNone;
  UnpackOptions options;
  std::string what;

  std::mutex mutex;
  std::condition_variable data_ready;
  std::condition_variable space_free;
  std::deque<std::string> queue;
  size_t queued = 0;
  bool end = false;      ///< no more writes
  bool aborted = false;  ///< stop now
  bool done = false;     ///< the thread has ended
  std::optional<Error> error;
  UnpackStats stats;
  std::string current;  ///< the chunk the thread is reading; its own
  std::thread thread;

  static constexpr size_t kBlock = 256u << 10;  ///< chunks are coalesced into blocks up to this size

  Result<std::string_view> next() override {
    std::unique_lock lock(mutex);
    data_ready.wait(lock, [&] { return !queue.empty() || end || aborted; });
    if (aborted) return make_error(ErrorKind::kInternal, "{}: unpacking aborted", what);
    if (queue.empty()) return std::string_view{};
    current = std::move(queue.front());
    queue.pop_front();
    queued -= current.size();
    lock.unlock();
    space_free.notify_one();
    return std::string_view(current);
  }

  void run() {
    pthread_setname_np(pthread_self(), "cfmo-unpack");
    Extractor extractor(root.get(), options, what);
    auto decoder = layer_decoder(compression, *this, what);
    UnpackStats local;
    Status status = extractor.run(*decoder, local);
    if (!status) {
      // The error is the writer's answer from now on; a decoder thread that
      // waits for bytes that no longer come is ended by `aborted`.
      std::lock_guard lock(mutex);
      error = std::move(status).error();
      aborted = true;
      data_ready.notify_all();
      space_free.notify_all();
    }
    decoder.reset();
    std::lock_guard lock(mutex);
    if (!error) stats = local;
    done = true;
    // Nothing reads any more: drop what is queued and wake a blocked writer.
    queue.clear();
    queued = 0;
    space_free.notify_all();
  }
};

LayerUnpacker::LayerUnpacker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LayerUnpacker::~LayerUnpacker() {
  if (impl_ && impl_->thread.joinable()) abort();
}

Result<std::unique_ptr<LayerUnpacker>> LayerUnpacker::start(const fs::path& root, Compression compression,
                                                            const UnpackOptions& options, std::string what) {
  CFMO_TRY(check_options(options, what));
  auto impl = std::make_unique<Impl>();
  CFMO_ASSIGN_OR_RETURN(impl->root, open_root(root, what));
  impl->compression = compression;
  impl->options = options;
  impl->options.buffer_bytes = std::max<size_t>(options.buffer_bytes, Impl::kBlock);
  impl->what = std::move(what);
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<LayerUnpacker>(new LayerUnpacker(std::move(impl)));
}

Status LayerUnpacker::write(std::string_view compressed) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mutex);
  while (!compressed.empty()) {
    s.space_free.wait(lock, [&] { return s.done || s.aborted || s.queued < s.options.buffer_bytes; });
    if (s.error) return *s.error;
    if (s.aborted || s.end) return make_error(ErrorKind::kInternal, "{}: write after the end", s.what);
    if (s.done) return make_error(ErrorKind::kInternal, "{}: the unpacker has stopped", s.what);
    if (s.queue.empty() || s.queue.back().size() >= Impl::kBlock) {
      s.queue.emplace_back();
      s.queue.back().reserve(Impl::kBlock);
    }
    std::string& back = s.queue.back();
    const std::string_view piece =
        compressed.substr(0, std::min(s.options.buffer_bytes - s.queued, Impl::kBlock - back.size()));
    back.append(piece);
    s.queued += piece.size();
    compressed.remove_prefix(piece.size());
    s.data_ready.notify_one();
  }
  return {};
}

Result<UnpackStats> LayerUnpacker::finish() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    s.end = true;
  }
  s.data_ready.notify_all();
  if (s.thread.joinable()) s.thread.join();
  if (s.error) return *s.error;
  if (s.aborted) return make_error(ErrorKind::kInternal, "{}: unpacking aborted", s.what);
  return s.stats;
}

void LayerUnpacker::abort() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    s.aborted = true;
  }
  s.data_ready.notify_all();
  s.space_free.notify_all();
  if (s.thread.joinable()) s.thread.join();
}

Result<UnpackStats> unpack_layer_file(const fs::path& blob, const fs::path& root, Compression compression,
                                      const UnpackOptions& options, const std::string& what) {
  CFMO_TRY(check_options(options, what));
  CFMO_ASSIGN_OR_RETURN(const Fd root_fd, open_root(root, what));
  Fd fd(::open(blob.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd)
    return make_error(ErrorKind::kInternal, "{}: cannot open '{}': {}", what, blob.string(), std::strerror(errno));
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  FileSource source(fd.get(), what);
  auto decoder = layer_decoder(compression, source, what);
  Extractor extractor(root_fd.get(), options, what);
  UnpackStats stats;
  CFMO_TRY(extractor.run(*decoder, stats));
  return stats;
}

}  // namespace cfmo::oci
