#include "optim/optimizer.h"

#include "core/rng.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cfmo::optim {
namespace {

using Trajectory = std::vector<std::vector<float>>;

// The inputs below and every table of expected parameters come from
// tests/reference/optim_reference.py, run with Debian's /usr/bin/python3 and
// torch 1.13: torch.optim.SGD/Adam/AdamW for those cases, a float64 Muon
// written after Keller Jordan's reference for the Muon cases. Rerun the script
// and paste its output here when a case changes.
const std::vector<float> kParams = {0.5f, -1.25f, 2.0f, 0.0f, -0.75f, 1.5f, -2.5f, 0.125f, 3.0f, -0.3f};
const Trajectory kGrads = {
    {0.1f, -0.2f, 0.3f, -0.4f, 0.5f, -0.6f, 0.7f, -0.8f, 0.9f, -1.0f},
    {-0.05f, 0.15f, 0.25f, -0.35f, 0.45f, 0.55f, -0.65f, 0.75f, -0.85f, 0.95f},
    {0.2f, 0.2f, -0.1f, 0.0f, 0.3f, -0.3f, 0.05f, 0.6f, -0.4f, 0.01f},
    {1.0f, -0.5f, 0.25f, -0.125f, 0.0625f, 2.0f, -1.5f, 0.33f, -0.01f, 0.4f},
};
// A learning rate that changes every step, so each step must use the lr it is given.
const std::vector<float> kSgdLrs = {0.1f, 0.08f, 0.06f, 0.04f};
const std::vector<float> kAdamLrs = {0.01f, 0.008f, 0.006f, 0.004f};
const std::vector<float> kMuonLrs = {0.02f, 0.02f, 0.01f};

// kSgdMomentum: parameters after each step
const Trajectory kSgdMomentum = {
    {0.49000001f, -1.23000002f, 1.97000003f, 0.0400000028f, -0.800000012f, 1.56000006f, -2.56999993f, 0.204999998f,
     2.91000009f, -0.200000018f},
    {0.486800015f, -1.22759998f, 1.92840004f, 0.0967999995f, -0.871999979f, 1.55920005f, -2.56839991f, 0.202600002f,
     2.91320014f, -0.204000026f},
    {0.472640008f, -1.23798001f, 1.9063201f, 0.135140002f, -0.938599944f, 1.57666004f, -2.57031989f, 0.164979994f,
     2.93936014f, -0.207300022f},
    {0.424144f, -1.224208f, 1.88307214f, 0.163143992f, -0.981059909f, 1.50713599f, -2.51147199f, 0.129207999f,
     2.95545626f, -0.225280017f},
};

// kSgdNesterov: parameters after each step
const Trajectory kSgdNesterov = {
    {0.481000006f, -1.21200001f, 1.94299996f, 0.0759999976f, -0.845000029f, 1.61399996f, -2.6329999f, 0.27700001f,
     2.829f, -0.110000014f},
    {0.482120007f, -1.22184002f, 1.88555992f, 0.15512f, -0.945800006f, 1.56927991f, -2.5795598f, 0.21484001f,
     2.89987993f, -0.189600006f},
    {0.457376003f, -1.24318206f, 1.87168789f, 0.189625993f, -1.02374005f, 1.60299397f, -2.58428788f, 0.14498201f,
     2.94742393f, -0.193170011f},
    {0.373729616f, -1.2107873f, 1.84076464f, 0.219829589f, -1.06445408f, 1.4604224f, -2.47132468f, 0.099587217f,
     2.96231031f, -0.225352004f},
};

// kSgdWeightDecay: parameters after each step
const Trajectory kSgdWeightDecay = {
    {0.489499986f, -1.22874999f, 1.96800005f, 0.0400000028f, -0.799250007f, 1.55850005f, -2.56750011f, 0.204874992f,
     2.90700006f, -0.199700013f},
    {0.485548377f, -1.22446704f, 1.92338562f, 0.0967679992f, -0.870070577f, 1.55537331f, -2.56204605f, 0.202221096f,
     2.90571451f, -0.203324258f},
    {0.470589727f, -1.23284137f, 1.89811683f, 0.135028332f, -0.935352445f, 1.57032955f, -2.55982733f, 0.164308384f,
     2.92710328f, -0.206248626f},
    {0.421426296f, -1.21737278f, 1.87219632f, 0.162930518f, -0.976647437f, 1.49867511f, -2.49747229f, 0.128295034f,
     2.93916583f, -0.223920748f},
};

// kSgdPlain: parameters after each step
const Trajectory kSgdPlain = {
    {0.489499986f, -1.22874999f, 1.96800005f, 0.0400000028f, -0.799250007f, 1.55850005f, -2.56750011f, 0.204874992f,
     2.90700006f, -0.199700013f},
    {0.493108392f, -1.23976696f, 1.94642568f, 0.0679680035f, -0.834610581f, 1.51325321f, -2.51344609f, 0.144711092f,
     2.97267437f, -0.275540262f},
    {0.48081252f, -1.25102305f, 1.95125782f, 0.067927219f, -0.85210979f, 1.5303452f, -2.51493812f, 0.108624265f,
     2.99489069f, -0.275974929f},
    {0.440620184f, -1.23052263f, 1.94047737f, 0.0729000494f, -0.854268968f, 1.44973302f, -2.45393205f, 0.0953808129f,
     2.9940927f, -0.291864544f},
};

// kAdamL2: parameters after each step
const Trajectory kAdamL2 = {
    {0.49000001f, -1.24000001f, 1.99000001f, 0.00999999978f, -0.75999999f, 1.50999999f, -2.50999999f, 0.135000005f,
     2.99000001f, -0.290000021f},
    {0.484679371f, -1.23513162f, 1.98203397f, 0.0179531835f, -0.767957151f, 1.50788426f, -2.50706792f, 0.134702772f,
     2.98761415f, -0.289974153f},
    {0.479804128f, -1.23326015f, 1.97690952f, 0.0225510597f, -0.773655176f, 1.50735319f, -2.50465131f, 0.132680342f,
     2.98652816f, -0.289906442f},
    {0.476853728f, -1.23072863f, 1.97329354f, 0.0255215261f, -0.77670908f, 1.50508368f, -2.50197864f, 0.13100192f,
     2.98545313f, -0.290474206f},
};

// kAdamW: parameters after each step
const Trajectory kAdamW = {
    {0.489500105f, -1.23874998f, 1.98800004f, 0.00999997463f, -0.759249985f, 1.50849998f, -2.50749993f, 0.134874985f,
     2.98699999f, -0.289700031f},
    {0.487192631f, -1.23726964f, 1.97849953f, 0.0179324076f, -0.766598463f, 1.50699258f, -2.50514174f, 0.134376675f,
     2.98503017f, -0.289911658f},
    {0.482855439f, -1.23883641f, 1.9740088f, 0.0223857239f, -0.771867394f, 1.50732827f, -2.50365257f, 0.132163703f,
     2.98470712f, -0.290016294f},
    {0.479747772f, -1.23688769f, 1.97041273f, 0.0252503827f, -0.774790347f, 1.50468826f, -2.50054216f, 0.130379125f,
     2.98430872f, -0.290742397f},
};

// kMuonNesterov: parameters after each step
const Trajectory kMuonNesterov = {
    {0.14422551f,   0.415506702f,   0.495732645f,  0.341920603f,  0.0224593567f, -0.307596738f, -0.4879282f,
     -0.438639525f, -0.185244455f,  0.15396092f,   0.423154431f,  0.497802346f,  0.334235331f,  0.0100766674f,
     -0.316547053f, -0.509487178f,  -0.416850629f, -0.158756411f, 0.164186827f,  0.424814266f,  0.489531624f,
     0.327002239f,  0.00806930329f, -0.318732648f, -0.495467632f, -0.434772785f, -0.167569415f, 0.175221665f,
     0.431818913f,  0.486454463f,   0.298073889f,  0.0155831964f, -0.304830185f, -0.512470848f},
    {0.139304428f,  0.4123679f,    0.498139155f,  0.345362457f,  0.0212236961f, -0.308488747f, -0.485642513f,
     -0.435554297f, -0.185002546f, 0.151376266f,  0.423996942f,  0.501672845f,  0.334481398f,  0.00567968518f,
     -0.319170093f, -0.522459556f, -0.397710658f, -0.139217331f, 0.161887096f,  0.420084454f,  0.48844799f,
     0.330573746f,  0.0103118983f, -0.321112278f, -0.498640209f, -0.433302431f, -0.16274929f,  0.176690618f,
     0.427824222f,  0.481987108f,  0.306069483f,  0.0355185152f, -0.292776743f, -0.5302706f},
    {0.137082054f,  0.412288809f,  0.499902397f,  0.345893637f,  0.0194100441f, -0.308267411f, -0.484028435f,
     -0.434427899f, -0.18557635f,  0.150128077f,  0.425485803f,  0.503041884f,  0.333234896f,  0.0033153495f,
     -0.319200772f, -0.520581359f, -0.387817361f, -0.134113045f, 0.159747546f,  0.418336004f,  0.48922651f,
     0.332414069f,  0.0102308477f, -0.322999912f, -0.49931576f,  -0.431438058f, -0.160646713f, 0.176047817f,
     0.425389403f,  0.480897521f,  0.312843807f,  0.0447070216f, -0.295049675f, -0.5393866f},
};

// kMuonPlain: parameters after each step
const Trajectory kMuonPlain = {
    {0.14452103f,   0.416348173f,   0.49672431f,   0.342596066f,  0.0225009373f, -0.308208596f, -0.48890573f,
     -0.43952298f,  -0.185618331f,  0.154272462f,  0.424004867f,  0.498791705f,  0.3348983f,    0.0101014429f,
     -0.317172124f, -0.510468114f,  -0.417726081f, -0.15911464f,  0.164514302f,  0.425673428f,  0.490518397f,
     0.327652527f,  0.00807726607f, -0.319370754f, -0.496451697f, -0.435639987f, -0.167911896f, 0.175564979f,
     0.432686557f,  0.48743837f,    0.298711311f,  0.0155743451f, -0.305481147f, -0.513457764f},
    {0.140057995f,  0.413452571f,  0.499638213f,  0.347050598f,  0.0219702012f, -0.309956858f, -0.487899834f,
     -0.43723658f,  -0.185401006f, 0.152102325f,  0.425053262f,  0.503651994f,  0.336450156f,  0.00607139144f,
     -0.320880044f, -0.524282664f, -0.399241297f, -0.140010425f, 0.163139182f,  0.421678656f,  0.489756288f,
     0.331614202f,  0.010819805f,  -0.321865176f, -0.500828389f, -0.435627012f, -0.163528221f, 0.177957718f,
     0.429925154f,  0.483568338f,  0.307379422f,  0.035586257f,  -0.29417706f,  -0.532443385f},
    {0.137766883f,  0.413202174f,  0.501795372f,  0.348455059f,  0.0205644296f, -0.310316099f, -0.486908329f,
     -0.436346903f, -0.185916515f, 0.150936843f,  0.426642727f,  0.505838943f,  0.336030712f,  0.00366003006f,
     -0.321750668f, -0.522921568f, -0.389657651f, -0.135115045f, 0.16146703f,   0.420054336f,  0.490559411f,
     0.333863325f,  0.0112227656f, -0.323898719f, -0.502421662f, -0.434587735f, -0.161378918f, 0.178021835f,
     0.42801329f,   0.482481408f,  0.314585238f,  0.0447366331f, -0.296763265f, -0.542153738f},
};

// The float32 torch results differ from ours only by rounding order (for
// example sqrt(v) * (1/sqrt(bc2)) against sqrt(v) / sqrt(bc2)).
constexpr float kTorchTolerance = 1e-6f;
// Muon: float32 Newton-Schulz through BLAS against a float64 reference. The
// observed error is below 1e-6; 1e-5 leaves room for other BLAS kernels and
// still catches a 1% error in an update of about 5e-3.
constexpr float kMuonTolerance = 1e-5f;

std::vector<model::ParamInfo> flat_layout(size_t size) { return {{"p", {static_cast<int64_t>(size)}, 0, size}}; }

/// A wide weight, a bias, a tall weight (transposed inside Newton-Schulz) and a
/// bias, contiguous; the same layout as MUON_LAYOUT in the reference script.
std::vector<model::ParamInfo> muon_layout() {
  return {{"layers.0.weight", {3, 5}, 0, 15},
          {"layers.0.bias", {3}, 15, 3},
          {"layers.1.weight", {4, 3}, 18, 12},
          {"layers.1.bias", {4}, 30, 4}};
}
constexpr size_t kMuonSize = 34;

/// Muon's inputs are generated by formula (muon_inputs() in the script) so
/// the test need not embed them; computed in double, rounded to float.
std::vector<float> muon_params() {
  std::vector<float> params(kMuonSize);
  for (size_t i = 0; i < kMuonSize; ++i) {
    params[i] = static_cast<float>(0.5 * std::sin(0.7 * static_cast<double>(i) + 0.3));
  }
  return params;
}

Trajectory muon_grads() {
  Trajectory grads(3, std::vector<float>(kMuonSize));
  for (size_t t = 0; t < grads.size(); ++t) {
    const auto td = static_cast<double>(t);
    for (size_t i = 0; i < kMuonSize; ++i) {
      grads[t][i] = static_cast<float>(std::cos(1.3 * static_cast<double>(i) + 0.9 * td) * (1.0 + 0.1 * td));
    }
  }
  return grads;
}

std::unique_ptr<Optimizer> make(const OptimizerConfig& config, const std::vector<model::ParamInfo>& layout,
                                size_t size) {
  auto made = make_optimizer(config, layout, size);
  if (!made) {
    ADD_FAILURE() << made.error().message;
    return nullptr;
  }
  return std::move(made).value();
}

/// Runs `config` over the gradients and compares the parameters after every step.
void expect_trajectory(const OptimizerConfig& config, const std::vector<model::ParamInfo>& layout,
                       std::vector<float> params, const Trajectory& grads, const std::vector<float>& lrs,
                       const Trajectory& expected, float tolerance) {
  ASSERT_EQ(expected.size(), lrs.size());
  auto opt = make(config, layout, params.size());
  ASSERT_NE(opt, nullptr);
  for (size_t t = 0; t < expected.size(); ++t) {
    ASSERT_EQ(expected[t].size(), params.size());
    opt->step(params, grads[t], lrs[t]);
    EXPECT_EQ(opt->step_count(), static_cast<int64_t>(t + 1));
    for (size_t i = 0; i < params.size(); ++i) {
      const float want = expected[t][i];
      // Relative, with a floor of 1: the rounding error of a value that
      // cancelled towards zero is that of its O(1) inputs.
      EXPECT_NEAR(params[i], want, tolerance * std::max(1.0f, std::abs(want))) << "step " << t + 1 << " index " << i;
    }
  }
}

OptimizerConfig sgd_config(double momentum, bool nesterov, double weight_decay) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kSgd;
  config.momentum = momentum;
  config.nesterov = nesterov;
  config.weight_decay = weight_decay;
  return config;
}

