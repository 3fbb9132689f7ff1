#include "comm/collectives.h"

#include <algorithm>
#include <cstring>

namespace cfmo::comm {

Status Collectives::all_reduce_sum(std::span<float> data) {
  const int w = transport_.size();
  if (w == 1) return {};
  const int rank = transport_.rank();
  const int right = (rank + 1) % w;
  const int left = (rank + w - 1) % w;
  auto begin = [&](int chunk) { return data.size() * static_cast<size_t>(chunk) / static_cast<size_t>(w); };
  size_t largest = 0;
  for (int c = 0; c < w; ++c) largest = std::max(largest, begin(c + 1) - begin(c));
  scratch_.resize(largest);
  for (int step = 0; step < 2 * (w - 1); ++step) {
    const bool reducing = step < w - 1;
    const int s = reducing ? step : step - (w - 1);
    const int send_chunk = reducing ? (rank - s + w) % w : (rank - s + 1 + w) % w;
    const int recv_chunk = reducing ? (rank - s - 1 + 2 * w) % w : (rank - s + w) % w;
    float* recv_into = reducing ? scratch_.data() : data.data() + begin(recv_chunk);
    const size_t recv_count = begin(recv_chunk + 1) - begin(recv_chunk);
    const size_t send_count = begin(send_chunk + 1) - begin(send_chunk);
    const ReceiveFrom receive{left, std::as_writable_bytes(std::span<float>(recv_into, recv_count))};
    const SendTo send{right, std::as_bytes(data.subspan(begin(send_chunk), send_count))};
    CFMO_TRY(transport_.exchange(++tag_, std::span(&send, 1), std::span(&receive, 1), "all-reduce"));
    if (reducing) {
      float* target = data.data() + begin(recv_chunk);
      for (size_t i = 0; i < recv_count; ++i) target[i] += scratch_[i];
    }
  }
  return {};
}

Status Collectives::barrier() {
  const int w = transport_.size();
  const int rank = transport_.rank();
  const std::byte token{1};
  std::byte heard{0};
  for (int distance = 1; distance < w; distance *= 2) {
    const SendTo send{(rank + distance) % w, std::span(&token, 1)};
    const ReceiveFrom receive{(rank - distance + w) % w, std::span(&heard, 1)};
    CFMO_TRY(transport_.exchange(++tag_, std::span(&send, 1), std::span(&receive, 1), "barrier"));
  }
  return {};
}

Status Collectives::all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                                 const std::vector<std::span<std::byte>>& recv) {
  const int w = transport_.size();
  const int rank = transport_.rank();
  if (static_cast<int>(send.size()) != w || static_cast<int>(recv.size()) != w) {
    return make_error(ErrorKind::kInternal, "all_to_all_v: {} send and {} receive buffers for {} ranks", send.size(),
                      recv.size(), w);
  }
  const auto self = static_cast<size_t>(rank);
  if (recv[self].size() != send[self].size()) {
    return make_error(ErrorKind::kInternal, "all_to_all_v: {} bytes to self, {} expected", send[self].size(),
                      recv[self].size());
  }
  if (!send[self].empty()) std::memcpy(recv[self].data(), send[self].data(), send[self].size());
  if (w == 1) return {};
  std::vector<SendTo> sends;
  std::vector<ReceiveFrom> receives;
  sends.reserve(static_cast<size_t>(w - 1));
  receives.reserve(static_cast<size_t>(w - 1));
  for (int step = 1; step < w; ++step) {
    const int peer = (rank + step) % w;
    const auto p = static_cast<size_t>(peer);
    receives.push_back({peer, recv[p]});
    sends.push_back({peer, send[p]});
  }
  return transport_.exchange(++tag_, sends, receives, "all-to-all");
}

}  // namespace cfmo::comm
