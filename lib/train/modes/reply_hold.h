#pragma once
/// cfmo's owners answer a shard's contributions by rounds (--reply-hold
/// round): a contribution is applied at once, but its reply, the fresh shard,
/// waits until every live rank still training has contributed to that shard
/// since the last answer, or until the owner has taken 2H steps of its own
/// since the oldest one held. Every worker of a round then rebases on the same
/// shard, with the whole round's deltas and the outer step in it, instead of
/// the first to arrive rebasing on a shard with only its own delta (and
/// training its next round without the others' last one).
///
/// This is also how the delta pipeline adapts to a slow link: a worker sends
/// a shard again only once its reply is in, so when the link (or a peer)
/// cannot carry a round within H steps, the next round of that shard waits
/// and carries more steps: fewer, larger rounds, every rank's in each, and no
/// round a worker sends queues behind the one before. `held_steps` and the
/// counts say how much it held.
///
/// The owner's bookkeeping only: no messages, no clock (steps are the owner's
/// training steps), no lock of its own (the owner calls it under its mutex).

#include <cstdint>
#include <vector>

namespace cfmo::train::modes {

class ReplyHold {
 public:
  /// A reply owed to `to` for its contribution to a shard.
  struct Reply {
    int to = 0;
    int64_t staleness = 0;
    bool dropped = false;
  };
  /// A reply due now, with its shard.
  struct Due {
    int shard = 0;
    Reply reply;
  };

  /// `enabled` false: every reply is due at once (--reply-hold off).
  ReplyHold(int shards, int world, int64_t bound_steps, bool enabled);

  /// A contribution to `shard` was applied; the replies due now (this one
  /// and those held with it when the round is whole; none when it waits).
  std::vector<Due> applied(int shard, const Reply& reply);
  /// `rank` sent its last round (answered at once, without the shard), or was
  /// lost: rounds no longer wait for it. The replies now due.
  std::vector<Due> finished(int rank);
  /// `rank` is back (a join), or new (the world grew to it): rounds wait for it (again).
  void rejoined(int rank);
  /// The owner's training step now: replies held `bound_steps` are due.
  std::vector<Due> tick(int64_t step);
  /// Everything held, now (the shards may move: membership changed).
  std::vector<Due> flush();
  /// Everything held (the owner stops training: nobody would release them).
  /// From then on every reply is due at once.
  std::vector<Due> release_all();

  /// Replies answered after being held, and the owner's steps they waited in all.
  int64_t held() const { return held_; }
  int64_t held_steps() const { return held_steps_; }
  /// Rounds answered whole (every rank's reply at once) and cut short by the bound.
  int64_t whole_rounds() const { return whole_; }
  int64_t cut_rounds() const { return cut_; }
  bool holding() const { return enabled_; }

 private:
  struct Held {
    std::vector<Reply> replies;
    std::vector<bool> from;  ///< by rank: already in this round
    int64_t since = 0;       ///< the owner's step when the first was held
  };
  /// Releases `shard`'s held replies into `out`.
  void release(int shard, std::vector<Due>& out);
  int waiting_for() const { return active_; }

  bool enabled_;
  int64_t bound_;
  int64_t step_ = 0;
  int active_;  ///< ranks still training (not finished, not lost)
  std::vector<bool> active_by_rank_;
  std::vector<Held> shards_;
  int64_t held_ = 0;
  int64_t held_steps_ = 0;
  int64_t whole_ = 0;
  int64_t cut_ = 0;
};

}  // namespace cfmo::train::modes