OptimizerConfig muon_nesterov_config() {
  OptimizerConfig config;
  config.kind = OptimizerKind::kMuon;
  config.nesterov = true;
  config.momentum = 0.95;
  config.beta1 = 0.9;
  config.beta2 = 0.95;
  config.eps = 1e-8;
  config.weight_decay = 0.1;
  config.ns_steps = 5;
  return config;
}

tensor::FloatBuffer* find_state(Optimizer& opt, const std::string& name) {
  for (auto& s : opt.state()) {
    if (s.name == name) return s.buffer;
  }
  return nullptr;
}

TEST(TestOptimOptimizer, SgdMomentumMatchesTorch) {
  expect_trajectory(sgd_config(0.9, false, 0.0), flat_layout(kParams.size()), kParams, kGrads, kSgdLrs, kSgdMomentum,
                    kTorchTolerance);
}

TEST(TestOptimOptimizer, SgdNesterovMatchesTorch) {
  expect_trajectory(sgd_config(0.9, true, 0.0), flat_layout(kParams.size()), kParams, kGrads, kSgdLrs, kSgdNesterov,
                    kTorchTolerance);
}

TEST(TestOptimOptimizer, SgdWeightDecayMatchesTorch) {
  expect_trajectory(sgd_config(0.9, false, 0.01), flat_layout(kParams.size()), kParams, kGrads, kSgdLrs,
                    kSgdWeightDecay, kTorchTolerance);
}

