#pragma once
/// The lockstep modes' sum when workers may be lost (localsgd always, sync
/// with --elastic): a group of members that adds their vectors through its
/// leader (the lowest live member) over point-to-point messages, and that
/// re-forms without a lost member. The ring all-reduce cannot serve here: a
/// rank waiting in it on a live neighbour that gave up waits forever.
///
///   all_reduce_sum(data)  each member sends its data to the leader, which
///                         adds them in rank order and sends the sum back:
///                         every member gets the same bits (and the samples
///                         each member had trained: its tally)
///   after a loss          each survivor sends the (new) leader the number of
///                         the sum it is in and the last sum it got; the
///                         leader waits for every live member, then tells each
///                         the new members. A survivor that missed the last
///                         sum (its leader was lost while sending it) gets it
///                         then; the others redo the sum in flight without the
///                         lost member. Within --peer-timeout (the loss is
///                         found) plus the messages' time.
///
/// Messages (on the channel given):
///   kPart    [u8 1][u32 epoch][u64 seq][i64 samples][floats]     a member's data for sum seq
///   kSum     [u8 2][u32 epoch][u64 seq][tally][floats]             the leader's sum
///   kJoin    [u8 3][u32 epoch][u64 seq][u8 has last][floats: the last sum]
///   kGroup   [u8 4][u32 epoch][u64 seq][u32 n][n x i32 ranks][u8 has][floats: sum seq - 1]
///   kReform  [u8 5][u32 epoch][u64 0]               the leader asks the members to join
///   kAdmit   [u8 6][u32 0][u64 0]                   a process that joined the run asks to be a member
///   kWelcome [u8 7][u32 epoch][u64 seq][u32 n][n x i32 ranks][u32 count][u64 n][bytes: state]
///            [tally: reconciled by rank][tally: retired by rank][floats: sum seq - 1]
///   kSumGrow [u8 8][u32 epoch][u64 seq][u32 n][n x i32 ranks][tally][floats]   kSum, and the members from then on
///   kEnded   [u8 9][u32 0][u64 0]                   a member to a joiner: the group made its last sum (close)
/// where the epoch counts the group's re-formings and growths, and a tally
/// is [u32 n][n x i64 samples]: in a sum, each of the members that made it
/// (in their order) had trained that many samples in this run when it sent
/// its part. So every member knows what each member trained up to its last
/// sum, which is what a lost member adds to the run's samples
/// (reconciled_samples), and what earlier processes in a joined rank's place
/// did (retired_samples), whichever member ends up keeping the run. A joiner is
/// taken in by the leader at the end of a sum: it gets that sum, how many
/// members made it, and the caller's state (set_welcome: the mode's global
/// parameters before the sum), and is a member of the next. With
/// welcome_later (sync) the kWelcome carries no sum: the leader sends it
/// once the caller has used the sum (send_welcome: its parameters and
/// optimizer state after the step), still before the next sum. A joiner
/// that asks once the group made its last sum (close) is told so (kEnded),
/// as it is by the others leaving the run: it comes too late, and goes.
///
/// Threads: the training thread calls all_reduce_sum; the handler only
/// queues what arrives.

#include "comm/communicator.h"
#include "core/error.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace cfmo::train::modes {

class ElasticGroup {
 public:
  ElasticGroup(comm::Communicator& comm, comm::Channel channel, double peer_timeout_s);
  ~ElasticGroup();
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;

  /// Afterwards `data` holds the element-wise sum over the members (as the
  /// group was when the sum completed); `samples` is what this process has
  /// trained in this run, this sum's part included. Fails (kPeer) only when
  /// the group cannot re-form in time.
  Status all_reduce_sum(std::span<float> data, int64_t samples);

  /// The samples the process now in `rank`'s place had trained when its part
  /// of its last completed sum was sent (0 for a rank never in a sum).
  int64_t reconciled_samples(int rank) const { return at(reconciled_, rank); }
  /// The samples earlier processes in `rank`'s place trained up to their last
  /// sums, before a new process joined there.
  int64_t retired_samples(int rank) const { return at(retired_, rank); }

  /// The members now, in rank order; the first is the leader.
  const std::vector<int>& members() const { return members_; }
  /// How many members made the last sum (the group may have grown after it).
  size_t last_sum_members() const { return last_sum_members_; }
  /// Those members, in rank order (a joiner: the group it was taken into).
  const std::vector<int>& last_sum_ranks() const { return last_sum_ranks_; }

  /// What the leader gives a joiner with the sum it is taken in at (called on
  /// the leader's training thread, inside all_reduce_sum, before the caller
  /// has used the sum).
  void set_welcome(std::function<std::vector<std::byte>()> state) { welcome_ = std::move(state); }
  /// The joiners are welcomed after the sum they were taken in at is used,
  /// by send_welcome, rather than with it (what a joiner needs is only
  /// there then: sync's parameters after the step).
  void welcome_later() { welcome_later_ = true; }
  /// With welcome_later, the leader after a sum that took joiners in (then
  /// before its next all_reduce_sum): those still to be welcomed.
  const std::vector<int>& welcome_due() const { return welcome_due_; }
  /// Sends each joiner due its welcome with `state`, as of the last sum.
  void send_welcome(std::span<const std::byte> state);
  /// A joiner's welcome: the state, the sum (empty with welcome_later), and how many members made it.
  struct Welcome {
    std::vector<std::byte> state;
    std::vector<float> sum;
    size_t members = 0;
  };
  /// This rank joined the run (Communicator::joined): asks the leader until
  /// it is taken in, at most `timeout_s`; afterwards it is a member. Nothing
  /// when the run ended first: a member said the group made its last sum,
  /// or every other rank left the run (none lost only: an error then).
  Result<std::optional<Welcome>> join(double timeout_s);
  /// The group made its last sum (the run's end): a joiner that asks, or
  /// asked and was not taken in, is told so. Any thread.
  void close();
  /// This rank's place among them.
  int index() const;

