#pragma once
/// NCCL for the blocking collectives of the lockstep modes (sync,
/// localsgd) on CUDA devices: gradients and deltas are summed where they
/// live, without a trip through host memory. The NCCL communicator is made
/// non-blocking, and every wait polls it together with the host
/// Communicator's health, so a lost rank is an error naming it, never a
/// hang inside NCCL.

#include "comm/communicator.h"
#include "core/error.h"
#include "cuda/runtime.h"

#include <nccl.h>

#include <memory>
#include <string>

namespace cfmo::cuda {

class NcclComm {
 public:
  /// Every rank of `host` calls this together: rank 0's NCCL id travels over
  /// `host` (an all-to-all-v), then NCCL connects the devices. `timeout_s`
  /// bounds each wait when a peer goes silent without the host noticing.
  static Result<std::unique_ptr<NcclComm>> create(Context& ctx, comm::Communicator& host, double timeout_s);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  /// Blocking: `data` (device memory, `n` floats) becomes the sum over ranks.
  Status all_reduce_sum(float* data, size_t n);

  /// True when every rank of `host` has a GPU of its own (NCCL refuses two
  /// ranks on one device). Collective: every rank calls it, all get the same answer.
  static Result<bool> one_gpu_per_rank(const Context& ctx, comm::Communicator& host);

  /// "NCCL 2.28.9", for reports.
  static std::string version();

 private:
  NcclComm(Context& ctx, comm::Communicator& host, double timeout_s) : ctx_(ctx), host_(host), timeout_s_(timeout_s) {}
  /// Waits until NCCL's pending work (and, with `stream_too`, the stream) is done,
  /// failing on an NCCL error, a lost host peer or the timeout.
  Status wait(std::string_view what, bool stream_too);

  Context& ctx_;
  comm::Communicator& host_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};

}  // namespace cfmo::cuda
