#pragma once
// A directory under the system's temporary directory, removed with all it
// holds when the test ends.
#include <stdlib.h>

#include <filesystem>
#include <string>

namespace cfmo::testing {

class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix = "cfmo") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace cfmo::testing
