#include "diverge/report.h"

#include "core/atomic_file.h"
#include "unit/diverge_fixtures.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

namespace cfmo::diverge {
namespace {

namespace fs = std::filesystem;
using testing::NamedDelta;
using ReportTest = testing::TempDirTest;

std::vector<ReportInput> run_input(const fs::path& run) { return {{ReportInput::Kind::kRunDir, run, {}}}; }

std::string le64(uint64_t value) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  return out;
}

template <typename T>
std::string raw_bytes(std::initializer_list<T> values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

// A safetensors file made byte by byte, independently of ckpt/safetensors.
void write_safetensors_by_hand(const fs::path& path, const std::vector<std::pair<std::string, std::string>>& entries,
                               const std::string& data) {
  std::string header = "{";
  for (size_t i = 0; i < entries.size(); ++i) header += (i ? "," : "") + entries[i].first + ":" + entries[i].second;
  header += "}";
  ASSERT_TRUE(write_file_atomic(path, le64(header.size()) + header + data));
}

// Two tensors with known sums: A base (3, 4), delta (0, 0.5); B base (1, 0, 0, 0), delta (0, 0, 0, 2).
std::vector<NamedDelta> known_tensors() {
  return {{"a", {2}, {3, 4}, {0, 0.5f}}, {"b", {2, 2}, {1, 0, 0, 0}, {0, 0, 0, 2}}};
}

TEST_F(ReportTest, KnownAnswersPerTensorAndOverall) {
  const fs::path file = dir_ / "x.cfd";
  testing::write_delta_file(file, 2, 5, known_tensors(), 50);
  const std::vector<ReportInput> inputs = {classify_path(file)};
  auto report = build_report(inputs, {});
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_TRUE(report->verified);
  ASSERT_EQ(report->deltas.size(), 1u);
  const DeltaRow& row = report->deltas[0];
  EXPECT_EQ(row.rank, 2);
  EXPECT_EQ(row.round, 5);
  EXPECT_EQ(row.step, 50);
  EXPECT_EQ(row.base_version, 4);
  ASSERT_EQ(row.tensors.size(), 2u);
  EXPECT_EQ(row.tensors[0].name, "a");
  EXPECT_DOUBLE_EQ(row.tensors[0].divergence.rel_l2, 0.1);
  EXPECT_DOUBLE_EQ(row.tensors[0].divergence.cosine, 27 / (5 * std::sqrt(29.25)));
  EXPECT_DOUBLE_EQ(row.tensors[1].divergence.rel_l2, 2.0);
  EXPECT_DOUBLE_EQ(row.tensors[1].divergence.cosine, 1 / std::sqrt(5.0));
  EXPECT_EQ(row.tensors[1].divergence.max_abs, 2.0);
  // Overall: |base|^2 = 26, |delta|^2 = 4.25, base.delta = 2.
  EXPECT_DOUBLE_EQ(row.overall.rel_l2, std::sqrt(4.25 / 26));
  EXPECT_DOUBLE_EQ(row.overall.cosine, 28 / (std::sqrt(26.0) * std::sqrt(26 + 4 + 4.25)));
  EXPECT_EQ(row.overall.max_abs, 2.0);
  EXPECT_EQ(row.total.elements, 6);
}

TEST_F(ReportTest, ARunDirectoryIsReadByRoundThenRankWithEveryThreadCountAndHeaderOnly) {
  const fs::path run = dir_ / "run";
  for (int round = 1; round <= 3; ++round) {
    for (int rank = 0; rank < 3; ++rank) {
      // Frames of 2 values: several tasks per tensor.
      testing::write_run_delta(run, rank, round, testing::scaled_delta(0.01f * static_cast<float>(rank + round)),
                               {.chunk_elements = 2});
    }
  }
  auto reference = build_report(run_input(run), {.threads = 1});
  ASSERT_TRUE(reference) << reference.error().message;
  ASSERT_EQ(reference->deltas.size(), 9u);
  for (size_t i = 0; i < 9; ++i) {
    const auto& row = reference->deltas[i];
    EXPECT_EQ(*row.round, static_cast<int64_t>(i / 3 + 1));
    EXPECT_EQ(*row.rank, static_cast<int>(i % 3));
    EXPECT_NEAR(row.overall.rel_l2, 0.01 * (*row.rank + *row.round), 1e-6);
    EXPECT_NEAR(row.overall.cosine, 1.0, 1e-12);
  }
  for (int threads : {0, 2, 5}) {
    for (bool header_only : {false, true}) {
      auto again = build_report(run_input(run), {.threads = threads, .header_only = header_only, .batch_files = 4});
      ASSERT_TRUE(again) << again.error().message;
      EXPECT_EQ(again->verified, !header_only);
      ASSERT_EQ(again->deltas.size(), 9u);
      for (size_t i = 0; i < 9; ++i) {
        EXPECT_EQ(again->deltas[i].overall.rel_l2, reference->deltas[i].overall.rel_l2);
        EXPECT_EQ(again->deltas[i].source, reference->deltas[i].source);
      }
    }
  }
}

TEST_F(ReportTest, SelectionByRankRoundLastAndTensor) {
  const fs::path run = dir_ / "run";
  for (int round = 1; round <= 4; ++round) {
    for (int rank = 0; rank < 2; ++rank) testing::write_run_delta(run, rank, round, testing::scaled_delta(0.02f));
  }
  ReportOptions options;
  options.selection.ranks = {1};
  options.selection.last = 2;
  options.selection.tensor_globs = {"*.bias"};
  auto report = build_report(run_input(run), options);
  ASSERT_TRUE(report) << report.error().message;
  ASSERT_EQ(report->deltas.size(), 2u);
  EXPECT_EQ(*report->deltas[0].round, 3);
  ASSERT_EQ(report->deltas[0].tensors.size(), 1u);
  EXPECT_EQ(report->deltas[0].tensors[0].name, "layers.0.bias");
  EXPECT_EQ(report->deltas[0].total.elements, 2);

  options.selection.tensor_globs = {"*.bias", "nothing.*"};
  auto unmatched = build_report(run_input(run), options);
  ASSERT_FALSE(unmatched);
  EXPECT_EQ(unmatched.error().kind, ErrorKind::kUsage);
  EXPECT_NE(unmatched.error().message.find("nothing.*"), std::string::npos);

  options = {};
  options.selection.rounds = {{9, 9}};
  auto none = build_report(run_input(run), options);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().kind, ErrorKind::kUsage);
  // A .cfd file given by name is filtered by its header's rank and round.
  options = {};
  options.selection.ranks = {1};
  const std::vector<ReportInput> files = {classify_path(ckpt::delta_path(run, 0, 1)),
                                          classify_path(ckpt::delta_path(run, 1, 1))};
  auto picked = build_report(files, options);
  ASSERT_TRUE(picked);
  ASSERT_EQ(picked->deltas.size(), 1u);
  EXPECT_EQ(picked->deltas[0].rank, 1);
}

TEST_F(ReportTest, EmptyRunsAndCorruptFilesAreInputErrorsNamingTheFileAndTensor) {
  fs::create_directories(dir_ / "empty" / "deltas");
  auto empty = build_report(run_input(dir_ / "empty"), {});
  ASSERT_FALSE(empty);
  EXPECT_EQ(empty.error().kind, ErrorKind::kInput);
  EXPECT_NE(empty.error().message.find("no deltas"), std::string::npos);

  const fs::path run = dir_ / "run";
  testing::write_run_delta(run, 0, 1, testing::scaled_delta(0.01f), {.codec = ckpt::CfdCodec::kNone});
  testing::write_run_delta(run, 1, 1, testing::scaled_delta(0.01f));
  // Flip the last byte of rank 0's file: inside the bias, stored without a codec.
  const fs::path victim = ckpt::delta_path(run, 0, 1);
  std::string bytes = *read_file(victim);
  bytes.back() ^= 0x40;
  ASSERT_TRUE(write_file_atomic(victim, bytes));
  auto corrupt = build_report(run_input(run), {.threads = 2});
  ASSERT_FALSE(corrupt);
  EXPECT_EQ(corrupt.error().kind, ErrorKind::kInput);
  EXPECT_NE(corrupt.error().message.find("rank-0/round-000001.cfd"), std::string::npos) << corrupt.error().message;
  EXPECT_NE(corrupt.error().message.find("'layers.0.bias'"), std::string::npos) << corrupt.error().message;
  // The header alone is still intact.
  EXPECT_TRUE(build_report(run_input(run), {.header_only = true}));

  // A file whose header names another rank than its path.
  fs::create_directories(ckpt::delta_path(run, 2, 1).parent_path());
  fs::copy_file(ckpt::delta_path(run, 1, 1), ckpt::delta_path(run, 2, 1));
  auto moved = build_report(run_input(run), {.header_only = true});
  ASSERT_FALSE(moved);
  EXPECT_NE(moved.error().message.find("rank-2"), std::string::npos);
  EXPECT_NE(moved.error().message.find("header says rank 1"), std::string::npos);

  const std::vector<ReportInput> missing = {classify_path(dir_ / "missing.cfd")};
  auto gone = build_report(missing, {});
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.error().kind, ErrorKind::kInput);
  EXPECT_NE(gone.error().message.find("missing.cfd"), std::string::npos);
}

