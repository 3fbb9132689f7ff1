#include "diverge/diverge_config.h"

#include "core/atomic_file.h"
#include "unit/diverge_fixtures.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <functional>
#include <memory>

namespace cfmo::diverge {
namespace {

namespace fs = std::filesystem;
using ConfigTest = testing::TempDirTest;

struct Parsed {
  DivergeConfig config;
  OptionTable table;
  CLI::App app;
};

// Registers a subcommand's options and parses `args` as its flags.
std::unique_ptr<Parsed> parse(Subcommand s, std::vector<std::string> args) {
  auto p = std::make_unique<Parsed>();
  add_diverge_options(p->table, p->config, s);
  p->table.register_cli(p->app);
  p->app.allow_extras();
  std::reverse(args.begin(), args.end());
  p->app.parse(args);
  return p;
}

TEST_F(ConfigTest, TopLevelKeysThenTheSubcommandsTableThenFlags) {
  const fs::path file = dir_ / "d.toml";
  ASSERT_TRUE(write_file_atomic(file,
                                "threads = 3\nmax_rel_l2 = \"4%\"\nformat = \"json\"\n"
                                "[check]\nmax_rel_l2 = 0.02\nmax_abs = 0.5\n"
                                "[plot]\nformat = \"sparkline\"\nwidth = 1000\n"
                                "[watch]\ninterval = \"250ms\"\n"));
  auto check = parse(Subcommand::kCheck, {"--threads", "2"});
  ASSERT_TRUE(load_diverge_config(check->table, file, Subcommand::kCheck));
  EXPECT_EQ(check->config.threads, 2);  // the flag wins
  EXPECT_EQ(check->config.max_rel_l2, "0.02");
  EXPECT_EQ(check->config.max_abs, "0.5");
  EXPECT_EQ(check->config.format, "json");
  auto plan = validate(check->config, Subcommand::kCheck);
  ASSERT_TRUE(plan) << plan.error().message;
  EXPECT_DOUBLE_EQ(*plan->thresholds.max_rel_l2, 0.02);
  EXPECT_DOUBLE_EQ(*plan->thresholds.max_abs, 0.5);
  EXPECT_EQ(*plan->thresholds.max_nonfinite, 0);
  EXPECT_EQ(plan->format, OutputFormat::kJson);

  auto plot = parse(Subcommand::kPlot, {});
  ASSERT_TRUE(load_diverge_config(plot->table, file, Subcommand::kPlot));
  EXPECT_EQ(plot->config.format, "sparkline");
  EXPECT_EQ(plot->config.width, 1000);
  EXPECT_EQ(plot->config.max_rel_l2, "4%");

  auto watch = parse(Subcommand::kWatch, {});
  ASSERT_TRUE(load_diverge_config(watch->table, file, Subcommand::kWatch));
  auto watch_plan = validate(watch->config, Subcommand::kWatch);
  ASSERT_TRUE(watch_plan) << watch_plan.error().message;
  EXPECT_DOUBLE_EQ(watch_plan->interval_s, 0.25);
  EXPECT_FALSE(watch_plan->timeout_s);

  // The merged configuration loads back as the same configuration.
  const std::string printed = diverge_config_toml(check->table, Subcommand::kCheck);
  EXPECT_EQ(printed.rfind("[check]\n", 0), 0u);
  ASSERT_TRUE(write_file_atomic(dir_ / "printed.toml", printed));
  auto again = parse(Subcommand::kCheck, {});
  ASSERT_TRUE(load_diverge_config(again->table, dir_ / "printed.toml", Subcommand::kCheck));
  EXPECT_EQ(diverge_config_toml(again->table, Subcommand::kCheck), printed);
}

TEST_F(ConfigTest, UnknownKeysTablesAndWrongTypesAreUsageErrors) {
  auto expect_error = [&](const std::string& text, Subcommand s, const std::string& needle) {
    const fs::path file = dir_ / "bad.toml";
    ASSERT_TRUE(write_file_atomic(file, text));
    auto p = parse(s, {});
    auto loaded = load_diverge_config(p->table, file, s);
    ASSERT_FALSE(loaded) << text;
    EXPECT_EQ(loaded.error().kind, ErrorKind::kUsage);
    EXPECT_NE(loaded.error().message.find(needle), std::string::npos) << loaded.error().message;
    EXPECT_NE(loaded.error().message.find("bad.toml"), std::string::npos);
  };
  expect_error("nonsense = 1\n", Subcommand::kReport, "'nonsense'");
  expect_error("[check]\nwidth = 3\n", Subcommand::kCheck, "'check.width'");
  expect_error("check = 3\n", Subcommand::kCheck, "must be a table");
  expect_error("threads = \"many\"\n", Subcommand::kReport, "'threads'");
  expect_error("threads = = 1\n", Subcommand::kReport, "line 1");
  // Every table is checked by every subcommand: a mistake in [plot] shows in `check` and `report` too.
  for (Subcommand s : {Subcommand::kCheck, Subcommand::kReport, Subcommand::kWatch, Subcommand::kPlot}) {
    expect_error("[plot]\nfrob = 1\n", s, "'plot.frob'");
    expect_error("[watch]\nwidth = 3\n", s, "'watch.width'");
  }
  auto missing = parse(Subcommand::kReport, {});
  auto loaded = load_diverge_config(missing->table, dir_ / "none.toml", Subcommand::kReport);
  ASSERT_FALSE(loaded);
  EXPECT_EQ(loaded.error().kind, ErrorKind::kUsage);
  EXPECT_NE(loaded.error().message.find("none.toml"), std::string::npos);
}

TEST_F(ConfigTest, ADirectoryOrAFifoIsNotAConfigFile) {
  const fs::path fifo = dir_ / "config.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const auto& [path, what] : {std::pair{dir_, "a directory"}, std::pair{fifo, "a FIFO"}}) {
    auto p = parse(Subcommand::kCheck, {});
    auto loaded = load_diverge_config(p->table, path, Subcommand::kCheck);
    ASSERT_FALSE(loaded) << path;
    EXPECT_EQ(loaded.error().kind, ErrorKind::kUsage);
    EXPECT_NE(loaded.error().message.find(what), std::string::npos) << loaded.error().message;
    EXPECT_NE(loaded.error().message.find(path.string()), std::string::npos) << loaded.error().message;
  }
}

TEST(ValidateTest, ValuesAreCheckedAndErrorsNameTheFlag) {
  auto expect_error = [](Subcommand s, const std::function<void(DivergeConfig&)>& edit, const std::string& flag) {
    DivergeConfig c;
    edit(c);
    auto plan = validate(c, s);
    ASSERT_FALSE(plan) << flag;
    EXPECT_EQ(plan.error().kind, ErrorKind::kUsage);
    EXPECT_NE(plan.error().message.find(flag), std::string::npos) << plan.error().message;
  };
  expect_error(
      Subcommand::kCheck, [](auto& c) { c.max_rel_l2 = "5"; }, "--max-rel-l2");
  expect_error(
      Subcommand::kCheck, [](auto& c) { c.max_abs = "-1"; }, "--max-abs");
  expect_error(
      Subcommand::kCheck, [](auto& c) { c.max_abs = "lots"; }, "--max-abs");
  expect_error(
      Subcommand::kCheck, [](auto& c) { c.max_nonfinite = -2; }, "--max-nonfinite");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.format = "xml"; }, "--format");
  expect_error(
      Subcommand::kPlot, [](auto& c) { c.format = "json"; }, "--format");
  expect_error(
      Subcommand::kPlot, [](auto& c) { c.width = 10; }, "--width");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.last = -1; }, "--last");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.threads = -1; }, "--threads");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.rank = {"x"}; }, "--rank");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.round = {"3..1"}; }, "--round");
  expect_error(
      Subcommand::kReport, [](auto& c) { c.tensor = {""}; }, "--tensor");
  expect_error(
      Subcommand::kWatch, [](auto& c) { c.interval = "0s"; }, "--interval");
  expect_error(
      Subcommand::kWatch, [](auto& c) { c.timeout = "soon"; }, "--timeout");
  expect_error(
      Subcommand::kWatch, [](auto& c) { c.max_rounds = -1; }, "--max-rounds");

  DivergeConfig off;
  off.max_rel_l2 = "off";
  off.max_nonfinite = -1;
  auto plan = validate(off, Subcommand::kCheck);
  ASSERT_TRUE(plan);
  EXPECT_FALSE(plan->thresholds.max_rel_l2);
  EXPECT_FALSE(plan->thresholds.max_nonfinite);
  // report holds nothing to limits; plot draws the default line.
  EXPECT_FALSE(validate(DivergeConfig{}, Subcommand::kReport)->thresholds.max_rel_l2);
  EXPECT_DOUBLE_EQ(*validate(DivergeConfig{}, Subcommand::kPlot)->thresholds.max_rel_l2, 0.05);
  EXPECT_EQ(validate(DivergeConfig{}, Subcommand::kPlot)->format, OutputFormat::kSvg);
}

}  // namespace
}  // namespace cfmo::diverge
