#pragma once
/// A training process's connection to its run's other ranks: the rendezvous
/// (or --join) with the checks a joiner needs, and a joiner's shard owners
/// fitted to the run's first world.

#include "comm/communicator.h"
#include "comm/world.h"
#include "core/error.h"
#include "train/train_config.h"

#include <memory>
#include <optional>
#include <string>

namespace cfmo::train {

/// What connect_run came to: this process's place in the run, or none.
struct RunConnection {
  std::unique_ptr<comm::Communicator> comm;  ///< null when the run ended as this process came
  /// Then the one line that says so: a joiner (or a rank restarted into its
  /// run) refused because the run was ending came too late through no fault
  /// of its own, trains nothing and writes nothing (status 0), as a joiner
  /// told so by its mode (Joined::kRunEnded).
  std::string too_late;
};

/// Connects this process of `world` (or a --join) under `config`, whose
/// TOML is `config_toml`: rank 0 shows it to joiners, a joiner declines a
/// run whose own differs (check_join_fits). A joiner's --owners becomes the
/// run's (fit_owners_to_run), and `first_world`, when given, the ranks the
/// run started with (TrainOptions::first_world; 0 for a process that did not join).
/// `ready`: how this process's own preparation went (preload, before it
/// connects). A process that finds its run under way (a restarted rank)
/// declines it with that error, so that no rank counts it in; a rank of the
/// run's start connects all the same, and fails in train(), where the
/// others learn the cause from its goodbye.
Result<RunConnection> connect_run(TrainConfig& config, const std::optional<comm::WorldInfo>& world,
                                  const std::string& config_toml, int* first_world = nullptr, const Status& ready = {});

}  // namespace cfmo::train
