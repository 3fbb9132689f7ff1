#include "model/factory.h"

#include "model/gpt.h"
#include "model/mlp.h"

namespace cfmo::model {

Result<std::unique_ptr<Model>> make_model(std::string_view spec, const DataShape& data, const MoeOptions& moe) {
  if (spec.starts_with("gpt:")) {
    CFMO_ASSIGN_OR_RETURN(GptSpec gpt, GptSpec::parse(spec, data.kind == InputKind::kTokens ? data.classes : 1));
    if (data.kind != InputKind::kTokens) {
      return make_error(ErrorKind::kUsage, "--model '{}' trains on token data: give --data text:FILE or tokens:GLOB",
                        spec);
    }
    if (moe.expert_ranks > 1) CFMO_TRY(check_expert_parallel(spec, moe.expert_ranks));
    return std::unique_ptr<Model>(std::make_unique<Gpt>(gpt, moe));
  }
  if (spec.starts_with("mlp:") && data.kind != InputKind::kFeatures) {
    return make_error(ErrorKind::kUsage, "--model '{}' trains on images: use --model gpt:... for token data", spec);
  }
  CFMO_ASSIGN_OR_RETURN(MlpSpec mlp, MlpSpec::parse(spec, data.features, data.classes));
  return std::unique_ptr<Model>(std::make_unique<Mlp>(mlp));
}

int model_context(std::string_view spec) {
  if (!spec.starts_with("gpt:")) return 0;
  auto gpt = GptSpec::parse(spec, 1);
  return gpt ? gpt->context : 0;
}

Status check_expert_parallel(std::string_view spec, int ranks) {
  auto gpt = GptSpec::parse(spec, 1);
  if (!gpt || !gpt->is_moe()) {
    return make_error(ErrorKind::kUsage, "--expert-parallel: --model '{}' has no experts (a gpt with experts=E)", spec);
  }
  if (gpt->experts < ranks) {
    return make_error(ErrorKind::kUsage,
                      "--expert-parallel: --model '{}' has experts {}, fewer than the {} workers (each needs one)",
                      spec, gpt->experts, ranks);
  }
  return {};
}

Status check_model_spec(std::string_view spec) {
  if (spec.starts_with("gpt:")) {
    CFMO_TRY(GptSpec::parse(spec, 1));
  } else {
    CFMO_TRY(MlpSpec::parse(spec, 784, 10));
  }
  return {};
}

}  // namespace cfmo::model
