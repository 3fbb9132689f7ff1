#include "core/config.h"

#include <toml++/toml.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

namespace cfmo {
namespace {

Error bad_value(const std::string& source, const std::string& key, std::string_view expected) {
  return make_error(ErrorKind::kUsage, "config '{}': key '{}': expected {}", source, key, expected);
}

Status assign(const toml::node& node, OptionTable::Target target, const std::string& source, const std::string& key) {
  return std::visit(
      [&](auto* out) -> Status {
        using T = std::remove_pointer_t<decltype(out)>;
        if constexpr (std::is_same_v<T, bool>) {
          auto v = node.value_exact<bool>();
          if (!v) return bad_value(source, key, "true or false");
          *out = *v;
        } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
          auto v = node.value_exact<int64_t>();
          if (!v) return bad_value(source, key, "an integer");
          if constexpr (std::is_same_v<T, int>) {
            if (*v < INT32_MIN || *v > INT32_MAX) return bad_value(source, key, "an integer in 32-bit range");
          }
          *out = static_cast<T>(*v);
        } else if constexpr (std::is_same_v<T, double>) {
          if (auto i = node.value_exact<int64_t>()) {
            *out = static_cast<double>(*i);
          } else if (auto d = node.value_exact<double>()) {
            *out = *d;
          } else {
            return bad_value(source, key, "a number");
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (auto s = node.value_exact<std::string>()) {
            *out = *s;
          } else if (node.is_integer() || node.is_floating_point()) {
            // Numbers are accepted where a string is parsed later ("data", durations).
            // fmt's shortest round-trip form: a stream's default 6 digits would turn 0.123456789 into 0.123457.
            *out = node.is_integer() ? fmt::format("{}", *node.value<int64_t>())
                                     : fmt::format("{}", *node.value<double>());
          } else {
            return bad_value(source, key, "a string");
          }
        } else {
          const auto* array = node.as_array();
          if (array == nullptr) {
            if (auto s = node.value_exact<std::string>()) {
              *out = {*s};
              return {};
            }
            return bad_value(source, key, "an array of strings");
          }
          out->clear();
          for (const auto& item : *array) {
            auto s = item.value_exact<std::string>();
            if (!s) return bad_value(source, key, "an array of strings");
            out->push_back(*s);
          }
        }
        return {};
      },
      target);
}

std::string format_value(const OptionTable::Target& target) {
  return std::visit(
      [](auto* value) -> std::string {
        using T = std::remove_pointer_t<decltype(value)>;
        std::ostringstream out;
        if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          toml::array array;
          for (const auto& s : *value) array.push_back(s);
          out << array;
        } else if constexpr (std::is_same_v<T, int>) {
          out << toml::value<int64_t>(*value);
        } else if constexpr (std::is_same_v<T, double>) {
          // The shortest text that reads back as the same double (0.9, not 0.90000000000000002).
          std::string text = fmt::format("{}", *value);
          if (std::isfinite(*value) && text.find_first_of(".e") == std::string::npos) text += ".0";
          if (!std::isfinite(*value)) text = std::isnan(*value) ? "nan" : (*value > 0 ? "inf" : "-inf");
          out << text;
        } else {
          out << toml::value<T>(*value);
        }
        return out.str();
      },
      target);
}

}  // namespace

void OptionTable::add(std::string key, Target target, std::string help, std::string group, std::string short_flag) {
  entries_.push_back(Entry{std::move(key), target, std::move(help), std::move(group), std::move(short_flag), nullptr});
}

std::string OptionTable::flag_for(const std::string& key) {
  std::string flag = "--" + key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

void OptionTable::register_cli(CLI::App& app) {
  for (auto& entry : entries_) {
    const std::string flag = (entry.short_flag.empty() ? "" : entry.short_flag + ",") + flag_for(entry.key);
    entry.option = std::visit(
        [&](auto* value) -> CLI::Option* {
          using T = std::remove_pointer_t<decltype(value)>;
          if constexpr (std::is_same_v<T, bool>) {
            return app.add_flag(flag + ",!--no-" + flag_for(entry.key).substr(2), *value, entry.help)
                ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
          } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            return app.add_option(flag, *value, entry.help)->capture_default_str();
          } else {
            // A flag given twice takes the last value, so scripts can append overrides.
            return app.add_option(flag, *value, entry.help)
                ->capture_default_str()
                ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
          }
        },
        entry.target);
    if (!entry.group.empty()) entry.option->group(entry.group);
  }
}

bool OptionTable::given_on_cli(const std::string& key) const {
  for (const auto& entry : entries_) {
    if (entry.key == key) return entry.option != nullptr && entry.option->count() > 0;
  }
  return false;
}

bool OptionTable::has(std::string_view key) const {
  return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
}

