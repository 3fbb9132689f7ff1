#include "comm/peer_health.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace cfmo::comm {
namespace {
// In a goodbye's first byte, beside the failure's kind: the leaving rank's run failed.
constexpr uint8_t kFailedLeaving = 0x80;
}  // namespace

PeerHealth::PeerHealth(int rank, int size)
    : rank_(rank), lost_(static_cast<size_t>(size)), departed_(static_cast<size_t>(size), false) {}

void PeerHealth::mark_lost(int peer, std::string why) {
  if (stopping_) return;
  std::lock_guard lock(mutex_);
  if (departed_[static_cast<size_t>(peer)]) return;
  auto& reason = lost_[static_cast<size_t>(peer)];
  if (reason.empty()) reason = std::move(why);
}

bool PeerHealth::is_lost(int peer) const {
  std::lock_guard lock(mutex_);
  return !lost_[static_cast<size_t>(peer)].empty();
}

bool PeerHealth::departed(int peer) const {
  std::lock_guard lock(mutex_);
  return departed_[static_cast<size_t>(peer)];
}

std::vector<int> PeerHealth::lost_ranks() const {
  std::lock_guard lock(mutex_);
  std::vector<int> out;
  for (size_t r = 0; r < lost_.size(); ++r) {
    if (!lost_[r].empty()) out.push_back(static_cast<int>(r));
  }
  return out;
}

void PeerHealth::grow(int size) {
  std::lock_guard lock(mutex_);
  if (static_cast<size_t>(size) <= lost_.size()) return;
  lost_.resize(static_cast<size_t>(size));
  departed_.resize(static_cast<size_t>(size), false);
}

void PeerHealth::rejoined(int peer) {
  std::lock_guard lock(mutex_);
  replaced_.push_back(std::exchange(lost_[static_cast<size_t>(peer)], std::string()));
  departed_[static_cast<size_t>(peer)] = false;
  joined_.push_back(peer);
  joined_at_.push_back(std::chrono::steady_clock::now());
}

std::string PeerHealth::replaced_loss(size_t join) const {
  std::lock_guard lock(mutex_);
  return join < replaced_.size() ? replaced_[join] : std::string();
}

std::chrono::steady_clock::time_point PeerHealth::joined_at(size_t join) const {
  std::lock_guard lock(mutex_);
  return join < joined_at_.size() ? joined_at_[join] : std::chrono::steady_clock::now();
}

std::vector<int> PeerHealth::joined_ranks() const {
  std::lock_guard lock(mutex_);
  return joined_;
}

size_t PeerHealth::joins_of(int peer) const {
  std::lock_guard lock(mutex_);
  return static_cast<size_t>(std::count(joined_.begin(), joined_.end(), peer));
}

Status PeerHealth::first_lost_locked() const {
  for (size_t r = 0; r < lost_.size(); ++r) {
    if (!lost_[r].empty()) return make_error(ErrorKind::kPeer, "rank {} lost: {}", r, lost_[r]);
  }
  return {};
}

Status PeerHealth::health() const {
  std::lock_guard lock(mutex_);
  if (!first_failure_.empty()) return Error{first_failure_kind_, first_failure_};
  return first_lost_locked();
}

std::string PeerHealth::lost_reason(int peer) const {
  std::lock_guard lock(mutex_);
  return peer >= 0 && peer < static_cast<int>(lost_.size()) ? lost_[static_cast<size_t>(peer)] : std::string();
}

Error PeerHealth::failure_of(std::string_view what, int peer) const {
  std::lock_guard lock(mutex_);
  if (!first_failure_.empty()) return make_error(first_failure_kind_, "{}: {}", what, first_failure_);
  const auto& reason = lost_[static_cast<size_t>(peer)];
  if (!reason.empty()) return make_error(ErrorKind::kPeer, "{}: rank {} lost: {}", what, peer, reason);
  return make_error(ErrorKind::kPeer, "{}: rank {} left the run", what, peer);
}

void PeerHealth::leave_with(const Error& error) {
  std::lock_guard lock(mutex_);
  if (!left_with_.message.empty()) return;
  left_with_ = Error{error.kind, fmt::format("rank {} failed: {}", rank_, error.message)};
}

Error PeerHealth::own_failure() const {
  std::lock_guard lock(mutex_);
  if (!first_failure_.empty()) return Error{first_failure_kind_, first_failure_};
  if (!left_with_.message.empty() && left_with_.kind != ErrorKind::kPeer) return left_with_;
  if (Status lost = first_lost_locked(); !lost) return lost.error();
  return left_with_;
}

std::vector<std::byte> PeerHealth::goodbye() const {
  const Error reason = own_failure();
  bool failing = false;
  {
    std::lock_guard lock(mutex_);
    failing = !left_with_.message.empty();
  }
  if (reason.message.empty()) return {};
  // resize + memcpy rather than insert: GCC 12 warns falsely (-Warray-bounds) about the insert.
  std::vector<std::byte> payload(1 + reason.message.size());
  payload[0] = static_cast<std::byte>(static_cast<uint8_t>(reason.kind) | (failing ? kFailedLeaving : 0));
  std::memcpy(payload.data() + 1, reason.message.data(), reason.message.size());
  return payload;
}

void PeerHealth::on_goodbye(int peer, std::span<const std::byte> payload) {
  std::lock_guard lock(mutex_);
  departed_[static_cast<size_t>(peer)] = true;
  if (payload.size() <= 1) return;
  const auto flags = static_cast<uint8_t>(payload[0]);
  const int kind = flags & ~kFailedLeaving;
  std::string message(reinterpret_cast<const char*>(payload.data()) + 1, payload.size() - 1);
  // A rank whose run failed is gone for the others: lost, so that nobody
  // waits for its answers (asgd's owners), with the failure as the reason.
  // One that finished its work and merely saw a failure (another rank lost)
  // just left.
  const bool lost = (flags & kFailedLeaving) != 0 && !stopping_;
  if (lost && lost_[static_cast<size_t>(peer)].empty()) lost_[static_cast<size_t>(peer)] = message;
  if (first_failure_.empty()) {
    first_failure_kind_ = kind >= 1 && kind <= 5 ? static_cast<ErrorKind>(kind) : ErrorKind::kPeer;
    first_failure_ = std::move(message);
  }
}

}  // namespace cfmo::comm