TEST(TestOptimOptimizer, SgdWithoutMomentumMatchesTorch) {
  expect_trajectory(sgd_config(0.0, false, 0.01), flat_layout(kParams.size()), kParams, kGrads, kSgdLrs, kSgdPlain,
                    kTorchTolerance);
}

TEST(TestOptimOptimizer, AdamL2WeightDecayMatchesTorch) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kAdam;
  config.weight_decay = 0.1;
  expect_trajectory(config, flat_layout(kParams.size()), kParams, kGrads, kAdamLrs, kAdamL2, kTorchTolerance);
}

TEST(TestOptimOptimizer, AdamWDecoupledWeightDecayMatchesTorch) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kAdamW;
  config.beta1 = 0.85;
  config.beta2 = 0.995;
  config.eps = 1e-6;
  config.weight_decay = 0.1;
  expect_trajectory(config, flat_layout(kParams.size()), kParams, kGrads, kAdamLrs, kAdamW, kTorchTolerance);
}

TEST(TestOptimOptimizer, MuonNesterovMatchesReference) {
  expect_trajectory(muon_nesterov_config(), muon_layout(), muon_params(), muon_grads(), kMuonLrs, kMuonNesterov,
                    kMuonTolerance);
}

TEST(TestOptimOptimizer, MuonWithoutNesterovMatchesReference) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kMuon;
  config.nesterov = false;
  config.momentum = 0.9;
  config.beta1 = 0.9;
  config.beta2 = 0.999;
  config.weight_decay = 0.0;
  expect_trajectory(config, muon_layout(), muon_params(), muon_grads(), kMuonLrs, kMuonPlain, kMuonTolerance);
}

