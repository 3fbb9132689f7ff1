#include "reconciler.h"

#include "train/train_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace cfmo::python {
namespace {

/// The Optimizer the modes see: PyTorch steps the parameters itself, so this
/// one only discounts its first moments (scale_first_moment, the cfmo mode's
/// rebase) in the buffers the caller passed for the call.
class FirstMoments final : public optim::Optimizer {
 public:
  FirstMoments(const std::vector<model::ParamInfo>& layout, Buffers moments)
      : layout_(layout), moments_(std::move(moments)) {}
  std::string_view name() const override { return "torch"; }
  void step(std::span<float>, std::span<const float>, float) override {}
  void scale_first_moment(float factor, size_t offset, size_t count) override {
    const size_t end = count > SIZE_MAX - offset ? SIZE_MAX : offset + count;
    for (size_t t = 0; t < layout_.size() && t < moments_.size(); ++t) {
      float* m = moments_[t];
      const model::ParamInfo& p = layout_[t];
      const size_t lo = std::max(offset, p.offset);
      const size_t hi = std::min(end, p.offset + p.size);
      if (m == nullptr || lo >= hi) continue;
      for (size_t i = lo; i < hi; ++i) m[i - p.offset] *= factor;
    }
  }
  std::vector<optim::OptimizerState> state() override { return {}; }

 private:
  const std::vector<model::ParamInfo>& layout_;
  const Buffers moments_;
};

}  // namespace

Error as_keyword_error(Error error) {
  if (error.message.rfind("--", 0) != 0) return error;
  const size_t colon = error.message.find_first_of(": ");
  std::string flag = error.message.substr(2, colon - 2);
  if (flag == "staleness-discount") flag = "staleness_beta";
  if (flag == "outer-optimizer") flag = "outer";
  std::replace(flag.begin(), flag.end(), '-', '_');
  error.message = flag + error.message.substr(colon);
  return error;
}

namespace {

/// The settings checked by cfmo-train's own rules, so both accept the same values.
Status validate_settings(const ReconcilerSettings& s) {
  // cfmo-train's 0 (the outer step's own lr) needs a model to choose by; the Reconciler has none.
  if (!(s.mode.outer_lr > 0)) return make_error(ErrorKind::kUsage, "outer_lr: must be positive");
  train::TrainConfig c;
  c.mode = std::string(train::mode_entry(s.mode.kind).name);
  c.sync_interval = s.mode.sync_interval;
  c.staleness_discount = s.mode.staleness_discount;
  c.max_staleness = s.mode.max_staleness;
  c.outer_optimizer = std::string(to_string(s.mode.outer_optimizer));
  c.outer_lr = s.mode.outer_lr;
  c.outer_momentum = s.mode.outer_momentum;
  c.outer_warmup = s.mode.outer_warmup;
  c.delta_dtype = std::string(to_string(s.mode.delta_dtype));
  c.peer_timeout = s.mode.peer_timeout_s;
  c.steps = 1;
  if (s.mode.kind == train::ModeKind::kAsgd) {  // only asgd runs an optimizer of libcfmo's
    c.optimizer = std::string(optim::optimizer_kind_name(s.optimizer.kind));
    c.momentum = s.optimizer.momentum;
    c.beta1 = s.optimizer.beta1;
    c.beta2 = s.optimizer.beta2;
    c.eps = s.optimizer.eps;
    c.weight_decay = s.optimizer.weight_decay;
  }
  auto status = train::validate(c);
  if (!status) return as_keyword_error(status.error());
  return {};
}

/// 16 bits of FNV-1a over the tensors' names and shapes.
uint32_t layout_hash(const std::vector<TensorView>& tensors) {
  uint32_t h = 2166136261u;
  auto mix = [&h](const void* data, size_t size) {
    for (size_t i = 0; i < size; ++i) h = (h ^ static_cast<const unsigned char*>(data)[i]) * 16777619u;
  };
  for (const auto& t : tensors) {
    mix(t.name.data(), t.name.size() + 1);
    for (const int64_t d : t.shape) mix(&d, sizeof d);
  }
  return (h ^ (h >> 16)) & 0xFFFFu;
}

}  // namespace

