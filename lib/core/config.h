#pragma once
/// One table of options per tool, so that a flag and a TOML key are the same
/// thing: `--batch-size` on the command line is `batch_size` in the file.
/// Precedence: flag > config file > the default held in the target variable.
/// CLI11 only writes a target when its flag is given, so the file is loaded
/// after parsing and skips every key whose flag was seen.

#include "core/error.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace cfmo {

class OptionTable {
 public:
  using Target = std::variant<bool*, int*, int64_t*, double*, std::string*, std::vector<std::string>*>;

  /// Registers `key` (snake_case); its flag is "--" + key with '-' for '_',
  /// plus `short_flag` ("-o") when given. `target` holds the default and
  /// receives the value; it must outlive the table.
  void add(std::string key, Target target, std::string help, std::string group = "", std::string short_flag = "");

  /// Adds every option to `app` under its flag; booleans get --no-FLAG too.
  void register_cli(CLI::App& app);

  /// Loads a TOML file; keys given as flags are skipped. Unknown keys and
  /// values of the wrong type are usage errors naming the file and key.
  Status load_toml(const std::filesystem::path& file);

  /// Loads TOML text (the file name is only used in messages).
  Status load_toml_text(std::string_view text, const std::string& source);

  /// The merged configuration as TOML, each key preceded by its help line.
  std::string to_toml() const;

  /// True when the flag for `key` was given on the command line.
  bool given_on_cli(const std::string& key) const;

  /// True when `key` is one of the table's options.
  bool has(std::string_view key) const;

  static std::string flag_for(const std::string& key);

 private:
  struct Entry {
    std::string key;
    Target target;
    std::string help;
    std::string group;
    std::string short_flag;
    CLI::Option* option = nullptr;
  };
  std::vector<Entry> entries_;
};

/// A configuration file's text. Anything but a readable regular file is
/// kUsage saying what it is (missing, a directory, a FIFO, ...); a FIFO or
/// a device is never opened, so it cannot block the reader.
Result<std::string> read_config_file(const std::filesystem::path& file);

/// The shape of a configuration file shared by a tool's subcommands: which
/// subcommands there are, and which keys each one knows.
struct SharedConfigShape {
  std::vector<std::string> subcommands;
  std::function<bool(size_t subcommand, std::string_view key)> knows;
  /// Whether the file may hold a table per subcommand ([check]) whose keys
  /// only that subcommand reads, after (and over) the top-level ones.
  bool sections = false;
};

/// Loads into `table` what subcommand number `subcommand` takes from `file`:
/// the top-level keys it knows (a key only another subcommand knows is passed
/// over, so one file serves them all; a key none knows is kUsage), then its
/// own section's. Every section is checked whichever subcommand reads the
/// file, so a mistake shows at once, not when that subcommand first runs.
Status load_shared_config(OptionTable& table, const std::filesystem::path& file, const SharedConfigShape& shape,
                          size_t subcommand);

/// "30", "30s", "1.5m", "2h", "250ms" -> seconds.
Result<double> parse_duration(std::string_view text);
/// "512", "64K", "64KiB", "1.5G", "2GB" -> bytes (binary multiples).
Result<uint64_t> parse_size(std::string_view text);

}  // namespace cfmo
