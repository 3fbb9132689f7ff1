#include "diverge/report.h"

#include "ckpt/cfd.h"
#include "ckpt/safetensors.h"
#include "core/parallel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

namespace cfmo::diverge {
namespace fs = std::filesystem;

namespace {

// Values compared per task when reducing a pair of checkpoints.
constexpr size_t kPairChunk = size_t{1} << 20;

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

void finish_row(DeltaRow& row) {
  row.total = {};
  for (auto& t : row.tensors) {
    t.divergence = divergence(t.stats);
    row.total.merge(t.stats);
  }
  row.overall = divergence(row.total);
}

// Globs that matched at least one tensor, to name the ones that matched none.
struct GlobUse {
  const Selection& selection;
  std::vector<bool> used = std::vector<bool>(selection.tensor_globs.size(), false);

  bool wants(const std::string& name) {
    if (selection.tensor_globs.empty()) return true;
    bool any = false;
    for (size_t g = 0; g < selection.tensor_globs.size(); ++g) {
      if (glob_matches(selection.tensor_globs[g], name)) {
        used[g] = true;
        any = true;
      }
    }
    return any;
  }
};

// ------------------------------------------------------------------ .cfd files

struct CfdItem {
  fs::path path;
  std::optional<DeltaFileRef> expected;  // rank and round the path names, when it follows the layout
};

Status read_cfd_batch(std::span<const CfdItem> items, const ReportOptions& options, GlobUse& globs,
                      std::vector<DeltaRow>& out) {
  std::vector<std::optional<Result<ckpt::CfdFile>>> opened(items.size());
  parallel_for(items.size(), options.threads, "cfd-open",
               [&](size_t i) { opened[i].emplace(ckpt::CfdFile::open(items[i].path)); });
  struct Wanted {
    size_t file;
    size_t tensor;
  };
  std::vector<Wanted> wanted;
  std::vector<size_t> kept_files;
  for (size_t i = 0; i < items.size(); ++i) {
    auto& file = *opened[i];
    if (!file) return std::move(file).error();
    const ckpt::CfdFileInfo& info = file->info();
    if (const auto& e = items[i].expected; e && (e->rank != info.rank || e->round != info.round)) {
      return make_error(ErrorKind::kInput, "'{}': the header says rank {} round {}, the file name rank {} round {}",
                        items[i].path.string(), info.rank, info.round, e->rank, e->round);
    }
    if (!options.selection.wants(info.rank, info.round)) continue;
    kept_files.push_back(i);
    for (size_t t = 0; t < file->tensors().size(); ++t) {
      if (globs.wants(file->tensors()[t].name)) wanted.push_back({i, t});
    }
  }

  // Reading and reducing: every frame of every wanted tensor is one task.
  std::vector<std::vector<ckpt::DeltaStats>> reduced(wanted.size());
  if (!options.header_only) {
    struct Task {
      size_t wanted;
      size_t frame;
    };
    std::vector<Task> tasks;
    for (size_t w = 0; w < wanted.size(); ++w) {
      const auto& tensor = (*opened[wanted[w].file])->tensors()[wanted[w].tensor];
      reduced[w].resize(tensor.frames.size());
      for (size_t k = 0; k < tensor.frames.size(); ++k) tasks.push_back({w, k});
    }
    std::vector<std::optional<Error>> errors(tasks.size());
    parallel_for(tasks.size(), options.threads, "cfd-reduce", [&](size_t j) {
      const auto& [w, k] = tasks[j];
      const ckpt::CfdFile& file = **opened[wanted[w].file];
      auto stats = file.reduce_frame(file.tensors()[wanted[w].tensor], k);
      if (stats) {
        reduced[w][k] = *stats;
      } else {
        errors[j] = std::move(stats).error();
      }
    });
    for (auto& e : errors) {
      if (e) return std::move(*e);
    }
  }

  size_t w = 0;
  for (size_t i : kept_files) {
    const ckpt::CfdFile& file = **opened[i];
    DeltaRow row;
    row.source = items[i].path.string();
    row.rank = file.info().rank;
    row.round = file.info().round;
    row.step = file.info().step;
    row.base_version = file.info().base_version;
    for (; w < wanted.size() && wanted[w].file == i; ++w) {
      const auto& tensor = file.tensors()[wanted[w].tensor];
      if (!options.header_only) {
        ckpt::DeltaStats merged;
        for (const auto& part : reduced[w]) merged.merge(part);
        CFMO_TRY(file.check_reduced(tensor, merged));
      }
      row.tensors.push_back({tensor.name, tensor.shape, tensor.stats, {}});
    }
    // A delta none of whose tensors --tensor selects has nothing to report.
    if (row.tensors.empty() && !options.selection.tensor_globs.empty()) continue;
    finish_row(row);
    out.push_back(std::move(row));
  }
  return {};
}

// ------------------------------------------------------- safetensors checkpoints

bool is_float_dtype(std::string_view dtype) {
  return dtype == "F32" || dtype == "F64" || dtype == "F16" || dtype == "BF16";
}

// IEEE binary16 to binary32; every half is exactly a float. Written out
// because C++20 has no float16 type and the conversion is a few shifts.
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Values [first, first + out.size()) of a floating-point tensor, as float32.
void to_floats(const ckpt::SafetensorsFile& file, const ckpt::SafetensorsFile::Entry& entry, size_t first,
               std::span<float> out) {
  const auto bytes = file.bytes(entry);
  const std::byte* p = bytes.data();
  const size_t n = out.size();
  if (entry.dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), p + 4 * first, 4 * n);  // copied: the bytes need not be aligned
  } else if (entry.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double v = 0;
      std::memcpy(&v, p + 8 * (first + i), 8);
      out[i] = static_cast<float>(v);
    }
  } else {
    const bool bf16 = entry.dtype == "BF16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t h = 0;
      std::memcpy(&h, p + 2 * (first + i), 2);
      out[i] = bf16 ? std::bit_cast<float>(static_cast<uint32_t>(h) << 16) : half_to_float(h);
    }
  }
}

