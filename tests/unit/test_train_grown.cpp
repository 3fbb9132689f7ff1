// A run that grows by a join, its checkpoints and their resumes: whole
// training runs (train()) over the in-process loopback transport, a thread
// per rank, the joiner a new rank of the loopback world as `cfmo-train
// --join` is one of UCX's (with real processes: test_cfmo_train_workers.cpp).
#include "ckpt/safetensors.h"
#include "comm/loopback.h"
#include "optim/schedule.h"
#include "train/join_log.h"
#include "train/train_config.h"
#include "train/trainer.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

namespace cfmo::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

/// Holds a member at its first step (in on_step, on its training thread)
/// until `hold_s` passed, having said it got there (`reached`): the joiner
/// comes then, once the members' world is made, and is taken in early (at
/// the group's first round, or within a few); records notes and each
/// step's learning rate.
class Member final : public TrainObserver {
 public:
  explicit Member(double hold_s = 0, std::atomic<int>* reached = nullptr) : hold_s_(hold_s), reached_(reached) {}
  void on_step(const StepEvent& e) override {
    // (Its first step: a resumed run's is not step 1.)
    if (std::exchange(first_, false)) {
      if (reached_ != nullptr) ++*reached_;
      if (hold_s_ > 0) std::this_thread::sleep_for(std::chrono::duration<double>(hold_s_));
    }
    std::lock_guard lock(mutex_);
    lr[e.step] = e.lr;
  }
  void on_note(std::string_view text) override {
    std::lock_guard lock(mutex_);
    notes.emplace_back(text);
  }
  std::string all_notes() {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& n : notes) out += n + "\n";
    return out;
  }
  /// Whether it stepped at all (on its training thread, or after its run).
  bool stepped() const { return !first_; }
  std::map<int64_t, double> lr;  ///< by step (after the run: no lock needed)

 private:
  const double hold_s_;
  std::atomic<int>* reached_;
  bool first_ = true;  ///< (the training thread's)
  std::mutex mutex_;
  std::vector<std::string> notes;
};

TrainConfig grown_config(const std::string& mode, const fs::path& out) {
  TrainConfig c;
  c.data = "synthetic:1024:256";
  c.model = "mlp:32";
  c.mode = mode;
  c.elastic = mode != "cfmo";
  c.batch_size = 32;  // 16 global batches an epoch of two ranks, 11 of three
  c.epochs = 2;
  c.sync_interval = 2;
  c.schedule = "cosine";
  c.warmup_steps = 2;
  c.optimizer = "adamw";
  c.lr = 1e-3;
  c.threads = 1;
  c.checkpoint_every = 2;
  c.keep_checkpoints = 1000;
  c.peer_timeout = 10;
  c.quiet = true;
  c.out = out.string();
  return c;
}

struct RunResult {
  std::vector<Result<TrainSummary>> summaries;
};

