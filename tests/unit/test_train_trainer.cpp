// The training loop as a library: it learns, it stops when told, it reports
// through the observer, and it fails cleanly.
#include "train/trainer.h"

#include "ckpt/safetensors.h"
#include "comm/loopback.h"
#include "train/checkpoint.h"
#include "train/sample.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <thread>
#include <tuple>

namespace cfmo::train {
namespace {

using testing::TempDir;

TrainConfig small_config() {
  TrainConfig c;
  c.data = "synthetic:1024:256";
  c.model = "mlp:32";
  c.epochs = 2;
  c.quiet = true;
  return c;
}

class Recorder final : public TrainObserver {
 public:
  void on_step(const StepEvent& e) override { steps.push_back(e); }
  void on_eval(const EvalEvent& e) override { evals.push_back(e); }
  std::vector<StepEvent> steps;
  std::vector<EvalEvent> evals;
};

TEST(Trainer, LearnsTheSyntheticTaskWithEveryOptimizer) {
  for (const char* optimizer : {"sgd", "adam", "adamw", "muon"}) {
    SCOPED_TRACE(optimizer);
    TrainConfig c = small_config();
    c.optimizer = optimizer;
    c.lr = std::string(optimizer) == "sgd" ? 0.05 : 1e-3;
    c.epochs = 3;
    auto summary = train(c, {});
    ASSERT_TRUE(summary) << summary.error().message;
    EXPECT_GT(summary->test_accuracy, 0.6);  // chance is 0.1
    EXPECT_EQ(summary->steps, 48);
    EXPECT_EQ(summary->samples, 3 * 1024);
    EXPECT_EQ(summary->stopped_by, "epochs");
  }
}

TEST(Trainer, SameSeedSameResult) {
  auto a = train(small_config(), {});
  auto b = train(small_config(), {});
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->test_loss, b->test_loss);
  TrainConfig other = small_config();
  other.seed = 2;
  auto c = train(other, {});
  ASSERT_TRUE(c);
  EXPECT_NE(a->test_loss, c->test_loss);
}

TEST(Trainer, ReportsStepsAndEvaluationsToTheObserver) {
  Recorder recorder;
  TrainConfig c = small_config();
  c.log_every = 5;
  TrainOptions options;
  options.observer = &recorder;
  auto summary = train(c, options);
  ASSERT_TRUE(summary);
  ASSERT_EQ(recorder.steps.size(), 32u);
  EXPECT_EQ(std::count_if(recorder.steps.begin(), recorder.steps.end(), [](const StepEvent& e) { return e.logged; }),
            6);
  EXPECT_DOUBLE_EQ(recorder.steps.back().fraction, 1.0);
  // One per epoch end; the run ended on an epoch boundary, so no extra final evaluation.
  ASSERT_EQ(recorder.evals.size(), 2u);
  EXPECT_DOUBLE_EQ(recorder.evals[0].epochs, 1.0);
  EXPECT_DOUBLE_EQ(recorder.evals[1].epochs, 2.0);
  EXPECT_EQ(recorder.evals[1].test_accuracy, summary->test_accuracy);
  // A run that stops mid-epoch evaluates once more, marked final.
  Recorder mid;
  c.steps = 20;
  options.observer = &mid;
  ASSERT_TRUE(train(c, options));
  ASSERT_EQ(mid.evals.size(), 2u);
  EXPECT_TRUE(mid.evals.back().final);
  EXPECT_DOUBLE_EQ(mid.evals.back().epochs, 1.25);
}

TEST(Trainer, StopsOnStepsTimeLimitAndRequest) {
  TrainConfig c = small_config();
  c.steps = 5;
  auto by_steps = train(c, {});
  ASSERT_TRUE(by_steps);
  EXPECT_EQ(by_steps->steps, 5);
  EXPECT_EQ(by_steps->stopped_by, "steps");

  c.steps = 0;
  c.epochs = 0;
  c.time_limit = "1ms";
  auto by_time = train(c, {});
  ASSERT_TRUE(by_time);
  EXPECT_EQ(by_time->stopped_by, "time-limit");

  std::atomic<bool> stop{true};
  TrainOptions options;
  options.stop = &stop;
  c.time_limit = "1h";
  auto by_request = train(c, options);
  ASSERT_TRUE(by_request);
  EXPECT_EQ(by_request->stopped_by, "interrupt");
  EXPECT_EQ(by_request->steps, 0);
}

TEST(Trainer, DivergenceIsACheckFailure) {
  TrainConfig c = small_config();
  c.optimizer = "sgd";
  c.lr = 1e6;
  auto summary = train(c, {});
  ASSERT_FALSE(summary);
  EXPECT_EQ(summary.error().kind, ErrorKind::kCheckFailed);
  EXPECT_NE(summary.error().message.find("diverged"), std::string::npos);
}

TEST(Trainer, InvalidConfigurationIsAUsageError) {
  TrainConfig c = small_config();
  c.batch_size = 0;
  auto summary = train(c, {});
  ASSERT_FALSE(summary);
  EXPECT_EQ(summary.error().kind, ErrorKind::kUsage);
  EXPECT_NE(summary.error().message.find("--batch-size"), std::string::npos);
  c = small_config();
  c.schedule = "cosine";
  c.epochs = 0;
  c.time_limit = "10s";
  EXPECT_EQ(train(c, {}).error().kind, ErrorKind::kUsage);
}

// Which runs may keep UCX's shared-memory FIFOs (comm::UcxOptions::fifos):
// those a lost rank ends anyway.
TEST(Trainer, OnlyARunThatEndsAtALossKeepsTheFifos) {
  TrainConfig c = small_config();
  for (const auto& [mode, elastic, join, ends] :
       std::vector<std::tuple<std::string, bool, std::string, bool>>{{"sync", false, "", true},
                                                                     {"localsgd", false, "", true},
                                                                     {"sync", true, "", false},
                                                                     {"localsgd", true, "", false},
                                                                     {"sync", true, "127.0.0.1:9", false},
                                                                     {"cfmo", false, "", false},
                                                                     {"asgd", false, "", false}}) {
    c.mode = mode;
    c.elastic = elastic;
    c.join = join;
    EXPECT_EQ(ends_at_a_loss(c), ends) << mode << (elastic ? " --elastic" : "") << (join.empty() ? "" : " --join");
  }
}

TEST(Trainer, SummaryJsonHasTheDocumentedKeys) {
  auto summary = train(small_config(), {});
  ASSERT_TRUE(summary);
  const auto j = nlohmann::json::parse(summary->to_json());
  for (const char* key : {"mode", "workers", "steps", "samples", "wall_s", "samples_per_s", "test_accuracy",
                          "test_loss", "bytes_sent", "per_worker"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["per_worker"][0]["rank"], 0);
  // The loop's CPU time: some, and no more than its wall time on one thread.
  const auto& own = j["per_worker"][0];
  EXPECT_GT(own["loop_cpu_s"].get<double>(), 0);
  EXPECT_LE(own["loop_cpu_s"].get<double>(), own["loop_s"].get<double>() * 1.05 + 0.01);
  EXPECT_TRUE(j["run_dir"].is_null());
  EXPECT_EQ(j["parameters"], 784 * 32 + 32 + 32 * 10 + 10);  // trainable parameters, no padding
}

TEST(Trainer, RunDirectoryGetsMetricsAndModel) {
  TempDir dir;
  TrainConfig c = small_config();
  c.out = (dir / "run").string();
  c.log_every = 4;
  auto summary = train(c, {});
  ASSERT_TRUE(summary) << summary.error().message;
  EXPECT_TRUE(std::filesystem::exists(dir / "run/metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(dir / "run/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/step-00000032/state.json"));
}

/// A byte-level corpus for the GPT: a few thousand bytes of text with structure.
std::filesystem::path write_corpus(const std::filesystem::path& dir) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox " + std::to_string(i % 13) + " jumps over the lazy dog\n";
  const auto path = dir / "corpus.txt";
  std::ofstream(path) << text;
  return path;
}

TrainConfig gpt_config(const std::filesystem::path& corpus) {
  TrainConfig c;
  c.data = "text:" + corpus.string();
  c.model = "gpt:layers=2,heads=2,dim=16,context=16";
  c.epochs = 0;
  c.steps = 30;
  c.batch_size = 4;
  c.lr = 3e-3;
  c.weight_decay = 0.1;
  c.quiet = true;
  return c;
}

TEST(Trainer, TrainsTheGptOnTextWithEveryOptimizer) {
  TempDir dir;
  const auto corpus = write_corpus(dir.path());
  for (const char* optimizer : {"sgd", "adam", "adamw", "muon"}) {
    SCOPED_TRACE(optimizer);
    TrainConfig c = gpt_config(corpus);
    c.optimizer = optimizer;
    c.lr = std::string(optimizer) == "sgd" ? 0.1 : 3e-3;
    c.clip_grad_norm = 1.0;
    c.schedule = "cosine";
    c.warmup_steps = 5;
    auto summary = train(c, {});
    ASSERT_TRUE(summary) << summary.error().message;
    EXPECT_EQ(summary->context, 16);
    EXPECT_EQ(summary->tokens, 30 * 4 * 16);
    EXPECT_LT(summary->val_loss, std::log(256.0));  // below uniform over the bytes
    EXPECT_GT(summary->tokens_per_s, 0);
    EXPECT_GT(summary->gflops_per_s, 0);
    const bool muon = std::string(optimizer) == "muon";
    EXPECT_EQ(summary->muon_tensors.size(), muon ? 8u : 0u);  // 4 matrices x 2 blocks
    auto json = nlohmann::json::parse(summary->to_json());
    EXPECT_TRUE(json["val_loss"].is_number());
    EXPECT_EQ(json["tokens"], 30 * 4 * 16);
  }
}

TEST(Trainer, GptTokensBudgetAndResumeExactness) {
  TempDir dir;
  const auto corpus = write_corpus(dir.path());
  TrainConfig c = gpt_config(corpus);
  c.steps = 0;
  c.tokens = 20 * 4 * 16 - 5;  // rounds up to 20 steps
  c.out = (dir.path() / "whole").string();
  auto whole = train(c, {});
  ASSERT_TRUE(whole) << whole.error().message;
  EXPECT_EQ(whole->steps, 20);
  EXPECT_EQ(whole->stopped_by, "tokens");
  // The run directory loads as a Hugging Face GPT-2: names, Conv1D shapes and config.json.
  auto file = ckpt::SafetensorsFile::read(dir.path() / "whole" / "model.safetensors");
  ASSERT_TRUE(file) << file.error().message;
  ASSERT_NE(file->find("h.1.attn.c_attn.weight"), nullptr);
  EXPECT_EQ(file->find("h.1.attn.c_attn.weight")->shape, (std::vector<int64_t>{16, 48}));
  EXPECT_EQ(file->find("h.0.mlp.c_proj.weight")->shape, (std::vector<int64_t>{64, 16}));
  EXPECT_EQ(file->find("wte.weight")->shape, (std::vector<int64_t>{256, 16}));
  const auto config = nlohmann::json::parse(std::ifstream(dir.path() / "whole" / "config.json"));
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_embd"], 16);
  EXPECT_EQ(config["vocab_size"], 256);
  EXPECT_EQ(config["activation_function"], "gelu_new");
  // Stopped at step 10 and resumed: the same parameters at the end.
  TrainConfig first = c;
  first.tokens = 0;
  first.steps = 10;
  first.out = (dir.path() / "split").string();
  ASSERT_TRUE(train(first, {}));
  TrainConfig rest = c;
  rest.out = first.out;
  TrainOptions options;
  options.resume = resolve_checkpoint(first.out).value();
  auto resumed = train(rest, options);
  ASSERT_TRUE(resumed) << resumed.error().message;
  EXPECT_EQ(resumed->steps, 20);
  EXPECT_EQ(resumed->val_loss, whole->val_loss);
  // And a sample from it is text of the asked length.
  auto model = load_saved_model(dir.path() / "split");
  ASSERT_TRUE(model) << model.error().message;
  SampleOptions so;
  so.tokens = 25;
  auto sampled = sample_tokens(**model, {'t', 'h'}, so);
  ASSERT_TRUE(sampled);
  EXPECT_EQ(sampled->size(), 25u);
}

// preload() reads the data and builds the model before the worker knows its
// rank (cfmo-train does so before it connects): a run that takes them up
// trains exactly as one that loads its own, the MLP alone and a GPT of two
// ranks, each of which takes its own part of the tokens after the load.
TEST(Trainer, APreloadedRunTrainsAsOneThatLoadsItsOwn) {
  auto preloaded = [](const TrainConfig& c) {
    TrainOptions o;
    auto ready = preload(c);
    EXPECT_TRUE(ready) << ready.error().message;
    if (ready) o.preloaded = *ready;
    return o;
  };
  const TrainConfig mlp = small_config();
  auto own = train(mlp, {});
  auto taken = train(mlp, preloaded(mlp));
  ASSERT_TRUE(own && taken);
  EXPECT_EQ(own->test_loss, taken->test_loss);
  EXPECT_EQ(own->steps, taken->steps);

  TempDir dir;
  TrainConfig gpt = gpt_config(write_corpus(dir.path()));
  gpt.mode = "localsgd";
  gpt.sync_interval = 3;
  auto run_two = [&](bool preload_them) {
    auto world = comm::make_loopback_world(2);
    std::vector<Result<TrainSummary>> out(2, make_error(ErrorKind::kInternal, "did not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        TrainOptions o = preload_them ? preloaded(gpt) : TrainOptions{};
        o.comm = world.ranks[static_cast<size_t>(r)].get();
        out[static_cast<size_t>(r)] = train(gpt, o);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  const auto loaded = run_two(false);
  const auto ready = run_two(true);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(loaded[r]) << loaded[r].error().message;
    ASSERT_TRUE(ready[r]) << ready[r].error().message;
    EXPECT_EQ(loaded[r]->val_loss, ready[r]->val_loss) << r;
  }
}

// A worker whose data cannot be read learns it from preload, before it
// connects to anyone: the one line names the data, status 3.
TEST(Trainer, PreloadFailsOnDataItCannotRead) {
  TempDir dir;
  TrainConfig c = small_config();
  c.data = (dir / "nowhere").string();
  auto ready = preload(c);
  ASSERT_FALSE(ready);
  EXPECT_EQ(ready.error().kind, ErrorKind::kInput);
  EXPECT_NE(ready.error().message.find("nowhere"), std::string::npos) << ready.error().message;
  c = gpt_config(dir / "missing.txt");
  ready = preload(c);
  ASSERT_FALSE(ready);
  EXPECT_EQ(ready.error().kind, ErrorKind::kInput);
  EXPECT_NE(ready.error().message.find("missing.txt"), std::string::npos) << ready.error().message;
}

// A joining worker compares the run's configuration with its own: the first
// flag that differs is named (status 2); a process's own flags may differ.
TEST(Trainer, AJoinerWhoseFlagsDifferFromTheRunsIsToldWhichOne) {
  auto toml_of = [](const std::function<void(TrainConfig&)>& change) {
    TrainConfig config;
    OptionTable table;
    add_train_options(table, config);
    change(config);
    return table.to_toml();
  };
  const std::string run = toml_of([](TrainConfig& c) { c.mode = "cfmo"; });
  EXPECT_TRUE(check_join_fits(run, toml_of([](TrainConfig& c) {
                                c.mode = "cfmo";
                                c.out = "elsewhere";
                                c.threads = 4;
                                c.join = "127.0.0.1:9";
                                c.time_limit = "5m";
                              })));
  const Status other = check_join_fits(run, toml_of([](TrainConfig& c) {
                                         c.mode = "cfmo";
                                         c.model = "mlp:32";
                                       }));
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().kind, ErrorKind::kUsage);
  EXPECT_NE(other.error().message.find("--model"), std::string::npos) << other.error().message;
  EXPECT_NE(other.error().message.find("mlp:32"), std::string::npos) << other.error().message;
  EXPECT_FALSE(check_join_fits("", run));
}

// A join needs a mode that goes on without a lost worker: cfmo and asgd,
// sync and localsgd with --elastic.
TEST(Trainer, JoinIsForModesThatSurviveALossAndNeedsAnAddress) {
  TrainConfig config;
  config.join = "127.0.0.1:9";
  for (const char* lockstep : {"sync", "localsgd"}) {
    config.mode = lockstep;
    config.elastic = false;
    EXPECT_EQ(validate(config).error().kind, ErrorKind::kUsage);
    EXPECT_NE(validate(config).error().message.find("--join"), std::string::npos);
    config.elastic = true;
    EXPECT_TRUE(validate(config)) << lockstep;
  }
  config.elastic = false;
  config.mode = "asgd";
  EXPECT_TRUE(validate(config));
  config.mode = "cfmo";
  EXPECT_TRUE(validate(config));
  config.join = "nowhere";
  EXPECT_FALSE(validate(config));
}

TEST(Sample, APromptIsBytesOrTokenIdsAndComesBackAsItWent) {
  // Bytes, high ones included, for a byte-level vocabulary.
  const std::string bytes = "the \xff\n";
  auto as_bytes = text_to_tokens(bytes, 256);
  ASSERT_TRUE(as_bytes);
  EXPECT_EQ(*as_bytes, (std::vector<int32_t>{'t', 'h', 'e', ' ', 255, '\n'}));
  EXPECT_EQ(tokens_to_text(*as_bytes, 256), bytes);
  // Ids separated by spaces for any other vocabulary.
  auto as_ids = text_to_tokens("464 3290  50256", 50257);
  ASSERT_TRUE(as_ids);
  EXPECT_EQ(*as_ids, (std::vector<int32_t>{464, 3290, 50256}));
  EXPECT_EQ(tokens_to_text(*as_ids, 50257), "464 3290 50256");
  auto words = text_to_tokens("464 dog", 50257);
  ASSERT_FALSE(words);
  EXPECT_EQ(words.error().kind, ErrorKind::kUsage);
  EXPECT_NE(words.error().message.find("--prompt"), std::string::npos);
}

TEST(Trainer, GptRefusesImagesAndTheMlpRefusesText) {
  TempDir dir;
  const auto corpus = write_corpus(dir.path());
  TrainConfig c = gpt_config(corpus);
  c.data = "synthetic:100:10";
  auto gpt_on_images = train(c, {});
  ASSERT_FALSE(gpt_on_images);
  EXPECT_EQ(gpt_on_images.error().kind, ErrorKind::kUsage);
  TrainConfig m = gpt_config(corpus);
  m.model = "mlp:8";
  auto mlp_on_text = train(m, {});
  ASSERT_FALSE(mlp_on_text);
  EXPECT_EQ(mlp_on_text.error().kind, ErrorKind::kUsage);
}

// --outer-optimizer auto and --outer-lr 0 resolve by the model: a GPT
// averages (lr 1), the MLP takes Nesterov (lr 0.5); a value given wins.
TEST(TrainPlan, TheOuterStepIsAvgForAGptAndNesterovForTheMlp) {
  TrainConfig gpt = gpt_config("corpus.txt");
  auto plan = make_plan(gpt);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->outer_optimizer, OuterKind::kAvg);
  EXPECT_EQ(plan->outer_lr, 1.0);
  TrainConfig mlp;
  plan = make_plan(mlp);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_EQ(plan->outer_optimizer, OuterKind::kNesterov);
  EXPECT_EQ(plan->outer_lr, 0.5);

  gpt.outer_optimizer = "nesterov";
  plan = make_plan(gpt);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->outer_optimizer, OuterKind::kNesterov);
  EXPECT_EQ(plan->outer_lr, 0.5);
  mlp.outer_optimizer = "avg";
  mlp.outer_lr = 0.7;
  plan = make_plan(mlp);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->outer_optimizer, OuterKind::kAvg);
  EXPECT_EQ(plan->outer_lr, 0.7);

  mlp.outer_lr = -1;
  auto bad = make_plan(mlp);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().kind, ErrorKind::kUsage);
  EXPECT_NE(bad.error().message.find("--outer-lr"), std::string::npos);
  mlp.outer_lr = 0;
  mlp.outer_optimizer = "adam";
  bad = make_plan(mlp);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().message, "--outer-optimizer: 'adam' is not auto, avg or nesterov");
}

}  // namespace
}  // namespace cfmo::train
