#pragma once
/// cfmo-diverge's options: one struct, registered per subcommand in an
/// OptionTable (so each is both a flag and a TOML key), and turned into the
/// library's Selection, Thresholds and output choices by `validate`.
///
/// A configuration file holds keys at the top level, which apply to every
/// subcommand that has them, and tables [report], [check], [plot] and
/// [watch], whose keys apply to that subcommand only and override the top
/// level.

#include "core/config.h"
#include "core/error.h"
#include "diverge/sources.h"
#include "diverge/thresholds.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::diverge {

enum class Subcommand { kReport, kCheck, kPlot, kWatch };

std::string_view to_string(Subcommand subcommand);

struct DivergeConfig {
  // What to read.
  std::vector<std::string> tensor;
  std::vector<std::string> rank;
  std::vector<std::string> round;
  int64_t last = 0;
  int threads = 0;
  bool header_only = false;
  // Limits.
  std::string max_rel_l2 = "5%";
  std::string max_abs;
  int64_t max_nonfinite = 0;
  bool per_tensor = false;
  // Output.
  std::string format;  ///< empty: the subcommand's default
  std::string output = "-";
  int width = 800;
  int height = 450;
  bool quiet = false;
  // Following a run.
  std::string interval = "1s";
  std::string timeout;
  int64_t max_rounds = 0;
  bool follow = false;
};

/// Registers the options `subcommand` takes.
void add_diverge_options(OptionTable& table, DivergeConfig& config, Subcommand subcommand);

/// Loads a configuration file for `subcommand`: top-level keys it knows,
/// then its own table; keys only other subcommands know are skipped. Unknown
/// keys or tables and wrong types are usage errors naming the file and key.
Status load_diverge_config(OptionTable& table, const std::filesystem::path& file, Subcommand subcommand);

/// The merged configuration as a TOML table for `subcommand` ([check] ...).
std::string diverge_config_toml(const OptionTable& table, Subcommand subcommand);

enum class OutputFormat { kTable, kJson, kCsv, kSvg, kSparkline };

/// What the options mean, checked: errors are usage errors naming the flag.
struct DivergePlan {
  Selection selection;
  Thresholds thresholds;
  OutputFormat format = OutputFormat::kTable;
  double interval_s = 1;
  std::optional<double> timeout_s;
};
Result<DivergePlan> validate(const DivergeConfig& config, Subcommand subcommand);

}  // namespace cfmo::diverge