// Muon's 1-D parameters must follow AdamW with the same hyper-parameters: one
// --lr and --weight-decay serve both halves of the model.
TEST(TestOptimOptimizer, MuonBiasesFollowAdamW) {
  auto config = muon_nesterov_config();
  auto muon = make(config, muon_layout(), kMuonSize);
  config.kind = OptimizerKind::kAdamW;
  auto adamw = make(config, muon_layout(), kMuonSize);
  ASSERT_NE(muon, nullptr);
  ASSERT_NE(adamw, nullptr);
  auto by_muon = muon_params();
  auto by_adamw = muon_params();
  const auto grads = muon_grads();
  for (size_t t = 0; t < grads.size(); ++t) {
    muon->step(by_muon, grads[t], kMuonLrs[t]);
    adamw->step(by_adamw, grads[t], kMuonLrs[t]);
  }
  for (const auto& info : muon_layout()) {
    if (info.is_matrix()) continue;
    for (size_t i = info.offset; i < info.offset + info.size; ++i) {
      EXPECT_FLOAT_EQ(by_muon[i], by_adamw[i]) << info.name << " index " << i;
    }
  }
}

// Each half of Muon keeps its own state: momentum for matrices, Adam moments
// for vectors; a checkpoint that saved the wrong slots would lose nothing visible.
TEST(TestOptimOptimizer, MuonStateSlotsFollowLayout) {
  auto muon = make(muon_nesterov_config(), muon_layout(), kMuonSize);
  ASSERT_NE(muon, nullptr);
  auto params = muon_params();
  muon->step(params, muon_grads()[0], kMuonLrs[0]);
  const auto state = muon->state();
  ASSERT_EQ(state.size(), 3u);
  EXPECT_EQ(state[0].name, "momentum_buffer");
  EXPECT_EQ(state[1].name, "exp_avg");
  EXPECT_EQ(state[2].name, "exp_avg_sq");
  for (const auto& s : state) ASSERT_EQ(s.buffer->size(), kMuonSize) << s.name;
  for (const auto& info : muon_layout()) {
    for (size_t i = info.offset; i < info.offset + info.size; ++i) {
      const bool matrix = info.is_matrix();
      EXPECT_EQ((*state[0].buffer)[i] != 0.0f, matrix) << info.name << " momentum at " << i;
      EXPECT_EQ((*state[1].buffer)[i] != 0.0f, !matrix) << info.name << " exp_avg at " << i;
      EXPECT_EQ((*state[2].buffer)[i] != 0.0f, !matrix) << info.name << " exp_avg_sq at " << i;
    }
  }
}

