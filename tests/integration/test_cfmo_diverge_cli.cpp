// Drives the real cfmo-diverge binary: the documented contract (help, man
// page, config), reports and their formats, check's exit statuses, every
// kind of corrupt input, plots, watching a run, and deltas of a real
// cfmo-train run.
#include "ckpt/cfd.h"
#include "ckpt/safetensors.h"
#include "core/atomic_file.h"
#include "diverge/sources.h"
#include "integration/harness.h"
#include "integration/man_page.h"
#include "support/well_formed_xml.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>

namespace cfmo {
namespace {

using testing::lines;
using testing::run;
using testing::RunResult;
using testing::slurp;
using testing::TempDir;
namespace fs = std::filesystem;

std::string binary() { return testing::env_or("CFMO_DIVERGE", "build/tools/cfmo-diverge"); }
std::string trainer() { return testing::env_or("CFMO_TRAIN", "build/tools/cfmo-train"); }
fs::path source_root() { return testing::env_or("CFMO_SOURCE_ROOT", "."); }

std::set<std::string> matches(const std::string& text, const std::regex& pattern) {
  std::set<std::string> found;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it) {
    found.insert((*it)[1]);
  }
  return found;
}

RunResult diverge(std::vector<std::string> args, double timeout_s = 120) {
  args.insert(args.begin(), binary());
  return run(args, timeout_s);
}

// Every error is one line on stderr naming what was wrong, and nothing on stdout.
void expect_one_line_error(const RunResult& r, int status, std::initializer_list<std::string> needles) {
  EXPECT_EQ(r.status, status) << r.err;
  EXPECT_FALSE(r.timed_out);
  for (const auto& needle : needles) EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  EXPECT_EQ(lines(r.err).size(), 1u) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> base;
  std::vector<float> delta;
};

void write_delta(const fs::path& path, int rank, int64_t round, const std::vector<Tensor>& tensors,
                 const ckpt::CfdWriteOptions& options = {}) {
  std::vector<ckpt::CfdTensorInput> inputs;
  for (const auto& t : tensors) inputs.push_back({t.name, t.shape, t.base, t.delta});
  fs::create_directories(path.parent_path());
  auto written = ckpt::write_cfd(path, {rank, round, round * 100, round - 1, {}}, inputs, options);
  ASSERT_TRUE(written) << written.error().message;
}

// Delta = scale * base: the relative L2 is `scale` and the cosine 1.
std::vector<Tensor> scaled(float scale) {
  Tensor w{"layers.0.weight", {2, 2}, {0.5f, -1.0f, 2.0f, 0.25f}, {}};
  Tensor b{"layers.0.bias", {2}, {1.0f, -0.5f}, {}};
  for (auto* t : {&w, &b}) {
    for (float v : t->base) t->delta.push_back(scale * v);
  }
  return {w, b};
}

// A run directory of 2 ranks and 3 rounds; rank 1's round 3 drifts 8%, everything else 2%.
fs::path make_run(const TempDir& dir, const std::string& name = "run") {
  const fs::path run_dir = dir / name;
  for (int64_t round = 1; round <= 3; ++round) {
    for (int rank = 0; rank < 2; ++rank) {
      write_delta(ckpt::delta_path(run_dir, rank, round), rank, round, scaled(rank == 1 && round == 3 ? 0.08f : 0.02f));
    }
  }
  return run_dir;
}

uint64_t le64_at(const std::string& bytes, size_t offset) {
  uint64_t v = 0;
  std::memcpy(&v, bytes.data() + offset, 8);
  return v;
}

// The file with its header edited and the prelude's length and checksum fixed.
std::string with_header(const std::string& file, const std::function<void(nlohmann::json&)>& edit) {
  const uint64_t length = le64_at(file, 16);
  auto header = nlohmann::json::parse(file.substr(32, length));
  edit(header);
  std::string text = header.dump();
  text.append((64 - (32 + text.size()) % 64) % 64, ' ');
  std::string out = file.substr(0, 32);
  const uint64_t new_length = text.size();
  const uint64_t checksum = XXH3_64bits(text.data(), text.size());
  std::memcpy(out.data() + 16, &new_length, 8);
  std::memcpy(out.data() + 24, &checksum, 8);
  return out + text + file.substr(32 + length);
}

TEST(CfmoDivergeCli, HelpManPageAndConfigListTheSameOptions) {
  const std::regex long_flag(R"((--[a-z][a-z0-9-]*))");
  std::set<std::string> help_flags;
  const RunResult top = diverge({"--help"});
  ASSERT_EQ(top.status, 0);
  help_flags = matches(top.out, long_flag);
  std::set<std::string> printed_keys;
  const std::regex key(R"((?:^|\n)([a-z_0-9]+) = )");
  for (const char* sub : {"report", "check", "plot", "watch"}) {
    const RunResult help = diverge({sub, "--help"});
    ASSERT_EQ(help.status, 0) << sub;
    EXPECT_NE(help.out.find(std::string("cfmo-diverge ") + sub), std::string::npos) << help.out;
    for (const auto& f : matches(help.out, long_flag)) help_flags.insert(f);
    const RunResult printed = diverge({sub, "--print-config"});
    ASSERT_EQ(printed.status, 0) << sub << ": " << printed.err;
    EXPECT_EQ(printed.out.rfind(std::string("[") + sub + "]\n", 0), 0u) << printed.out;
    for (const auto& k : matches(printed.out, key)) printed_keys.insert(k);
    // The shipped file and the printed configuration both load.
    EXPECT_EQ(diverge({sub, "--config", (source_root() / "conf/diverge.toml").string(), "--print-config"}).status, 0)
        << sub;
    TempDir dir;
    ASSERT_TRUE(write_file_atomic(dir / "printed.toml", printed.out));
    const RunResult again = diverge({sub, "--config", (dir / "printed.toml").string(), "--print-config"});
    EXPECT_EQ(again.out, printed.out) << sub << ": " << again.err;
  }
  const std::string man = slurp(source_root() / "man/cfmo-diverge.1.scd");
  ASSERT_FALSE(man.empty()) << "man/cfmo-diverge.1.scd missing";
  const std::set<std::string> man_flags = matches(man, std::regex(R"(\*(--[a-z][a-z0-9-]*)\*)"));
  for (const auto& f : help_flags) EXPECT_TRUE(man_flags.count(f)) << f << " is in --help but not in the man page";
  for (const auto& f : man_flags) EXPECT_TRUE(help_flags.count(f)) << f << " is in the man page but not in --help";
  for (const char* section : {"# EXIT STATUS", "# FILES", "# ENVIRONMENT", "# EXAMPLES", "crontab"}) {
    EXPECT_NE(man.find(section), std::string::npos) << section;
  }
  const std::set<std::string> conf_keys = matches(slurp(source_root() / "conf/diverge.toml"), key);
  EXPECT_EQ(conf_keys, printed_keys);
}

TEST(CfmoDivergeCli, GeneratedManPageIsCurrent) {
  testing::expect_generated_man_page_current(source_root(), "cfmo-diverge");
}

TEST(CfmoDivergeCli, ReportInEveryFormat) {
  TempDir dir;
  const fs::path run_dir = make_run(dir);
  const RunResult table = diverge({"report", run_dir.string()});
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_TRUE(table.err.empty()) << table.err;
  const auto rows = lines(table.out);
  ASSERT_EQ(rows.size(), 8u) << table.out;  // header, 6 deltas, summary
  EXPECT_NE(rows[6].find("8%"), std::string::npos) << rows[6];
  EXPECT_NE(rows[7].find("largest relative L2 8% (rank 1, round 3)"), std::string::npos) << rows[7];

  const RunResult json = diverge({"report", run_dir.string(), "--format", "json", "--threads", "2"});
  ASSERT_EQ(json.status, 0) << json.err;
  const auto j = nlohmann::json::parse(json.out);
  ASSERT_EQ(j["tensors"].size(), 12u);
  for (const auto& t : j["tensors"]) {
    for (const char* k : {"name", "rel_l2", "cosine", "max_abs", "nonfinite", "rank", "round"}) {
      EXPECT_TRUE(t.contains(k)) << k;
    }
    EXPECT_NEAR(t["rel_l2"].get<double>(), t["rank"] == 1 && t["round"] == 3 ? 0.08 : 0.02, 1e-7);
    EXPECT_NEAR(t["cosine"].get<double>(), 1.0, 1e-12);
  }
  EXPECT_EQ(j["deltas"].size(), 6u);
  EXPECT_EQ(j["summary"]["max_rel_l2"]["round"], 3);

  const RunResult csv = diverge({"report", run_dir.string(), "--format", "csv", "--rank", "0", "--last", "1"});
  ASSERT_EQ(csv.status, 0) << csv.err;
  const auto csv_lines = lines(csv.out);
  ASSERT_EQ(csv_lines.size(), 4u) << csv.out;  // header, the delta, its two tensors
  EXPECT_EQ(csv_lines[0].rfind("scope,source,rank,round,step,tensor,", 0), 0u);
  EXPECT_EQ(csv_lines[1].rfind("delta,", 0), 0u);

  // One .cfd file: a row per tensor and the overall figures.
  const RunResult one = diverge({"report", ckpt::delta_path(run_dir, 1, 3).string(), "--header-only"});
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_NE(one.out.find("rank 1, round 3, step 300, base version 2"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("layers.0.bias"), std::string::npos);
  EXPECT_NE(one.out.find("overall"), std::string::npos);

  const RunResult filtered = diverge({"report", run_dir.string(), "--tensor", "*.bias", "--format", "json"});
  ASSERT_EQ(filtered.status, 0) << filtered.err;
  EXPECT_EQ(nlohmann::json::parse(filtered.out)["tensors"].size(), 6u);
}

TEST(CfmoDivergeCli, CheckExitsOneListingEveryViolation) {
  TempDir dir;
  const fs::path run_dir = make_run(dir);
  const RunResult within = diverge({"check", run_dir.string(), "--max-rel-l2", "10%"});
  EXPECT_EQ(within.status, 0) << within.out << within.err;
  EXPECT_NE(within.out.find("ok: 6 delta(s) within limits"), std::string::npos) << within.out;
  const RunResult quiet = diverge({"check", run_dir.string(), "--max-rel-l2", "0.1", "--quiet"});
  EXPECT_EQ(quiet.status, 0);
  EXPECT_TRUE(quiet.out.empty()) << quiet.out;

  const RunResult exceeded = diverge({"check", run_dir.string(), "--max-rel-l2", "5%"});
  EXPECT_EQ(exceeded.status, 1) << exceeded.err;
  ASSERT_EQ(lines(exceeded.out).size(), 2u) << exceeded.out;
  EXPECT_NE(exceeded.out.find("rank 1, round 3 (step 300): relative L2 8% exceeds 5%"), std::string::npos);
  // 1.5% fails all six, and all six are listed; a fraction means the same as a percentage.
  for (const char* limit : {"1.5%", "0.015"}) {
    const RunResult all = diverge({"check", run_dir.string(), "--max-rel-l2", limit, "--per-tensor"});
    EXPECT_EQ(all.status, 1);
    EXPECT_EQ(lines(all.out).size(), 6u * 3 + 1) << all.out;  // overall and both tensors of each, then the summary
  }
  const RunResult json = diverge({"check", run_dir.string(), "--max-abs", "0.1", "--format", "json"});
  EXPECT_EQ(json.status, 1);
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["ok"], false);
  ASSERT_EQ(j["violations"].size(), 2u);  // round 3 of rank 1: 8% overall, and 0.16 in the weight
  EXPECT_EQ(j["violations"][1]["tensor"], "layers.0.weight");
  EXPECT_EQ(j["violations"][1]["metric"], "max_abs");
  EXPECT_EQ(j["violations"][1]["rank"], 1);

  // Non-finite values fail by default.
  write_delta(ckpt::delta_path(run_dir, 0, 4), 0, 4, {{"w", {2}, {1, 1}, {std::nanf(""), 0}}});
  const RunResult nan = diverge({"check", run_dir.string(), "--round", "4"});
  EXPECT_EQ(nan.status, 1);
  EXPECT_NE(nan.out.find("1 non-finite values exceed 0: 1 in 'w'"), std::string::npos) << nan.out;
  EXPECT_EQ(diverge({"check", run_dir.string(), "--round", "4", "--max-nonfinite", "-1"}).status, 0);
}

TEST(CfmoDivergeCli, UsageErrorsExitTwo) {
  TempDir dir;
  const fs::path run_dir = make_run(dir);
  expect_one_line_error(diverge({"check", run_dir.string(), "--max-rel-l2", "5"}), 2, {"--max-rel-l2", "5%"});
  expect_one_line_error(diverge({"check"}), 2, {"nothing to read"});
  expect_one_line_error(diverge({"report", "--base", "a.safetensors"}), 2, {"--against"});
  expect_one_line_error(diverge({"report", "a.safetensors", "b.safetensors"}), 2, {"a.safetensors", "--base"});
  expect_one_line_error(diverge({"report", run_dir.string(), "--format", "xml"}), 2, {"--format"});
  expect_one_line_error(diverge({"report", run_dir.string(), "--rank", "x"}), 2, {"--rank"});
  expect_one_line_error(diverge({"report", run_dir.string(), "--round", "9"}), 2, {"no delta matches"});
  expect_one_line_error(diverge({"report", run_dir.string(), "--tensor", "nope.*"}), 2, {"nope.*"});
  expect_one_line_error(diverge({"plot"}), 2, {"run directory"});
  expect_one_line_error(diverge({"watch", run_dir.string(), "--interval", "0"}), 2, {"--interval"});
  ASSERT_TRUE(write_file_atomic(dir / "bad.toml", "[check]\nwidth = 10\n"));
  expect_one_line_error(diverge({"check", run_dir.string(), "--config", (dir / "bad.toml").string()}), 2,
                        {"bad.toml", "check.width"});
  // CLI11's own errors add a hint line; the status is what scripts rely on.
  EXPECT_EQ(diverge({}).status, 2);
  expect_one_line_error(diverge({"frobnicate", run_dir.string()}), 2, {"'frobnicate'", "report, check, plot or watch"});
  // Every subcommand checks the whole file: a mistake in [plot] is one in check's configuration too.
  ASSERT_TRUE(write_file_atomic(dir / "plot.toml", "[plot]\nfrob = 1\n"));
  expect_one_line_error(diverge({"check", run_dir.string(), "--config", (dir / "plot.toml").string()}), 2,
                        {"plot.toml", "plot.frob"});
  // A directory or a FIFO is not a configuration file, and a FIFO is not waited on.
  expect_one_line_error(diverge({"check", run_dir.string(), "--config", dir.path().string()}), 2, {"a directory"});
  ASSERT_EQ(mkfifo((dir / "fifo").c_str(), 0600), 0);
  expect_one_line_error(diverge({"check", run_dir.string(), "--config", (dir / "fifo").string()}, 30), 2, {"a FIFO"});
  EXPECT_EQ(diverge({"report", run_dir.string(), "--no-such-flag"}).status, 2);
  EXPECT_EQ(diverge({"report", run_dir.string(), "--threads", "many"}).status, 2);
}

TEST(CfmoDivergeCli, CorruptInputExitsThreeWithOneLineNamingTheFileAndTensor) {
  TempDir dir;
  const fs::path good = dir / "good.cfd";
  write_delta(good, 0, 1, scaled(0.02f), {.chunk_elements = 2});
  const std::string bytes = slurp(good);
  auto broken = [&](const std::string& name, const std::string& contents) {
    const fs::path path = dir / name;
    EXPECT_TRUE(write_file_atomic(path, contents));
    return path.string();
  };
  auto expect_corrupt = [&](const std::string& path, std::initializer_list<std::string> needles) {
    SCOPED_TRACE(path);
    for (const char* sub : {"report", "check"}) expect_one_line_error(diverge({sub, path}), 3, needles);
  };
  expect_corrupt((dir / "missing.cfd").string(), {"missing.cfd"});
  expect_corrupt(broken("text.cfd", "this is not a delta at all, only some text"), {"text.cfd", "magic"});
  std::string huge_header = bytes;
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(huge_header.data() + 16, &huge, 8);
  expect_corrupt(broken("huge.cfd", huge_header), {"huge.cfd", "exceeds the limit"});
  expect_corrupt(broken("truncated.cfd", bytes.substr(0, bytes.size() - 3)),
                 {"truncated.cfd", "'layers.0.bias'", "past the end"});
  expect_corrupt(broken("cut-header.cfd", bytes.substr(0, 50)), {"cut-header.cfd", "truncated header"});
  expect_corrupt(broken("overlap.cfd", with_header(bytes, [](auto& h) { h["tensors"][1]["offset"] = 0; })),
                 {"overlap.cfd", "overlaps"});
  expect_corrupt(broken("offset.cfd", with_header(bytes, [](auto& h) { h["tensors"][0]["offset"] = 1 << 20; })),
                 {"offset.cfd", "'layers.0.weight'", "past the end"});
  std::string header_flip = bytes;
  header_flip[40] ^= 1;
  expect_corrupt(broken("header-flip.cfd", header_flip), {"header-flip.cfd", "header checksum"});
  // A flipped payload byte without a codec reaches the frame's checksum.
  write_delta(dir / "plain.cfd", 0, 1, scaled(0.02f), {.codec = ckpt::CfdCodec::kNone, .chunk_elements = 2});
  std::string payload_flip = slurp(dir / "plain.cfd");
  payload_flip[payload_flip.size() - 2] ^= 0x10;
  expect_corrupt(broken("payload-flip.cfd", payload_flip),
                 {"payload-flip.cfd", "'layers.0.bias'", "checksum mismatch"});
  // A zstd frame cut short.
  const std::string short_frame = with_header(bytes, [](auto& h) {
    auto& frames = h["tensors"][0]["frames"];
    frames[0]["size"] = frames[0]["size"].template get<uint64_t>() - 4;
    frames[1]["size"] = frames[1]["size"].template get<uint64_t>() + 4;
  });
  expect_corrupt(broken("short-frame.cfd", short_frame), {"short-frame.cfd", "'layers.0.weight' frame 1 of 2"});
  // --header-only does not read payloads, so a payload fault passes; the header's do not.
  EXPECT_EQ(diverge({"report", (dir / "payload-flip.cfd").string(), "--header-only"}).status, 0);
  expect_one_line_error(diverge({"report", (dir / "overlap.cfd").string(), "--header-only"}), 3, {"overlaps"});
  // A run directory without deltas, a directory that is not a run.
  fs::create_directories(dir / "empty-run" / "deltas");
  expect_one_line_error(diverge({"check", (dir / "empty-run").string()}), 3, {"no deltas"});
  expect_one_line_error(diverge({"report", (dir / "empty-run" / "deltas" / "..").string() + "/.."}), 3,
                        {"not a run directory"});
}

// A safetensors file made byte by byte, independently of ckpt/safetensors.
std::string safetensors_bytes(const std::string& header, const std::vector<float>& values) {
  const uint64_t length = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &length, 8);
  out += header;
  out.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  return out;
}

