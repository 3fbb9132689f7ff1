// preload(): a worker's data and model before it connects to its run.
#include "train/training_run.h"

namespace cfmo::train {

Result<std::shared_ptr<Preloaded>> preload(const TrainConfig& config) {
  CFMO_ASSIGN_OR_RETURN(const TrainPlan plan, make_plan(config));
  detail::set_up_thread(config);
  auto out = std::make_shared<Preloaded>();
  CFMO_ASSIGN_OR_RETURN(out->source, load_data_source(config, plan.context));
  if (!config.expert_parallel) {
    CFMO_TRY(detail::build_model(config, plan, out->source->shape(), moe_options(config), out->model, out->optimizer));
  }
  return out;
}

}  // namespace cfmo::train
