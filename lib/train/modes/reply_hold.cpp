#include "train/modes/reply_hold.h"

#include <algorithm>

namespace cfmo::train::modes {

ReplyHold::ReplyHold(int shards, int world, int64_t bound_steps, bool enabled)
    : enabled_(enabled),
      bound_(std::max<int64_t>(1, bound_steps)),
      active_(world),
      active_by_rank_(static_cast<size_t>(world), true),
      shards_(static_cast<size_t>(shards)) {
  for (auto& h : shards_) h.from.assign(static_cast<size_t>(world), false);
}

std::vector<ReplyHold::Due> ReplyHold::applied(int shard, const Reply& reply) {
  std::vector<Due> out;
  if (!enabled_) {
    out.push_back({shard, reply});
    return out;
  }
  Held& h = shards_[static_cast<size_t>(shard)];
  // A second contribution of one rank in a round (its earlier reply was
  // given up for lost): the round so far goes first.
  if (h.from[static_cast<size_t>(reply.to)]) release(shard, out);
  if (h.replies.empty()) h.since = step_;
  h.replies.push_back(reply);
  h.from[static_cast<size_t>(reply.to)] = true;
  if (static_cast<int>(h.replies.size()) >= waiting_for()) release(shard, out);
  return out;
}

std::vector<ReplyHold::Due> ReplyHold::finished(int rank) {
  std::vector<Due> out;
  if (rank < 0 || static_cast<size_t>(rank) >= active_by_rank_.size() || !active_by_rank_[static_cast<size_t>(rank)]) {
    return out;
  }
  active_by_rank_[static_cast<size_t>(rank)] = false;
  --active_;
  for (size_t j = 0; j < shards_.size(); ++j) {
    const Held& h = shards_[j];
    if (!h.replies.empty() && static_cast<int>(h.replies.size()) >= waiting_for()) release(static_cast<int>(j), out);
  }
  return out;
}

void ReplyHold::rejoined(int rank) {
  if (rank < 0) return;
  if (static_cast<size_t>(rank) >= active_by_rank_.size()) {
    // A new rank (the world grew): the ranks between, never heard of, are not waited for.
    active_by_rank_.resize(static_cast<size_t>(rank) + 1, false);
    for (auto& h : shards_) h.from.resize(active_by_rank_.size(), false);
  }
  if (active_by_rank_[static_cast<size_t>(rank)]) return;
  active_by_rank_[static_cast<size_t>(rank)] = true;
  ++active_;
}

std::vector<ReplyHold::Due> ReplyHold::tick(int64_t step) {
  step_ = step;
  std::vector<Due> out;
  for (size_t j = 0; j < shards_.size(); ++j) {
    const Held& h = shards_[j];
    if (!h.replies.empty() && step_ - h.since >= bound_) release(static_cast<int>(j), out);
  }
  return out;
}

std::vector<ReplyHold::Due> ReplyHold::flush() {
  std::vector<Due> out;
  for (size_t j = 0; j < shards_.size(); ++j) {
    if (!shards_[j].replies.empty()) release(static_cast<int>(j), out);
  }
  return out;
}

std::vector<ReplyHold::Due> ReplyHold::release_all() {
  auto out = flush();
  enabled_ = false;
  return out;
}

void ReplyHold::release(int shard, std::vector<Due>& out) {
  Held& h = shards_[static_cast<size_t>(shard)];
  const auto n = static_cast<int64_t>(h.replies.size());
  // A whole round's last reply waited for nobody: it is not counted as held.
  const bool whole = n >= waiting_for();
  ++(whole ? whole_ : cut_);
  const int64_t waited = whole ? n - 1 : n;
  held_ += waited;
  held_steps_ += waited * (step_ - h.since);
  for (const Reply& r : h.replies) out.push_back({shard, r});
  h.replies.clear();
  std::fill(h.from.begin(), h.from.end(), false);
}

}  // namespace cfmo::train::modes
