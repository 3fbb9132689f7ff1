#include "oci/reference.h"

#include <gtest/gtest.h>

namespace cfmo::oci {
namespace {

const std::string kDigest = "sha256:" + std::string(64, 'a');

TEST(OciReference, DockerHubDefaults) {
  auto r = parse_reference("alpine");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->registry, "docker.io");
  EXPECT_EQ(r->api_host(), "registry-1.docker.io");
  EXPECT_EQ(r->repository, "library/alpine");
  EXPECT_EQ(r->tag, "latest");
  EXPECT_EQ(r->digest, "");
  EXPECT_EQ(r->to_string(), "docker.io/library/alpine:latest");
}

TEST(OciReference, DockerHubUserRepositoryKeepsItsNamespace) {
  auto r = parse_reference("team/app:1.2");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->registry, "docker.io");
  EXPECT_EQ(r->repository, "team/app");
  EXPECT_EQ(r->tag, "1.2");
  auto hub = parse_reference("docker.io/ubuntu");
  ASSERT_TRUE(hub);
  EXPECT_EQ(hub->repository, "library/ubuntu");
  auto index = parse_reference("index.docker.io/library/ubuntu:22.04");
  ASSERT_TRUE(index);
  EXPECT_EQ(index->registry, "docker.io");
}

TEST(OciReference, RegistryWithPortIsNotATag) {
  auto r = parse_reference("127.0.0.1:5000/fixtures/small");
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->registry, "127.0.0.1:5000");
  EXPECT_EQ(r->api_host(), "127.0.0.1:5000");
  EXPECT_EQ(r->repository, "fixtures/small");
  EXPECT_EQ(r->tag, "latest");
  auto tagged = parse_reference("localhost:5000/app:v1");
  ASSERT_TRUE(tagged);
  EXPECT_EQ(tagged->registry, "localhost:5000");
  EXPECT_EQ(tagged->tag, "v1");
  auto local = parse_reference("localhost/app");
  ASSERT_TRUE(local);
  EXPECT_EQ(local->registry, "localhost");
  EXPECT_EQ(local->repository, "app");  // no library/ prefix off Docker Hub
}

TEST(OciReference, DigestWinsOverTag) {
  auto r = parse_reference("ghcr.io/org/app:v1@" + kDigest);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->registry, "ghcr.io");
  EXPECT_EQ(r->tag, "v1");
  EXPECT_EQ(r->digest, kDigest);
  EXPECT_EQ(r->manifest_reference(), kDigest);
  auto only = parse_reference("ghcr.io/org/app@" + kDigest);
  ASSERT_TRUE(only);
  EXPECT_EQ(only->tag, "");
  EXPECT_EQ(only->manifest_reference(), kDigest);
}

TEST(OciReference, RejectsMalformedReferences) {
  for (const char* bad : {"", "Alpine", "app:", "app:bad tag", "app@sha256:abc", "host.io/", "a//b",
                          "app@md5:0123456789abcdef0123456789abcdef"}) {
    auto r = parse_reference(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_EQ(r.error().kind, ErrorKind::kUsage) << bad;
      EXPECT_NE(r.error().message.find("reference"), std::string::npos) << r.error().message;
    }
  }
}

TEST(OciReference, RegistryHostsThatCanNeverBeReachedAreUsageErrors) {
  for (const char* bad : {":5055/x", "127.0.0.1:99999/x:v1", "127.0.0.1:0/x", "localhost:/x", "localhost:5x/x",
                          "[::1/x", "[::1]x/y", "-bad.io/x", "bad..:5000/x"}) {
    auto r = parse_reference(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_EQ(r.error().kind, ErrorKind::kUsage) << bad;
      EXPECT_NE(r.error().message.find("registry '"), std::string::npos) << r.error().message;
    }
  }
  for (const char* good : {"127.0.0.1:65535/x", "localhost:1/x", "[::1]:5000/x", "[::1]/x", "my-registry.io/x"}) {
    EXPECT_TRUE(parse_reference(good)) << good;
  }
  EXPECT_EQ(host_problem(":5055"), "no host before the port");
  EXPECT_EQ(host_problem("h:99999"), "port 99999 is out of range (1-65535)");
  EXPECT_EQ(host_problem("h:"), "port '' is not a number");
  EXPECT_EQ(host_problem("registry.example.com:443"), "");
}

TEST(OciReference, Sha256DigestFormat) {
  EXPECT_TRUE(is_sha256_digest(kDigest));
  EXPECT_FALSE(is_sha256_digest("sha256:" + std::string(64, 'A')));
  EXPECT_FALSE(is_sha256_digest("sha256:" + std::string(63, 'a')));
  EXPECT_FALSE(is_sha256_digest("sha512:" + std::string(64, 'a')));
}

}  // namespace
}  // namespace cfmo::oci
