#include "oci/registry.h"
#include "support/temp_dir.h"

#include "core/atomic_file.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;

/// A scratch directory named for these tests.
class TempDir : public cfmo::testing::ScratchDir {
 public:
  TempDir() : ScratchDir("cfmo-oci") {}
};

TEST(OciRegistry, Sha256OfKnownStrings) {
  EXPECT_EQ(sha256_digest(""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_digest("abc"), "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(OciRegistry, CredentialsFromADockerConfig) {
  TempDir dir;
  const auto file = dir.path() / "config.json";
  // "user:pa:ss" — a password may hold a colon; only the first one splits.
  ASSERT_TRUE(write_file_atomic(file, R"({"auths":{
    "registry.example:5000":{"auth":"dXNlcjpwYTpzcw=="},
    "https://index.docker.io/v1/":{"auth":"aHViOnNlY3JldA=="}}})"));
  auto found = load_credentials("registry.example:5000", file.string());
  ASSERT_TRUE(found) << found.error().message;
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->username, "user");
  EXPECT_EQ((*found)->password, "pa:ss");
  auto hub = load_credentials("registry-1.docker.io", file.string());
  ASSERT_TRUE(hub && hub->has_value());
  EXPECT_EQ((*hub)->username, "hub");
  EXPECT_EQ((*hub)->password, "secret");
  auto other = load_credentials("ghcr.io", file.string());
  ASSERT_TRUE(other);
  EXPECT_FALSE(other->has_value());
}

TEST(OciRegistry, BadCredentialFilesAreErrorsThatHideTheSecret) {
  TempDir dir;
  EXPECT_FALSE(load_credentials("h", (dir.path() / "absent.json").string()));  // named explicitly: must exist
  ASSERT_TRUE(write_file_atomic(dir.path() / "bad.json", "{nope"));
  auto bad = load_credentials("h", (dir.path() / "bad.json").string());
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kInput);
  ASSERT_TRUE(write_file_atomic(dir.path() / "nocolon.json", R"({"auths":{"h":{"auth":"c2VjcmV0"}}})"));
  auto nocolon = load_credentials("h", (dir.path() / "nocolon.json").string());
  ASSERT_FALSE(nocolon);
  EXPECT_EQ(nocolon.error().message.find("secret"), std::string::npos) << nocolon.error().message;
  EXPECT_EQ(nocolon.error().message.find("c2VjcmV0"), std::string::npos) << nocolon.error().message;
}

TEST(OciRegistry, DefaultConfigComesFromDockerConfigAndMayBeAbsent) {
  TempDir dir;
  ASSERT_TRUE(write_file_atomic(dir.path() / "config.json", R"({"auths":{"h":{"auth":"dTpw"}}})"));
  const char* old = std::getenv("DOCKER_CONFIG");
  const std::string saved = old != nullptr ? old : "";
  setenv("DOCKER_CONFIG", dir.path().c_str(), 1);
  auto found = load_credentials("h", "");
  setenv("DOCKER_CONFIG", (dir.path() / "empty").c_str(), 1);
  auto absent = load_credentials("h", "");
  if (old != nullptr) {
    setenv("DOCKER_CONFIG", saved.c_str(), 1);
  } else {
    unsetenv("DOCKER_CONFIG");
  }
  ASSERT_TRUE(found && found->has_value());
  EXPECT_EQ((*found)->username, "u");
  EXPECT_EQ((*found)->password, "p");
  ASSERT_TRUE(absent);
  EXPECT_FALSE(absent->has_value());
}

}  // namespace
}  // namespace cfmo::oci