/// Ranks 0 and 1 train `config` from the start (or from `resume` with
/// `workers` ranks); with `joiner`, one more process joins as the new rank
/// `workers` (told the world of `workers` as its first, as connect_run tells
/// it: the world the transport started with).
RunResult run_world(const TrainConfig& config, int workers, bool joiner, const fs::path& resume = {},
                    std::vector<std::unique_ptr<Member>>* observers = nullptr) {
  auto world = comm::make_loopback_world(workers, {.peer_timeout_s = config.peer_timeout});
  std::vector<std::unique_ptr<Member>> own;
  auto& obs = observers != nullptr ? *observers : own;
  const int ranks = workers + (joiner ? 1 : 0);
  std::atomic<int> reached{0};
  for (int r = 0; r < ranks; ++r) {
    // (3 s: under CI's load a cfmo joiner's set-up and its shards took more
    // than 1 s, and the members of a short run ended before it was in.)
    obs.push_back(joiner && r < workers ? std::make_unique<Member>(3.0, &reached) : std::make_unique<Member>());
  }
  RunResult out;
  out.summaries.resize(static_cast<size_t>(ranks), make_error(ErrorKind::kInternal, "did not run"));
  std::vector<std::thread> threads;
  std::vector<TrainOptions> options(static_cast<size_t>(ranks));
  std::unique_ptr<comm::Communicator> joined;
  for (int r = 0; r < ranks; ++r) {
    auto& o = options[static_cast<size_t>(r)];
    o.comm = r < workers ? world.ranks[static_cast<size_t>(r)].get() : nullptr;
    o.observer = obs[static_cast<size_t>(r)].get();
    o.resume = resume;
    if (r >= workers) o.first_world = workers;  // as connect_run tells a joiner
  }
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      out.summaries[static_cast<size_t>(r)] = train(config, options[static_cast<size_t>(r)]);
      // A member with nothing left to train (a resumed run's budget spent) never steps.
      if (!obs[static_cast<size_t>(r)]->stepped()) ++reached;
      // Its process ends here: the goodbye tells a joiner still asking that nobody will answer.
      world.ranks[static_cast<size_t>(r)].reset();
    });
  }
  if (joiner) {
    // Once the members stepped (their world is made: it grows now), or ended.
    for (int i = 0; i < 60000 && reached.load() < workers; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto c = world.network->join(workers);
    if (!c && (c.error().message.find("the run ends") != std::string::npos ||
               c.error().message.find("no live rank") != std::string::npos)) {
      // Refused as the rendezvous refuses a process that comes as the run
      // ends (or finds nobody after it): it trains nothing.
      TrainSummary late;
      late.rank = workers;
      late.keeper = -1;
      late.stopped_by = "run-ended";
      out.summaries.back() = late;
    } else {
      EXPECT_TRUE(c) << c.error().message;
    }
    if (c) {
      joined = std::move(*c);
      options.back().comm = joined.get();
      threads.emplace_back([&] {
        // Its shard owners are the run's, as connect_run fits them.
        TrainConfig own = config;
        fit_owners_to_run(own, workers);
        out.summaries.back() = train(own, options.back());
      });
    }
  }
  for (auto& t : threads) t.join();
  joined.reset();
  world.ranks.clear();
  return out;
}

nlohmann::json state_of(const fs::path& checkpoint) {
  return nlohmann::json::parse(std::ifstream(checkpoint / "state.json"));
}

/// The run's checkpoints, by step.
std::map<int64_t, fs::path> checkpoints_of(const fs::path& run) {
  std::map<int64_t, fs::path> out;
  for (const auto& e : fs::directory_iterator(run / "checkpoints")) {
    if (e.is_directory() && e.path().filename().string().starts_with("step-")) {
      out[state_of(e.path()).at("step").get<int64_t>()] = e.path();
    }
  }
  return out;
}