Result<DeltaRow> compare_checkpoints(const fs::path& base_path, const fs::path& local_path,
                                     const ReportOptions& options, GlobUse& globs, std::vector<std::string>& notes) {
  std::optional<Result<ckpt::SafetensorsFile>> files[2];
  const fs::path* paths[2] = {&base_path, &local_path};
  parallel_for(2, options.threads, "st-read",
               [&](size_t i) { files[i].emplace(ckpt::SafetensorsFile::read(*paths[i])); });
  for (auto& f : files) {
    if (!*f) return std::move(*f).error();
  }
  const ckpt::SafetensorsFile& base = **files[0];
  const ckpt::SafetensorsFile& local = **files[1];
  const std::string b = base_path.string();
  const std::string l = local_path.string();

  struct Pair {
    const ckpt::SafetensorsFile::Entry* base;
    const ckpt::SafetensorsFile::Entry* local;
  };
  std::vector<Pair> pairs;
  std::vector<std::string> skipped;
  for (const auto& entry : base.tensors()) {
    if (!globs.wants(entry.name)) continue;
    const auto* other = local.find(entry.name);
    if (other == nullptr) {
      return make_error(ErrorKind::kInput, "'{}': no tensor '{}' (it is in '{}')", l, entry.name, b);
    }
    if (!is_float_dtype(entry.dtype) || !is_float_dtype(other->dtype)) {
      skipped.push_back(entry.name);
      continue;
    }
    if (entry.shape != other->shape) {
      return make_error(ErrorKind::kInput, "'{}': tensor '{}' has shape {}, '{}' has {}", l, entry.name,
                        shape_string(other->shape), b, shape_string(entry.shape));
    }
    pairs.push_back({&entry, other});
  }
  for (const auto& entry : local.tensors()) {
    if (globs.wants(entry.name) && base.find(entry.name) == nullptr) {
      return make_error(ErrorKind::kInput, "'{}': no tensor '{}' (it is in '{}')", b, entry.name, l);
    }
  }
  if (!skipped.empty()) {
    notes.push_back(
        fmt::format("skipped {} tensor(s) that are not floating point: {}", skipped.size(), fmt::join(skipped, ", ")));
  }

  struct Task {
    size_t pair;
    size_t first;
    size_t count;
  };
  std::vector<Task> tasks;
  std::vector<size_t> first_task;
  for (size_t p = 0; p < pairs.size(); ++p) {
    first_task.push_back(tasks.size());
    const auto n = static_cast<size_t>(pairs[p].base->elements());
    for (size_t first = 0; first < n; first += kPairChunk) tasks.push_back({p, first, std::min(kPairChunk, n - first)});
  }
  first_task.push_back(tasks.size());
  std::vector<ckpt::DeltaStats> parts(tasks.size());
  parallel_for(tasks.size(), options.threads, "st-reduce", [&](size_t j) {
    const Task& task = tasks[j];
    thread_local std::vector<float> base_values;
    thread_local std::vector<float> local_values;
    base_values.resize(task.count);
    local_values.resize(task.count);
    to_floats(base, *pairs[task.pair].base, task.first, base_values);
    to_floats(local, *pairs[task.pair].local, task.first, local_values);
    parts[j] = ckpt::pair_stats(base_values, local_values);
  });

  DeltaRow row;
  row.source = l;
  row.base_source = b;
  for (size_t p = 0; p < pairs.size(); ++p) {
    ckpt::DeltaStats stats;
    for (size_t j = first_task[p]; j < first_task[p + 1]; ++j) stats.merge(parts[j]);
    stats.elements = pairs[p].base->elements();
    row.tensors.push_back({pairs[p].base->name, pairs[p].base->shape, stats, {}});
  }
  finish_row(row);
  return row;
}

}  // namespace

