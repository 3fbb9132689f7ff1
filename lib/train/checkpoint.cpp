#include "train/checkpoint.h"

#include "ckpt/safetensors.h"
#include "core/atomic_file.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>

namespace cfmo {
namespace fs = std::filesystem;
namespace {

constexpr int kStateVersion = 1;

std::span<const std::byte> as_bytes(const float* data, size_t count) {
  return std::as_bytes(std::span<const float>(data, count));
}

// Failing to create or rename in the run directory is a system failure (exit 5).
Error fs_error(const fs::path& path, std::string_view what, const std::error_code& ec) {
  return make_error(ErrorKind::kInternal, "{} '{}': {}", what, path.string(), ec.message());
}

/// "step-00001234" -> 1234, or -1 for anything else.
int64_t step_of(const std::string& name) {
  constexpr std::string_view kPrefix = "step-";
  if (!name.starts_with(kPrefix) || name.size() == kPrefix.size()) return -1;
  int64_t step = 0;
  for (char c : std::string_view(name).substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

/// Keeps the newest `keep` checkpoints up to `current`. Checkpoints past
/// `current` belong to a run that was abandoned when this one resumed from an
/// earlier step, and temporary directories to writers that crashed: both go.
/// Best effort: a checkpoint that cannot be removed costs disk, not correctness.
void prune_checkpoints(const fs::path& root, int64_t current, int keep) {
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> kept;
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!it->is_directory(ec)) continue;
    const int64_t step = step_of(name);
    if (name.starts_with(".step-") && name.find(".tmp-") != std::string::npos) {
      doomed.push_back(it->path());
    } else if (step > current) {
      doomed.push_back(it->path());
    } else if (step >= 0) {
      kept.emplace_back(step, it->path());
    }
  }
  std::sort(kept.begin(), kept.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < kept.size(); ++i) doomed.push_back(kept[i].second);
  for (const auto& path : doomed) fs::remove_all(path, ec);
}

}  // namespace

Status save_model(const fs::path& path, const Mlp& model, const std::map<std::string, std::string>& metadata) {
  std::vector<TensorRef> tensors;
  for (const auto& p : model.params()) {
    tensors.push_back({p.name, "F32", p.shape, as_bytes(model.parameters().data() + p.offset, p.size)});
  }
  return write_safetensors(path, tensors, metadata);
}

Result<fs::path> save_checkpoint(const fs::path& run_dir, const Mlp& model, Optimizer& optimizer,
                                 const TrainPosition& position, const std::string& config_toml, int keep) {
  const fs::path root = run_dir / "checkpoints";
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return fs_error(root, "Failed to create", ec);
  const std::string name = fmt::format("step-{:08}", position.step);
  const fs::path final_dir = root / name;
  const fs::path temp_dir = root / fmt::format(".{}.tmp-{}", name, ::getpid());
  fs::remove_all(temp_dir, ec);
  fs::create_directory(temp_dir, ec);
  if (ec) return fs_error(temp_dir, "Failed to create", ec);

  const std::map<std::string, std::string> model_meta = {
      {"format", "pt"}, {"cfmo.model", model.spec().to_string()}, {"cfmo.step", std::to_string(position.step)}};
  CFMO_TRY(save_model(temp_dir / "model.safetensors", model, model_meta));

  std::vector<TensorRef> state_tensors;
  auto states = optimizer.state();
  for (const auto& s : states) {
    for (const auto& p : model.params()) {
      state_tensors.push_back({p.name + "." + s.name, "F32", p.shape, as_bytes(s.buffer->data() + p.offset, p.size)});
    }
  }
  const std::map<std::string, std::string> optim_meta = {{"cfmo.optimizer", std::string(optimizer.name())},
                                                         {"cfmo.optimizer_steps", std::to_string(optimizer.step_count())}};
  CFMO_TRY(write_safetensors(temp_dir / "optimizer.safetensors", state_tensors, optim_meta));

  nlohmann::ordered_json state = {{"format", "cfmo-checkpoint"},
                                  {"version", kStateVersion},
                                  {"step", position.step},
                                  {"epoch", position.epoch},
                                  {"batch_in_epoch", position.batch_in_epoch},
                                  {"samples", position.samples},
                                  {"train_s", position.train_s},
                                  {"model", model.spec().to_string()},
                                  {"optimizer", optimizer.name()},
                                  {"optimizer_steps", optimizer.step_count()}};
  CFMO_TRY(write_file_atomic(temp_dir / "state.json", state.dump(2) + "\n"));
  CFMO_TRY(write_file_atomic(temp_dir / "config.toml", config_toml));
  CFMO_TRY(fsync_directory(temp_dir));

  // A checkpoint of the same step (a resumed run that stopped where it began) is replaced.
  fs::remove_all(final_dir, ec);
  fs::rename(temp_dir, final_dir, ec);
  if (ec) return fs_error(final_dir, "Failed to rename checkpoint onto", ec);
  CFMO_TRY(fsync_directory(root));
  CFMO_TRY(write_file_atomic(root / "latest", name + "\n"));

  prune_checkpoints(root, position.step, keep);
  return final_dir;
}

Result<fs::path> resolve_checkpoint(const fs::path& given) {
  std::error_code ec;
  // Absolute and without a trailing slash, so parent_path() means the parent directory.
  fs::path path = fs::absolute(given, ec).lexically_normal();
  if (path.has_parent_path() && path.filename().empty()) path = path.parent_path();
  if (fs::is_regular_file(path / "state.json", ec)) return path;
  const fs::path latest = path / "checkpoints" / "latest";
  if (!fs::is_regular_file(latest, ec)) {
    return make_error(ErrorKind::kInput, "--resume '{}': neither a checkpoint nor a run directory with checkpoints",
                      path.string());
  }
  CFMO_ASSIGN_OR_RETURN(std::string name, read_file(latest));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (name.empty() || name.find('/') != std::string::npos) {
    return make_error(ErrorKind::kInput, "'{}': does not name a checkpoint", latest.string());
  }
  const fs::path dir = path / "checkpoints" / name;
  if (!fs::is_regular_file(dir / "state.json", ec)) {
    return make_error(ErrorKind::kInput, "'{}': names '{}', which is missing", latest.string(), name);
  }
  return dir;
}

std::filesystem::path run_dir_of(const std::filesystem::path& checkpoint_dir) {
  const fs::path parent = checkpoint_dir.parent_path();
  if (parent.filename() == "checkpoints" && parent.has_parent_path()) return parent.parent_path();
  return {};
}

Result<TrainPosition> load_checkpoint(const fs::path& dir, Mlp& model, Optimizer& optimizer) {
  const fs::path state_path = dir / "state.json";
  CFMO_ASSIGN_OR_RETURN(std::string text, read_file(state_path));
  TrainPosition position;
  std::string optimizer_name;
  int64_t optimizer_steps = 0;
  try {
    const auto state = nlohmann::json::parse(text);
    if (state.at("format") != "cfmo-checkpoint" || state.at("version") != kStateVersion) {
      return make_error(ErrorKind::kInput, "'{}': not a version {} cfmo checkpoint", state_path.string(),
                        kStateVersion);
    }
    position.step = state.at("step").get<int64_t>();
    position.epoch = state.at("epoch").get<int64_t>();
    position.batch_in_epoch = state.at("batch_in_epoch").get<int64_t>();
    position.samples = state.at("samples").get<int64_t>();
    position.train_s = state.at("train_s").get<double>();
    optimizer_name = state.at("optimizer").get<std::string>();
    optimizer_steps = state.at("optimizer_steps").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kInput, "'{}': {}", state_path.string(), e.what());
  }
  if (position.step < 0 || position.epoch < 0 || position.batch_in_epoch < 0 || position.samples < 0) {
    return make_error(ErrorKind::kInput, "'{}': negative counters", state_path.string());
  }
  if (optimizer_name != optimizer.name()) {
    return make_error(ErrorKind::kUsage, "'{}': saved with optimizer {}, this run uses {}", state_path.string(),
                      optimizer_name, optimizer.name());
  }

  CFMO_ASSIGN_OR_RETURN(auto params, SafetensorsFile::read(dir / "model.safetensors"));
  for (const auto& p : model.params()) {
    CFMO_TRY(params.read_f32(p.name, p.shape, model.parameters().subspan(p.offset, p.size)));
  }
  CFMO_ASSIGN_OR_RETURN(auto state_file, SafetensorsFile::read(dir / "optimizer.safetensors"));
  for (const auto& s : optimizer.state()) {
    for (const auto& p : model.params()) {
      CFMO_TRY(state_file.read_f32(p.name + "." + s.name, p.shape, std::span<float>(*s.buffer).subspan(p.offset, p.size)));
    }
  }
  optimizer.set_step_count(optimizer_steps);
  return position;
}

}  // namespace cfmo