// A run resumed from saved state and step count must continue the same
// trajectory; in particular SGD must not treat the resumed step as its first.
TEST(TestOptimOptimizer, ResumedStateContinuesTrajectory) {
  struct Case {
    OptimizerConfig config;
    const std::vector<float>* lrs;
    const Trajectory* expected;
  };
  OptimizerConfig adamw;
  adamw.kind = OptimizerKind::kAdamW;
  adamw.beta1 = 0.85;
  adamw.beta2 = 0.995;
  adamw.eps = 1e-6;
  adamw.weight_decay = 0.1;
  const Case cases[] = {{sgd_config(0.9, true, 0.0), &kSgdLrs, &kSgdNesterov}, {adamw, &kAdamLrs, &kAdamW}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(optimizer_kind_name(c.config.kind)));
    const auto layout = flat_layout(kParams.size());
    auto first = make(c.config, layout, kParams.size());
    auto resumed = make(c.config, layout, kParams.size());
    ASSERT_NE(first, nullptr);
    ASSERT_NE(resumed, nullptr);
    auto params = kParams;
    first->step(params, kGrads[0], (*c.lrs)[0]);
    first->step(params, kGrads[1], (*c.lrs)[1]);
    auto saved = first->state();
    auto restored = resumed->state();
    ASSERT_EQ(saved.size(), restored.size());
    for (size_t s = 0; s < saved.size(); ++s) *restored[s].buffer = *saved[s].buffer;
    resumed->set_step_count(first->step_count());
    resumed->step(params, kGrads[2], (*c.lrs)[2]);
    resumed->step(params, kGrads[3], (*c.lrs)[3]);
    for (size_t i = 0; i < params.size(); ++i) {
      const float want = (*c.expected)[3][i];
      EXPECT_NEAR(params[i], want, kTorchTolerance * std::max(1.0f, std::abs(want))) << "index " << i;
    }
  }
}