 private:
  enum Kind : uint8_t {
    kPart = 1,
    kSum = 2,
    kJoin = 3,
    kGroup = 4,
    kReform = 5,
    kAdmit = 6,
    kWelcome = 7,
    kSumGrow = 8,
    kEnded = 9
  };
  struct Message {
    Kind kind = kPart;
    int from = -1;
    uint32_t epoch = 0;
    uint64_t seq = 0;
    std::vector<int> ranks;  ///< kGroup, kWelcome, kSumGrow
    bool has = false;        ///< kJoin, kGroup: floats are a sum
    std::vector<float> floats;
    uint32_t count = 0;              ///< kWelcome: the members that made the sum
    std::vector<std::byte> state{};  ///< kWelcome
    int64_t samples = 0;             ///< kPart: the sender's samples
    std::vector<int64_t> tally{};    ///< kSum, kSumGrow: the members' samples; kWelcome: reconciled_
    std::vector<int64_t> retired{};  ///< kWelcome: retired_
  };
  /// What a reduction attempt ended with.
  enum class Outcome { kDone, kReform };

  Outcome reduce_once(std::span<float> data);
  /// The leader, a sum done: takes in the ranks that asked (and are live), telling the members and them.
  bool admit_joiners(std::span<const float> sum);
  /// Re-forms the group; true when `data` got the sum this rank missed (the call is done).
  Result<bool> reform(std::span<float> data);
  void send(int to, Kind kind, uint32_t epoch, uint64_t seq, std::span<const float> floats, bool has = false,
            std::span<const int> ranks = {}, std::span<const int64_t> tally = {});
  /// kSumGrow (to a member) or kWelcome (to a joiner) of the sum just made
  /// (`after` false), or kWelcome after it was counted (send_welcome).
  void send_grown(int to, Kind kind, std::span<const float> sum, std::span<const int> ranks,
                  std::span<const std::byte> state = {}, bool after = false);
  void on_message(int from, std::span<const std::byte> payload);
  bool lost(int rank) const;
  /// How many times a new process joined as `rank` (Communicator::joined_ranks: in a lost rank's place, or new).
  size_t joins_of(int rank) const;
  /// `rank` becomes a member now: later joins as it are another process.
  void note_member(int rank);
  /// A member lost, or replaced by a new process since it became one (not yet taken in).
  bool gone(int rank) const;
  /// A new process is taken in as `rank`: what the last one there trained up to its last sum is counted apart.
  void retire(int rank);
  /// The members that made the sum just done had trained `tally` (in members_' order).
  void count(std::span<const int64_t> tally);
  static int64_t at(const std::vector<int64_t>& by_rank, int rank) {
    return rank >= 0 && static_cast<size_t>(rank) < by_rank.size() ? by_rank[static_cast<size_t>(rank)] : 0;
  }
  /// Under lock: the first queued message that `match` accepts, removed; false if none.
  template <typename Match>
  bool take_locked(Message& out, Match&& match);
  /// Under lock: whether a message asks for a re-forming beyond the current epoch (and which epoch).
  bool reform_asked_locked(uint32_t& epoch) const;

  comm::Communicator& comm_;
  const comm::Channel channel_;
  const double peer_timeout_s_;

  std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<Message> inbox_;  ///< under mutex_
  bool closed_ = false;        ///< under mutex_: close() was called

  // Training thread.
  std::vector<int> members_;
  std::vector<size_t> since_;  ///< per rank: joins_of(rank) when it became a member (grows with the world)
  uint32_t epoch_ = 0;
  uint64_t seq_ = 0;  ///< sums completed
  std::vector<float> last_;
  bool has_last_ = false;
  uint32_t target_epoch_ = 0;  ///< a re-forming asked for this epoch
  size_t last_sum_members_ = 0;
  std::vector<int> last_sum_ranks_;
  std::vector<int> grow_to_;  ///< the members after the sum under way (kSumGrow), empty: as they are
  std::function<std::vector<std::byte>()> welcome_;
  bool welcome_later_ = false;
  std::vector<int> welcome_due_;     ///< the leader, welcome_later: joiners taken in at the last sum
  int64_t samples_ = 0;              ///< this process's, as all_reduce_sum was last told
  std::vector<int64_t> tally_;       ///< the sum under way's, once made or received (members_' order)
  std::vector<int64_t> reconciled_;  ///< by rank: see reconciled_samples()
  std::vector<int64_t> retired_;     ///< by rank: see retired_samples()
};

}  // namespace cfmo::train::modes
