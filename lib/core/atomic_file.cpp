#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cfmo {
namespace {

// Reading fails on bad input (exit 3); writing fails on the system (a full
// disk, a read-only mount: exit 5), whatever the caller asked for.
Error io_error(const std::filesystem::path& path, std::string_view what, ErrorKind kind = ErrorKind::kInternal) {
  return make_error(kind, "{} '{}': {}", what, path.string(), std::strerror(errno));
}

}  // namespace

Result<AtomicFile> AtomicFile::create(const std::filesystem::path& path) {
  std::filesystem::path temp = path;
  temp += fmt::format(".tmp.{}", ::getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error(temp, "Failed to create");
  return AtomicFile(path, std::move(temp), fd);
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    fd_ = std::move(other.fd_);
    other.temp_path_.clear();
  }
  return *this;
}

AtomicFile::~AtomicFile() { discard(); }

void AtomicFile::discard() {
  fd_.reset();
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

Status AtomicFile::write(std::span<const std::byte> data) {
  const auto* bytes = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd_.get(), bytes, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(temp_path_, "Failed to write");
    }
    bytes += n;
    left -= static_cast<size_t>(n);
  }
  return {};
}

Status AtomicFile::commit() {
  if (::fsync(fd_.get()) != 0) return io_error(temp_path_, "Failed to fsync");
  if (fd_.close() != 0) return io_error(temp_path_, "Failed to close");
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) return io_error(path_, "Failed to rename onto");
  temp_path_.clear();
  auto parent = path_.parent_path();
  return fsync_directory(parent.empty() ? std::filesystem::path(".") : parent);
}

Status write_file_atomic(const std::filesystem::path& path, std::string_view contents) {
  CFMO_ASSIGN_OR_RETURN(auto file, AtomicFile::create(path));
  CFMO_TRY(file.write(contents));
  return file.commit();
}

Status fsync_directory(const std::filesystem::path& dir) {
  const Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return io_error(dir, "Failed to open directory");
  if (::fsync(fd.get()) != 0) return io_error(dir, "Failed to fsync directory");
  return {};
}

Result<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error(path, "Failed to open", ErrorKind::kInput);
  // A directory opens and then reads as empty, without any stream error.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return make_error(ErrorKind::kInput, "Failed to read '{}': is a directory", path.string());
  }
  // Sized first and read in one go: through a stringstream a file of a few
  // MB was copied several times as the buffer grew (most of a lazy mount's
  // start, which reads its layers' indexes).
  std::string bytes(static_cast<size_t>(std::filesystem::file_size(path, ec)), '\0');
  if (ec) bytes.clear();
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (in.bad()) return io_error(path, "Failed to read", ErrorKind::kInput);
  // A file that grew meanwhile, or one whose size stat does not tell (/proc): the rest.
  std::ostringstream rest;
  rest << in.rdbuf();
  bytes += std::move(rest).str();
  return bytes;
}

}  // namespace cfmo
