#pragma once
/// The pull's job runner: blobs fetched on `jobs` threads, each thread with
/// the registry clients of its slot (kept across the hot and cold phases)
/// and a write buffer leased from the transfer's MemoryBudget; each layer's
/// bytes handed to the transfer's sinks as they are written; a hot blob
/// put in the memory store and linked from the layout. pull.cpp decides
/// which jobs run and records their outcomes.

#include "core/error.h"
#include "oci/blob.h"
#include "oci/hosts.h"
#include "oci/manifest.h"
#include "oci/memory_budget.h"
#include "oci/pull_sink.h"
#include "oci/reference.h"
#include "oci/registry.h"

#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cfmo::oci {

inline constexpr size_t kConfigJob = static_cast<size_t>(-1);  ///< a job's layer index for the config blob

/// One blob to fetch.
struct BlobJob {
  size_t layer = kConfigJob;
  /// Other layers with the same digest (the empty layer of many images):
  /// one download, recorded for each of them.
  std::vector<size_t> also;
  Descriptor blob;
  std::filesystem::path store;  ///< the directory whose blobs/sha256/ receives the file (DIR, or the memory store)
  bool link = false;            ///< make DIR's entry a symlink to it
  std::string what;
};

struct JobOutcome {
  BlobResult result;
  double seconds = 0;
  bool kept_on_disk = false;  ///< a hot blob found in DIR already, left there rather than fetched again
};

/// What every thread of one transfer shares.
struct Transfer {
  Reference ref;
  std::vector<Endpoint> endpoints;
  RegistryOptions registry;
  std::string auth_file;
  std::shared_ptr<EndpointHealth> health;
  MemoryBudget* budget = nullptr;
  std::vector<PullSink*> sinks;
  std::filesystem::path dir;
  std::mutex notes_mutex;  ///< guards notes
  std::vector<std::string> notes;
  /// One pool per worker slot, kept across the hot and cold phases so its
  /// connections and tokens carry over; a slot is used by one thread at a time.
  std::vector<std::unique_ptr<RegistryPool>> slots;

  void note(const std::string& message) {
    {
      std::lock_guard lock(notes_mutex);
      notes.push_back(message);
    }
    for (auto* s : sinks) s->on_note(message);
  }
  RegistryPool pool() {
    return RegistryPool(ref, endpoints, registry, auth_file, health, [this](const std::string& m) { note(m); });
  }
  RegistryPool& slot(size_t i) {
    if (!slots[i]) slots[i] = std::make_unique<RegistryPool>(pool());
    return *slots[i];
  }
};

/// Fetches `jobs` on up to `threads` threads, each with its own clients and
/// a write buffer from the budget; `done` is called for each job under one
/// mutex, on the thread that fetched it. The first error stops the others
/// taking new jobs and is returned.
Status run_jobs(const std::vector<BlobJob>& jobs, int threads, Transfer& transfer,
                const std::function<Status(const BlobJob&, const Result<JobOutcome>&)>& done);

}  // namespace cfmo::oci
