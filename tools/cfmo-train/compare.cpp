// cfmo-train --compare: the same job once per mode, in the modes' table's
// order, each a run of its own (run_self), then a table or one JSON object.
#include "comm/world.h"
#include "commands.h"
#include "train/modes.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace cfmo::train_tool {

int compare_modes(int argc, char** argv, const train::TrainConfig& config, bool json, const std::atomic<bool>& stop) {
  std::vector<std::string> base;
  for (int i = 0; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--compare") base.emplace_back(argv[i]);
  }
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  std::vector<std::string> rows;
  bool language_model = false;
  for (const auto& entry : train::mode_table()) {
    const std::string mode(entry.name);
    if (stop.load()) return kInterruptedStatus;
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--mode", mode, "--json", "--quiet"});
    if (!config.out.empty()) {
      args.emplace_back("--out");
      args.emplace_back((std::filesystem::path(config.out) / mode).string());
    }
    fmt::print(stderr, "compare: running {}...\n", mode);
    auto ran = comm::run_self(args);
    if (!ran) return fail(ran.error());
    const auto& [status, out] = *ran;
    // The summary is the run's last line on stdout.
    const auto last = out.rfind('\n', out.size() > 1 ? out.size() - 2 : 0);
    const auto summary =
        nlohmann::ordered_json::parse(out.substr(last == std::string::npos ? 0 : last + 1), nullptr, false);
    if (status != 0 || !summary.is_object()) {
      fmt::print(stderr, "cfmo-train: --compare: the {} run failed with status {}\n", mode, status);
      return status != 0 ? status : static_cast<int>(ErrorKind::kInternal);
    }
    double wait = 0;
    for (const auto& w : summary["per_worker"]) wait = std::max(wait, w["wait_s"].get<double>());
    // A language model's column is its val_loss; the MLP's, its test accuracy.
    language_model = summary["val_loss"].is_number();
    rows.push_back(fmt::format("{:<9} {:>12.0f} {:>10.2f} {:>9.2f} {:>12} {:>9.4f}", mode,
                               summary["samples_per_s"].get<double>(), summary["efficiency"].get<double>(), wait,
                               summary["bytes_sent"].get<uint64_t>(),
                               summary[language_model ? "val_loss" : "test_accuracy"].get<double>()));
    results.push_back(summary);
  }
  if (json) {
    fmt::print("{}\n", nlohmann::ordered_json{{"compare", results}}.dump());
  } else {
    fmt::print("{:<9} {:>12} {:>10} {:>9} {:>12} {:>9}\n", "mode", "samples/s", "efficiency", "max wait", "bytes sent",
               language_model ? "val loss" : "test acc");
    for (const auto& row : rows) fmt::print("{}\n", row);
  }
  return 0;
}

}  // namespace cfmo::train_tool
