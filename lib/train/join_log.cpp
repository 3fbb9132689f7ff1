#include "train/join_log.h"

#include "train/channels.h"
#include "train/modes/wire.h"

#include <algorithm>
#include <cmath>

namespace cfmo::train {

using modes::put;
using modes::take;

namespace {

bool same_join(const JoinedRank& a, const JoinedRank& b) {
  return a.rank == b.rank && std::abs(a.wall_s - b.wall_s) < kSameJoinS;
}

}  // namespace

std::vector<JoinedRank> merge_joins(const std::vector<JoinedRank>& a, const std::vector<JoinedRank>& b) {
  // The union, a join noticed in both once (its first notice, with the
  // joiner's first_step_s where either knew it), in the order of the run's
  // clock: robust whichever list is older and however they came to be merged.
  std::vector<JoinedRank> out = a;
  for (const JoinedRank& j : b) {
    const auto seen = std::find_if(out.begin(), out.end(), [&](const JoinedRank& o) { return same_join(o, j); });
    if (seen == out.end()) {
      out.push_back(j);
      continue;
    }
    seen->first_step_s = std::max(seen->first_step_s, j.first_step_s);
    if (j.wall_s < seen->wall_s) {
      seen->wall_s = j.wall_s;
      seen->step = j.step;
    }
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const JoinedRank& x, const JoinedRank& y) { return x.wall_s < y.wall_s; });
  return out;
}

JoinLog::JoinLog(comm::Communicator& comm) : comm_(comm) {
  comm_.on_message(channels::kJoins, [this](int, std::span<const std::byte> m) { on_message(m); });
}

JoinLog::~JoinLog() { comm_.on_message(channels::kJoins, nullptr); }

void JoinLog::share(const std::vector<JoinedRank>& joins, int keeper, int standby) {
  if (joins.size() == shared_size_ && keeper == shared_keeper_ && standby == shared_standby_) return;
  shared_size_ = joins.size();
  shared_keeper_ = keeper;
  shared_standby_ = standby;
  if (joins.empty()) return;
  std::vector<std::byte> out;
  put(out, static_cast<uint32_t>(joins.size()));
  for (const auto& j : joins) {
    put(out, static_cast<int32_t>(j.rank));
    put(out, j.step);
    put(out, j.wall_s);
    put(out, j.first_step_s);
  }
  for (const int to : {keeper, standby}) {
    if (to >= 0 && to != comm_.rank()) comm_.post(to, channels::kJoins, out);
  }
}

void JoinLog::merge_received(std::vector<JoinedRank>& joins) {
  std::vector<std::vector<JoinedRank>> lists;
  {
    std::lock_guard lock(mutex_);
    lists.swap(received_);
  }
  for (const auto& list : lists) joins = merge_joins(joins, list);
}

void JoinLog::on_message(std::span<const std::byte> m) {
  uint32_t n = 0;
  constexpr size_t kEntry = sizeof(int32_t) + sizeof(int64_t) + 2 * sizeof(double);
  if (!take(m, n) || m.size() != static_cast<size_t>(n) * kEntry) return;
  std::vector<JoinedRank> list(n);
  for (auto& j : list) {
    int32_t rank = 0;
    take(m, rank);
    take(m, j.step);
    take(m, j.wall_s);
    take(m, j.first_step_s);
    j.rank = rank;
  }
  std::lock_guard lock(mutex_);
  received_.push_back(std::move(list));
}

}  // namespace cfmo::train
