#include "oci/blob_jobs.h"

#include "core/clock.h"
#include "core/parallel.h"
#include "oci/layout_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>

namespace cfmo::oci {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

/// Whether DIR already holds the blob as a file of its own (a layer pulled
/// cold before): then a hot job keeps it there instead of fetching it again.
bool present_on_disk(const fs::path& dir, const Descriptor& blob) {
  const fs::path path = blob_path(dir, blob.digest);
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(path, ec))) return false;
  auto matches = file_matches(path, blob.digest, blob.size);
  return matches && *matches;
}

/// One layer's blob handed to every sink: fetch_blob sees one BlobObserver.
class LayerTee : public BlobObserver {
 public:
  LayerTee(const std::vector<PullSink*>& sinks, size_t layer) : sinks_(sinks), layer_(layer) {}
  void on_start(int64_t bytes_on_disk) override {
    for (auto* s : sinks_) s->on_blob_start(layer_, bytes_on_disk);
  }
  void on_restart() override {
    for (auto* s : sinks_) s->on_blob_restart(layer_);
  }
  Status on_write(std::string_view chunk) override {
    for (auto* s : sinks_) CFMO_TRY(s->on_blob_write(layer_, chunk));
    return {};
  }

 private:
  const std::vector<PullSink*>& sinks_;
  size_t layer_;
};

}  // namespace

/// Fetches `jobs` on up to `threads` threads, each with its own clients and
/// a write buffer from the budget; `done` is called for each job under one
/// mutex, on the thread that fetched it. The first error stops the others
/// taking new jobs and is returned.
Status run_jobs(const std::vector<BlobJob>& jobs, int threads, Transfer& transfer,
                const std::function<Status(const BlobJob&, const Result<JobOutcome>&)>& done) {
  if (jobs.empty()) return {};
  const size_t count = std::clamp<size_t>(static_cast<size_t>(std::max(threads, 1)), 1, jobs.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;  // guards first_error and serialises `done`
  std::optional<Error> first_error;
  const size_t share = transfer.budget->share(count, 64 << 10, 4 << 20);
  if (transfer.slots.size() < count) transfer.slots.resize(count);
  parallel_for(count, static_cast<int>(count), "pull", [&](size_t slot) {
    RegistryPool& pool = transfer.slot(slot);
    for (size_t i = next++; i < jobs.size() && !failed.load(); i = next++) {
      const BlobJob& job = jobs[i];
      MemoryBudget::Lease lease = transfer.budget->acquire(share);
      BlobFetchOptions fetch_options;
      fetch_options.buffer_bytes = lease.bytes();
      LayerTee tee(transfer.sinks, job.layer);
      if (!transfer.sinks.empty() && job.layer != kConfigJob) {
        for (auto* s : transfer.sinks) s->on_layer_start(job.layer);
        fetch_options.on_bytes = [&transfer, &job](int64_t bytes) {
          for (auto* s : transfer.sinks) s->on_layer_bytes(job.layer, bytes);
        };
        fetch_options.observer = &tee;
      }
      const auto start = Clock::now();
      JobOutcome outcome;
      int attempts = 0;
      Status status;
      if (job.link && present_on_disk(transfer.dir, job.blob)) {
        outcome.result.already_present = true;
        outcome.kept_on_disk = true;
        transfer.note(fmt::format("hot {} is in '{}' already (pulled cold before): kept on disk", job.what,
                                  transfer.dir.string()));
        if (fetch_options.observer != nullptr) {
          // The observer reads what fetch_blob would have left: the blob, complete.
          fetch_options.observer->on_start(job.blob.size);
        }
      } else {
        status = pool.each_until_ok(job.what, [&](RegistryApi& client) -> Status {
          // Another host after one failed: the observer starts the blob again
          // (the partial file may have been dropped after a mismatch).
          if (attempts++ > 0 && fetch_options.observer != nullptr) fetch_options.observer->on_restart();
          auto got = fetch_blob(client, job.blob, job.store, job.what, fetch_options);
          if (!got) return std::move(got).error();
          outcome.result.bytes_fetched += got->bytes_fetched;
          outcome.result.already_present = got->already_present;
          outcome.result.resumed = outcome.result.resumed || got->resumed;
          return {};
        });
      }
      lease.release();
      if (status && job.link && !outcome.kept_on_disk) {
        status = link_blob(transfer.dir, blob_path(job.store, job.blob.digest), job.blob.digest);
      }
      if (job.layer != kConfigJob) {
        const Error* error = status ? nullptr : &status.error();
        for (auto* s : transfer.sinks) {
          s->on_blob_done(job.layer, error);
          for (const size_t k : job.also) s->on_blob_done(k, error);
        }
      }
      outcome.seconds = seconds_since(start);
      std::lock_guard lock(mutex);
      Status recorded = status ? done(job, outcome) : done(job, status.error());
      if (!status || !recorded) {
        if (!first_error) first_error = status ? recorded.error() : status.error();
        failed.store(true);
        return;
      }
    }
  });
  if (first_error) return *first_error;
  return {};
}

}  // namespace cfmo::oci
