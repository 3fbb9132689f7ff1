#pragma once
// A directory tree as comparable text: one line per entry, sorted by path,
// with its type, mode, size, a hash of its contents or its symlink target,
// owner when asked, and which entries are hard links of one another (by the
// first path of each inode, so two trees compare equal when they link alike).

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace cfmo::testing {

struct ListingOptions {
  bool owners = false;
  bool mtimes = false;  ///< regular files' and symlinks' mtimes (seconds)
};

inline std::string list_tree(const std::filesystem::path& root, ListingOptions options = {}) {
  namespace fs = std::filesystem;
  std::vector<std::string> paths;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::none, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    paths.push_back(fs::relative(it->path(), root).string());
  }
  std::sort(paths.begin(), paths.end());
  std::map<std::pair<dev_t, ino_t>, std::string> first_path;
  std::ostringstream out;
  for (const auto& rel : paths) {
    const fs::path p = root / rel;
    struct stat st;
    if (lstat(p.c_str(), &st) != 0) continue;
    out << rel << " ";
    const auto perm = st.st_mode & 07777;
    if (S_ISDIR(st.st_mode)) {
      out << "dir " << std::oct << perm << std::dec;
    } else if (S_ISLNK(st.st_mode)) {
      out << "link -> " << fs::read_symlink(p).string();
    } else if (S_ISREG(st.st_mode)) {
      std::ifstream in(p, std::ios::binary);
      std::ostringstream s;
      s << in.rdbuf();
      const std::string data = s.str();
      out << "file " << std::oct << perm << std::dec << " " << st.st_size << " " << std::hex
          << XXH3_64bits(data.data(), data.size()) << std::dec;
      if (st.st_nlink > 1) {
        const auto key = std::make_pair(st.st_dev, st.st_ino);
        auto [it, inserted] = first_path.emplace(key, rel);
        if (!inserted) out << " hardlink-of " << it->second;
      }
    } else if (S_ISFIFO(st.st_mode)) {
      out << "fifo " << std::oct << perm << std::dec;
    } else if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) {
      out << (S_ISCHR(st.st_mode) ? "char " : "block ") << std::oct << perm << std::dec << " " << major(st.st_rdev)
          << ":" << minor(st.st_rdev);
    } else {
      out << "other";
    }
    if (options.owners) out << " " << st.st_uid << ":" << st.st_gid;
    if (options.mtimes && !S_ISDIR(st.st_mode)) out << " t" << st.st_mtim.tv_sec;
    out << "\n";
  }
  return out.str();
}

}  // namespace cfmo::testing
