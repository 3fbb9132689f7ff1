#include "train/delta_writer.h"

#include "ckpt/cfd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace cfmo::train {
namespace {
// Two rounds may wait; a third is skipped rather than waited for.
constexpr size_t kQueueLimit = 2;
}  // namespace

DeltaWriter::DeltaWriter(std::filesystem::path run_dir, int rank, std::vector<model::ParamInfo> layout,
                         int64_t round_offset)
    : run_dir_(run_dir),
      dir_(ckpt::delta_path(run_dir, rank, 0).parent_path()),
      rank_(rank),
      layout_(std::move(layout)),
      round_offset_(round_offset),
      writer_(kQueueLimit, BackgroundWriter<Job>::WhenFull::kSkipNew, [this](Job& job) { return write(job); }) {}

int64_t DeltaWriter::last_round(const std::filesystem::path& run_dir, int rank) {
  const auto dir = ckpt::delta_path(run_dir, rank, 0).parent_path();
  int64_t last = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    int64_t round = 0;
    const std::string name = it->path().filename().string();
    if (std::sscanf(name.c_str(), "round-%" SCNd64 ".cfd", &round) == 1 &&
        it->path() == ckpt::delta_path(run_dir, rank, round)) {
      last = std::max(last, round);
    }
  }
  return last;
}

DeltaWriter::~DeltaWriter() { close(); }

void DeltaWriter::close() { writer_.close(); }

void DeltaWriter::submit(int64_t round, int64_t step, int64_t base_version, std::span<const float> base,
                         std::span<const float> delta) {
  writer_.submit_with([&] {
    return Job{round_offset_ + round, step, base_version, tensor::FloatBuffer(base.begin(), base.end()),
               tensor::FloatBuffer(delta.begin(), delta.end())};
  });
}

Status DeltaWriter::write(Job& job) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return make_error(ErrorKind::kInternal, "Failed to create '{}': {}", dir_.string(), ec.message());
  std::vector<ckpt::CfdTensorInput> tensors;
  for (const auto& p : layout_) {
    tensors.push_back({p.name, p.shape, std::span<const float>(job.base).subspan(p.offset, p.size),
                       std::span<const float>(job.delta).subspan(p.offset, p.size)});
  }
  ckpt::CfdFileInfo info;
  info.rank = rank_;
  info.round = job.round;
  info.step = job.step;
  info.base_version = job.base_version;
  return ckpt::write_cfd(ckpt::delta_path(run_dir_, rank_, job.round), info, tensors);
}

}  // namespace cfmo::train