std::vector<float> model_of(const fs::path& file) {
  auto f = ckpt::SafetensorsFile::read(file);
  EXPECT_TRUE(f) << f.error().message;
  std::vector<float> out;
  if (!f) return out;
  for (const auto& t : f->tensors()) {
    std::vector<float> v(static_cast<size_t>(t.elements()));
    EXPECT_TRUE(f->read_f32(t.name, t.shape, v));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// localsgd --elastic of two grows to three at a round's end: each
// checkpoint after the join records all three members' inner states and
// the data's cut of the epoch (two ranks until the epoch's end, three
// after), and a resume of one with three ranks ends on the uninterrupted
// run's final parameters bit for bit (localsgd sums in the members' order:
// it is deterministic without --deterministic, which takes no joins). With
// two ranks it resumes too, the shards redistributed, and says so.
TEST(GrownRun, LocalSgdCheckpointsEveryMemberAndResumesBitwiseWithTheGrownWorld) {
  TempDir dir;
  const TrainConfig config = grown_config("localsgd", dir.path() / "whole");
  std::vector<std::unique_ptr<Member>> observers;
  const auto whole = run_world(config, 2, /*joiner=*/true, {}, &observers);
  for (size_t r = 0; r < whole.summaries.size(); ++r) {
    ASSERT_TRUE(whole.summaries[r]) << r << ": " << whole.summaries[r].error().message;
  }
  // The joiner's learning rate is the members' at every step it took (planned for two ranks).
  for (const auto& [step, lr] : observers[2]->lr) EXPECT_EQ(lr, observers[0]->lr.at(step)) << step;

  // A checkpoint of the grown world within the epoch it joined in, and one after that epoch.
  fs::path within;
  fs::path after;
  for (const auto& [step, path] : checkpoints_of(dir.path() / "whole")) {
    const auto s = state_of(path);
    if (s.at("workers") != 3) continue;
    EXPECT_EQ(s.at("first_workers"), 2);
    ASSERT_TRUE(s.contains("rank_optimizers")) << path;
    EXPECT_EQ(s.at("rank_optimizers").size(), 2u);
    EXPECT_EQ(s.at("rank_optimizer_steps").size(), 3u);
    if (s.at("epoch") == 0 && within.empty()) within = path;
    if (s.at("epoch") == 1 && s.at("batch_in_epoch") > 0 && after.empty()) after = path;
  }
  ASSERT_FALSE(after.empty()) << "no checkpoint of three ranks after the first epoch";
  if (!within.empty()) {
    EXPECT_EQ(state_of(within).at("data_world"), 2) << within;
  }
  EXPECT_EQ(state_of(after).at("data_world"), 3);
  const auto final_params = model_of(dir.path() / "whole" / "model.safetensors");

  // From the join's round (or the first after it) if it came in the first epoch, else from the next epoch.
  for (const fs::path& from : {within.empty() ? after : within}) {
    SCOPED_TRACE(from.string());
    TrainConfig again = config;
    again.out = (dir.path() / ("again-" + from.filename().string())).string();
    const auto resumed = run_world(again, 3, /*joiner=*/false, from);
    for (size_t r = 0; r < resumed.summaries.size(); ++r) {
      ASSERT_TRUE(resumed.summaries[r]) << r << ": " << resumed.summaries[r].error().message;
    }
    EXPECT_EQ(model_of(fs::path(again.out) / "model.safetensors"), final_params) << "bit for bit";
  }

  // With two ranks: redistributed, and said so.
  TrainConfig two = config;
  two.out = (dir.path() / "two").string();
  std::vector<std::unique_ptr<Member>> said;
  const auto fewer = run_world(two, 2, /*joiner=*/false, after, &said);
  for (size_t r = 0; r < fewer.summaries.size(); ++r) {
    ASSERT_TRUE(fewer.summaries[r]) << r << ": " << fewer.summaries[r].error().message;
  }
  EXPECT_NE(said[0]->all_notes().find("written by 3 worker(s) (a run grown from 2 by joins), resumed with 2"),
            std::string::npos)
      << said[0]->all_notes();
}

// cfmo of two grows to three: the keeper's checkpoints hold every rank's own
// state and position (the joiner's too), and resume with three ranks (each
// from its own) and with two (redistributed).
TEST(GrownRun, CfmoCheckpointsEveryRanksOwnStateAndResumesWithEitherWorld) {
  TempDir dir;
  TrainConfig config = grown_config("cfmo", dir.path() / "whole");
  config.checkpoint_every = 4;
  std::vector<std::unique_ptr<Member>> observers;
  const auto whole = run_world(config, 2, /*joiner=*/true, {}, &observers);
  for (size_t r = 0; r < whole.summaries.size(); ++r) {
    EXPECT_TRUE(whole.summaries[r]) << r << ": " << whole.summaries[r].error().message;
  }
  for (size_t r = 0; r < whole.summaries.size(); ++r) ASSERT_TRUE(whole.summaries[r]);
  // Every worker's report reached the keeper (one that finished first too: its report came before the keeper's end).
  EXPECT_EQ(whole.summaries[0]->per_worker.size(), 3u);
  EXPECT_EQ(whole.summaries[0]->workers, 3);
  // The joiner's schedule is the members': its rate at a step is theirs there.
  ASSERT_FALSE(observers[2]->lr.empty());
  for (const auto& [step, lr] : observers[2]->lr) {
    if (observers[0]->lr.count(step) != 0) {
      EXPECT_EQ(lr, observers[0]->lr.at(step)) << step;
    }
  }
  fs::path grown;
  for (const auto& [step, path] : checkpoints_of(dir.path() / "whole")) {
    const auto s = state_of(path);
    if (s.at("workers") == 3) grown = path;  // the newest: the end's
  }
  ASSERT_FALSE(grown.empty());
  const auto s = state_of(grown);
  EXPECT_EQ(s.at("first_workers"), 2);
  EXPECT_EQ(s.at("ranks").size(), 3u);
  EXPECT_EQ(s.at("rank_optimizers").size(), 2u);
  EXPECT_GT(s.at("ranks")[2].at("step").get<int64_t>(), 0) << "the joiner's own position";

  for (const int workers : {3, 2}) {
    SCOPED_TRACE(workers);
    // Resumed with the grown world, it grows once more: the joiner plans for
    // the run's first world of two (as its ranks do, from the checkpoint),
    // not for the three the transport started with.
    const bool grows = workers == 3;
    TrainConfig again = config;
    // One epoch more than the checkpoint's run trained: under load its
    // joiner, taken in while the members were held, trained on alone, and
    // the budget's stop reached it late, at up to twice the two epochs.
    again.epochs = (whole.summaries[0]->samples + 1023) / 1024 + 1;
    std::vector<std::unique_ptr<Member>> said;
    RunResult resumed;
    // A joiner that came as the run ended (its members' one epoch, or the
    // budget, was over before it asked: under CI's load its set-up took
    // longer than their hold) rightly trains nothing; the schedule is
    // checked on a run it trained in, so such a run is tried again, at most
    // twice.
    for (int attempt = 0; attempt < 3; ++attempt) {
      again.out = (dir.path() / fmt::format("again-{}-{}", workers, attempt)).string();
      said.clear();
      resumed = run_world(again, workers, /*joiner=*/grows, grown, &said);
      for (size_t r = 0; r < resumed.summaries.size(); ++r) {
        ASSERT_TRUE(resumed.summaries[r]) << r << ": " << resumed.summaries[r].error().message;
      }
      if (!grows || !said[3]->lr.empty()) break;
    }
    EXPECT_EQ(said[0]->all_notes().find("redistributed") != std::string::npos, workers == 2) << said[0]->all_notes();
    EXPECT_GT(resumed.summaries[0]->samples, 0);
    if (!grows) continue;
    EXPECT_EQ(resumed.summaries[0]->workers, 4);
    // The members' schedule: the budget of three epochs in global batches of two ranks.
    optim::Schedule planned;
    planned.kind = optim::Schedule::Kind::kCosine;
    planned.base_lr = again.lr;
    planned.min_lr = again.min_lr;
    planned.warmup_steps = again.warmup_steps;
    planned.total_steps = again.epochs * 1024 / (2 * again.batch_size);
    ASSERT_FALSE(said[3]->lr.empty());
    // (A step's event has its rate for the update after step - 1 steps.)
    for (const auto& [step, lr] : said[3]->lr) EXPECT_DOUBLE_EQ(lr, planned.at(step - 1)) << "the joiner's " << step;
    for (const auto& [step, lr] : said[1]->lr) EXPECT_DOUBLE_EQ(lr, planned.at(step - 1)) << "rank 1's " << step;
  }
}

// A joiner appends to its rank's metrics file and drops nothing: the lines
// there are the history of the processes that held the place before it,
// kept even where it continues from an earlier step than theirs (here a new
// rank's step 0; in a run, a replaced rank whose keeper was lost before it
// told the joiner its place's position, which bench/elastic.sh met: the
// lines of 45 s of training were gone, and its count of them with them).
TEST(GrownRun, AJoinerKeepsTheMetricsLinesOfTheProcessesBeforeIt) {
  TempDir dir;
  const TrainConfig config = grown_config("cfmo", dir.path() / "run");
  const fs::path file = dir.path() / "run" / "metrics-rank-2.jsonl";
  fs::create_directories(file.parent_path());
  const std::string before =
      "{\"type\":\"step\",\"rank\":2,\"step\":40,\"samples\":1280}\n"
      "{\"type\":\"step\",\"rank\":2,\"step\":50,\"samples\":1600}\n";
  std::ofstream(file) << before;
  const auto run = run_world(config, 2, /*joiner=*/true);
  for (size_t r = 0; r < run.summaries.size(); ++r) {
    ASSERT_TRUE(run.summaries[r]) << r << ": " << run.summaries[r].error().message;
  }
  std::stringstream text;
  text << std::ifstream(file).rdbuf();
  ASSERT_TRUE(text.str().starts_with(before)) << text.str();
  bool joined = false;
  std::string line;
  text.seekg(static_cast<std::streamoff>(before.size()));
  while (std::getline(text, line)) {
    const auto m = nlohmann::json::parse(line);
    if (m.value("event", "") == "joined" && m.contains("first_step_s")) joined = true;
  }
  EXPECT_TRUE(joined) << "its own joined line follows them: " << text.str();
}

/// Runs `at_end` once on the keeper's training thread at its final
/// evaluation: after the group's last round, before the end's checkpoint.
class AtFinalEvaluation final : public TrainObserver {
 public:
  explicit AtFinalEvaluation(std::function<void()> at_end) : at_end_(std::move(at_end)) {}
  void on_eval(const EvalEvent& e) override {
    if (e.final && at_end_) std::exchange(at_end_, nullptr)();
  }

 private:
  std::function<void()> at_end_;
};

// A process that joins after the run's last round (at the keeper's final
// evaluation) is told at once that the run ended: it trains nothing and ends
// with "run-ended" (its tool: one line, status 0), and the keeper waits for
// nothing of it (its end's checkpoint for the members' states only, its
// summary for their reports), not 2x --peer-timeout. localsgd --elastic: its
// group closed after its last sum; cfmo and asgd: the keeper's end began
// before the joiner's request for the global state came.
void expect_a_joiner_after_the_last_round_to_end_at_once(const std::string& mode) {
  SCOPED_TRACE(mode);
  using Clock = std::chrono::steady_clock;
  TempDir dir;
  TrainConfig config = grown_config(mode, dir.path() / "run");
  config.epochs = 1;
  config.owners = 2;  // the run's, as connect_run fits a joiner's (asgd, cfmo)
  auto world = comm::make_loopback_world(2, {.peer_timeout_s = config.peer_timeout});
  std::unique_ptr<comm::Communicator> joined;
  Result<TrainSummary> late = make_error(ErrorKind::kInternal, "did not run");
  double late_s = -1;
  Clock::time_point released{};
  AtFinalEvaluation keeper([&] {
    // (Past the keeper's close_joins: as a process the rendezvous admitted
    // just before it, whose request comes after the keeper's end began.)
    auto c = world.network->join(2, /*past_close=*/true);
    ASSERT_TRUE(c) << c.error().message;
    joined = std::move(*c);
    TrainOptions o;
    o.comm = joined.get();
    o.first_world = 2;
    const auto start = Clock::now();
    late = train(config, o);  // meanwhile the keeper waits here
    late_s = std::chrono::duration<double>(Clock::now() - start).count();
    released = Clock::now();
  });
  Member other;
  std::vector<Result<TrainSummary>> summaries(2, make_error(ErrorKind::kInternal, "did not run"));
  Clock::time_point keeper_done{};
  std::vector<TrainOptions> options(2);
  for (int r = 0; r < 2; ++r) {
    options[static_cast<size_t>(r)].comm = world.ranks[static_cast<size_t>(r)].get();
    options[static_cast<size_t>(r)].observer = r == 0 ? static_cast<TrainObserver*>(&keeper) : &other;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      summaries[static_cast<size_t>(r)] = train(config, options[static_cast<size_t>(r)]);
      if (r == 0) keeper_done = Clock::now();
    });
  }
  for (auto& t : threads) t.join();
  joined.reset();
  world.ranks.clear();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(summaries[static_cast<size_t>(r)]) << r << ": " << summaries[static_cast<size_t>(r)].error().message;
  }
  ASSERT_TRUE(late) << late.error().message;
  EXPECT_EQ(late->stopped_by, "run-ended");
  EXPECT_EQ(late->rank, 2);
  EXPECT_NE(late->keeper, late->rank) << "its tool prints no summary";
  EXPECT_LT(late_s, 5.0) << "told, not timed out";
  EXPECT_LT(std::chrono::duration<double>(keeper_done - released).count(), config.peer_timeout)
      << "the keeper waited for the joiner's report or state";
  EXPECT_EQ(summaries[0]->per_worker.size(), 2u);
  if (mode == "localsgd") {
    EXPECT_EQ(summaries[0]->stopped_by, "epochs");
  }
  EXPECT_FALSE(fs::exists(dir.path() / "run" / "metrics-rank-2.jsonl")) << "it wrote nothing";
}