Status load_shared_config(OptionTable& table, const std::filesystem::path& file, const SharedConfigShape& shape,
                          size_t subcommand) {
  const std::string source = file.string();
  CFMO_ASSIGN_OR_RETURN(const std::string contents, read_config_file(file));
  toml::table parsed;
  try {
    parsed = toml::parse(contents, source);
  } catch (const toml::parse_error& e) {
    return make_error(ErrorKind::kUsage, "config '{}': line {}: {}", source, e.source().begin.line, e.description());
  }
  const size_t count = shape.subcommands.size();
  auto known_by_any = [&](std::string_view key) {
    for (size_t s = 0; s < count; ++s) {
      if (shape.knows(s, key)) return true;
    }
    return false;
  };
  toml::table mine;
  const toml::table* own_section = nullptr;
  for (const auto& [key, node] : parsed) {
    const std::string name(key.str());
    const auto section = std::find(shape.subcommands.begin(), shape.subcommands.end(), name);
    if (shape.sections && section != shape.subcommands.end()) {
      if (!node.is_table()) return make_error(ErrorKind::kUsage, "config '{}': '{}' must be a table", source, name);
      const auto index = static_cast<size_t>(section - shape.subcommands.begin());
      for (const auto& [inner, value] : *node.as_table()) {
        if (!shape.knows(index, inner.str())) {
          return make_error(ErrorKind::kUsage, "config '{}': unknown key '{}.{}'", source, name, inner.str());
        }
      }
      if (index == subcommand) own_section = node.as_table();
      continue;
    }
    if (shape.knows(subcommand, name)) {
      mine.insert_or_assign(name, node);
    } else if (!known_by_any(name)) {
      return make_error(ErrorKind::kUsage, "config '{}': unknown key '{}'", source, name);
    }
  }
  if (own_section != nullptr) {
    for (const auto& [key, node] : *own_section) mine.insert_or_assign(std::string(key.str()), node);
  }
  std::ostringstream text;
  text << mine;
  return table.load_toml_text(text.str(), source);
}

Result<std::string> read_config_file(const std::filesystem::path& file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(file, ec);
  const auto not_a_file = [&](std::string_view what) {
    return make_error(ErrorKind::kUsage, "config '{}': {}, not a file", file.string(), what);
  };
  switch (status.type()) {
    case fs::file_type::regular:
      break;
    case fs::file_type::not_found:
      return make_error(ErrorKind::kUsage, "config '{}': no such file", file.string());
    case fs::file_type::directory:
      return not_a_file("a directory");
    case fs::file_type::fifo:
      return not_a_file("a FIFO");
    case fs::file_type::socket:
      return not_a_file("a socket");
    case fs::file_type::block:
    case fs::file_type::character:
      return not_a_file("a device");
    default:
      return make_error(ErrorKind::kUsage, "config '{}': cannot read: {}", file.string(),
                        ec ? ec.message() : "not a regular file");
  }
  errno = 0;
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) {
    return make_error(ErrorKind::kUsage, "config '{}': cannot read: {}", file.string(),
                      errno != 0 ? std::strerror(errno) : "unknown error");
  }
  return text.str();
}

Status OptionTable::load_toml(const std::filesystem::path& file) {
  CFMO_ASSIGN_OR_RETURN(const std::string text, read_config_file(file));
  return load_toml_text(text, file.string());
}

Status OptionTable::load_toml_text(std::string_view text, const std::string& source) {
  toml::table table;
  try {
    table = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    return make_error(ErrorKind::kUsage, "config '{}': line {}: {}", source, e.source().begin.line, e.description());
  }
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == name; });
    if (it == entries_.end()) {
      return make_error(ErrorKind::kUsage, "config '{}': unknown key '{}'", source, name);
    }
    if (it->option != nullptr && it->option->count() > 0) continue;  // the flag wins
    CFMO_TRY(assign(node, it->target, source, name));
  }
  return {};
}

std::string OptionTable::to_toml() const {
  std::string out;
  std::string group;
  for (const auto& entry : entries_) {
    if (entry.group != group) {
      group = entry.group;
      out += fmt::format("\n# --- {} ---\n", group);
    }
    // Every line of the help is a comment, or a multi-line help would make the output unloadable.
    std::string help = entry.help;
    for (size_t pos = help.find('\n'); pos != std::string::npos; pos = help.find('\n', pos + 3)) {
      help.replace(pos, 1, "\n# ");
    }
    out += fmt::format("# {}\n{} = {}\n", help, entry.key, format_value(entry.target));
  }
  return out;
}

Result<double> parse_duration(std::string_view text) {
  double number = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc() || !std::isfinite(number) || number < 0) {
    return make_error(ErrorKind::kUsage, "'{}' is not a duration (e.g. 90, 90s, 5m, 2h)", text);
  }
  std::string_view unit(end, static_cast<size_t>(text.data() + text.size() - end));
  double scale = 0;
  if (unit.empty() || unit == "s") {
    scale = 1;
  } else if (unit == "ms") {
    scale = 1e-3;
  } else if (unit == "m" || unit == "min") {
    scale = 60;
  } else if (unit == "h") {
    scale = 3600;
  } else {
    return make_error(ErrorKind::kUsage, "'{}' is not a duration (e.g. 90, 90s, 5m, 2h)", text);
  }
  return number * scale;
}

Result<uint64_t> parse_size(std::string_view text) {
  double number = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc() || !std::isfinite(number) || number < 0) {
    return make_error(ErrorKind::kUsage, "'{}' is not a size (e.g. 512M, 2G)", text);
  }
  std::string unit(end, static_cast<size_t>(text.data() + text.size() - end));
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });
  for (const char* suffix : {"IB", "B"}) {
    std::string_view s(suffix);
    if (unit.size() > s.size() - 1 && unit.ends_with(s)) {
      unit.resize(unit.size() - s.size());
      break;
    }
  }
  static constexpr std::string_view kUnits = "KMGT";
  double scale = 1;
  if (!unit.empty()) {
    auto pos = kUnits.find(unit);
    if (unit.size() != 1 || pos == std::string_view::npos) {
      return make_error(ErrorKind::kUsage, "'{}' is not a size (e.g. 512M, 2G)", text);
    }
    scale = std::pow(1024.0, static_cast<double>(pos + 1));
  }
  // Converting a double at or above 2^64 to uint64_t is undefined behaviour.
  if (number * scale >= 0x1p64) return make_error(ErrorKind::kUsage, "'{}' is too large a size", text);
  return static_cast<uint64_t>(number * scale);
}

}  // namespace cfmo
