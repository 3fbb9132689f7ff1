#pragma once
/// Files are written whole or not at all (write errors are ErrorKind::kInternal,
/// exit 5; read errors kInput, exit 3): data goes to a temporary file in
/// the same directory, is fsync'ed, then renamed over the target, and the
/// directory is fsync'ed so the rename survives a crash.

#include "core/error.h"
#include "core/fd.h"

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace cfmo {

class AtomicFile {
 public:
  /// Opens "<path>.tmp.<pid>" for writing next to `path`.
  static Result<AtomicFile> create(const std::filesystem::path& path);

  AtomicFile(AtomicFile&& other) noexcept
      : path_(std::move(other.path_)), temp_path_(std::exchange(other.temp_path_, {})), fd_(std::move(other.fd_)) {}
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  /// Removes the temporary file unless commit() succeeded.
  ~AtomicFile();

  Status write(std::span<const std::byte> data);
  Status write(std::string_view text) { return write(std::as_bytes(std::span(text.data(), text.size()))); }
  /// fsync, rename over the target, fsync the directory.
  Status commit();

 private:
  AtomicFile(std::filesystem::path path, std::filesystem::path temp_path, int fd)
      : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}
  void discard();

  std::filesystem::path path_;
  std::filesystem::path temp_path_;
  Fd fd_;
};

Status write_file_atomic(const std::filesystem::path& path, std::string_view contents);

/// fsync a directory so a rename or create inside it is durable.
Status fsync_directory(const std::filesystem::path& dir);

/// Reads a whole file; an error names the file.
Result<std::string> read_file(const std::filesystem::path& path);

}  // namespace cfmo
