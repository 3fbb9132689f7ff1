// train(): one worker's run, in the phases of train/training_run.h.
#include "train/trainer.h"

#include "train/training_run.h"

namespace cfmo::train {

Result<TrainSummary> train(const TrainConfig& config, const TrainOptions& options) {
  CFMO_ASSIGN_OR_RETURN(const TrainPlan plan, make_plan(config));
  detail::TrainingRun run(config, plan, options);
  CFMO_TRY(run.set_up());
  if (run.came_too_late) return run.too_late_summary();
  CFMO_TRY(run.run_loop());
  return run.finish();
}

}  // namespace cfmo::train