TEST(CfmoDivergeCli, TwoCheckpointsGiveTheKnownRelativeL2AndCosine) {
  TempDir dir;
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_TRUE(write_file_atomic(dir / "a.safetensors", safetensors_bytes(header, {3, 4})));
  ASSERT_TRUE(write_file_atomic(dir / "b.safetensors", safetensors_bytes(header, {3, 4.5f})));
  const RunResult r = diverge({"report", "--base", (dir / "a.safetensors").string(), "--against",
                               (dir / "b.safetensors").string(), "--format", "json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["tensors"].size(), 1u);
  EXPECT_DOUBLE_EQ(j["tensors"][0]["rel_l2"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(j["tensors"][0]["cosine"].get<double>(), 27 / (5 * std::sqrt(29.25)));
  EXPECT_TRUE(j["tensors"][0]["rank"].is_null());
  EXPECT_EQ(j["deltas"][0]["base"], (dir / "a.safetensors").string());
  const RunResult check = diverge({"check", "--base", (dir / "a.safetensors").string(), "--against",
                                   (dir / "b.safetensors").string(), "--max-rel-l2", "5%"});
  EXPECT_EQ(check.status, 1);
  EXPECT_NE(check.out.find("relative L2 10% exceeds 5%"), std::string::npos) << check.out;
  ASSERT_TRUE(write_file_atomic(dir / "c.safetensors", safetensors_bytes(header, {3}).substr(0, 20)));
  expect_one_line_error(
      diverge({"report", "--base", (dir / "a.safetensors").string(), "--against", (dir / "c.safetensors").string()}), 3,
      {"c.safetensors"});
}

TEST(CfmoDivergeCli, PlotWritesAWellFormedSvgOrSparklines) {
  TempDir dir;
  const fs::path run_dir = make_run(dir);
  const fs::path svg = dir / "divergence.svg";
  const RunResult r = diverge({"plot", run_dir.string(), "-o", svg.string(), "--max-rel-l2", "5%"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
  const std::string text = slurp(svg);
  EXPECT_EQ(testing::xml_problem(text), "") << text;
  EXPECT_NE(text.find("threshold 5%"), std::string::npos);
  EXPECT_NE(text.find(">rank 1</text>"), std::string::npos);
  const RunResult to_stdout = diverge({"plot", run_dir.string(), "--width", "1000"});
  ASSERT_EQ(to_stdout.status, 0);
  EXPECT_EQ(testing::xml_problem(to_stdout.out), "");
  EXPECT_NE(to_stdout.out.find("width=\"1000\""), std::string::npos);

  const RunResult spark = run({binary(), "plot", run_dir.string(), "--format", "sparkline"}, 60, {"COLUMNS=80"});
  ASSERT_EQ(spark.status, 0) << spark.err;
  ASSERT_EQ(lines(spark.out).size(), 3u) << spark.out;
  EXPECT_NE(spark.out.find("rank 1   \u2583\u2583\u2588  last 8%  max 8% at round 3  1 above 5%"), std::string::npos)
      << spark.out;

  // Writing fails as a system failure; a .cfd file is not a run.
  ASSERT_TRUE(write_file_atomic(dir / "a-file", "x"));
  expect_one_line_error(diverge({"plot", run_dir.string(), "-o", (dir / "a-file" / "plot.svg").string()}), 5,
                        {"plot.svg"});
  expect_one_line_error(diverge({"plot", ckpt::delta_path(run_dir, 0, 1).string()}), 3, {"not a run directory"});
}

TEST(CfmoDivergeCli, WatchPrintsAFinishedRunAndStops) {
  TempDir dir;
  const fs::path run_dir = make_run(dir);
  ASSERT_TRUE(write_file_atomic(run_dir / "model.safetensors", "final"));
  fs::last_write_time(run_dir / "model.safetensors",
                      fs::last_write_time(ckpt::delta_path(run_dir, 1, 3)) + std::chrono::seconds(1));
  const RunResult r = diverge({"watch", run_dir.string(), "--max-rel-l2", "10%"}, 60);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(lines(r.out).size(), 7u) << r.out;  // header and six deltas
  // The same with a limit it exceeds: the violation is marked and the status is 1.
  const RunResult over = diverge({"watch", run_dir.string(), "--format", "json"}, 60);
  EXPECT_EQ(over.status, 1);
  const auto rows = lines(over.out);
  ASSERT_EQ(rows.size(), 6u);
  const auto last = nlohmann::json::parse(rows[5]);
  EXPECT_EQ(last["rank"], 1);
  EXPECT_EQ(last["violations"].size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(rows[0])["violations"].size(), 0u);
  // --last limits what was there at the start.
  const RunResult tail = diverge({"watch", run_dir.string(), "--last", "1", "--format", "csv"}, 60);
  EXPECT_EQ(lines(tail.out).size(), 1u + 2 * 3) << tail.out;
}

TEST(CfmoDivergeCli, WatchFollowsNewDeltasUntilMaxRoundsOrTimeout) {
  TempDir dir;
  const fs::path run_dir = dir / "run";
  write_delta(ckpt::delta_path(run_dir, 0, 1), 0, 1, scaled(0.01f));
  write_delta(ckpt::delta_path(run_dir, 1, 1), 1, 1, scaled(0.01f));
  // Round 2 appears while watch runs; whenever it appears, watch prints it and stops after 3 deltas.
  bool written = false;
  const RunResult r =
      run({binary(), "watch", run_dir.string(), "--interval", "50ms", "--max-rounds", "3", "--timeout", "60s"}, 90, {},
          [&](pid_t, double elapsed) {
            if (!written && elapsed > 0.2) {
              write_delta(ckpt::delta_path(run_dir, 0, 2), 0, 2, scaled(0.03f));
              written = true;
            }
          });
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.status, 0) << r.err;
  const auto rows = lines(r.out);
  ASSERT_EQ(rows.size(), 4u) << r.out;
  EXPECT_NE(rows[3].find("3%"), std::string::npos) << rows[3];

  // An unfinished run with nothing new: --timeout ends it with status 0.
  const RunResult idle = diverge({"watch", run_dir.string(), "--timeout", "300ms", "--interval", "50ms"}, 60);
  ASSERT_FALSE(idle.timed_out);
  EXPECT_EQ(idle.status, 0) << idle.err;
  EXPECT_EQ(lines(idle.out).size(), 4u);
  // A directory that does not exist.
  expect_one_line_error(diverge({"watch", (dir / "nowhere").string()}), 3, {"nowhere"});
}

TEST(CfmoDivergeCli, WatchStopsOnSigint) {
  TempDir dir;
  const fs::path run_dir = dir / "run";
  write_delta(ckpt::delta_path(run_dir, 0, 1), 0, 1, scaled(0.01f));
  bool sent = false;
  const RunResult r = run({binary(), "watch", run_dir.string(), "--interval", "50ms", "--timeout", "60s"}, 90, {},
                          [&](pid_t pid, double elapsed) {
                            if (!sent && elapsed > 0.3) {
                              kill(pid, SIGINT);
                              sent = true;
                            }
                          });
  ASSERT_TRUE(sent);
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.status, 130) << r.err;
}

// Deltas of a real (single-worker, synthetic-data) cfmo-train run: the
// parameters at a checkpoint are the base; two "ranks" continue from it
// with other data orders, as workers of a round would.
TEST(CfmoDivergeCli, DeltasFromARealTrainingRun) {
  TempDir dir;
  const fs::path base_run = dir / "base";
  const std::vector<std::string> common = {"--data", "synthetic:1024:128", "--model", "mlp:32", "--quiet"};
  auto train = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {trainer()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return run(args, 300);
  };
  ASSERT_EQ(train({"--steps", "8", "--epochs", "0", "--out", base_run.string()}).status, 0);
  const fs::path base_ckpt = base_run / "checkpoints" / "step-00000008";
  const fs::path base_model = base_ckpt / "model.safetensors";
  ASSERT_TRUE(fs::exists(base_model));
  auto base = ckpt::SafetensorsFile::read(base_model);
  ASSERT_TRUE(base) << base.error().message;

  const fs::path run_dir = dir / "cfmo-run";
  std::vector<fs::path> locals;
  for (int rank = 0; rank < 2; ++rank) {
    const fs::path local_run = dir / ("rank" + std::to_string(rank));
    ASSERT_EQ(run({trainer(), "--resume", base_ckpt.string(), "--seed", std::to_string(rank + 5), "--steps", "16",
                   "--out", local_run.string(), "--quiet"},
                  300)
                  .status,
              0);
    locals.push_back(local_run / "model.safetensors");
    auto local = ckpt::SafetensorsFile::read(locals.back());
    ASSERT_TRUE(local) << local.error().message;
    std::vector<std::vector<float>> bases;
    std::vector<std::vector<float>> deltas;
    std::vector<Tensor> tensors;
    for (const auto& entry : base->tensors()) {
      Tensor t{entry.name, entry.shape, std::vector<float>(static_cast<size_t>(entry.elements())), {}};
      std::vector<float> l(t.base.size());
      ASSERT_TRUE(base->read_f32(entry.name, entry.shape, t.base));
      ASSERT_TRUE(local->read_f32(entry.name, entry.shape, l));
      for (size_t i = 0; i < l.size(); ++i) t.delta.push_back(l[i] - t.base[i]);
      tensors.push_back(std::move(t));
    }
    write_delta(ckpt::delta_path(run_dir, rank, 1), rank, 1, tensors);
  }
  const RunResult report = diverge({"report", run_dir.string(), "--format", "json"});
  ASSERT_EQ(report.status, 0) << report.err;
  const auto j = nlohmann::json::parse(report.out);
  ASSERT_EQ(j["deltas"].size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const auto& delta = j["deltas"][static_cast<size_t>(rank)];
    EXPECT_GT(delta["rel_l2"].get<double>(), 0.0);
    EXPECT_LT(delta["rel_l2"].get<double>(), 1.0);
    EXPECT_GT(delta["cosine"].get<double>(), 0.5);
    // The .cfd delta and the two checkpoints it was made from agree.
    const RunResult pair = diverge({"report", "--base", base_model.string(), "--against",
                                    locals[static_cast<size_t>(rank)].string(), "--format", "json"});
    ASSERT_EQ(pair.status, 0) << pair.err;
    const auto p = nlohmann::json::parse(pair.out);
    EXPECT_NEAR(p["deltas"][0]["rel_l2"].get<double>(), delta["rel_l2"].get<double>(), 1e-12);
    EXPECT_NEAR(p["deltas"][0]["cosine"].get<double>(), delta["cosine"].get<double>(), 1e-12);
    EXPECT_EQ(p["deltas"][0]["max_abs"], delta["max_abs"]);
  }
  // Two different data orders drift apart: the ranks' deltas differ.
  EXPECT_NE(j["deltas"][0]["rel_l2"], j["deltas"][1]["rel_l2"]);
}

}  // namespace
}  // namespace cfmo
