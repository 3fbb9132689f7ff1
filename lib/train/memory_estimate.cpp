#include "train/memory_estimate.h"

#include "data/dataset.h"
#include "data/tokens.h"
#include "model/factory.h"
#include "optim/optimizer.h"
#include "train/modes.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>
#include <string>

namespace cfmo::train {
namespace {

// A worker's private memory before its data and model: the program, its
// libraries' own allocations (OpenBLAS's buffers, UCX's pools), thread
// stacks. Shared library pages are not counted: the workers share them.
// Measured as the RssAnon of a worker with a linear model on 64 examples
// (97 MB alone, 98 MB as a rank of --workers 2; bench/RESULTS.md); rounded up.
constexpr uint64_t kProcessBaseBytes = uint64_t{100} << 20;

std::string human_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) return fmt::format("{:.1f} GB", b / 1e9);
  return fmt::format("{:.0f} MB", b / 1e6);
}

}  // namespace

Result<uint64_t> estimate_worker_bytes(const TrainConfig& config) {
  // The model is built (its parameters, not its data or workspaces) for its
  // sizes; token data is memory-mapped and shared, an image set is held.
  model::DataShape shape;
  uint64_t data_bytes = 0;
  if (data::is_token_spec(config.data)) {
    const bool text = config.data.starts_with("text:");
    shape = {model::InputKind::kTokens, 0,
             config.vocab_size > 0 ? config.vocab_size
             : text                ? 256
                                   : data::kGpt2VocabSize};
  } else {
    CFMO_ASSIGN_OR_RETURN(const data::DatasetSize data, data::data_shape(config.data));
    shape = {model::InputKind::kFeatures, data.features, data.classes};
    // A byte a pixel and an int32 label an example.
    data_bytes = static_cast<uint64_t>(data.train + data.test) * (static_cast<uint64_t>(data.features) + 4);
  }
  CFMO_ASSIGN_OR_RETURN(const auto model, model::make_model(config.model, shape, moe_options(config)));
  const uint64_t params = model->num_params();
  // The optimizer's state buffers, each of the parameters' size.
  CFMO_ASSIGN_OR_RETURN(const optim::OptimizerKind optimizer_kind, optim::parse_optimizer_kind(config.optimizer));
  const optim::OptimizerConfig optim_config = optimizer_config(config, optimizer_kind);
  CFMO_ASSIGN_OR_RETURN(auto optimizer, optim::make_optimizer(optim_config, model->params(), model->num_params()));
  const uint64_t optimizer_copies = optimizer->state().size();
  // The mode's own copies of the parameters: a reduce buffer (sync), the
  // round's anchor, delta and outer momentum (localsgd, cfmo), the owners'
  // shards and their state (asgd).
  CFMO_ASSIGN_OR_RETURN(const ModeKind mode, parse_mode(config.mode));
  const uint64_t mode_copies =
      config.workers <= 1 ? 0 : static_cast<uint64_t>(mode_entry(mode).traits.parameter_copies);
  const uint64_t floats = params * (2 + optimizer_copies + mode_copies) + model->workspace_floats(config.batch_size);
  return kProcessBaseBytes + floats * sizeof(float) + data_bytes;
}

std::optional<uint64_t> available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with("MemAvailable:")) continue;
    std::istringstream fields(line.substr(13));
    uint64_t kib = 0;
    if (fields >> kib) return kib * 1024;
  }
  return std::nullopt;
}

Status check_workers_fit(const TrainConfig& config, int workers) {
  const auto per_worker = estimate_worker_bytes(config);
  const auto available = available_memory();
  if (!per_worker || !available) return {};
  const uint64_t needed = *per_worker * static_cast<uint64_t>(workers);
  if (needed <= *available) return {};
  return make_error(ErrorKind::kUsage,
                    "--workers {}: about {} x {} = {} of memory needed, {} available (MemAvailable); use fewer "
                    "workers, or a smaller model or data set",
                    workers, workers, human_bytes(*per_worker), human_bytes(needed), human_bytes(*available));
}

}  // namespace cfmo::train
