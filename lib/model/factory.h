#pragma once
/// Builds the Model a `--model` spec names, for the data it will train on.
/// The one place outside lib/model's implementations that knows them all.

#include "core/error.h"
#include "model/model.h"
#include "model/moe_options.h"

#include <memory>
#include <string_view>

namespace cfmo::model {

/// What the data offers a model.
struct DataShape {
  InputKind kind = InputKind::kFeatures;
  int features = 0;  ///< per example, for kFeatures
  int classes = 0;   ///< classes for kFeatures; the vocabulary for kTokens
};

/// "mlp:..." or "gpt:..."; kUsage for a malformed spec or one that does not
/// fit the data (a GPT on images, an MLP on tokens). `moe` trains a GPT's
/// Mixture-of-Experts layers (the other models ignore it).
Result<std::unique_ptr<Model>> make_model(std::string_view spec, const DataShape& data, const MoeOptions& moe = {});

/// The tokens per example of the model `spec` names (a GPT's context), 0 for
/// other models or a malformed spec: what token data must know before the model.
int model_context(std::string_view spec);

/// --expert-parallel over `ranks` workers: the spec is a GPT with at least
/// `ranks` experts (each worker holds expert e when e mod ranks is its
/// rank); kUsage in one line otherwise.
Status check_expert_parallel(std::string_view spec, int ranks);

/// Checks the spec's syntax alone (for configuration validation before the data is read).
Status check_model_spec(std::string_view spec);

}  // namespace cfmo::model
