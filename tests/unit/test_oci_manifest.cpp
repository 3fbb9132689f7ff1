#include "oci/manifest.h"

#include "oci/pull.h"

#include <gtest/gtest.h>

namespace cfmo::oci {
namespace {

const std::string kA = "sha256:" + std::string(64, 'a');
const std::string kB = "sha256:" + std::string(64, 'b');
const std::string kC = "sha256:" + std::string(64, 'c');

TEST(OciManifest, ParsesAnImageManifest) {
  const std::string body = R"({"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
    "config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":")" +
                           kA + R"(","size":10},
    "layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":")" +
                           kB + R"(","size":20},
              {"mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","digest":")" +
                           kC + R"(","size":0}]})";
  auto m = parse_manifest(body, "", "image x");
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_FALSE(m->is_index);
  EXPECT_EQ(m->config.digest, kA);
  ASSERT_EQ(m->layers.size(), 2u);
  EXPECT_EQ(m->layers[0].size, 20);
  EXPECT_EQ(m->layers[1].media_type, "application/vnd.oci.image.layer.v1.tar+zstd");
}

TEST(OciManifest, MediaTypeFromContentTypeWhenTheBodyHasNone) {
  const std::string body = R"({"schemaVersion":2,"manifests":[
    {"digest":")" + kA + R"(","size":5,"platform":{"os":"linux","architecture":"amd64"}},
    {"digest":")" + kB + R"(","size":6,"platform":{"os":"linux","architecture":"arm64","variant":"v8"}}]})";
  auto m = parse_manifest(body, "application/vnd.docker.distribution.manifest.list.v2+json; charset=utf-8", "x");
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_TRUE(m->is_index);
  EXPECT_EQ(m->media_type, kDockerList);
  auto arm = select_platform(*m, {"linux", "arm64", ""}, "x");
  ASSERT_TRUE(arm);
  EXPECT_EQ(arm->digest, kB);
  auto arm_v8 = select_platform(*m, {"linux", "arm64", "v8"}, "x");
  ASSERT_TRUE(arm_v8);
  auto arm_v7 = select_platform(*m, {"linux", "arm64", "v7"}, "x");
  ASSERT_FALSE(arm_v7);
  EXPECT_EQ(arm_v7.error().kind, ErrorKind::kInput);
  EXPECT_NE(arm_v7.error().message.find("available: linux/amd64, linux/arm64/v8"), std::string::npos)
      << arm_v7.error().message;
}

TEST(OciManifest, RejectsMalformedManifestsNamingTheObject) {
  const std::string layer = R"({"digest":")" + kB + R"(","size":1})";
  const std::string config = R"("config":{"digest":")" + kA + R"(","size":1})";
  for (const std::string& bad : {
           std::string("not json"),
           std::string("[]"),
           R"({"schemaVersion":1,)" + config + R"(,"layers":[]})",
           std::string(R"({"schemaVersion":2,"layers":[]})"),
           R"({"schemaVersion":2,)" + config + "}",
           R"({"schemaVersion":2,)" + config + R"(,"layers":[{"digest":"sha256:abc","size":1}]})",
           R"({"schemaVersion":2,)" + config + R"(,"layers":[{"digest":")" + kB + R"(","size":-1}]})",
           R"({"schemaVersion":2,)" + config + R"(,"layers":[{"digest":")" + kB + R"("}]})",
           R"({"schemaVersion":2,"mediaType":"application/x-other",)" + config + R"(,"layers":[)" + layer + "]}",
       }) {
    auto m = parse_manifest(bad, "", "manifest m");
    EXPECT_FALSE(m) << bad;
    if (!m) {
      EXPECT_EQ(m.error().kind, ErrorKind::kInput) << bad;
      EXPECT_EQ(m.error().message.rfind("manifest m: ", 0), 0u) << m.error().message;
    }
  }
}

TEST(OciManifest, Platforms) {
  auto p = parse_platform("linux/arm/v7");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->os, "linux");
  EXPECT_EQ(p->architecture, "arm");
  EXPECT_EQ(p->variant, "v7");
  EXPECT_EQ(p->to_string(), "linux/arm/v7");
  for (const char* bad : {"", "linux", "linux/", "/amd64", "linux/arm/", "a/b/c/d"}) {
    auto r = parse_platform(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
    }
  }
  const auto host = host_platform();
  EXPECT_EQ(host.os, "linux");
  EXPECT_FALSE(host.architecture.empty());
}

}  // namespace
}  // namespace cfmo::oci

namespace cfmo::oci {
namespace {

TEST(OciManifest, DockerSchema2BecomesOciWithTheSameBlobs) {
  const std::string docker = R"({"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
    "config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":")" +
                             kA + R"(","size":10},
    "layers":[{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":")" +
                             kB + R"(","size":20},
              {"mediaType":"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip","digest":")" +
                             kC + R"(","size":30,"urls":["https://example.com/l"]}]})";
  auto converted = docker_to_oci_manifest(docker, "manifest m");
  ASSERT_TRUE(converted) << converted.error().message;
  auto m = parse_manifest(*converted, "", "converted");
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->media_type, kOciManifest);
  EXPECT_EQ(m->config.media_type, "application/vnd.oci.image.config.v1+json");
  EXPECT_EQ(m->config.digest, kA);
  ASSERT_EQ(m->layers.size(), 2u);
  EXPECT_EQ(m->layers[0].media_type, "application/vnd.oci.image.layer.v1.tar+gzip");
  EXPECT_EQ(m->layers[0].digest, kB);
  EXPECT_EQ(m->layers[1].media_type, "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip");
  EXPECT_NE(converted->find("https://example.com/l"), std::string::npos);  // urls kept
  auto bad = docker_to_oci_manifest("{}", "manifest m");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kInput);
}

}  // namespace
}  // namespace cfmo::oci