TEST_F(ReportTest, ManyFilesAreReadInBatchesWithoutRunningOutOfDescriptors) {
  const fs::path run = dir_ / "run";
  for (int round = 0; round < 150; ++round)
    testing::write_run_delta(run, round % 3, round, testing::scaled_delta(0.01f));
  auto report = build_report(run_input(run), {.threads = 2, .batch_files = 16});
  ASSERT_TRUE(report) << report.error().message;
  EXPECT_EQ(report->deltas.size(), 150u);
}

TEST_F(ReportTest, SafetensorsCheckpointsBuiltByHandGiveTheKnownAnswers) {
  // Base: w = (3, 4) F32, h = (1, 2) F16, b = (1) BF16, step (I64), skipped.
  // Local: w = (3, 4.5), h = (1, -2), b = (1) F32; the step differs and does not count.
  const std::string base_data = raw_bytes<float>({3, 4}) + raw_bytes<uint16_t>({0x3C00, 0x4000}) +
                                raw_bytes<uint16_t>({0x3F80}) + raw_bytes<int64_t>({7});
  write_safetensors_by_hand(dir_ / "base.safetensors",
                            {{"\"w\"", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"},
                             {"\"h\"", R"({"dtype":"F16","shape":[2],"data_offsets":[8,12]})"},
                             {"\"b\"", R"({"dtype":"BF16","shape":[1],"data_offsets":[12,14]})"},
                             {"\"step\"", R"({"dtype":"I64","shape":[],"data_offsets":[14,22]})"}},
                            base_data);
  const std::string local_data = raw_bytes<int64_t>({8}) + raw_bytes<float>({3, 4.5f}) +
                                 raw_bytes<uint16_t>({0x3C00, 0xC000}) + raw_bytes<float>({1});
  write_safetensors_by_hand(dir_ / "local.safetensors",
                            {{"\"step\"", R"({"dtype":"I64","shape":[],"data_offsets":[0,8]})"},
                             {"\"w\"", R"({"dtype":"F32","shape":[2],"data_offsets":[8,16]})"},
                             {"\"h\"", R"({"dtype":"F16","shape":[2],"data_offsets":[16,20]})"},
                             {"\"b\"", R"({"dtype":"F32","shape":[1],"data_offsets":[20,24]})"}},
                            local_data);
  const std::vector<ReportInput> inputs = {
      {ReportInput::Kind::kSafetensorsPair, dir_ / "base.safetensors", dir_ / "local.safetensors"}};
  auto report = build_report(inputs, {});
  ASSERT_TRUE(report) << report.error().message;
  const DeltaRow& row = report->deltas[0];
  EXPECT_FALSE(row.rank);
  EXPECT_EQ(row.base_source, (dir_ / "base.safetensors").string());
  ASSERT_EQ(row.tensors.size(), 3u);
  EXPECT_EQ(row.tensors[0].name, "w");
  EXPECT_DOUBLE_EQ(row.tensors[0].divergence.rel_l2, 0.1);
  EXPECT_DOUBLE_EQ(row.tensors[0].divergence.cosine, 27 / (5 * std::sqrt(29.25)));
  // h: base (1, 2), local (1, -2): delta (0, -4), |delta|/|base| = 4/sqrt(5), cosine -3/5.
  EXPECT_DOUBLE_EQ(row.tensors[1].divergence.rel_l2, 4 / std::sqrt(5.0));
  EXPECT_DOUBLE_EQ(row.tensors[1].divergence.cosine, -0.6);
  EXPECT_EQ(row.tensors[2].divergence.rel_l2, 0.0);
  EXPECT_EQ(row.tensors[2].divergence.cosine, 1.0);
  // Overall: |base|^2 = 25 + 5 + 1, |delta|^2 = 0.25 + 16, base.delta = 2 - 8.
  EXPECT_DOUBLE_EQ(row.overall.rel_l2, std::sqrt(16.25 / 31));
  EXPECT_DOUBLE_EQ(row.overall.cosine, (31 - 6) / (std::sqrt(31.0) * std::sqrt(31 - 12 + 16.25)));
  ASSERT_EQ(report->notes.size(), 1u);
  EXPECT_NE(report->notes[0].find("step"), std::string::npos);
}

TEST_F(ReportTest, CheckpointsThatDoNotMatchAreInputErrors) {
  write_safetensors_by_hand(dir_ / "a.safetensors", {{"\"w\"", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"}},
                            raw_bytes<float>({1, 2}));
  write_safetensors_by_hand(dir_ / "b.safetensors",
                            {{"\"w\"", R"({"dtype":"F32","shape":[1,2],"data_offsets":[0,8]})"}},
                            raw_bytes<float>({1, 2}));
  write_safetensors_by_hand(dir_ / "c.safetensors", {{"\"v\"", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"}},
                            raw_bytes<float>({1, 2}));
  auto run = [&](const char* a, const char* b) {
    const std::vector<ReportInput> inputs = {{ReportInput::Kind::kSafetensorsPair, dir_ / a, dir_ / b}};
    return build_report(inputs, {});
  };
  auto shape = run("a.safetensors", "b.safetensors");
  ASSERT_FALSE(shape);
  EXPECT_EQ(shape.error().kind, ErrorKind::kInput);
  EXPECT_NE(shape.error().message.find("'w' has shape [1,2]"), std::string::npos) << shape.error().message;
  auto names = run("a.safetensors", "c.safetensors");
  ASSERT_FALSE(names);
  EXPECT_NE(names.error().message.find("no tensor 'w'"), std::string::npos) << names.error().message;
  auto missing = run("a.safetensors", "none.safetensors");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().kind, ErrorKind::kInput);
  EXPECT_NE(missing.error().message.find("none.safetensors"), std::string::npos);
}

TEST_F(ReportTest, JsonHasTheDocumentedKeysAndNullsForUndefinedValues) {
  const fs::path run = dir_ / "run";
  testing::write_run_delta(run, 0, 1, {{"zero", {2}, {0, 0}, {1, 0}}, {"w", {2}, {3, 4}, {0, 0.5f}}});
  testing::write_run_delta(run, 1, 1, {{"zero", {2}, {0, 0}, {0, 0}}, {"w", {2}, {3, 4}, {0, 0}}});
  auto report = build_report(run_input(run), {});
  ASSERT_TRUE(report) << report.error().message;
  const auto j = nlohmann::json::parse(format_json(*report));
  ASSERT_EQ(j["tensors"].size(), 4u);
  for (const auto& t : j["tensors"]) {
    for (const char* key : {"name", "rel_l2", "cosine", "max_abs", "nonfinite", "rank", "round", "step", "source",
                            "shape", "elements", "base_nonfinite", "delta_l2", "base_l2"}) {
      EXPECT_TRUE(t.contains(key)) << key;
    }
  }
  EXPECT_EQ(j["tensors"][0]["name"], "zero");
  EXPECT_TRUE(j["tensors"][0]["rel_l2"].is_null());
  EXPECT_TRUE(j["tensors"][0]["cosine"].is_null());
  EXPECT_EQ(j["tensors"][1]["rel_l2"].get<double>(), 0.1);
  EXPECT_EQ(j["tensors"][2]["rank"], 1);
  EXPECT_EQ(j["tensors"][2]["rel_l2"].get<double>(), 0.0);
  ASSERT_EQ(j["deltas"].size(), 2u);
  EXPECT_EQ(j["deltas"][0]["tensor_count"], 2);
  EXPECT_TRUE(j["deltas"][0]["base"].is_null());
  EXPECT_DOUBLE_EQ(j["deltas"][0]["rel_l2"].get<double>(), std::sqrt(1.25 / 25));
  const auto& s = j["summary"];
  EXPECT_EQ(s["deltas"], 2);
  EXPECT_EQ(s["ranks"], nlohmann::json::array({0, 1}));
  EXPECT_EQ(s["max_rel_l2"]["rank"], 0);
  EXPECT_EQ(s["first_round"], 1);
  EXPECT_EQ(s["verified"], true);

  const auto line = nlohmann::json::parse(format_json_line(report->deltas[0]));
  EXPECT_EQ(line["rank"], 0);
  EXPECT_EQ(line["tensors"].size(), 2u);
}

TEST_F(ReportTest, CsvQuotesFieldsAndLeavesUndefinedValuesEmpty) {
  const fs::path file = dir_ / "odd,\"name\".cfd";
  testing::write_delta_file(file, 0, 3, {{"a,b", {2}, {0, 0}, {1, 0}}});
  const std::vector<ReportInput> inputs = {classify_path(file)};
  auto report = build_report(inputs, {});
  ASSERT_TRUE(report) << report.error().message;
  const std::string csv = format_csv(*report);
  std::istringstream in(csv);
  std::string header, delta_line, tensor_line;
  std::getline(in, header);
  std::getline(in, delta_line);
  std::getline(in, tensor_line);
  EXPECT_EQ(header,
            "scope,source,rank,round,step,tensor,elements,rel_l2,cosine,max_abs,nonfinite,base_nonfinite,"
            "delta_l2,base_l2");
  EXPECT_EQ(delta_line.rfind("delta,\"", 0), 0u) << delta_line;
  EXPECT_NE(delta_line.find("odd,\"\"name\"\".cfd\""), std::string::npos) << delta_line;
  EXPECT_NE(tensor_line.find(",\"a,b\",2,,,1,0,0,1,0"), std::string::npos) << tensor_line;
}

TEST_F(ReportTest, TablesForOneDeltaAndForMany) {
  const fs::path run = dir_ / "run";
  testing::write_run_delta(run, 0, 1, known_tensors());
  testing::write_run_delta(run, 1, 1, known_tensors());
  auto one = build_report(std::vector<ReportInput>{classify_path(ckpt::delta_path(run, 1, 1))}, {});
  ASSERT_TRUE(one);
  const std::string single = format_table(*one, false);
  EXPECT_NE(single.find("rank 1, round 1, step 10, base version 0"), std::string::npos) << single;
  EXPECT_NE(single.find("overall"), std::string::npos);
  EXPECT_NE(single.find("10%"), std::string::npos) << single;   // tensor a
  EXPECT_NE(single.find("200%"), std::string::npos) << single;  // tensor b

  auto many = build_report(run_input(run), {});
  ASSERT_TRUE(many);
  const std::string table = format_table(*many, false);
  EXPECT_NE(table.find("top tensor"), std::string::npos);
  EXPECT_NE(table.find("b (200%)"), std::string::npos) << table;
  EXPECT_NE(table.find("2 deltas of 2 rank(s), rounds 1..1"), std::string::npos) << table;
  const std::string with_tensors = format_table(*many, true);
  EXPECT_GT(std::count(with_tensors.begin(), with_tensors.end(), '\n'), std::count(table.begin(), table.end(), '\n'));
  EXPECT_EQ(format_percent(0.05), "5%");
  EXPECT_EQ(format_percent(0.0123456), "1.23%");
  EXPECT_EQ(format_percent(std::nan("")), "-");
  EXPECT_EQ(format_percent(0), "0%");
}

TEST_F(ReportTest, NonFiniteValuesAreCountedInTheDeltaAndTheBase) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const fs::path file = dir_ / "bad.cfd";
  testing::write_delta_file(file, 0, 1, {{"w", {4}, {1, inf, 1, 1}, {nan, 0, 0.5f, -inf}}});
  auto report = build_report(std::vector<ReportInput>{classify_path(file)}, {});
  ASSERT_TRUE(report) << report.error().message;
  const auto& d = report->deltas[0].overall;
  EXPECT_EQ(d.nonfinite, 2);
  EXPECT_EQ(d.base_nonfinite, 1);
  EXPECT_EQ(d.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(d.rel_l2, 0.5 / std::sqrt(3.0));
  EXPECT_NE(format_table(*report, false).find("2 (+1 in base)"), std::string::npos);
}

}  // namespace
}  // namespace cfmo::diverge
