#include "oci/hosts.h"

#include "support/expect_error.h"

#include <gtest/gtest.h>

namespace cfmo::oci {
namespace {

Reference ref_of(const std::string& text) { return *parse_reference(text); }

TEST(OciHosts, MirrorsComeFirstThenTheOrigin) {
  auto e = endpoints_for(ref_of("registry.example.com/team/app:v1"),
                         {{"mirror-a.example", "http://127.0.0.1:5001/", "https://mirror-b.example:8443"}, {}, false});
  ASSERT_TRUE(e.has_value()) << e.error().message;
  ASSERT_EQ(e->size(), 4u);
  EXPECT_EQ((*e)[0].host, "mirror-a.example");
  EXPECT_FALSE((*e)[0].plain_http);
  EXPECT_EQ((*e)[1].host, "127.0.0.1:5001");
  EXPECT_TRUE((*e)[1].plain_http);
  EXPECT_EQ((*e)[2].host, "mirror-b.example:8443");
  EXPECT_FALSE((*e)[2].plain_http);
  EXPECT_TRUE((*e)[2].mirror);
  EXPECT_EQ((*e)[3].host, "registry.example.com");
  EXPECT_FALSE((*e)[3].mirror);
  EXPECT_EQ((*e)[3].describe(), "registry registry.example.com");
  // Docker Hub's API host.
  EXPECT_EQ(endpoints_for(ref_of("alpine"), {})->back().host, "registry-1.docker.io");
}

TEST(OciHosts, InsecureIsPerHost) {
  const HostSettings hosts{{"m.example:5000", "n.example"}, {"m.example", "127.0.0.1:5000"}, false};
  auto e = endpoints_for(ref_of("127.0.0.1:5000/x:1"), hosts);
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE((*e)[0].plain_http);  // a host without a port covers all of its ports
  EXPECT_FALSE((*e)[1].plain_http);
  EXPECT_TRUE((*e)[2].plain_http);
  EXPECT_FALSE(endpoints_for(ref_of("127.0.0.1:5001/x:1"), hosts)->back().plain_http);
  EXPECT_TRUE(endpoints_for(ref_of("example.com/x"), {{}, {}, true})->back().plain_http);
}

TEST(OciHosts, MalformedHostsAreUsageErrors) {
  for (const char* bad : {"ftp://x", "x/y", "", "a b", "host:port"}) {
    EXPECT_TRUE(fails_with(endpoints_for(ref_of("alpine"), {{bad}, {}, false}), ErrorKind::kUsage, {"--mirror"}))
        << bad;
  }
  EXPECT_TRUE(fails_with(endpoints_for(ref_of("alpine"), {{}, {"http://x"}, false}), ErrorKind::kUsage,
                         {"--insecure-registry 'http://x'"}));
  EXPECT_TRUE(endpoints_for(ref_of("alpine"), {{"[::1]:5000"}, {}, false}).has_value());
}

}  // namespace
}  // namespace cfmo::oci
