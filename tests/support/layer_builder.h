#pragma once
// Image layers for tests, built in memory: a tar written with libarchive's
// writer (pax by default, GNU and ustar on request) from a list of entries,
// compressed with zlib (gzip) or zstd. Malicious entries (`..`, absolute
// names, links out) are written as given: libarchive's writer does not check.

#include <archive.h>
#include <archive_entry.h>
#include <sys/stat.h>
#include <zlib.h>
#include <zstd.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cfmo::testing {

struct TarEntry {
  std::string path;
  mode_t type = AE_IFREG;  ///< AE_IFREG, AE_IFDIR, AE_IFLNK, AE_IFCHR, AE_IFBLK, AE_IFIFO
  std::string data;        ///< a regular file's contents
  std::string link;        ///< a symlink's target
  std::string hardlink;    ///< when set, a hard link to this path (type is ignored)
  mode_t perm = 0644;
  int64_t mtime = 1700000000;
  int64_t uid = 0;
  int64_t gid = 0;
  unsigned major = 0;
  unsigned minor = 0;
  std::vector<std::pair<std::string, std::string>> xattrs;
};

inline TarEntry file(std::string path, std::string data, mode_t perm = 0644) {
  TarEntry e;
  e.path = std::move(path);
  e.data = std::move(data);
  e.perm = perm;
  return e;
}
inline TarEntry dir(std::string path, mode_t perm = 0755) {
  TarEntry e;
  e.path = std::move(path);
  e.type = AE_IFDIR;
  e.perm = perm;
  return e;
}
inline TarEntry symlink(std::string path, std::string target) {
  TarEntry e;
  e.path = std::move(path);
  e.type = AE_IFLNK;
  e.link = std::move(target);
  e.perm = 0777;
  return e;
}
inline TarEntry hardlink(std::string path, std::string target) {
  TarEntry e;
  e.path = std::move(path);
  e.hardlink = std::move(target);
  return e;
}
inline TarEntry whiteout(const std::string& dir_path, const std::string& name) {
  return file(dir_path.empty() ? ".wh." + name : dir_path + "/.wh." + name, "");
}
inline TarEntry opaque(const std::string& dir_path) {
  return file(dir_path.empty() ? ".wh..wh..opq" : dir_path + "/.wh..wh..opq", "");
}

enum class TarFormat { kPax, kGnu, kUstar };

/// An uncompressed tar of `entries`, in order.
inline std::string make_tar(const std::vector<TarEntry>& entries, TarFormat format = TarFormat::kPax) {
  std::string out;
  archive* a = archive_write_new();
  switch (format) {
    case TarFormat::kPax:
      archive_write_set_format_pax_restricted(a);
      break;
    case TarFormat::kGnu:
      archive_write_set_format_gnutar(a);
      break;
    case TarFormat::kUstar:
      archive_write_set_format_ustar(a);
      break;
  }
  archive_write_set_bytes_per_block(a, 10240);
  archive_write_open(
      a, &out, nullptr,
      +[](archive*, void* data, const void* buffer, size_t size) -> la_ssize_t {
        static_cast<std::string*>(data)->append(static_cast<const char*>(buffer), size);
        return static_cast<la_ssize_t>(size);
      },
      nullptr);
  for (const auto& t : entries) {
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, t.path.c_str());
    archive_entry_set_mtime(e, t.mtime, 0);
    archive_entry_set_uid(e, t.uid);
    archive_entry_set_gid(e, t.gid);
    archive_entry_set_perm(e, t.perm);
    for (const auto& [name, value] : t.xattrs)
      archive_entry_xattr_add_entry(e, name.c_str(), value.data(), value.size());
    if (!t.hardlink.empty()) {
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_set_hardlink(e, t.hardlink.c_str());
      archive_entry_set_size(e, 0);
    } else {
      archive_entry_set_filetype(e, t.type);
      if (t.type == AE_IFLNK) archive_entry_set_symlink(e, t.link.c_str());
      if (t.type == AE_IFCHR || t.type == AE_IFBLK) {
        archive_entry_set_rdevmajor(e, t.major);
        archive_entry_set_rdevminor(e, t.minor);
      }
      archive_entry_set_size(e, t.type == AE_IFREG ? static_cast<la_int64_t>(t.data.size()) : 0);
    }
    if (archive_write_header(a, e) < ARCHIVE_WARN) {
      const std::string message = archive_error_string(a);
      archive_entry_free(e);
      archive_write_free(a);
      throw std::runtime_error("make_tar: " + t.path + ": " + message);
    }
    if (t.hardlink.empty() && t.type == AE_IFREG && !t.data.empty())
      archive_write_data(a, t.data.data(), t.data.size());
    archive_entry_free(e);
  }
  archive_write_close(a);
  archive_write_free(a);
  return out;
}

inline std::string gzip(const std::string& data, int level = 6) {
  z_stream z{};
  deflateInit2(&z, level, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

/// zstd with a content checksum, as the zstd command writes it.
inline std::string zstd(const std::string& data, int level = 3) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
  std::string out(ZSTD_compressBound(data.size()), '\0');
  out.resize(ZSTD_compress2(cctx, out.data(), out.size(), data.data(), data.size()));
  ZSTD_freeCCtx(cctx);
  return out;
}

/// zstd in independent frames of `frame` input bytes each, as seekable
/// writers (zstd:chunked, `zstd --seekable` tools) make them.
inline std::string zstd_frames(const std::string& data, size_t frame, int level = 3) {
  std::string out;
  for (size_t at = 0; at < data.size(); at += frame) out += zstd(data.substr(at, frame), level);
  return out;
}

/// Deterministic bytes that do not compress.
inline std::string random_bytes(size_t size, uint64_t seed) {
  std::string out(size, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& c : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x >> 24);
  }
  return out;
}

}  // namespace cfmo::testing
