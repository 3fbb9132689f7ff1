#pragma once
/// What a pull feeds. Every consumer of a pull is a sink the puller calls in
/// turn: the state file (StateRecorder, pull_state.h), the terminal's
/// progress (the tool), the rootfs applier (rootfs.cpp), the layer indexes
/// (IndexSink, index_sink.h), and whoever else wants the image's blobs as
/// they arrive. The puller drives; a sink never calls back into it, so
/// control stays in pull.cpp. The layout's blobs and index.json are the
/// puller's own store.
///
/// Calls come from the download threads: one layer's blob calls from the
/// thread fetching it, in order; different layers' at once. A sink
/// serialises what it shares.

#include "core/error.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cfmo::oci {

struct ResolvedImage;
struct PullState;
struct LayerReport;
struct BlobResult;

class PullSink {
 public:
  virtual ~PullSink() = default;

  /// The manifest is known, before any blob is fetched; an error stops the pull.
  virtual Status on_resolved(const ResolvedImage& /*image*/) { return {}; }
  /// Once, before the first layer: every layer, hot or not, where it goes.
  virtual void on_plan(const PullState& /*state*/) {}
  /// The pull's state, whenever it changed: planned, a layer's outcome,
  /// ready, the end (and, in a fetch, the layers it takes on). An error
  /// (the state file cannot be written) stops the pull.
  virtual Status on_state(const PullState& /*state*/) { return {}; }

  /// Layer `layer`'s download starts (progress).
  virtual void on_layer_start(size_t /*layer*/) {}
  /// The layer's bytes so far (resumed ones included), at most every 256 KiB.
  virtual void on_layer_bytes(size_t /*layer*/, int64_t /*bytes*/) {}
  /// The layer's outcome, as the report has it.
  virtual void on_layer_done(size_t /*layer*/, const LayerReport& /*report*/) {}

  /// The layer's blob, as it is written to its partial file. Before the
  /// first request: the file already holds `bytes_on_disk` (a resumed
  /// download, or the whole blob when it is there already), which
  /// on_blob_write will not repeat.
  virtual void on_blob_start(size_t /*layer*/, int64_t /*bytes_on_disk*/) {}
  /// The registry answered 200 to a Range request, or another host took
  /// over: the file starts again, empty.
  virtual void on_blob_restart(size_t /*layer*/) {}
  /// Bytes just appended to the partial file; an error aborts the download.
  virtual Status on_blob_write(size_t /*layer*/, std::string_view /*chunk*/) { return {}; }
  /// The blob is complete and verified (`error` null), or failed. Also for
  /// each other layer of the same digest, which came with it.
  virtual void on_blob_done(size_t /*layer*/, const Error* /*error*/) {}

  /// The hot layers are complete (and the ready file written).
  virtual void on_ready(double /*seconds*/) {}
  /// A warning or notice: a hot layer spilled to disk, a mirror given up.
  virtual void on_note(const std::string& /*message*/) {}
};

}  // namespace cfmo::oci