ReportInput classify_path(const fs::path& path) {
  std::error_code ec;
  ReportInput input;
  input.path = path;
  input.kind = fs::is_directory(path, ec) ? ReportInput::Kind::kRunDir : ReportInput::Kind::kCfd;
  return input;
}

Result<Report> build_report(std::span<const ReportInput> inputs, const ReportOptions& options) {
  Report report;
  report.verified = !options.header_only;
  GlobUse globs{options.selection};
  std::vector<CfdItem> pending;
  auto flush = [&]() -> Status {
    for (size_t begin = 0; begin < pending.size(); begin += std::max<size_t>(options.batch_files, 1)) {
      const size_t n = std::min(std::max<size_t>(options.batch_files, 1), pending.size() - begin);
      CFMO_TRY(read_cfd_batch(std::span(pending).subspan(begin, n), options, globs, report.deltas));
    }
    pending.clear();
    return {};
  };
  for (const auto& input : inputs) {
    switch (input.kind) {
      case ReportInput::Kind::kRunDir: {
        CFMO_ASSIGN_OR_RETURN(auto all, list_deltas(input.path));
        if (all.empty()) {
          return make_error(ErrorKind::kInput, "'{}': no deltas yet (deltas/rank-K/round-RRRRRR.cfd)",
                            input.path.string());
        }
        for (auto& ref : select_deltas(all, options.selection)) pending.push_back({ref.path, ref});
        break;
      }
      case ReportInput::Kind::kCfd:
        pending.push_back({input.path, parse_delta_path(input.path)});
        break;
      case ReportInput::Kind::kSafetensorsPair: {
        CFMO_TRY(flush());
        CFMO_ASSIGN_OR_RETURN(auto row, compare_checkpoints(input.path, input.against, options, globs, report.notes));
        report.deltas.push_back(std::move(row));
        break;
      }
    }
  }
  CFMO_TRY(flush());
  for (size_t g = 0; g < globs.used.size(); ++g) {
    if (!globs.used[g]) {
      return make_error(ErrorKind::kUsage, "--tensor: '{}' matches no tensor", options.selection.tensor_globs[g]);
    }
  }
  if (report.deltas.empty()) {
    return make_error(ErrorKind::kUsage, "no delta matches the selection (--rank, --round, --last)");
  }
  return report;
}