Reconciler::Reconciler(std::shared_ptr<World> world, std::vector<TensorView> tensors, ReconcilerSettings settings)
    : world_(std::move(world)), tensors_(std::move(tensors)), settings_(std::move(settings)) {
  model::LayoutBuilder builder;
  for (const auto& t : tensors_) {
    builder.add(layout_, t.name, t.shape, t.shape.size() == 2 ? model::ParamKind::kMatrix : model::ParamKind::kBias,
                true);
  }
  flat_.assign(builder.size(), 0.0f);
}

Result<std::unique_ptr<Reconciler>> Reconciler::create(std::shared_ptr<World> world, std::vector<TensorView> tensors,
                                                       ReconcilerSettings settings) {
  CFMO_TRY(validate_settings(settings));
  if (tensors.empty()) return make_error(ErrorKind::kUsage, "params: no tensors to reconcile");
  if (world->in_use) {
    return make_error(ErrorKind::kUsage, "this World already has a Reconciler: finish() it before making another");
  }
  std::unique_ptr<Reconciler> r(new Reconciler(std::move(world), std::move(tensors), std::move(settings)));
  r->world_->in_use = true;
  CFMO_TRY(r->check_same_tensors());
  r->gather();
  CFMO_TRY(r->start_mode(r->flat_, {}));
  return r;
}

Reconciler::~Reconciler() {
  mode_.reset();  // unregisters its handlers before the writer and the world go
  if (delta_writer_) delta_writer_->close();
  world_->in_use = false;
}

Status Reconciler::check_same_tensors() {
  if (size() == 1) return {};
  // Every rank's [tensors, floats / 2^24, floats % 2^24, hash]: each an exact float.
  size_t floats = 0;
  for (const auto& t : tensors_) floats += t.size;
  std::vector<float> table(4 * static_cast<size_t>(size()), 0.0f);
  float* mine = table.data() + 4 * static_cast<size_t>(rank());
  mine[0] = static_cast<float>(tensors_.size());
  mine[1] = static_cast<float>(floats >> 24);
  mine[2] = static_cast<float>(floats & 0xFFFFFFu);
  mine[3] = static_cast<float>(layout_hash(tensors_));
  CFMO_TRY(world_->comm->all_reduce_sum(table));
  auto describe = [&](int r) {
    const float* t = table.data() + 4 * static_cast<size_t>(r);
    const auto n = static_cast<uint64_t>(t[1]) << 24 | static_cast<uint64_t>(t[2]);
    return fmt::format("rank {} has {} tensors ({} floats)", r, static_cast<int64_t>(t[0]), n);
  };
  for (int r = 1; r < size(); ++r) {
    const float* a = table.data();
    const float* b = table.data() + 4 * static_cast<size_t>(r);
    if (std::equal(a, a + 3, b) && a[3] != b[3]) {
      return make_error(ErrorKind::kUsage,
                        "params differ between workers: rank {}'s tensor names or shapes are not "
                        "rank 0's",
                        r);
    }
    if (!std::equal(a, a + 3, b)) {
      return make_error(ErrorKind::kUsage, "params differ between workers: {}, {}", describe(0), describe(r));
    }
  }
  return {};
}

Status Reconciler::start_mode(std::span<const float> initial, const train::ModeResume& resume) {
  mode_.reset();
  delta_writer_.reset();
  train::ModeSettings mode = settings_.mode;
  const bool writes_deltas = train::mode_entry(mode.kind).traits.writes_deltas;
  if (!settings_.out.empty() && size() > 1 && writes_deltas) {
    // A resumed run continues after its deltas, as cfmo-train's does.
    const int64_t offset = position_.step > 0 ? train::DeltaWriter::last_round(settings_.out, rank()) : 0;
    delta_writer_ = std::make_unique<train::DeltaWriter>(settings_.out, rank(), layout_, offset);
    mode.delta_sink = [writer = delta_writer_.get()](int64_t round, int64_t step, int64_t base_version,
                                                     std::span<const float> base, std::span<const float> delta) {
      writer->submit(round, step, base_version, base, delta);
    };
  }
  CFMO_ASSIGN_OR_RETURN(mode_,
                        train::make_mode(mode, world_->comm.get(), layout_, initial, settings_.optimizer, resume));
  // No rank posts before every rank's handlers are registered.
  if (size() > 1) CFMO_TRY(world_->comm->barrier());
  return {};
}