TEST(TestOptimOptimizer, ScaleFirstMomentSgdDiscountsMomentumBuffer) {
  auto opt = make(sgd_config(0.9, false, 0.0), flat_layout(kParams.size()), kParams.size());
  ASSERT_NE(opt, nullptr);
  auto params = kParams;
  opt->step(params, kGrads[0], 0.1f);
  const auto after_first = params;
  opt->scale_first_moment(0.5f);
  tensor::FloatBuffer* buffer = find_state(*opt, "momentum_buffer");
  ASSERT_NE(buffer, nullptr);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_FLOAT_EQ((*buffer)[i], 0.5f * kGrads[0][i]);
  opt->step(params, kGrads[1], 0.1f);
  for (size_t i = 0; i < params.size(); ++i) {
    const double buf = 0.9 * 0.5 * kGrads[0][i] + kGrads[1][i];
    EXPECT_NEAR(params[i], after_first[i] - 0.1 * buf, 1e-6) << "index " << i;
  }
}

TEST(TestOptimOptimizer, ScaleFirstMomentAdamLeavesSecondMoment) {
  OptimizerConfig config;
  config.kind = OptimizerKind::kAdam;
  auto opt = make(config, flat_layout(kParams.size()), kParams.size());
  ASSERT_NE(opt, nullptr);
  auto params = kParams;
  opt->step(params, kGrads[0], 0.01f);
  const tensor::FloatBuffer exp_avg = *find_state(*opt, "exp_avg");
  const tensor::FloatBuffer exp_avg_sq = *find_state(*opt, "exp_avg_sq");
  opt->scale_first_moment(0.25f);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_FLOAT_EQ((*find_state(*opt, "exp_avg"))[i], 0.25f * exp_avg[i]);
    EXPECT_EQ((*find_state(*opt, "exp_avg_sq"))[i], exp_avg_sq[i]);
  }
}