ReportSummary summarize(const Report& report) {
  ReportSummary s;
  std::set<int> ranks;
  s.deltas = report.deltas.size();
  for (const auto& row : report.deltas) {
    s.tensors += row.tensors.size();
    if (row.rank) ranks.insert(*row.rank);
    if (row.round) {
      s.first_round = std::min(s.first_round.value_or(*row.round), *row.round);
      s.last_round = std::max(s.last_round.value_or(*row.round), *row.round);
    }
    const auto& d = row.overall;
    if (!std::isnan(d.rel_l2) && (s.worst == nullptr || d.rel_l2 > s.worst->overall.rel_l2)) s.worst = &row;
    if (!std::isnan(d.cosine) && (s.least_aligned == nullptr || d.cosine < s.least_aligned->overall.cosine)) {
      s.least_aligned = &row;
    }
    s.max_abs = std::max(s.max_abs, d.max_abs);
    s.nonfinite += d.nonfinite;
    s.base_nonfinite += d.base_nonfinite;
  }
  s.ranks.assign(ranks.begin(), ranks.end());
  return s;
}

// ------------------------------------------------------------------ formatting

std::string format_percent(double fraction) {
  if (std::isnan(fraction)) return "-";
  const double percent = 100 * fraction;
  if (percent == 0) return "0%";
  if (std::fabs(percent) >= 100) return fmt::format("{:.0f}%", percent);
  return fmt::format("{:.3g}%", percent);
}

namespace {

std::string format_cosine(double cosine) { return std::isnan(cosine) ? "-" : fmt::format("{:.6f}", cosine); }
std::string format_abs(double value) { return value == 0 ? "0" : fmt::format("{:.3g}", value); }
std::string format_nonfinite(const Divergence& d) {
  if (d.base_nonfinite == 0) return std::to_string(d.nonfinite);
  return fmt::format("{} (+{} in base)", d.nonfinite, d.base_nonfinite);
}

const TensorRow* top_tensor(const DeltaRow& row) {
  const TensorRow* top = nullptr;
  for (const auto& t : row.tensors) {
    if (!std::isnan(t.divergence.rel_l2) && (top == nullptr || t.divergence.rel_l2 > top->divergence.rel_l2)) top = &t;
  }
  return top;
}

std::string optional_text(const auto& value) { return value ? fmt::format("{}", *value) : std::string("-"); }

}  // namespace

std::string describe(const DeltaRow& row) {
  if (row.rank && row.round) return fmt::format("rank {}, round {}", *row.rank, *row.round);
  if (!row.base_source.empty()) return fmt::format("'{}' against '{}'", row.source, row.base_source);
  return fmt::format("'{}'", row.source);
}

std::string format_table_header() {
  return fmt::format("{:>5}  {:>7}  {:>9}  {:>8}  {:>9}  {:>11}  {:>10}  {}\n", "rank", "round", "step", "rel L2",
                     "cosine", "max |delta|", "non-finite", "top tensor (rel L2)");
}

