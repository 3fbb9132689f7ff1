#pragma once
/// The state file of a pull (DIR/cfmo-pull-state.json, FORMATS.md): the
/// image, where every layer is kept and whether it is fetched yet, so that
/// `cfmo-pull fetch` and `status` (and a detached background fetch) carry
/// on where the pull left off. It is rewritten whole (temp + fsync +
/// rename) after every change, so a reader never sees half of it; writers
/// take the directory's lock (lock_layout) first.

#include "core/dir_lock.h"
#include "core/error.h"
#include "oci/hosts.h"
#include "oci/hot_set.h"
#include "oci/manifest.h"
#include "oci/pull_sink.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace cfmo::oci {

inline constexpr const char* kStateFile = "cfmo-pull-state.json";
inline constexpr const char* kLockFile = ".cfmo-pull.lock";
inline constexpr const char* kLogFile = "cfmo-pull.log";

/// What a layer's blob is, in the state file.
enum class LayerStatus {
  kPending,   ///< not fetched yet (lazy): `cfmo-pull fetch` brings it
  kFetching,  ///< a process is fetching it (if that process died, it is pending)
  kFetched,   ///< complete and verified
  kSkipped,   ///< left out (--cold skip); `cfmo-pull fetch` still brings it when asked
  kFailed,    ///< the last attempt failed (`error` says why); fetch tries again, resuming
};

const char* to_string(LayerStatus status);
Result<LayerStatus> parse_layer_status(std::string_view text);

struct LayerState {
  Descriptor blob;
  bool hot = false;
  Placement location = Placement::kDisk;
  LayerStatus status = LayerStatus::kPending;
  double seconds = 0;  ///< the fetch's duration, once fetched
  std::string error;   ///< kFailed: the one-line reason
};

struct PullState {
  int version = 1;
  std::string image;  ///< the reference, resolved to the manifest's digest: registry/repo@sha256:...
  std::string tag;    ///< the name index.json gives it
  std::string output;
  std::string manifest_digest;  ///< the registry's manifest, kept as a blob in DIR
  std::string manifest_media_type;
  Descriptor config;
  std::string cold;  ///< eager, lazy, skip
  HostSettings hosts;
  std::string auth_file;
  std::string memory_dir;  ///< the memory store of this pull (empty: none)
  int64_t memory_capacity = 0;
  bool spill = false;
  bool ready = false;
  double ready_s = -1;
  std::string ready_file;
  bool complete = false;  ///< every layer fetched and index.json written
  int fetcher_pid = 0;    ///< the process fetching now (0: none)
  /// The last run was stopped by a signal before it finished: its partial
  /// blobs are kept, and the layers it did not finish are pending again.
  bool interrupted = false;
  std::string updated;  ///< UTC, ISO 8601
  std::vector<LayerState> layers;
};

std::filesystem::path state_path(const std::filesystem::path& dir);

/// Now, UTC, ISO 8601 to the second ("2026-12-04T19:40:59Z").
std::string utc_now();

/// Reads DIR's state; an absent file is kInput ("not a cfmo-pull directory"),
/// a malformed one kInput naming the file and key.
Result<PullState> read_state(const std::filesystem::path& dir);
/// Writes it whole (the `updated` time set now).
Status write_state(const std::filesystem::path& dir, PullState& state);

/// The state file as a sink of the pull: each state it is fed is written
/// whole to DIR's state file. A pull that keeps no state file (a rootfs
/// pull's shared blob cache) has none among its sinks.
class StateRecorder : public PullSink {
 public:
  explicit StateRecorder(std::filesystem::path dir) : dir_(std::move(dir)) {}
  Status on_state(const PullState& state) override;

 private:
  std::filesystem::path dir_;
};

std::string state_to_json(const PullState& state);
Result<PullState> state_from_json(std::string_view text, const std::string& source);

/// The layout's lock (DIR/.cfmo-pull.lock, a DirLock): a second process
/// waits for it; `on_wait` hears the holder's pid, and the wait ends with
/// kPeer at `deadline`, or as interrupted when `stop` is set.
Result<DirLock> lock_layout(const std::filesystem::path& dir,
                            std::optional<std::chrono::steady_clock::time_point> deadline,
                            const std::function<void(int pid)>& on_wait = nullptr,
                            const std::atomic<bool>* stop = nullptr);

}  // namespace cfmo::oci
