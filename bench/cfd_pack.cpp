// cfd-pack: writes the delta between two safetensors checkpoints as a .cfd
// file, the way the trainer writes a round's delta (local - base, float32),
// for bench/diverge_vs_zstd.sh. Optionally also writes the raw float32 delta
// bytes, which the benchmark compresses with the zstd command as the peer.
//
//   cfd-pack BASE LOCAL OUT.cfd [--rank K] [--round R] [--step S] [--base-version V]
//            [--transform none|byteplanes|grouped-planes] [--codec zstd|none] [--level L]
//            [--raw OUT.f32] [--xor-base]
//
// --xor-base stores the bits of local XOR base instead of the delta: not a
// delta anyone can read back without the base, only a size to compare with.
#include "ckpt/cfd.h"
#include "ckpt/safetensors.h"

#include <fmt/format.h>

#include <bit>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

int usage() {
  fmt::print(
      stderr,
      "usage: cfd-pack BASE.safetensors LOCAL.safetensors OUT.cfd [--rank K] [--round R] [--step S]\n"
      "                [--base-version V] [--transform T] [--codec C] [--level L] [--raw OUT.f32] [--xor-base]\n");
  return 2;
}

bool to_int(const char* text, int64_t& out) {
  const char* end = text + std::strlen(text);
  auto [ptr, ec] = std::from_chars(text, end, out);
  return ec == std::errc() && ptr == end;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  cfmo::ckpt::CfdFileInfo info;
  cfmo::ckpt::CfdWriteOptions options;
  std::string raw_path;
  bool xor_base = false;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--xor-base") {
      xor_base = true;
      continue;
    }
    if (i + 1 >= argc) return usage();
    const char* value = argv[++i];
    int64_t n = 0;
    if (flag == "--transform" || flag == "--codec") {
      auto t = cfmo::ckpt::parse_cfd_transform(value);
      auto c = cfmo::ckpt::parse_cfd_codec(value);
      if (flag == "--transform" && t) {
        options.transform = *t;
      } else if (flag == "--codec" && c) {
        options.codec = *c;
      } else {
        return usage();
      }
    } else if (flag == "--raw") {
      raw_path = value;
    } else if (!to_int(value, n)) {
      return usage();
    } else if (flag == "--rank") {
      info.rank = static_cast<int>(n);
    } else if (flag == "--round") {
      info.round = n;
    } else if (flag == "--step") {
      info.step = n;
    } else if (flag == "--base-version") {
      info.base_version = n;
    } else if (flag == "--level") {
      options.zstd_level = static_cast<int>(n);
    } else {
      return usage();
    }
  }
  auto base = cfmo::ckpt::SafetensorsFile::read(argv[1]);
  auto local = cfmo::ckpt::SafetensorsFile::read(argv[2]);
  for (const auto* file : {&base, &local}) {
    if (!*file) {
      fmt::print(stderr, "cfd-pack: {}\n", file->error().message);
      return 3;
    }
  }
  std::vector<std::vector<float>> bases;
  std::vector<std::vector<float>> deltas;
  std::vector<cfmo::ckpt::CfdTensorInput> inputs;
  for (const auto& entry : base->tensors()) {
    std::vector<float> b(static_cast<size_t>(entry.elements()));
    std::vector<float> l(b.size());
    for (auto status : {base->read_f32(entry.name, entry.shape, b), local->read_f32(entry.name, entry.shape, l)}) {
      if (!status) {
        fmt::print(stderr, "cfd-pack: {}\n", status.error().message);
        return 3;
      }
    }
    std::vector<float> d(b.size());
    for (size_t i = 0; i < d.size(); ++i) {
      d[i] =
          xor_base ? std::bit_cast<float>(std::bit_cast<uint32_t>(l[i]) ^ std::bit_cast<uint32_t>(b[i])) : l[i] - b[i];
    }
    bases.push_back(std::move(b));
    deltas.push_back(std::move(d));
  }
  for (size_t t = 0; t < base->tensors().size(); ++t) {
    const auto& entry = base->tensors()[t];
    inputs.push_back({entry.name, entry.shape, bases[t], deltas[t]});
  }
  if (xor_base) info.metadata["cfd-pack"] = "xor-base: bits of local XOR base, not a delta";
  if (auto written = cfmo::ckpt::write_cfd(argv[3], info, inputs, options); !written) {
    fmt::print(stderr, "cfd-pack: {}\n", written.error().message);
    return 5;
  }
  if (!raw_path.empty()) {
    std::ofstream raw(raw_path, std::ios::binary);
    for (const auto& d : deltas)
      raw.write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size() * 4));
    if (!raw) {
      fmt::print(stderr, "cfd-pack: cannot write '{}'\n", raw_path);
      return 5;
    }
  }
  return 0;
}
