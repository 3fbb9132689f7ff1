// oci-fixture: writes a synthetic container image as an OCI image layout,
// for bench/pull_vs_skopeo.sh (which pushes it to a local registry with
// skopeo). Each layer is a gzip tar of files in directories: a share of them
// random (incompressible), the rest text-like (gzip shrinks it about 3-4x, as
// it does binaries and text). Layers are generated, digested (diff ID and blob)
// and compressed as a stream, one thread per layer, in bounded memory.
//
//   oci-fixture DIR [--layers 4] [--layer-size 512M] [--file-size 8M]
//               [--random 0.5] [--level 6] [--seed 1] [--tag latest]
#include <archive.h>
#include <archive_entry.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size) { EVP_DigestUpdate(ctx_, data, size); }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    EVP_DigestFinal_ex(ctx_, md, &length);
    std::string out;
    for (unsigned int i = 0; i < length; ++i) out += fmt::format("{:02x}", md[i]);
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

std::string sha256_hex(const std::string& data) {
  Sha256 h;
  h.update(data.data(), data.size());
  return h.hex();
}

uint64_t parse_size(const std::string& text) {
  size_t used = 0;
  const double value = std::stod(text, &used);
  const std::string unit = text.substr(used);
  double scale = 1;
  if (unit == "K" || unit == "k") scale = 1024.0;
  if (unit == "M" || unit == "m") scale = 1024.0 * 1024;
  if (unit == "G" || unit == "g") scale = 1024.0 * 1024 * 1024;
  if (!unit.empty() && scale == 1) throw std::invalid_argument("size '" + text + "': use K, M or G");
  return static_cast<uint64_t>(value * scale);
}

struct Rng {
  uint64_t x;
  uint64_t next() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  }
};

/// Text-like bytes: words from a small vocabulary, with numbers and newlines.
void fill_text(std::string& out, size_t size, Rng& rng) {
  static const char* const kWords[] = {"the",    "layer", "image",   "config", "lib",    "usr",  "share", "error",
                                       "return", "value", "int",     "struct", "static", "void", "const", "data",
                                       "path",   "file",  "version", "build",  "pull",   "node", "train", "cfmo"};
  out.clear();
  while (out.size() < size) {
    const uint64_t r = rng.next();
    out += kWords[r % (sizeof kWords / sizeof kWords[0])];
    if ((r >> 8) % 7 == 0) out += std::to_string((r >> 16) % 100000);
    out += (r >> 40) % 11 == 0 ? '\n' : ' ';
  }
  out.resize(size);
}

void fill_random(std::string& out, size_t size, Rng& rng) {
  out.resize(size);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t v = rng.next();
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < size; ++i) out[i] = static_cast<char>(rng.next());
}

struct LayerOut {
  std::string diff_id;  ///< sha256 of the tar
  std::string digest;   ///< sha256 of the gzip blob
  uint64_t size = 0;
  uint64_t files = 0;
};

/// Receives the tar from libarchive: digests it, deflates it, digests and writes the blob.
struct Sink {
  Sha256 tar_hash;
  Sha256 blob_hash;
  z_stream z{};
  std::FILE* file = nullptr;
  std::vector<unsigned char> out = std::vector<unsigned char>(1u << 20);
  uint64_t blob_size = 0;

  void drain(int flush) {
    do {
      z.next_out = out.data();
      z.avail_out = static_cast<uInt>(out.size());
      deflate(&z, flush);
      const size_t n = out.size() - z.avail_out;
      blob_hash.update(out.data(), n);
      if (std::fwrite(out.data(), 1, n, file) != n) throw std::runtime_error("write failed");
      blob_size += n;
    } while (z.avail_out == 0);
  }
};

la_ssize_t sink_write(archive*, void* data, const void* buffer, size_t size) {
  auto* sink = static_cast<Sink*>(data);
  sink->tar_hash.update(buffer, size);
  sink->z.next_in = static_cast<Bytef*>(const_cast<void*>(buffer));
  sink->z.avail_in = static_cast<uInt>(size);
  sink->drain(Z_NO_FLUSH);
  return static_cast<la_ssize_t>(size);
}

