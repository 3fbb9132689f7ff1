#pragma once
/// cfmo-pull's options: one struct, registered per subcommand in an
/// OptionTable (so each is both a flag and a TOML key), and turned into the
/// library's PullOptions/FetchOptions by `validate`. A configuration file
/// is flat: each subcommand takes the keys it knows and skips those only
/// other subcommands know (conf/pull.toml serves pull, fetch and inspect).

#include "core/config.h"
#include "core/error.h"
#include "oci/pull.h"

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace cfmo::oci {

enum class PullCommand { kPull, kInspect, kFetch, kStatus, kMount, kUmount, kIndex, kRm, kPrune };

std::string_view to_string(PullCommand command);

struct PullConfig {
  // The image.
  std::string image;
  std::vector<std::string> output;  ///< oci:DIR[:tag] and/or rootfs:DIR
  std::string cache;
  bool replace = false;
  std::string platform;
  // Registries.
  bool plain_http = false;
  std::vector<std::string> insecure_registry;
  std::vector<std::string> mirror;
  std::string authfile;
  int jobs = 4;
  int retries = 5;
  std::string retry_delay = "0.5s";
  std::string retry_max_delay = "30s";
  std::string stall_timeout = "30s";
  std::string request_timeout = "0";
  std::string timeout = "0";
  // Hot and cold layers, memory.
  std::vector<std::string> hot;
  std::string max_memory = "2G";
  std::string buffer_memory;  ///< empty: 16 MiB, or a quarter of max_memory when that is less
  bool spill = false;
  std::string cold = "eager";
  bool background = false;
  std::string ready_file;
  std::string memory_dir = "/dev/shm";
  // Mounting.
  bool partial = false;
  bool writable = false;
  bool lazy = false;
  std::string cache_size = "1G";
  std::string record;
  std::string prefetch;
  // Indexing.
  std::string span = "4M";
  bool build_index = false;
  bool list = false;
  bool push = false;
  // Output.
  bool json = false;
  bool quiet = false;
  std::string progress = "auto";
};

/// Registers the options `command` takes.
void add_pull_options(OptionTable& table, PullConfig& config, PullCommand command);

/// Loads a configuration file for `command`: the keys it knows; keys only
/// other subcommands know are skipped; unknown keys and wrong types are
/// usage errors naming the file and key.
Status load_pull_config(OptionTable& table, const std::filesystem::path& file, PullCommand command);

enum class ProgressMode { kAuto, kTty, kPlain, kNone };

/// What the options mean, checked: errors are usage errors naming the flag.
struct PullPlan {
  PullOptions pull;    ///< pull and inspect
  FetchOptions fetch;  ///< fetch
  ProgressMode progress = ProgressMode::kAuto;
  uint64_t span = uint64_t{4} << 20;         ///< index: uncompressed bytes between checkpoints
  uint64_t cache_bytes = uint64_t{1} << 30;  ///< mount --lazy: the chunk cache on disk
};
Result<PullPlan> validate(const PullConfig& config, PullCommand command);

/// The flags that hand `config`'s registry settings (and the pull's buffer
/// budget) to a `cfmo-pull fetch` started in the background.
std::vector<std::string> fetch_arguments(const PullConfig& config, int64_t buffer_memory);

}  // namespace cfmo::oci