TEST(GrownRun, AJoinerAfterAnElasticGroupsLastRoundEndsAtOnceAndNobodyWaitsForIt) {
  expect_a_joiner_after_the_last_round_to_end_at_once("localsgd");
}

TEST(GrownRun, AJoinerAfterTheKeepersEndBeganEndsAtOnceAndNobodyWaitsForIt) {
  expect_a_joiner_after_the_last_round_to_end_at_once("cfmo");
  expect_a_joiner_after_the_last_round_to_end_at_once("asgd");
}

JoinedRank join(int rank, double wall_s, double first_step_s = -1) { return {rank, 0, wall_s, first_step_s}; }

std::vector<std::pair<int, double>> ranks_and_times(const std::vector<JoinedRank>& joins) {
  std::vector<std::pair<int, double>> out;
  for (const auto& j : joins) out.emplace_back(j.rank, j.wall_s);
  return out;
}

// Two ranks' lists of joins merge into one, whichever is older (a keeper
// restarted gets the list of the run before it), a join noticed by both
// (within 2 s of each other) counted once, in the order of their times.
TEST(JoinLog, ListsOfJoinsMergeAtTheirOverlap) {
  using Seen = std::vector<std::pair<int, double>>;
  // The standby noticed the keeper's last join (a little later) and one more after the keeper was lost.
  EXPECT_EQ(ranks_and_times(merge_joins({join(2, 5), join(3, 9)}, {join(3, 9.3), join(2, 20)})),
            (Seen{{2, 5}, {3, 9}, {2, 20}}));
  // A keeper restarted as rank 1 noticed joins from its start only; the list it receives is older.
  EXPECT_EQ(ranks_and_times(merge_joins({join(1, 30)}, {join(2, 5), join(1, 12), join(1, 30.2)})),
            (Seen{{2, 5}, {1, 12}, {1, 30}}));
  // As a keeper saw them: its own later notice of a join that a rank behind it on the clock listed.
  EXPECT_EQ(ranks_and_times(merge_joins({join(3, 8.53)}, {join(2, 7.05), join(3, 8.03)})),
            (Seen{{2, 7.05}, {3, 8.03}}));
  // A rank's second join is another entry; the joiner's own first_step_s is kept.
  const auto merged = merge_joins({join(1, 10)}, {join(1, 10.5, 1.25), join(1, 15)});
  EXPECT_EQ(ranks_and_times(merged), (Seen{{1, 10}, {1, 15}}));
  EXPECT_EQ(merged[0].first_step_s, 1.25);
  // Disjoint: one after the other; the same list: itself.
  EXPECT_EQ(merge_joins({join(2, 5)}, {join(3, 40)}).size(), 2u);
  EXPECT_EQ(merge_joins({join(2, 5), join(3, 9)}, {join(2, 5), join(3, 9)}).size(), 2u);
  EXPECT_TRUE(merge_joins({}, {}).empty());
}

// The keeper's list reaches its standby, which merges it into its own.
TEST(JoinLog, TheKeepersListReachesItsStandby) {
  auto world = comm::make_loopback_world(3, {.peer_timeout_s = 5});
  JoinLog keeper(*world.ranks[0]);
  JoinLog standby(*world.ranks[1]);
  JoinLog other(*world.ranks[2]);
  keeper.share({join(2, 5), join(2, 12)}, 0, 1);
  ASSERT_TRUE(world.network->drain());
  std::vector<JoinedRank> own = {join(2, 12.1)};
  standby.merge_received(own);
  EXPECT_EQ(ranks_and_times(own), (std::vector<std::pair<int, double>>{{2, 5}, {2, 12}}));
  std::vector<JoinedRank> none;
  other.merge_received(none);
  EXPECT_TRUE(none.empty()) << "sent to the keeper and its standby only";
}

}  // namespace
}  // namespace cfmo::train