std::string format_table_row(const DeltaRow& row, bool per_tensor) {
  const auto& d = row.overall;
  const TensorRow* top = top_tensor(row);
  std::string out = fmt::format("{:>5}  {:>7}  {:>9}  {:>8}  {:>9}  {:>11}  {:>10}  {}\n", optional_text(row.rank),
                                optional_text(row.round), optional_text(row.step), format_percent(d.rel_l2),
                                format_cosine(d.cosine), format_abs(d.max_abs), format_nonfinite(d),
                                top ? fmt::format("{} ({})", top->name, format_percent(top->divergence.rel_l2)) : "-");
  if (per_tensor) {
    for (const auto& t : row.tensors) {
      const auto& td = t.divergence;
      out +=
          fmt::format("{:>5}  {:>7}  {:>9}  {:>8}  {:>9}  {:>11}  {:>10}  {}\n", "", "", "", format_percent(td.rel_l2),
                      format_cosine(td.cosine), format_abs(td.max_abs), format_nonfinite(td), t.name);
    }
  }
  return out;
}

std::string format_table(const Report& report, bool per_tensor) {
  std::string out;
  if (report.deltas.size() == 1) {
    const DeltaRow& row = report.deltas[0];
    if (row.rank) {
      out += fmt::format("{}: rank {}, round {}, step {}, base version {}\n", row.source, *row.rank, *row.round,
                         *row.step, *row.base_version);
    } else {
      out += fmt::format("{} against {}\n", row.source, row.base_source);
    }
    size_t name_width = std::string_view("overall").size();
    size_t shape_width = std::string_view("shape").size();
    for (const auto& t : row.tensors) {
      name_width = std::max(name_width, t.name.size());
      shape_width = std::max(shape_width, shape_string(t.shape).size());
    }
    auto line = [&](std::string_view name, std::string_view shape, const Divergence& d) {
      return fmt::format("{:<{}}  {:<{}}  {:>8}  {:>9}  {:>11}  {}\n", name, name_width, shape, shape_width,
                         format_percent(d.rel_l2), format_cosine(d.cosine), format_abs(d.max_abs), format_nonfinite(d));
    };
    out += fmt::format("{:<{}}  {:<{}}  {:>8}  {:>9}  {:>11}  {}\n", "tensor", name_width, "shape", shape_width,
                       "rel L2", "cosine", "max |delta|", "non-finite");
    for (const auto& t : row.tensors) out += line(t.name, shape_string(t.shape), t.divergence);
    out += line("overall", "", row.overall);
  } else {
    out += format_table_header();
    for (const auto& row : report.deltas) out += format_table_row(row, per_tensor);
    const ReportSummary s = summarize(report);
    out += fmt::format("{} deltas", s.deltas);
    if (!s.ranks.empty()) out += fmt::format(" of {} rank(s)", s.ranks.size());
    if (s.first_round) out += fmt::format(", rounds {}..{}", *s.first_round, *s.last_round);
    if (s.worst != nullptr) {
      out += fmt::format(": largest relative L2 {} ({})", format_percent(s.worst->overall.rel_l2), describe(*s.worst));
    }
    if (s.least_aligned != nullptr)
      out += fmt::format(", smallest cosine {}", format_cosine(s.least_aligned->overall.cosine));
    out += fmt::format(", max |delta| {}, {} non-finite\n", format_abs(s.max_abs), s.nonfinite + s.base_nonfinite);
  }
  return out;
}