void Reconciler::gather() {
  for (size_t t = 0; t < tensors_.size(); ++t) {
    std::memcpy(flat_.data() + layout_[t].offset, tensors_[t].data, tensors_[t].size * sizeof(float));
  }
}

void Reconciler::scatter() {
  for (size_t t = 0; t < tensors_.size(); ++t) {
    std::memcpy(tensors_[t].data, flat_.data() + layout_[t].offset, tensors_[t].size * sizeof(float));
  }
}

Status Reconciler::failed(Status status) {
  // The goodbye then carries this rank's own failure to the others, as cfmo-train's does.
  if (!status && world_->comm && status.error().kind != ErrorKind::kPeer) world_->comm->leave_with(status.error());
  return status;
}

bool Reconciler::tick(int64_t samples) {
  ++position_.step;
  ++position_.batch_in_epoch;
  position_.samples += samples;
  if (size() == 1) return true;  // a world of one: nothing to reconcile
  if (mode_->needs_params(position_)) return false;
  // The mode reports progress and leaves the parameters alone: an empty span.
  FirstMoments none(layout_, {});
  (void)mode_->after_step(position_, {}, none);
  return true;
}

Status Reconciler::reconcile(const Buffers& moments) {
  const bool async = train::mode_entry(settings_.mode.kind).traits.asynchronous;
  if (async && rank() != 0) {
    // The others train on without a lost peer, but not without the budget keeper and gatherer.
    const auto lost = lost_ranks();
    if (std::find(lost.begin(), lost.end(), 0) != lost.end()) {
      const Status health = world_->comm->health();
      return make_error(health ? ErrorKind::kPeer : health.error().kind,
                        "rank 0, which keeps the run's budget, is lost: {}",
                        health ? std::string("it left") : health.error().message);
    }
  }
  gather();
  FirstMoments optimizer(layout_, moments);
  CFMO_TRY(failed(mode_->after_step(position_, flat_, optimizer)));
  scatter();
  return {};
}

Status Reconciler::reduce_gradients(const Buffers& grads, int count, float lr) {
  if (!uses_gradients()) return {};
  tensor::FloatBuffer flat(flat_.size(), 0.0f);
  for (size_t t = 0; t < tensors_.size(); ++t) {
    std::memcpy(flat.data() + layout_[t].offset, grads[t], tensors_[t].size * sizeof(float));
  }
  CFMO_TRY(failed(mode_->on_gradients(flat, count, lr)));
  for (size_t t = 0; t < tensors_.size(); ++t) {
    std::memcpy(grads[t], flat.data() + layout_[t].offset, tensors_[t].size * sizeof(float));
  }
  return {};
}

Status Reconciler::finish(const Buffers& moments) {
  if (finished_) return {};
  finished_ = true;
  if (size() == 1) return {};
  gather();
  FirstMoments optimizer(layout_, moments);
  CFMO_TRY(failed(mode_->finish(flat_, optimizer)));
  // The keeper (rank 0 unless it was lost) holds the global parameters now (every rank in sync and localsgd);
  // another rank of cfmo or asgd keeps its own.
  if (rank() == mode_->keeper() || mode_->params_are_global()) scatter();
  if (delta_writer_) {
    delta_writer_->close();  // writes what is queued
    CFMO_TRY(delta_writer_->status());
  }
  return {};
}

std::vector<size_t> Reconciler::shard_bounds() const { return cfmo::train::shard_bounds(flat_.size(), size()); }

comm::CommStats Reconciler::comm_stats() const { return world_->comm ? world_->comm->stats() : comm::CommStats{}; }

