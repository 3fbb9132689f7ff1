#include "core/atomic_file.h"
#include "support/expect_error.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace cfmo {
namespace {

namespace fs = std::filesystem;

// A fresh, empty directory per test, so a leftover temporary file is visible as an extra entry.
class AtomicFileTest : public ::testing::Test {
 protected:
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string contents(const fs::path& path) const {
    auto text = read_file(path);
    EXPECT_TRUE(text) << text.error().message;
    return text ? *text : std::string();
  }

  testing::TempDir temp_;
  const fs::path dir_ = temp_.path();
};

TEST_F(AtomicFileTest, WriteCreatesTheFile) {
  const auto path = dir_ / "out.txt";
  ASSERT_TRUE(write_file_atomic(path, "hello\n"));
  EXPECT_EQ(contents(path), "hello\n");
  EXPECT_EQ(entries(), std::vector<std::string>{"out.txt"});
}

TEST_F(AtomicFileTest, WriteReplacesLongerContent) {
  const auto path = dir_ / "out.txt";
  ASSERT_TRUE(write_file_atomic(path, "a much longer first version of the file"));
  ASSERT_TRUE(write_file_atomic(path, "short"));
  EXPECT_EQ(contents(path), "short");
  EXPECT_EQ(entries(), std::vector<std::string>{"out.txt"});
}

TEST_F(AtomicFileTest, EmptyAndBinaryContentSurvive) {
  const auto empty = dir_ / "empty";
  ASSERT_TRUE(write_file_atomic(empty, ""));
  EXPECT_TRUE(fs::exists(empty));
  EXPECT_EQ(fs::file_size(empty), 0u);

  std::string binary;
  for (int i = 0; i < 4096; ++i) binary.push_back(static_cast<char>(i * 7));
  const auto path = dir_ / "binary";
  ASSERT_TRUE(write_file_atomic(path, binary));
  EXPECT_EQ(contents(path), binary);
}

TEST_F(AtomicFileTest, SeveralWritesBeforeCommit) {
  const auto path = dir_ / "parts";
  auto file = AtomicFile::create(path);
  ASSERT_TRUE(file) << file.error().message;
  ASSERT_TRUE(file->write("one "));
  const std::byte raw[] = {std::byte{'t'}, std::byte{'w'}, std::byte{'o'}};
  ASSERT_TRUE(file->write(std::span<const std::byte>(raw)));
  // Nothing appears under the target's name before the commit.
  EXPECT_FALSE(fs::exists(path));
  ASSERT_TRUE(file->commit());
  EXPECT_EQ(contents(path), "one two");
  EXPECT_EQ(entries(), std::vector<std::string>{"parts"});
}

TEST_F(AtomicFileTest, UncommittedFileLeavesTheTargetUntouched) {
  const auto path = dir_ / "state.json";
  ASSERT_TRUE(write_file_atomic(path, "original"));
  {
    auto file = AtomicFile::create(path);
    ASSERT_TRUE(file) << file.error().message;
    ASSERT_TRUE(file->write("replacement that is never committed"));
    EXPECT_EQ(entries().size(), 2u);  // the target and the temporary file
    EXPECT_EQ(contents(path), "original");
  }
  EXPECT_EQ(contents(path), "original");
  EXPECT_EQ(entries(), std::vector<std::string>{"state.json"});
}

TEST_F(AtomicFileTest, UncommittedNewFileLeavesNothing) {
  {
    auto file = AtomicFile::create(dir_ / "never");
    ASSERT_TRUE(file) << file.error().message;
    ASSERT_TRUE(file->write("data"));
  }
  EXPECT_TRUE(entries().empty());
}

TEST_F(AtomicFileTest, MovedFileHasOneOwner) {
  const auto path = dir_ / "moved";
  auto created = AtomicFile::create(path);
  ASSERT_TRUE(created) << created.error().message;
  {
    AtomicFile owner = std::move(*created);
    ASSERT_TRUE(owner.write("via the new owner"));
    ASSERT_TRUE(owner.commit());
  }
  // The moved-from object is destroyed last; it must not remove anything.
  created = Error{};
  EXPECT_EQ(contents(path), "via the new owner");
  EXPECT_EQ(entries(), std::vector<std::string>{"moved"});
}

TEST_F(AtomicFileTest, MoveAssignmentDiscardsTheOverwrittenFile) {
  auto first = AtomicFile::create(dir_ / "first");
  auto second = AtomicFile::create(dir_ / "second");
  ASSERT_TRUE(first && second);
  ASSERT_TRUE(first->write("dropped"));
  ASSERT_TRUE(second->write("kept"));
  *first = std::move(*second);
  ASSERT_TRUE(first->commit());
  EXPECT_EQ(contents(dir_ / "second"), "kept");
  EXPECT_EQ(entries(), std::vector<std::string>{"second"});
}

TEST_F(AtomicFileTest, MissingDirectoryIsAnInputErrorNamingThePath) {
  const auto path = dir_ / "no" / "such" / "dir" / "out.txt";
  EXPECT_TRUE(fails_with(write_file_atomic(path, "x"), ErrorKind::kInternal, {path.string()}));
  EXPECT_TRUE(fails_with(AtomicFile::create(path), ErrorKind::kInternal, {path.string()}));
  EXPECT_TRUE(entries().empty());
}

TEST_F(AtomicFileTest, DirectoryInTheWayIsAnErrorAndLeavesNoTempFile) {
  const auto path = dir_ / "occupied";
  fs::create_directory(path);
  fs::create_directory(path / "inside");
  EXPECT_TRUE(fails_with(write_file_atomic(path, "x"), ErrorKind::kInternal, {path.string()}));
  EXPECT_TRUE(fs::is_directory(path / "inside"));
  EXPECT_EQ(entries(), std::vector<std::string>{"occupied"});
}

TEST_F(AtomicFileTest, ReadMissingFileNamesIt) {
  const auto path = dir_ / "absent.txt";
  EXPECT_TRUE(fails_with(read_file(path), ErrorKind::kInput, {path.string()}));
}

TEST_F(AtomicFileTest, ReadDirectoryIsAnError) {
  EXPECT_TRUE(fails_with(read_file(dir_), ErrorKind::kInput, {dir_.string()}));
}

TEST_F(AtomicFileTest, FsyncDirectory) {
  EXPECT_TRUE(fsync_directory(dir_));
  const auto missing = dir_ / "gone";
  EXPECT_TRUE(fails_with(fsync_directory(missing), ErrorKind::kInternal, {missing.string()}));
}

}  // namespace
}  // namespace cfmo
