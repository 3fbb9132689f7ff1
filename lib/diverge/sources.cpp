#include "diverge/sources.h"

#include <fmt/format.h>
#include <fnmatch.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <set>

namespace cfmo::diverge {
namespace fs = std::filesystem;

namespace {

// "PREFIX<digits>SUFFIX" -> the number, when it fits.
std::optional<int64_t> numbered(std::string_view name, std::string_view prefix, std::string_view suffix) {
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix)) {
    return std::nullopt;
  }
  const std::string_view digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

std::optional<int> rank_of(std::string_view dir_name) {
  auto n = numbered(dir_name, "rank-", "");
  if (!n || *n > std::numeric_limits<int>::max()) return std::nullopt;
  return static_cast<int>(*n);
}

Status list_rank_dir(const fs::path& dir, int rank, std::vector<DeltaFileRef>& out) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto round = numbered(it->path().filename().string(), "round-", ".cfd");
    if (round && it->is_regular_file(ec)) out.push_back({it->path(), rank, *round});
  }
  if (ec) return make_error(ErrorKind::kInput, "'{}': cannot list: {}", dir.string(), ec.message());
  return {};
}

Status list_deltas_dir(const fs::path& deltas, std::vector<DeltaFileRef>& out) {
  std::error_code ec;
  for (fs::directory_iterator it(deltas, ec), end; !ec && it != end; it.increment(ec)) {
    const auto rank = rank_of(it->path().filename().string());
    if (rank && it->is_directory(ec)) CFMO_TRY(list_rank_dir(it->path(), *rank, out));
  }
  if (ec) return make_error(ErrorKind::kInput, "'{}': cannot list: {}", deltas.string(), ec.message());
  return {};
}

}  // namespace

std::optional<DeltaFileRef> parse_delta_path(const fs::path& path) {
  const auto round = numbered(path.filename().string(), "round-", ".cfd");
  const auto rank = rank_of(path.parent_path().filename().string());
  if (!round || !rank) return std::nullopt;
  return DeltaFileRef{path, *rank, *round};
}

Result<std::vector<DeltaFileRef>> list_deltas(const fs::path& path, bool allow_missing) {
  std::error_code ec;
  std::vector<DeltaFileRef> out;
  if (!fs::is_directory(path, ec)) return make_error(ErrorKind::kInput, "'{}': no such directory", path.string());
  // "RUN/deltas/" names the same directory as "RUN/deltas".
  fs::path dir = path;
  if (!dir.has_filename() && dir.has_parent_path()) dir = dir.parent_path();
  if (const auto rank = rank_of(dir.filename().string())) {
    CFMO_TRY(list_rank_dir(dir, *rank, out));
  } else if (dir.filename() == "deltas") {
    CFMO_TRY(list_deltas_dir(dir, out));
  } else if (fs::is_directory(dir / "deltas", ec)) {
    CFMO_TRY(list_deltas_dir(dir / "deltas", out));
  } else if (!allow_missing) {
    return make_error(ErrorKind::kInput, "'{}': not a run directory (no deltas/ in it)", path.string());
  }
  std::sort(out.begin(), out.end(), [](const DeltaFileRef& a, const DeltaFileRef& b) {
    return a.round != b.round ? a.round < b.round : a.rank < b.rank;
  });
  return out;
}

bool glob_matches(const std::string& glob, const std::string& name) {
  return ::fnmatch(glob.c_str(), name.c_str(), 0) == 0;
}

bool Selection::wants_tensor(std::string_view name) const {
  if (tensor_globs.empty()) return true;
  const std::string text(name);
  return std::any_of(tensor_globs.begin(), tensor_globs.end(),
                     [&](const std::string& glob) { return glob_matches(glob, text); });
}

bool Selection::wants(int rank, int64_t round) const {
  if (!ranks.empty() && std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) return false;
  if (rounds.empty()) return true;
  return std::any_of(rounds.begin(), rounds.end(),
                     [&](const RoundRange& r) { return r.first <= round && round <= r.last; });
}

namespace {

std::vector<std::string_view> split_commas(const std::vector<std::string>& values) {
  std::vector<std::string_view> items;
  for (const auto& value : values) {
    std::string_view rest = value;
    for (;;) {
      const auto comma = rest.find(',');
      items.push_back(rest.substr(0, comma));
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  return items;
}

std::optional<int64_t> whole_number(std::string_view text) {
  int64_t value = 0;
  if (text.empty() || text[0] == '-' || text[0] == '+') return std::nullopt;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

Result<std::vector<int>> parse_ranks(const std::vector<std::string>& values) {
  std::vector<int> ranks;
  for (std::string_view item : split_commas(values)) {
    const auto n = whole_number(item);
    if (!n || *n > std::numeric_limits<int>::max()) {
      return make_error(ErrorKind::kUsage, "--rank: '{}' is not a rank (e.g. 0 or 0,2)", item);
    }
    ranks.push_back(static_cast<int>(*n));
  }
  return ranks;
}

Result<std::vector<RoundRange>> parse_rounds(const std::vector<std::string>& values) {
  std::vector<RoundRange> rounds;
  for (std::string_view item : split_commas(values)) {
    auto bad = [&] {
      return make_error(ErrorKind::kUsage, "--round: '{}' is not a round or range (e.g. 7, 5..9, 5..)", item);
    };
    const auto dots = item.find("..");
    if (dots == std::string_view::npos) {
      const auto n = whole_number(item);
      if (!n) return bad();
      rounds.push_back({*n, *n});
      continue;
    }
    const std::string_view lo = item.substr(0, dots);
    const std::string_view hi = item.substr(dots + 2);
    if (lo.empty() && hi.empty()) return bad();
    RoundRange range{0, std::numeric_limits<int64_t>::max()};
    if (!lo.empty()) {
      const auto n = whole_number(lo);
      if (!n) return bad();
      range.first = *n;
    }
    if (!hi.empty()) {
      const auto n = whole_number(hi);
      if (!n) return bad();
      range.last = *n;
    }
    if (range.first > range.last) return bad();
    rounds.push_back(range);
  }
  return rounds;
}

std::vector<DeltaFileRef> select_deltas(const std::vector<DeltaFileRef>& deltas, const Selection& selection) {
  std::vector<DeltaFileRef> out;
  for (const auto& d : deltas) {
    if (selection.wants(d.rank, d.round)) out.push_back(d);
  }
  if (selection.last > 0) {
    std::set<int64_t> rounds;
    for (const auto& d : out) rounds.insert(d.round);
    while (static_cast<int64_t>(rounds.size()) > selection.last) rounds.erase(rounds.begin());
    std::erase_if(out, [&](const DeltaFileRef& d) { return !rounds.contains(d.round); });
  }
  return out;
}

}  // namespace cfmo::diverge