TEST(TestOptimOptimizer, ScaleFirstMomentMuonScalesBothFirstMoments) {
  auto opt = make(muon_nesterov_config(), muon_layout(), kMuonSize);
  ASSERT_NE(opt, nullptr);
  auto params = muon_params();
  opt->step(params, muon_grads()[0], 0.02f);
  const tensor::FloatBuffer momentum = *find_state(*opt, "momentum_buffer");
  const tensor::FloatBuffer exp_avg = *find_state(*opt, "exp_avg");
  const tensor::FloatBuffer exp_avg_sq = *find_state(*opt, "exp_avg_sq");
  opt->scale_first_moment(0.5f);
  for (size_t i = 0; i < kMuonSize; ++i) {
    EXPECT_FLOAT_EQ((*find_state(*opt, "momentum_buffer"))[i], 0.5f * momentum[i]);
    EXPECT_FLOAT_EQ((*find_state(*opt, "exp_avg"))[i], 0.5f * exp_avg[i]);
    EXPECT_EQ((*find_state(*opt, "exp_avg_sq"))[i], exp_avg_sq[i]);
  }
}

TEST(TestOptimOptimizer, NamesStateAndStepCount) {
  const auto layout = flat_layout(4);
  const std::vector<std::pair<std::string, std::vector<std::string>>> expected = {
      {"sgd", {"momentum_buffer"}},
      {"adam", {"exp_avg", "exp_avg_sq"}},
      {"adamw", {"exp_avg", "exp_avg_sq"}},
      {"muon", {"momentum_buffer", "exp_avg", "exp_avg_sq"}},
  };
  for (const auto& [name, states] : expected) {
    OptimizerConfig config;
    auto kind = parse_optimizer_kind(name);
    ASSERT_TRUE(kind) << name;
    config.kind = *kind;
    EXPECT_EQ(optimizer_kind_name(*kind), name);
    auto opt = make(config, layout, 4);
    ASSERT_NE(opt, nullptr) << name;
    EXPECT_EQ(opt->name(), name);
    EXPECT_EQ(opt->step_count(), 0);
    const auto state = opt->state();
    ASSERT_EQ(state.size(), states.size()) << name;
    for (size_t s = 0; s < states.size(); ++s) {
      EXPECT_EQ(state[s].name, states[s]) << name;
      EXPECT_EQ(state[s].buffer->size(), 4u) << name;
    }
    std::vector<float> params = {1, 2, 3, 4};
    const std::vector<float> grads = {0.5f, -0.5f, 0.25f, 0};
    opt->step(params, grads, 0.01f);
    opt->step(params, grads, 0.01f);
    EXPECT_EQ(opt->step_count(), 2) << name;
    opt->set_step_count(7);
    EXPECT_EQ(opt->step_count(), 7) << name;
  }
}

TEST(TestOptimOptimizer, ParseOptimizerKindRejectsUnknownName) {
  auto parsed = parse_optimizer_kind("rmsprop");
  ASSERT_FALSE(parsed);
  EXPECT_EQ(parsed.error().kind, ErrorKind::kUsage);
  EXPECT_NE(parsed.error().message.find("--optimizer: 'rmsprop'"), std::string::npos) << parsed.error().message;
  EXPECT_FALSE(parse_optimizer_kind(""));
  EXPECT_FALSE(parse_optimizer_kind("SGD"));  // names are case-sensitive, like the CLI's other choices
}

std::vector<float> random_matrix(int rows, int cols, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> m(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  for (float& v : m) v = rng.normal();
  return m;
}

/// X X^T for row-major x [rows, cols], in double.
std::vector<double> gram(const std::vector<float>& x, int rows, int cols) {
  std::vector<double> g(static_cast<size_t>(rows) * static_cast<size_t>(rows), 0.0);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < rows; ++j) {
      double sum = 0;
      for (int k = 0; k < cols; ++k) {
        sum += static_cast<double>(x[static_cast<size_t>(i * cols + k)]) * x[static_cast<size_t>(j * cols + k)];
      }
      g[static_cast<size_t>(i * rows + j)] = sum;
    }
  }
  return g;
}

std::vector<float> transpose(const std::vector<float>& x, int rows, int cols) {
  std::vector<float> t(x.size());
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) t[static_cast<size_t>(j * rows + i)] = x[static_cast<size_t>(i * cols + j)];
  }
  return t;
}

