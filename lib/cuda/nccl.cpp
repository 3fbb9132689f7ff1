#include "cuda/nccl.h"

#include <chrono>
#include <cstring>
#include <thread>

#include <unistd.h>
#include <vector>

namespace cfmo::cuda {
namespace {

Error nccl_error(ncclResult_t code, ncclComm_t comm, std::string_view what) {
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return make_error(code == ncclRemoteError || code == ncclSystemError ? ErrorKind::kPeer : ErrorKind::kInternal,
                    "NCCL: {}: {}{}{}", what, ncclGetErrorString(code), detail != nullptr && *detail ? ": " : "",
                    detail != nullptr ? detail : "");
}

}  // namespace

std::string NcclComm::version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL";
  return fmt::format("NCCL {}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

Result<bool> NcclComm::one_gpu_per_rank(const Context& ctx, comm::Communicator& host) {
  // Every rank's "host/PCI bus id" to every rank, then the same comparison everywhere.
  constexpr size_t kHostBytes = 256;
  constexpr size_t kIdBytes = kHostBytes + 32;
  char id[kIdBytes] = {};
  if (gethostname(id, kHostBytes - 1) != 0) std::strcpy(id, "?");
  CFMO_CUDA_TRY(cudaDeviceGetPCIBusId(id + kHostBytes, 31, ctx.ordinal()), "reading the GPU's bus id");
  const auto world = static_cast<size_t>(host.size());
  std::vector<char> all(world * kIdBytes, 0);
  std::vector<std::span<const std::byte>> send(world);
  std::vector<std::span<std::byte>> recv(world);
  for (size_t p = 0; p < world; ++p) {
    send[p] = {reinterpret_cast<const std::byte*>(id), kIdBytes};
    recv[p] = {reinterpret_cast<std::byte*>(all.data() + p * kIdBytes), kIdBytes};
  }
  CFMO_TRY(host.all_to_all_v(send, recv));
  for (size_t a = 0; a < world; ++a) {
    for (size_t b = a + 1; b < world; ++b) {
      if (std::memcmp(all.data() + a * kIdBytes, all.data() + b * kIdBytes, kIdBytes) == 0) return false;
    }
  }
  return true;
}

Result<std::unique_ptr<NcclComm>> NcclComm::create(Context& ctx, comm::Communicator& host, double timeout_s) {
  std::unique_ptr<NcclComm> nc(new NcclComm(ctx, host, timeout_s));
  const int rank = host.rank();
  const int world = host.size();
  ncclUniqueId id{};
  if (rank == 0) {
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return nccl_error(r, nullptr, "making an id");
  }
  // Rank 0 sends the id to every rank (itself included); the others send nothing.
  std::vector<std::span<const std::byte>> send(static_cast<size_t>(world));
  std::vector<std::span<std::byte>> recv(static_cast<size_t>(world));
  ncclUniqueId received{};
  const auto* id_bytes = reinterpret_cast<const std::byte*>(&id);
  for (int p = 0; p < world; ++p) {
    if (rank == 0) send[static_cast<size_t>(p)] = {id_bytes, sizeof(id)};
  }
  recv[0] = {reinterpret_cast<std::byte*>(&received), sizeof(received)};
  CFMO_TRY(host.all_to_all_v(send, recv));

  CFMO_CUDA_TRY(cudaSetDevice(ctx.ordinal()), "selecting the device for NCCL");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; wait() polls with the host's health and a timeout
  if (const ncclResult_t r = ncclCommInitRankConfig(&nc->comm_, world, received, rank, &config);
      r != ncclSuccess && r != ncclInProgress) {
    return nccl_error(r, nc->comm_, "connecting the ranks");
  }
  CFMO_TRY(nc->wait("connecting the ranks", false));
  return nc;
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  if (aborted_) return;  // ncclCommAbort has freed it
  ncclCommFinalize(comm_);
  // A finalize that cannot finish (a peer went away) must not hang the exit.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  ncclResult_t state = ncclInProgress;
  while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
}

Status NcclComm::wait(std::string_view what, bool stream_too) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
      return nccl_error(r, comm_, what);
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      ncclCommAbort(comm_);
      aborted_ = true;
      return nccl_error(state, nullptr, what);
    }
    bool done = state == ncclSuccess;
    if (done && stream_too) {
      const cudaError_t q = cudaStreamQuery(ctx_.stream());
      if (q != cudaSuccess && q != cudaErrorNotReady) return cuda_error(q, what);
      done = q == cudaSuccess;
    }
    if (done) return {};
    if (Status health = host_.health(); !health) {
      ncclCommAbort(comm_);
      aborted_ = true;
      return make_error(ErrorKind::kPeer, "NCCL: {}: {}", what, health.error().message);
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s_ > 0 && waited > timeout_s_) {
      ncclCommAbort(comm_);
      aborted_ = true;
      return make_error(ErrorKind::kPeer, "NCCL: {}: no progress for {:.0f} s (a rank is lost or stuck)", what, waited);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status NcclComm::all_reduce_sum(float* data, size_t n) {
  if (aborted_) return make_error(ErrorKind::kPeer, "NCCL: the communicator was aborted after an earlier failure");
  if (const ncclResult_t r = ncclAllReduce(data, data, n, ncclFloat32, ncclSum, comm_, ctx_.stream());
      r != ncclSuccess && r != ncclInProgress) {
    return nccl_error(r, comm_, "all-reduce");
  }
  return wait("all-reduce", true);
}

}  // namespace cfmo::cuda
