#include "train/rank_states.h"

#include "train/channels.h"
#include "train/modes/wire.h"

#include <algorithm>

namespace cfmo::train {

using modes::put;
using modes::put_bytes;

RankStates::RankStates(comm::Communicator& comm) : comm_(comm) {
  comm_.on_message(channels::kRankState, [this](int from, std::span<const std::byte> m) { on_message(from, m); });
}

RankStates::~RankStates() { comm_.on_message(channels::kRankState, nullptr); }

uint64_t RankStates::request() {
  std::vector<std::byte> out;
  uint64_t id = 0;
  {
    std::lock_guard lock(mutex_);
    id = ++current_;
    // Only the newest request's answers are kept (and the end's).
    std::erase_if(answers_, [](const auto& a) { return a.first != kFinal; });
    put(out, kRequest);
    put(out, id);
  }
  for (int r = 0; r < comm_.size(); ++r) {
    if (r != comm_.rank()) comm_.post(r, channels::kRankState, out);
  }
  return id;
}

std::optional<std::pair<int, uint64_t>> RankStates::take_request() {
  std::lock_guard lock(mutex_);
  std::optional<std::pair<int, uint64_t>> out;
  out.swap(asked_);
  return out;
}

void RankStates::send(int to, uint64_t id, std::vector<std::byte> state) {
  std::vector<std::byte> out;
  out.reserve(sizeof(uint32_t) + sizeof(uint64_t) + state.size());
  put(out, kState);
  put(out, id);
  put_bytes(out, state.data(), state.size());
  comm_.post(to, channels::kRankState, std::move(out));
}

bool RankStates::complete(uint64_t id, const std::vector<int>& lost) const {
  std::lock_guard lock(mutex_);
  const auto it = answers_.find(id);
  for (int r = 0; r < comm_.size(); ++r) {
    if (r == comm_.rank() || std::find(lost.begin(), lost.end(), r) != lost.end()) continue;
    // (A rank the world grew by after the answers began has none there yet.)
    if (it == answers_.end() || it->second.size() <= static_cast<size_t>(r) ||
        it->second[static_cast<size_t>(r)].empty()) {
      return false;
    }
  }
  return true;
}

std::vector<std::vector<std::byte>> RankStates::take(uint64_t id) {
  std::lock_guard lock(mutex_);
  std::vector<std::vector<std::byte>> out(static_cast<size_t>(comm_.size()));
  if (const auto it = answers_.find(id); it != answers_.end()) {
    out.swap(it->second);
    answers_.erase(it);
  }
  out.resize(std::max(out.size(), static_cast<size_t>(comm_.size())));
  return out;
}

void RankStates::on_message(int from, std::span<const std::byte> m) {
  uint32_t kind = 0;
  uint64_t id = 0;
  if (!modes::take(m, kind) || !modes::take(m, id)) return;
  std::lock_guard lock(mutex_);
  if (kind == kRequest) {
    asked_ = {from, id};  // a newer request replaces one not answered yet
    return;
  }
  // An answer to an older request, or to a keeper before this one, is stale.
  if (kind != kState || m.empty() || (id != current_ && id != kFinal && !is_at_step(id))) return;
  // States sent at a step: an earlier step's that the keeper did not take (it
  // was not writing then) are stale once a later one comes.
  if (is_at_step(id)) std::erase_if(answers_, [id](const auto& a) { return is_at_step(a.first) && a.first < id; });
  auto& answers = answers_[id];
  answers.resize(std::max(answers.size(), static_cast<size_t>(comm_.size())));
  if (static_cast<size_t>(from) >= answers.size()) return;
  answers[static_cast<size_t>(from)].assign(m.begin(), m.end());
}

}  // namespace cfmo::train