// Keller Jordan's coefficients trade exactness for speed: five steps leave the
// singular values in roughly 0.7..1.2, not at 1, hence the loose band.
TEST(TestOptimOptimizer, NewtonSchulzWideIsNearlyOrthogonal) {
  constexpr int kRows = 8;
  constexpr int kCols = 32;
  auto x = random_matrix(kRows, kCols, 42);
  newton_schulz(x, kRows, kCols, 5);
  const auto g = gram(x, kRows, kCols);
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kRows; ++j) {
      const double v = g[static_cast<size_t>(i * kRows + j)];
      if (i == j) {
        EXPECT_GT(v, 0.5) << "diagonal " << i;
        EXPECT_LT(v, 1.5) << "diagonal " << i;
      } else {
        EXPECT_LT(std::abs(v), 0.5) << i << "," << j;
      }
    }
  }
}

// A tall matrix is orthogonalised through its transpose: the result must be
// the transpose of the wide case's, with orthonormal-ish columns.
TEST(TestOptimOptimizer, NewtonSchulzTallIsTransposeOfWide) {
  constexpr int kRows = 24;
  constexpr int kCols = 6;
  const auto tall = random_matrix(kRows, kCols, 7);
  auto wide = transpose(tall, kRows, kCols);
  auto tall_out = tall;
  newton_schulz(tall_out, kRows, kCols, 5);
  newton_schulz(wide, kCols, kRows, 5);
  const auto wide_back = transpose(wide, kCols, kRows);
  for (size_t i = 0; i < tall_out.size(); ++i) EXPECT_NEAR(tall_out[i], wide_back[i], 1e-5f) << "index " << i;
  const auto cols_gram = gram(transpose(tall_out, kRows, kCols), kCols, kRows);
  for (int i = 0; i < kCols; ++i) {
    EXPECT_GT(cols_gram[static_cast<size_t>(i * kCols + i)], 0.5) << "column " << i;
    EXPECT_LT(cols_gram[static_cast<size_t>(i * kCols + i)], 1.5) << "column " << i;
  }
}

// With no iterations Newton-Schulz only normalises, and the normalisation
// makes the result independent of the gradient's scale.
TEST(TestOptimOptimizer, NewtonSchulzNormalisesAndIgnoresScale) {
  constexpr int kRows = 5;
  constexpr int kCols = 9;
  auto x = random_matrix(kRows, kCols, 3);
  auto normalised = x;
  newton_schulz(normalised, kRows, kCols, 0);
  double sum_sq = 0;
  for (float v : normalised) sum_sq += static_cast<double>(v) * v;
  EXPECT_NEAR(std::sqrt(sum_sq), 1.0, 1e-6);
  auto scaled = x;
  for (float& v : scaled) v *= 1000.0f;
  newton_schulz(x, kRows, kCols, 5);
  newton_schulz(scaled, kRows, kCols, 5);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(scaled[i], x[i], 1e-5f) << "index " << i;
}

TEST(TestOptimOptimizer, ClipGradNormScalesToMaxNorm) {
  std::vector<float> grads = {3.0f, 0.0f, -4.0f, 0.0f};
  EXPECT_DOUBLE_EQ(clip_grad_norm(grads, 1.0), 5.0);
  // PyTorch's coefficient max_norm / (norm + 1e-6).
  const double coefficient = 1.0 / (5.0 + 1e-6);
  EXPECT_FLOAT_EQ(grads[0], static_cast<float>(3.0 * coefficient));
  EXPECT_EQ(grads[1], 0.0f);
  EXPECT_FLOAT_EQ(grads[2], static_cast<float>(-4.0 * coefficient));
  double sum_sq = 0;
  for (float g : grads) sum_sq += static_cast<double>(g) * g;
  EXPECT_NEAR(std::sqrt(sum_sq), 1.0, 1e-6);
}

TEST(TestOptimOptimizer, ClipGradNormLeavesSmallOrDisabledAlone) {
  const std::vector<float> original = {0.3f, -0.4f, 1.2f};  // norm 1.3
  auto grads = original;
  EXPECT_NEAR(clip_grad_norm(grads, 2.0), 1.3, 1e-6);
  EXPECT_EQ(grads, original);
  EXPECT_NEAR(clip_grad_norm(grads, 0.0), 1.3, 1e-6);  // 0 disables clipping
  EXPECT_EQ(grads, original);
  std::vector<float> zeros(5, 0.0f);
  EXPECT_EQ(clip_grad_norm(zeros, 1.0), 0.0);
  EXPECT_EQ(zeros, std::vector<float>(5, 0.0f));
}

}  // namespace
}  // namespace cfmo::optim