std::vector<int> Reconciler::lost_ranks() const {
  return world_->comm ? world_->comm->lost_ranks() : std::vector<int>{};
}

int64_t Reconciler::deltas_written() const {
  return delta_writer_ ? static_cast<int64_t>(delta_writer_->written()) : 0;
}
int64_t Reconciler::deltas_skipped() const {
  return delta_writer_ ? static_cast<int64_t>(delta_writer_->skipped()) : 0;
}

Result<ReconcilerState> Reconciler::state_dict() {
  ReconcilerState s;
  s.mode = mode_name();
  s.world = size();
  s.position = position_;
  const bool async = size() > 1 && (s.mode == "cfmo" || s.mode == "asgd");
  if (!async) {
    if (!mode_->params_are_global()) {
      return make_error(ErrorKind::kUsage,
                        "state_dict(): in mode {} the parameters are the global ones only right after a "
                        "reconciling step (every sync_interval={} steps); this is step {}",
                        s.mode, settings_.mode.sync_interval, position_.step);
    }
    gather();
    s.global = true;
    s.params.assign(flat_.begin(), flat_.end());
    const auto outer = mode_->outer_momentum();
    s.outer_momentum.assign(outer.begin(), outer.end());
    return s;
  }
  if (!finished_ && !mode_->request_snapshot()) return s;  // not rank 0: the owners answer it
  // Rank 0: the owners answer on their progress threads, whatever their training threads do.
  std::optional<train::GlobalState> global = finished_ ? mode_->final_state() : std::nullopt;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(settings_.mode.peer_timeout_s);
  while (!global && !finished_ && std::chrono::steady_clock::now() < deadline) {
    global = mode_->take_snapshot();
    if (!global) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!global) {
    if (finished_) return make_error(ErrorKind::kUsage, "state_dict(): after finish(), only once on rank 0");
    return make_error(ErrorKind::kPeer, "state_dict(): an owner did not send its shard within {} s (lost ranks: {})",
                      settings_.mode.peer_timeout_s, fmt::join(lost_ranks(), ", "));
  }
  s.global = true;
  s.params = std::move(global->params);
  s.outer_momentum = std::move(global->outer_momentum);
  s.owner_state = std::move(global->owner_state);
  s.owner_steps = std::move(global->owner_steps);
  s.ranks = std::move(global->ranks);
  s.versions = std::move(global->versions);
  return s;
}

Status Reconciler::load_state_dict(const ReconcilerState& s) {
  if (position_.step > 0 || finished_) {
    return make_error(ErrorKind::kUsage, "load_state_dict(): call it before the first step, on every rank");
  }
  if (s.mode != mode_name()) {
    return make_error(ErrorKind::kUsage, "load_state_dict(): the state is of mode {}, this Reconciler's is {}", s.mode,
                      mode_name());
  }
  if (!s.params.empty() && s.params.size() != flat_.size()) {
    return make_error(ErrorKind::kUsage, "load_state_dict(): the state holds {} floats of parameters, these params {}",
                      s.params.size(), flat_.size());
  }
  const bool async = size() > 1 && (s.mode == "cfmo" || s.mode == "asgd");
  if (s.world != size() || (async && s.ranks.size() != static_cast<size_t>(size()))) {
    return make_error(ErrorKind::kUsage,
                      "load_state_dict(): the state is of a world of {} ranks, this one has {} (resume with as many)",
                      s.world, size());
  }
  if (async && s.params.empty()) {
    return make_error(ErrorKind::kUsage, "load_state_dict(): the state holds no global parameters (save rank 0's)");
  }
  position_ = async ? s.ranks[static_cast<size_t>(rank())] : s.position;
  if (!s.params.empty()) {
    std::copy(s.params.begin(), s.params.end(), flat_.begin());
    scatter();
  }
  train::ModeResume resume;
  resume.outer_momentum = s.outer_momentum;
  resume.owner_state = s.owner_state;
  resume.owner_steps = s.owner_steps;
  resume.ranks = s.ranks;
  gather();
  return start_mode(flat_, resume);
}

}  // namespace cfmo::python
