#pragma once
/// A PullSink that builds each layer's seekable index (gzip_index.h) from
/// the bytes the pull downloads, as they arrive: one read of the layer, no
/// second pass over the blob. Each layer being fetched gets a thread that
/// runs build_layer_index over a bounded queue the download thread fills
/// (a full queue makes the download wait, so memory stays at `queue_bytes`
/// a layer plus the inflater's window); the bytes a resumed download had on
/// disk already are read from its partial file first. When the blob is
/// complete and verified the index goes to DIR/cfmo-index/<hex>, where
/// `mount --lazy DIR` and `cfmo-pull index --list` look; a failed or
/// restarted download drops what was built. A layer that was there already
/// (no download) is indexed from its file, unless its index exists. An
/// index that cannot be built (a layer that is not a tar) is a note, never
/// a failed pull.

#include "oci/gzip_index.h"
#include "oci/pull_sink.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cfmo::oci {

class IndexSink : public PullSink {
 public:
  /// Indexes go to DIR/cfmo-index; `span` as `cfmo-pull index --span`.
  IndexSink(std::filesystem::path dir, uint64_t span, size_t queue_bytes = size_t{1} << 20);
  ~IndexSink() override;
  IndexSink(const IndexSink&) = delete;
  IndexSink& operator=(const IndexSink&) = delete;

  void on_plan(const PullState& state) override;
  void on_blob_start(size_t layer, int64_t bytes_on_disk) override;
  void on_blob_restart(size_t layer) override;
  Status on_blob_write(size_t layer, std::string_view chunk) override;
  void on_blob_done(size_t layer, const Error* error) override;

  /// What became of each layer indexed so far, in the order they ended.
  struct Outcome {
    size_t layer = 0;
    std::string digest;
    bool indexed = false;
    bool streamed = false;  ///< built from the download's bytes (false: from the blob already there)
    std::string note;       ///< why it was not indexed
  };
  std::vector<Outcome> outcomes() const;

 private:
  class Job;
  void start(size_t layer, int64_t bytes_on_disk);
  void finish(size_t layer, std::unique_ptr<Job> job);
  std::filesystem::path on_disk(size_t layer, int64_t bytes) const;

  std::filesystem::path dir_;
  uint64_t span_;
  size_t queue_bytes_;
  std::vector<Descriptor> layers_;  ///< from the plan
  std::filesystem::path store_;     ///< the memory store, or empty
  mutable std::mutex mu_;           ///< guards jobs_ and outcomes_
  std::map<size_t, std::unique_ptr<Job>> jobs_;
  std::vector<Outcome> outcomes_;
};

}  // namespace cfmo::oci
