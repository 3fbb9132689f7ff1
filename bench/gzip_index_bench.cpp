// gzip-index-bench: cfmo-pull's layer index on a real gzip tar: how long the
// index takes to build, how large it is, and how long reading every regular
// file back through it takes (each checked against the uncompressed tar).
#include "core/config.h"
#include "oci/gzip_index.h"
#include "oci/registry.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Times cfmo-pull's layer index on TAR and its gzip, TAR_GZ."};
  std::string tar_path;
  std::string gz_path;
  std::vector<std::string> spans = {"1M", "4M"};
  app.add_option("TAR", tar_path, "the uncompressed tar")->required();
  app.add_option("TAR_GZ", gz_path, "the same tar, gzip-compressed")->required();
  app.add_option("--span", spans, "checkpoint spans to try");
  CLI11_PARSE(app, argc, argv);
  const std::string tar = slurp(tar_path);
  const std::string gz = slurp(gz_path);
  const cfmo::oci::Descriptor layer{
      "application/vnd.oci.image.layer.v1.tar+gzip", cfmo::oci::sha256_digest(gz), static_cast<int64_t>(gz.size()), {}};
  for (const auto& text : spans) {
    const auto span = cfmo::parse_size(text);
    if (!span) return fmt::print(stderr, "--span {}: {}\n", text, span.error().message), 2;
    const auto start = std::chrono::steady_clock::now();
    auto index = cfmo::oci::build_layer_index(gz_path, layer, *span, "layer");
    const double build_s = since(start);
    if (!index) return fmt::print(stderr, "{}\n", index.error().message), 3;
    const size_t index_bytes = cfmo::oci::serialize_index(*index).size();
    cfmo::oci::FileSource source(gz_path);
    size_t files = 0;
    size_t mismatches = 0;
    double slowest_s = 0;
    const auto read_start = std::chrono::steady_clock::now();
    for (const auto& e : index->entries) {
      if (e.type != '0') continue;
      const auto one = std::chrono::steady_clock::now();
      const auto bytes = cfmo::oci::read_entry(*index, source, e, "layer");
      slowest_s = std::max(slowest_s, since(one));
      ++files;
      if (!bytes || *bytes != tar.substr(e.offset, e.size)) ++mismatches;
    }
    const double read_s = since(read_start);
    fmt::print(
        "span {}: build {:.2f} s ({:.0f} MB/s of tar), {} entries, {} checkpoints, index {} bytes ({:.2f}% of the "
        "layer); {} files read back in {:.1f} s (mean {:.1f} ms, slowest {:.3f} s), {} mismatches\n",
        text, build_s, tar.size() / 1e6 / build_s, index->entries.size(), index->checkpoints.size(), index_bytes,
        100.0 * index_bytes / gz.size(), files, read_s, 1e3 * read_s / files, slowest_s, mismatches);
    if (mismatches > 0) return 1;
  }
  return 0;
}