namespace {

using Json = nlohmann::ordered_json;

Json number_or_null(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }
Json optional_json(const auto& value) { return value ? Json(*value) : Json(nullptr); }

void put_divergence(Json& j, const Divergence& d, int64_t elements) {
  j["elements"] = elements;
  j["rel_l2"] = number_or_null(d.rel_l2);
  j["cosine"] = number_or_null(d.cosine);
  j["max_abs"] = d.max_abs;
  j["nonfinite"] = d.nonfinite;
  j["base_nonfinite"] = d.base_nonfinite;
  j["delta_l2"] = d.delta_l2;
  j["base_l2"] = d.base_l2;
}

Json tensor_json(const DeltaRow& row, const TensorRow& t) {
  Json j;
  j["name"] = t.name;
  j["rank"] = optional_json(row.rank);
  j["round"] = optional_json(row.round);
  j["step"] = optional_json(row.step);
  j["source"] = row.source;
  j["shape"] = t.shape;
  put_divergence(j, t.divergence, t.stats.elements);
  return j;
}

Json delta_json(const DeltaRow& row) {
  Json j;
  j["source"] = row.source;
  j["base"] = row.base_source.empty() ? Json(nullptr) : Json(row.base_source);
  j["rank"] = optional_json(row.rank);
  j["round"] = optional_json(row.round);
  j["step"] = optional_json(row.step);
  j["base_version"] = optional_json(row.base_version);
  j["tensor_count"] = row.tensors.size();
  put_divergence(j, row.overall, row.total.elements);
  return j;
}

Json where_json(const DeltaRow* row, double value) {
  if (row == nullptr) return nullptr;
  Json j;
  j["value"] = number_or_null(value);
  j["source"] = row->source;
  j["rank"] = optional_json(row->rank);
  j["round"] = optional_json(row->round);
  return j;
}

std::string csv_field(std::string_view text) {
  if (text.find_first_of(",\"\n") == std::string_view::npos) return std::string(text);
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::string csv_number(double value) { return std::isfinite(value) ? fmt::format("{}", value) : std::string(); }
std::string csv_optional(const auto& value) { return value ? fmt::format("{}", *value) : std::string(); }

std::string csv_row(std::string_view scope, const DeltaRow& row, std::string_view tensor, const Divergence& d,
                    int64_t elements) {
  return fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", scope, csv_field(row.source),
                     csv_optional(row.rank), csv_optional(row.round), csv_optional(row.step), csv_field(tensor),
                     elements, csv_number(d.rel_l2), csv_number(d.cosine), csv_number(d.max_abs), d.nonfinite,
                     d.base_nonfinite, csv_number(d.delta_l2), csv_number(d.base_l2));
}

}  // namespace

std::string format_json(const Report& report) {
  Json j;
  j["tensors"] = Json::array();
  j["deltas"] = Json::array();
  for (const auto& row : report.deltas) {
    for (const auto& t : row.tensors) j["tensors"].push_back(tensor_json(row, t));
    j["deltas"].push_back(delta_json(row));
  }
  const ReportSummary s = summarize(report);
  Json summary;
  summary["deltas"] = s.deltas;
  summary["tensors"] = s.tensors;
  summary["ranks"] = s.ranks;
  summary["first_round"] = optional_json(s.first_round);
  summary["last_round"] = optional_json(s.last_round);
  summary["max_rel_l2"] = where_json(s.worst, s.worst ? s.worst->overall.rel_l2 : 0);
  summary["min_cosine"] = where_json(s.least_aligned, s.least_aligned ? s.least_aligned->overall.cosine : 0);
  summary["max_abs"] = s.max_abs;
  summary["nonfinite"] = s.nonfinite;
  summary["base_nonfinite"] = s.base_nonfinite;
  summary["verified"] = report.verified;
  j["summary"] = std::move(summary);
  j["notes"] = report.notes;
  return j.dump(2) + "\n";
}

std::string format_json_line(const DeltaRow& row) {
  Json j = delta_json(row);
  j["tensors"] = Json::array();
  for (const auto& t : row.tensors) j["tensors"].push_back(tensor_json(row, t));
  return j.dump() + "\n";
}

std::string format_csv_header() {
  return "scope,source,rank,round,step,tensor,elements,rel_l2,cosine,max_abs,nonfinite,base_nonfinite,delta_l2,"
         "base_l2\n";
}

std::string format_csv_rows(const DeltaRow& row) {
  std::string out = csv_row("delta", row, "", row.overall, row.total.elements);
  for (const auto& t : row.tensors) out += csv_row("tensor", row, t.name, t.divergence, t.stats.elements);
  return out;
}

std::string format_csv(const Report& report) {
  std::string out = format_csv_header();
  for (const auto& row : report.deltas) out += format_csv_rows(row);
  return out;
}

}  // namespace cfmo::diverge
