#include "train/checkpoint.h"

#include "ckpt/safetensors.h"
#include "core/atomic_file.h"
#include "core/dir_lock.h"

#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>

namespace cfmo::train {
namespace fs = std::filesystem;
namespace {

constexpr int kStateVersion = 1;

/// The file of rank K's own inner optimizer state (K >= 1).
std::string rank_optimizer_file(int rank) { return fmt::format("optimizer-rank-{}.safetensors", rank); }
/// The file of rank K's error feedback.
std::string wire_residual_file(int rank) { return fmt::format("wire-rank-{}.safetensors", rank); }

/// Reads an optimizer state file of this model into `optimizer`'s buffers.
Status read_optimizer_state(const fs::path& file, const model::Model& model, optim::Optimizer& optimizer) {
  CFMO_ASSIGN_OR_RETURN(auto state_file, ckpt::SafetensorsFile::read(file));
  for (const auto& s : optimizer.state()) {
    for (const auto& p : model.params()) {
      CFMO_TRY(
          state_file.read_f32(p.name + "." + s.name, p.shape, std::span<float>(*s.buffer).subspan(p.offset, p.size)));
    }
  }
  return {};
}

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
/// earlier step, and temporary directories to writers that died or to this
/// process's failed writes: both go.
/// Best effort: a checkpoint that cannot be removed costs disk, not correctness.
void prune_checkpoints(const fs::path& root, int64_t current, int keep) {
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> kept;
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!it->is_directory(ec)) continue;
    const int64_t step = step_of(name);
    if (const auto tmp = name.find(".tmp-"); name.starts_with(".step-") && tmp != std::string::npos) {
      // Another live process's write in progress (a second keeper of a
      // split run) is its to finish or drop; a dead writer's is left over.
      const int pid = std::atoi(name.c_str() + tmp + 5);
      if (pid == ::getpid() || !process_alive(pid)) doomed.push_back(it->path());
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

Status save_model(const fs::path& path, const model::Model& model, const std::map<std::string, std::string>& metadata) {
  std::vector<ckpt::TensorRef> tensors;
  for (const auto& p : model.params()) {
    tensors.push_back({p.name, "F32", p.shape, as_bytes(model.parameters().data() + p.offset, p.size)});
  }
  return ckpt::write_safetensors(path, tensors, metadata);
}

CheckpointData checkpoint_data(const model::Model& model, optim::Optimizer& optimizer, const TrainPosition& position) {
  CheckpointData data;
  data.position = position;
  data.params.assign(model.parameters().begin(), model.parameters().end());
  data.optimizer_name = std::string(optimizer.name());
  data.optimizer_steps = optimizer.step_count();
  for (const auto& s : optimizer.state()) data.optimizer_state.emplace_back(s.name, *s.buffer);
  return data;
}

namespace {

/// A position; of a grown world (`grown`), with the cut of its epoch.
nlohmann::ordered_json position_json(const TrainPosition& p, bool grown) {
  nlohmann::ordered_json out = {{"step", p.step},
                                {"epoch", p.epoch},
                                {"batch_in_epoch", p.batch_in_epoch},
                                {"samples", p.samples},
                                {"train_s", p.train_s}};
  if (grown && p.data_world > 0) out["data_world"] = p.data_world;
  return out;
}

/// Whether a checkpoint's world grew by joins since the run started.
bool grew(const CheckpointWorld& w) { return w.first_workers > 0 && w.first_workers != w.workers; }

/// Puts `temp_dir` where `final_dir` is: a rename, or, when a checkpoint of
/// the same step is there already (a resumed run that stopped where it began,
/// the end of an asynchronous run at a step that had a checkpoint), an atomic
/// exchange, so that step-N never goes missing; the old one is then removed.
Status put_in_place(const fs::path& temp_dir, const fs::path& final_dir) {
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (renameat2(AT_FDCWD, temp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      fs::remove_all(temp_dir, ec);
      return {};
    }
    // A file system without exchange: replace it (not atomic, but never torn).
    fs::remove_all(final_dir, ec);
  }
  fs::rename(temp_dir, final_dir, ec);
  if (ec) return fs_error(final_dir, "Failed to rename checkpoint onto", ec);
  return {};
}

}  // namespace

Result<fs::path> write_checkpoint(const fs::path& run_dir, const std::string& model_spec,
                                  const std::vector<model::ParamInfo>& layout, const CheckpointData& data,
                                  const std::string& config_toml, int keep) {
  const fs::path root = run_dir / "checkpoints";
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return fs_error(root, "Failed to create", ec);
  const TrainPosition& position = data.position;
  const std::string name = fmt::format("step-{:08}", position.step);
  const fs::path final_dir = root / name;
  const fs::path temp_dir = root / fmt::format(".{}.tmp-{}", name, ::getpid());
  fs::remove_all(temp_dir, ec);
  fs::create_directory(temp_dir, ec);
  if (ec) return fs_error(temp_dir, "Failed to create", ec);
  // However this ends, the temporary directory goes: after a failed write (a full
  // disk) a partial checkpoint left behind would keep the disk full; after a
  // successful one it has been renamed away already.
  struct RemoveOnExit {
    const fs::path& dir;
    ~RemoveOnExit() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } remove_temp{temp_dir};

  auto tensors_of = [&](std::span<const float> flat, const std::string& suffix) {
    std::vector<ckpt::TensorRef> tensors;
    for (const auto& p : layout) {
      tensors.push_back({p.name + suffix, "F32", p.shape, as_bytes(flat.data() + p.offset, p.size)});
    }
    return tensors;
  };
  const std::map<std::string, std::string> model_meta = {
      {"format", "pt"}, {"cfmo.model", model_spec}, {"cfmo.step", std::to_string(position.step)}};
  CFMO_TRY(ckpt::write_safetensors(temp_dir / "model.safetensors", tensors_of(data.params, ""), model_meta));

  const std::map<std::string, std::string> optim_meta = {
      {"cfmo.optimizer", data.optimizer_name}, {"cfmo.optimizer_steps", std::to_string(data.optimizer_steps)}};
  auto write_optimizer = [&](const std::string& file,
                             const std::vector<std::pair<std::string, tensor::FloatBuffer>>& state) {
    std::vector<ckpt::TensorRef> state_tensors;
    for (const auto& [state_name, buffer] : state) {
      for (auto& t : tensors_of(buffer, "." + state_name)) state_tensors.push_back(std::move(t));
    }
    return ckpt::write_safetensors(temp_dir / file, state_tensors, optim_meta);
  };
  CFMO_TRY(write_optimizer("optimizer.safetensors", data.optimizer_state));
  nlohmann::ordered_json rank_files = nlohmann::ordered_json::array();
  for (size_t k = 0; k < data.rank_optimizer_state.size(); ++k) {
    rank_files.push_back(rank_optimizer_file(static_cast<int>(k) + 1));
    CFMO_TRY(write_optimizer(rank_files.back().get<std::string>(), data.rank_optimizer_state[k]));
  }
  if (!data.outer_momentum.empty()) {
    auto tensors = tensors_of(data.outer_momentum, ".outer_momentum");
    if (data.outer_round_sum.size() == data.outer_momentum.size()) {
      auto sums = tensors_of(data.outer_round_sum, ".outer_round_sum");
      tensors.insert(tensors.end(), sums.begin(), sums.end());
    }
    CFMO_TRY(ckpt::write_safetensors(temp_dir / "outer.safetensors", tensors, {{"cfmo.state", "outer_momentum"}}));
  }
  nlohmann::ordered_json residual_files = nlohmann::ordered_json::array();
  for (size_t k = 0; k < data.wire_residuals.size(); ++k) {
    residual_files.push_back(wire_residual_file(static_cast<int>(k)));
    CFMO_TRY(ckpt::write_safetensors(temp_dir / residual_files.back().get<std::string>(),
                                     tensors_of(data.wire_residuals[k], ".wire_residual"),
                                     {{"cfmo.state", "wire_residual"}}));
  }

  nlohmann::ordered_json state = {{"format", "cfmo-checkpoint"},
                                  {"version", kStateVersion},
                                  {"step", position.step},
                                  {"epoch", position.epoch},
                                  {"batch_in_epoch", position.batch_in_epoch},
                                  {"samples", position.samples},
                                  {"train_s", position.train_s},
                                  {"model", model_spec},
                                  {"optimizer", data.optimizer_name},
                                  {"optimizer_steps", data.optimizer_steps},
                                  {"workers", data.world.workers}};
  const bool grown = grew(data.world);
  if (grown) {
    // The world the run started with (its plan), and the cut of this position's epoch.
    state["first_workers"] = data.world.first_workers;
    if (position.data_world > 0) state["data_world"] = position.data_world;
  }
  if (!data.world.mode.empty()) state["mode"] = data.world.mode;
  if (data.world.batch_size > 0) state["batch_size"] = data.world.batch_size;
  if (!data.world.ranks.empty()) {
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (const auto& p : data.world.ranks) ranks.push_back(position_json(p, grown));
    state["ranks"] = ranks;
  }
  if (!data.world.shard_optimizer_steps.empty()) state["shard_optimizer_steps"] = data.world.shard_optimizer_steps;
  if (!data.world.shard_versions.empty()) state["shard_versions"] = data.world.shard_versions;
  if (!data.outer_momentum.empty()) state["outer"] = "outer.safetensors";
  if (!data.outer_momentum.empty() && data.outer_round_sum.size() == data.outer_momentum.size()) {
    state["outer_in_round"] = data.world.outer_in_round;
  }
  if (!rank_files.empty()) {
    state["rank_optimizers"] = rank_files;
    if (!data.world.rank_optimizer_steps.empty()) state["rank_optimizer_steps"] = data.world.rank_optimizer_steps;
  }
  if (!residual_files.empty()) state["wire_residuals"] = residual_files;
  CFMO_TRY(write_file_atomic(temp_dir / "state.json", state.dump(2) + "\n"));
  CFMO_TRY(write_file_atomic(temp_dir / "config.toml", config_toml));
  CFMO_TRY(fsync_directory(temp_dir));

  CFMO_TRY(put_in_place(temp_dir, final_dir));
  CFMO_TRY(fsync_directory(root));
  CFMO_TRY(write_file_atomic(root / "latest", name + "\n"));

  prune_checkpoints(root, position.step, keep);
  return final_dir;
}

Result<fs::path> save_checkpoint(const fs::path& run_dir, const model::Model& model, optim::Optimizer& optimizer,
                                 const TrainPosition& position, const std::string& config_toml, int keep) {
  return write_checkpoint(run_dir, model.spec_string(), model.params(), checkpoint_data(model, optimizer, position),
                          config_toml, keep);
}

CheckpointWriter::CheckpointWriter(fs::path run_dir, std::string model_spec, std::vector<model::ParamInfo> layout,
                                   std::string config_toml, int keep)
    : run_dir_(std::move(run_dir)),
      spec_(std::move(model_spec)),
      layout_(std::move(layout)),
      config_toml_(std::move(config_toml)),
      keep_(keep),
      writer_(1, BackgroundWriter<CheckpointData>::WhenFull::kReplaceWaiting,
              [this](CheckpointData& data) { return write(data); }) {}

CheckpointWriter::~CheckpointWriter() { close(); }

void CheckpointWriter::close() { writer_.close(); }

bool CheckpointWriter::submit(CheckpointData data) { return writer_.submit(std::move(data)); }

Status CheckpointWriter::write(CheckpointData& data) {
  CFMO_TRY(write_checkpoint(run_dir_, spec_, layout_, data, config_toml_, keep_));
  last_step_ = data.position.step;
  return {};
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
  if (step_of(checkpoint_dir.filename().string()) >= 0 && parent.filename() == "checkpoints" &&
      parent.has_parent_path()) {
    return parent.parent_path();
  }
  return {};
}

Result<DirLock> lock_run_dir(const fs::path& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return make_error(ErrorKind::kUsage, "--out '{}': {}", run_dir.string(), ec.message());
  auto lock = DirLock::acquire(run_dir, ".cfmo-train.lock", "cfmo-train", std::chrono::steady_clock::now());
  if (!lock && lock.error().kind == ErrorKind::kPeer) {
    // Busy is not a network failure here: the user named a directory in use.
    return make_error(ErrorKind::kUsage, "--out {}; wait for it or choose another run directory", lock.error().message);
  }
  return lock;
}

namespace {

TrainPosition position_from(const nlohmann::json& j) {
  TrainPosition p;
  p.step = j.at("step").get<int64_t>();
  p.epoch = j.at("epoch").get<int64_t>();
  p.batch_in_epoch = j.at("batch_in_epoch").get<int64_t>();
  p.samples = j.at("samples").get<int64_t>();
  p.train_s = j.at("train_s").get<double>();
  p.data_world = j.value("data_world", int64_t{0});
  return p;
}

bool negative(const TrainPosition& p) {
  return p.step < 0 || p.epoch < 0 || p.batch_in_epoch < 0 || p.samples < 0 || p.data_world < 0;
}

}  // namespace

Result<TrainPosition> load_checkpoint(const fs::path& dir, model::Model& model, optim::Optimizer& optimizer,
                                      CheckpointWorld* world, tensor::FloatBuffer* outer_momentum,
                                      tensor::FloatBuffer* outer_round_sum) {
  const fs::path state_path = dir / "state.json";
  CFMO_ASSIGN_OR_RETURN(std::string text, read_file(state_path));
  TrainPosition position;
  CheckpointWorld recorded;
  std::string optimizer_name;
  std::string model_name;
  std::string outer_file;
  int64_t optimizer_steps = 0;
  try {
    const auto state = nlohmann::json::parse(text);
    if (state.at("format") != "cfmo-checkpoint" || state.at("version") != kStateVersion) {
      return make_error(ErrorKind::kInput, "'{}': not a version {} cfmo checkpoint", state_path.string(),
                        kStateVersion);
    }
    position = position_from(state);
    optimizer_name = state.at("optimizer").get<std::string>();
    model_name = state.value("model", std::string());
    optimizer_steps = state.at("optimizer_steps").get<int64_t>();
    recorded.workers = state.value("workers", 1);
    recorded.first_workers = state.value("first_workers", 0);
    recorded.mode = state.value("mode", std::string());
    recorded.batch_size = state.value("batch_size", 0);
    if (state.contains("ranks")) {
      for (const auto& r : state.at("ranks")) recorded.ranks.push_back(position_from(r));
    }
    if (state.contains("shard_optimizer_steps")) {
      recorded.shard_optimizer_steps = state.at("shard_optimizer_steps").get<std::vector<int64_t>>();
    }
    recorded.shard_versions = state.value("shard_versions", std::vector<int64_t>());
    recorded.outer_in_round = state.value("outer_in_round", std::vector<int64_t>());
    recorded.rank_optimizer_steps = state.value("rank_optimizer_steps", std::vector<int64_t>());
    if (state.contains("wire_residuals")) {
      const auto files = state.at("wire_residuals").get<std::vector<std::string>>();
      bool named = files.size() == static_cast<size_t>(recorded.workers);
      for (size_t k = 0; named && k < files.size(); ++k) named = files[k] == wire_residual_file(static_cast<int>(k));
      if (!named) {
        return make_error(ErrorKind::kInput, "'{}': wire_residuals does not name wire-rank-0 to -{} of {} workers",
                          state_path.string(), recorded.workers - 1, recorded.workers);
      }
    }
    outer_file = state.value("outer", std::string());
    if (state.contains("rank_optimizers")) {
      const auto files = state.at("rank_optimizers").get<std::vector<std::string>>();
      bool named = files.size() + 1 == static_cast<size_t>(recorded.workers);
      for (size_t k = 0; named && k < files.size(); ++k)
        named = files[k] == rank_optimizer_file(static_cast<int>(k) + 1);
      if (!named) {
        return make_error(ErrorKind::kInput,
                          "'{}': rank_optimizers does not name optimizer-rank-1 to -{} of {} workers",
                          state_path.string(), recorded.workers - 1, recorded.workers);
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kInput, "'{}': {}", state_path.string(), e.what());
  }
  bool bad_ranks = std::any_of(recorded.ranks.begin(), recorded.ranks.end(), negative);
  for (const auto* counts : {&recorded.shard_optimizer_steps, &recorded.shard_versions, &recorded.outer_in_round,
                             &recorded.rank_optimizer_steps}) {
    for (int64_t s : *counts) bad_ranks = bad_ranks || s < 0;
  }
  if (negative(position) || bad_ranks) {
    return make_error(ErrorKind::kInput, "'{}': negative counters", state_path.string());
  }
  // A grown world's cuts lie between the ranks it started with and those it has.
  auto cut_outside = [&](const TrainPosition& p) {
    return p.data_world != 0 &&
           (!grew(recorded) || p.data_world < recorded.first_workers || p.data_world > recorded.workers);
  };
  if (recorded.first_workers < 0 || recorded.first_workers > recorded.workers || cut_outside(position) ||
      std::any_of(recorded.ranks.begin(), recorded.ranks.end(), cut_outside)) {
    return make_error(ErrorKind::kInput,
                      "'{}': first_workers and data_world must lie between 1 and workers ({}), data_world only "
                      "where first_workers is below workers",
                      state_path.string(), recorded.workers);
  }
  if (recorded.workers < 1 || recorded.batch_size < 0 ||
      (!recorded.ranks.empty() && recorded.ranks.size() != static_cast<size_t>(recorded.workers)) ||
      (!recorded.shard_optimizer_steps.empty() &&
       recorded.shard_optimizer_steps.size() != static_cast<size_t>(recorded.workers)) ||
      // Per shard: K of them (--owners), at most one per worker, the same K for both.
      recorded.shard_versions.size() > static_cast<size_t>(recorded.workers) ||
      recorded.outer_in_round.size() > static_cast<size_t>(recorded.workers) ||
      (!recorded.shard_versions.empty() && !recorded.outer_in_round.empty() &&
       recorded.shard_versions.size() != recorded.outer_in_round.size()) ||
      (!recorded.rank_optimizer_steps.empty() &&
       recorded.rank_optimizer_steps.size() != static_cast<size_t>(recorded.workers))) {
    return make_error(ErrorKind::kInput,
                      "'{}': workers, ranks, shard_optimizer_steps, shard_versions, outer_in_round and "
                      "rank_optimizer_steps disagree",
                      state_path.string());
  }
  if (!outer_file.empty() && outer_file != "outer.safetensors") {
    return make_error(ErrorKind::kInput, "'{}': outer names '{}', not outer.safetensors", state_path.string(),
                      outer_file);
  }
  if (optimizer_name != optimizer.name()) {
    return make_error(ErrorKind::kUsage, "'{}': saved with optimizer {}, this run uses {}", state_path.string(),
                      optimizer_name, optimizer.name());
  }

  CFMO_ASSIGN_OR_RETURN(auto params, ckpt::SafetensorsFile::read(dir / "model.safetensors"));
  for (const auto& p : model.params()) {
    CFMO_TRY(params.read_f32(p.name, p.shape, model.parameters().subspan(p.offset, p.size)));
  }
  // Tensors of the right shapes under another model's name: state.json is not this checkpoint's.
  if (!model_name.empty() && model_name != model.spec_string()) {
    return make_error(ErrorKind::kInput, "'{}': model '{}' is not the one its tensors hold ({})", state_path.string(),
                      model_name, model.spec_string());
  }
  CFMO_TRY(read_optimizer_state(dir / "optimizer.safetensors", model, optimizer));
  optimizer.set_step_count(optimizer_steps);
  if (outer_momentum != nullptr) {
    outer_momentum->clear();
    if (!outer_file.empty()) {
      CFMO_ASSIGN_OR_RETURN(auto outer, ckpt::SafetensorsFile::read(dir / outer_file));
      outer_momentum->assign(model.num_params(), 0.0f);
      for (const auto& p : model.params()) {
        CFMO_TRY(outer.read_f32(p.name + ".outer_momentum", p.shape,
                                std::span<float>(*outer_momentum).subspan(p.offset, p.size)));
      }
      // The owners' pending rounds, where state.json counts them.
      if (outer_round_sum != nullptr && !recorded.outer_in_round.empty()) {
        outer_round_sum->assign(model.num_params(), 0.0f);
        for (const auto& p : model.params()) {
          CFMO_TRY(outer.read_f32(p.name + ".outer_round_sum", p.shape,
                                  std::span<float>(*outer_round_sum).subspan(p.offset, p.size)));
        }
      }
    }
  }
  if (world != nullptr) *world = std::move(recorded);
  return position;
}

Result<bool> load_rank_optimizer(const fs::path& dir, const model::Model& model, optim::Optimizer& optimizer,
                                 int rank) {
  const fs::path state_path = dir / "state.json";
  CFMO_ASSIGN_OR_RETURN(std::string text, read_file(state_path));
  size_t files = 0;
  std::vector<int64_t> steps;
  try {
    const auto state = nlohmann::json::parse(text);
    if (state.contains("rank_optimizers")) files = state.at("rank_optimizers").size();
    steps = state.value("rank_optimizer_steps", std::vector<int64_t>());
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kInput, "'{}': {}", state_path.string(), e.what());
  }
  // load_checkpoint checked the names and counts; rank 0's state is optimizer.safetensors.
  if (rank < 1 || static_cast<size_t>(rank) > files) return false;
  CFMO_TRY(read_optimizer_state(dir / rank_optimizer_file(rank), model, optimizer));
  // Ranks whose batch was empty at an epoch's end did not step: their counts differ.
  if (static_cast<size_t>(rank) < steps.size()) optimizer.set_step_count(steps[static_cast<size_t>(rank)]);
  return true;
}

Result<tensor::FloatBuffer> load_wire_residual(const fs::path& dir, const model::Model& model, int rank) {
  const fs::path state_path = dir / "state.json";
  CFMO_ASSIGN_OR_RETURN(std::string text, read_file(state_path));
  size_t files = 0;
  try {
    const auto state = nlohmann::json::parse(text);
    if (state.contains("wire_residuals")) files = state.at("wire_residuals").size();
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kInput, "'{}': {}", state_path.string(), e.what());
  }
  tensor::FloatBuffer out;
  if (rank < 0 || static_cast<size_t>(rank) >= files) return out;
  // load_checkpoint checked the names.
  CFMO_ASSIGN_OR_RETURN(auto file, ckpt::SafetensorsFile::read(dir / wire_residual_file(rank)));
  out.assign(model.num_params(), 0.0f);
  for (const auto& p : model.params()) {
    CFMO_TRY(file.read_f32(p.name + ".wire_residual", p.shape, std::span<float>(out).subspan(p.offset, p.size)));
  }
  return out;
}

Status check_positions(const fs::path& dir, const TrainPosition& position, const CheckpointWorld& world,
                       int64_t optimizer_steps, int64_t examples, int batch) {
  const std::string state = (dir / "state.json").string();
  const int64_t global_batch = static_cast<int64_t>(batch) * world.workers;
  const int64_t batches = (examples + global_batch - 1) / global_batch;  // an epoch's
  auto batches_of = [&](int64_t ranks) {
    const int64_t cut = static_cast<int64_t>(batch) * ranks;
    return (examples + cut - 1) / cut;
  };
  int64_t total_steps = 0;
  auto check_grown = [&](const TrainPosition& p, const std::string& where) -> Status {
    // Each epoch was cut among first_workers to workers ranks, as this rank
    // took the world's growth up (a joiner of cfmo from its own start, of a
    // lockstep group with the members' position): its epochs had between
    // the grown world's batches and the first world's each.
    const int64_t cut = p.data_world > 0 ? p.data_world : world.workers;
    const int64_t fewest = batches_of(world.workers);
    const int64_t most = batches_of(world.first_workers);
    if (p.batch_in_epoch > batches_of(cut)) {
      return make_error(ErrorKind::kInput, "'{}': {}batch_in_epoch {} is past the end of an epoch ({} batches of {})",
                        state, where, p.batch_in_epoch, batches_of(cut), static_cast<int64_t>(batch) * cut);
    }
    // (epoch <= step / fewest first: the products below then do not overflow, but the longest may.)
    const int64_t longest = p.epoch > INT64_MAX / most ? INT64_MAX : p.epoch * most;
    if (p.epoch > p.step / fewest || p.step - p.batch_in_epoch < p.epoch * fewest ||
        p.step - p.batch_in_epoch > longest) {
      return make_error(ErrorKind::kInput,
                        "'{}': {}step {} is not epoch {} x {} to {} batches + batch_in_epoch {} (the data has {} "
                        "examples, the world grew from {} to {} ranks)",
                        state, where, p.step, p.epoch, fewest, most, p.batch_in_epoch, examples, world.first_workers,
                        world.workers);
    }
    if (p.step > INT64_MAX / std::max(batch, 1) || p.samples > p.step * batch) {
      return make_error(ErrorKind::kInput, "'{}': {}samples {} is more than {} steps of this data take", state, where,
                        p.samples, p.step);
    }
    return {};
  };
  auto check_counts = [&](const TrainPosition& p, const std::string& where, int rank) -> Status {
    // The examples rank `rank` takes in the first `n` batches of an epoch (the last batches can be short or empty).
    auto samples_in = [&](int64_t n) {
      int64_t sum = 0;
      for (int64_t k = 0; k < n; ++k) {
        sum += std::clamp<int64_t>(examples - (k * global_batch + rank * batch), 0, batch);
      }
      return sum;
    };
    // batch_in_epoch = batches is the end of an epoch: a rank's position in cfmo and asgd is
    // recorded after its step and before it turns to the next epoch.
    if (p.batch_in_epoch > batches) {
      return make_error(ErrorKind::kInput, "'{}': {}batch_in_epoch {} is past the end of an epoch ({} batches of {})",
                        state, where, p.batch_in_epoch, batches, global_batch);
    }
    if (p.epoch > p.step / batches || p.epoch * batches + p.batch_in_epoch != p.step) {
      return make_error(ErrorKind::kInput,
                        "'{}': {}step {} is not epoch {} x {} batches + batch_in_epoch {} (the data has {} examples)",
                        state, where, p.step, p.epoch, batches, p.batch_in_epoch, examples);
    }
    // Without overflow: epoch <= step / batches, so epoch x an epoch's samples <= step x batch.
    if (p.step > INT64_MAX / std::max(batch, 1) ||
        p.samples != p.epoch * samples_in(batches) + samples_in(p.batch_in_epoch)) {
      return make_error(ErrorKind::kInput, "'{}': {}samples {} is not what {} steps of this data take", state, where,
                        p.samples, p.step);
    }
    return {};
  };
  // A position's counters (a grown world's as such), its time, and the steps of all.
  auto check = [&](const TrainPosition& p, const std::string& where, int rank) -> Status {
    if (world.first_workers > 0 && world.first_workers != world.workers) {
      CFMO_TRY(check_grown(p, where));
    } else {
      CFMO_TRY(check_counts(p, where, rank));
    }
    if (!std::isfinite(p.train_s) || p.train_s < 0) {
      return make_error(ErrorKind::kInput, "'{}': {}train_s {} is not a duration", state, where, p.train_s);
    }
    total_steps = p.step > INT64_MAX - total_steps ? INT64_MAX : total_steps + p.step;
    return {};
  };
  CFMO_TRY(check(position, "", 0));
  for (size_t r = 0; r < world.ranks.size(); ++r) {
    CFMO_TRY(check(world.ranks[r], fmt::format("ranks[{}].", r), static_cast<int>(r)));
  }
  // An optimizer steps at most once a step. In cfmo and asgd the ranks' positions are
  // the last each reported, behind their steps, so the bound adds them to rank 0's own
  // (and the owners' steps of asgd, which count pushes of steps not reported yet, are
  // not bounded by them at all).
  if (world.ranks.empty() && total_steps <= INT64_MAX / world.workers) total_steps *= world.workers;
  if (optimizer_steps > total_steps) {
    return make_error(ErrorKind::kInput, "'{}': optimizer_steps {} is more than the run's {} steps", state,
                      optimizer_steps, total_steps);
  }
  return {};
}

TrainPosition resume_position(TrainPosition position, int64_t batches_per_epoch) {
  if (position.batch_in_epoch == batches_per_epoch) {
    ++position.epoch;
    position.batch_in_epoch = 0;
  }
  return position;
}

}  // namespace cfmo::train