LayerOut write_layer(const fs::path& blobs, int index, uint64_t layer_size, uint64_t file_size, double random_share,
                     int level, uint64_t seed) {
  Rng rng{seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(index) * 7919 + 1};
  Sink sink;
  deflateInit2(&sink.z, level, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  const fs::path tmp = blobs / fmt::format(".layer-{}.tmp", index);
  sink.file = std::fopen(tmp.c_str(), "wb");
  if (sink.file == nullptr) throw std::runtime_error("cannot write " + tmp.string());
  archive* a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  archive_write_open(a, &sink, nullptr, sink_write, nullptr);
  LayerOut result;
  auto header = [&](const std::string& path, mode_t type, mode_t perm, int64_t size) {
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, path.c_str());
    archive_entry_set_filetype(e, type);
    archive_entry_set_perm(e, perm);
    archive_entry_set_size(e, size);
    archive_entry_set_mtime(e, 1700000000 + index, 0);
    archive_write_header(a, e);
    archive_entry_free(e);
  };
  const std::string top = fmt::format("layer{}", index);
  header(top, AE_IFDIR, 0755, 0);
  std::string chunk;
  uint64_t written = 0;
  uint64_t dir_count = 0;
  const uint64_t files_per_dir = file_size >= (1u << 20) ? 16 : 200;
  while (written < layer_size) {
    if (result.files % files_per_dir == 0) {
      header(fmt::format("{}/d{:05}", top, ++dir_count), AE_IFDIR, 0755, 0);
    }
    // Sizes vary from half to one and a half times the average.
    uint64_t size = file_size / 2 + rng.next() % (file_size + 1);
    size = std::min(size, layer_size - written);
    const bool random = static_cast<double>(rng.next() % 1000) < random_share * 1000;
    header(fmt::format("{}/d{:05}/f{:06}{}", top, dir_count, result.files, random ? ".bin" : ".txt"), AE_IFREG, 0644,
           static_cast<int64_t>(size));
    for (uint64_t done = 0; done < size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(size - done, 1u << 20));
      if (random) {
        fill_random(chunk, n, rng);
      } else {
        fill_text(chunk, n, rng);
      }
      archive_write_data(a, chunk.data(), n);
      done += n;
    }
    written += size;
    ++result.files;
  }
  archive_write_close(a);
  archive_write_free(a);
  sink.z.next_in = nullptr;
  sink.z.avail_in = 0;
  sink.drain(Z_FINISH);
  deflateEnd(&sink.z);
  std::fclose(sink.file);
  result.diff_id = "sha256:" + sink.tar_hash.hex();
  const std::string hex = sink.blob_hash.hex();
  result.digest = "sha256:" + hex;
  result.size = sink.blob_size;
  fs::rename(tmp, blobs / hex);
  return result;
}

std::string put_blob(const fs::path& blobs, const std::string& body) {
  const std::string hex = sha256_hex(body);
  std::ofstream(blobs / hex, std::ios::binary) << body;
  return "sha256:" + hex;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a synthetic image as an OCI layout (for bench/pull_vs_skopeo.sh)."};
  std::string dir;
  int layers = 4;
  std::string layer_size = "512M";
  std::string file_size = "8M";
  double random_share = 0.5;
  int level = 6;
  uint64_t seed = 1;
  std::string tag = "latest";
  app.add_option("DIR", dir, "the OCI layout to write")->required();
  app.add_option("--layers", layers, "number of layers")->check(CLI::Range(1, 128));
  app.add_option("--layer-size", layer_size, "uncompressed bytes per layer (K, M, G)");
  app.add_option("--file-size", file_size, "average file size (K, M, G)");
  app.add_option("--random", random_share, "share of files with random (incompressible) content")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--level", level, "gzip level")->check(CLI::Range(1, 9));
  app.add_option("--seed", seed, "content seed");
  app.add_option("--tag", tag, "the name in index.json");
  CLI11_PARSE(app, argc, argv);
  try {
    const fs::path blobs = fs::path(dir) / "blobs" / "sha256";
    fs::create_directories(blobs);
    const uint64_t per_layer = parse_size(layer_size);
    const uint64_t per_file = std::max<uint64_t>(1, parse_size(file_size));
    std::vector<LayerOut> outs(static_cast<size_t>(layers));
    {
      std::vector<std::jthread> threads;
      for (int i = 0; i < layers; ++i) {
        threads.emplace_back([&, i] {
          outs[static_cast<size_t>(i)] = write_layer(blobs, i, per_layer, per_file, random_share, level, seed);
        });
      }
    }
    Json diff_ids = Json::array();
    Json descriptors = Json::array();
    uint64_t total = 0;
    uint64_t files = 0;
    for (const auto& l : outs) {
      diff_ids.push_back(l.diff_id);
      descriptors.push_back(
          {{"mediaType", "application/vnd.oci.image.layer.v1.tar+gzip"}, {"digest", l.digest}, {"size", l.size}});
      total += l.size;
      files += l.files;
    }
    const std::string config = Json{{"architecture", "amd64"},
                                    {"os", "linux"},
                                    {"config", {{"Env", {"PATH=/usr/bin:/bin"}}}},
                                    {"rootfs", {{"type", "layers"}, {"diff_ids", diff_ids}}}}
                                   .dump();
    const std::string config_digest = put_blob(blobs, config);
    const std::string manifest = Json{
        {"schemaVersion", 2},
        {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
        {"config",
         {{"mediaType", "application/vnd.oci.image.config.v1+json"},
          {"digest", config_digest},
          {"size", config.size()}}},
        {"layers", descriptors}}.dump();
    const std::string manifest_digest = put_blob(blobs, manifest);
    const Json index = {{"schemaVersion", 2},
                        {"mediaType", "application/vnd.oci.image.index.v1+json"},
                        {"manifests",
                         {{{"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                           {"digest", manifest_digest},
                           {"size", manifest.size()},
                           {"annotations", {{"org.opencontainers.image.ref.name", tag}}}}}}};
    std::ofstream(fs::path(dir) / "index.json") << index.dump(2) << "\n";
    std::ofstream(fs::path(dir) / "oci-layout") << "{\"imageLayoutVersion\":\"1.0.0\"}\n";
    fmt::print("{}: {} layers, {} files, {} bytes uncompressed, {} bytes compressed, manifest {}\n", dir, layers, files,
               per_layer * static_cast<uint64_t>(layers), total, manifest_digest);
  } catch (const std::exception& e) {
    fmt::print(stderr, "oci-fixture: {}\n", e.what());
    return 1;
  }
  return 0;
}
