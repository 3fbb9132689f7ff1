#include "train/connect_run.h"

namespace cfmo::train {

Result<RunConnection> connect_run(TrainConfig& config, const std::optional<comm::WorldInfo>& world,
                                  const std::string& config_toml, int* first_world, const Status& ready) {
  comm::WorldOptions connect;
  connect.rendezvous = config.rendezvous;
  connect.peer_timeout_s = config.peer_timeout;
  connect.join = config.join;
  connect.join_timeout_s = config.join_timeout;
  // Rank 0 shows a joining process the run's configuration; the joiner (or a
  // rank restarted into a run under way) declines one that is not its own.
  connect.description = config_toml;
  connect.check = [&config_toml, ready](std::string_view run_config) -> Status {
    CFMO_TRY(check_join_fits(run_config, config_toml));
    return ready;
  };
  connect.fifos = ends_at_a_loss(config);  // the faster transport where a loss ends the run anyway
  connect.grow = takes_new_ranks(config);  // the leader's side decides; a joiner may come to lead
  int first_size = 0;
  connect.first_size = &first_size;
  bool run_ended = false;
  connect.run_ended = &run_ended;
  CFMO_ASSIGN_OR_RETURN(auto connected, comm::connect_world(world, connect));
  if (run_ended) {
    const std::string where = !config.join.empty()         ? config.join
                              : !config.rendezvous.empty() ? config.rendezvous
                                                           : "its rendezvous address";
    return RunConnection{nullptr, fmt::format("joined as the run ended: the run at {} was ending and took nobody "
                                              "in; it trained nothing",
                                              where)};
  }
  if (connected->joined()) fit_owners_to_run(config, first_size);
  // A joiner plans the run's length and learning-rate schedule for the world
  // the others planned them for, not the one it grew (TrainingRun::plan_length).
  if (first_world != nullptr) *first_world = connected->joined() ? first_size : 0;
  return RunConnection{std::move(connected), {}};
}

}  // namespace cfmo::train
