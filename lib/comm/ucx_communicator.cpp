#include "comm/ucx_communicator.h"

#include "comm/collectives.h"
#include "comm/communicator_base.h"
#include "comm/silence_clock.h"
#include "core/fd.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace cfmo::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Tag layout: channel (8 bits) | source rank (24 bits) | sequence (32 bits).
// Channel 0 carries collectives, 0xFF heartbeats.
constexpr uint8_t kCollective = 0;
constexpr uint8_t kHeartbeat = 0xFF;
constexpr uint8_t kGoodbye = 0xFE;  // a rank is leaving on purpose: its disconnect is not a failure
// Joins: [u8 kRejoinedNote][u32 rank][its address] the leader to the others (a rank past the
// world's end: it grows), [u8 kJoinAck][u32 rank] back.
constexpr uint8_t kMembership = 0xFD;
constexpr uint8_t kRejoinedNote = 1;
constexpr uint8_t kJoinAck = 2;
static_assert(kLastClientChannel < kMembership);
constexpr ucp_tag_t kChannelMask = ucp_tag_t{0xFF} << 56;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// Collective messages up to this size are sent eagerly (see post_send).
constexpr size_t kEagerCollectiveBytes = 64 * 1024;
// How long each waiting thread spins, yielding, before it sleeps.
constexpr auto kWaitSpin = std::chrono::microseconds(50);   // the caller of a collective, without news
constexpr auto kIdleSpin = std::chrono::microseconds(100);  // the progress thread after traffic
// How long the progress thread naps while a collective's caller has the
// worker: at first, then at most (doubling while the collective lasts).
constexpr auto kCallerNap = std::chrono::microseconds(200);
constexpr auto kCallerNapMax = std::chrono::microseconds(3200);
// How long a sleeping thread waits for an event before it looks anyway (UCX
// does not promise one for everything): the caller of a collective and the
// progress thread after traffic; the progress thread doubles it, up to the
// most, while it finds nothing.
constexpr auto kEventWait = std::chrono::microseconds(200);
constexpr auto kEventWaitMax = std::chrono::microseconds(3200);

ucp_tag_t make_tag(uint8_t channel, int source, uint32_t sequence) {
  return (ucp_tag_t{channel} << 56) | (ucp_tag_t{static_cast<uint32_t>(source) & 0xFFFFFF} << 32) | sequence;
}
int tag_source(ucp_tag_t tag) { return static_cast<int>((tag >> 32) & 0xFFFFFF); }

// Each UCX handle has one owner, which frees it when it goes.
struct UcpConfigRelease {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
using UcpConfig = std::unique_ptr<ucp_config_t, UcpConfigRelease>;
struct UcpCleanup {
  void operator()(ucp_context_h context) const { ucp_cleanup(context); }
};
using UcpContext = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, UcpCleanup>;
struct UcpWorkerDestroy {
  void operator()(ucp_worker_h worker) const { ucp_worker_destroy(worker); }
};
using UcpWorker = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, UcpWorkerDestroy>;
/// A worker's own address, released back to the worker that gave it.
struct UcpAddressRelease {
  ucp_worker_h worker = nullptr;
  void operator()(ucp_address_t* address) const { ucp_worker_release_address(worker, address); }
};
using UcpAddress = std::unique_ptr<ucp_address_t, UcpAddressRelease>;

/// A request a non-blocking UCX call handed back (null: none, the call
/// completed at once), freed when it goes. Freeing one still in flight lets
/// UCX finish it and then drop it; a caller that must not wait for that
/// cancels it first. Every request goes before the worker it belongs to.
class UcpRequest {
 public:
  UcpRequest() = default;
  explicit UcpRequest(void* request) : request_(request) {}
  UcpRequest(UcpRequest&& other) noexcept : request_(std::exchange(other.request_, nullptr)) {}
  UcpRequest& operator=(UcpRequest&& other) noexcept {
    if (this != &other) {
      reset();
      request_ = std::exchange(other.request_, nullptr);
    }
    return *this;
  }
  UcpRequest(const UcpRequest&) = delete;
  UcpRequest& operator=(const UcpRequest&) = delete;
  ~UcpRequest() { reset(); }

  void* get() const { return request_; }
  explicit operator bool() const { return request_ != nullptr; }
  ucs_status_t status() const { return ucp_request_check_status(request_); }
  bool in_flight() const { return request_ != nullptr && status() == UCS_INPROGRESS; }
  void reset() {
    if (request_ != nullptr) ucp_request_free(std::exchange(request_, nullptr));
  }

 private:
  void* request_ = nullptr;
};

/// An endpoint to one peer, closed when it goes. close() starts the close,
/// flushing what was sent or at once (`force`), and hands back the request to
/// progress; an endpoint still open when it goes is force-closed and its
/// request freed, which lets UCX finish it. Endpoints go before their worker.
class UcpEndpoint {
 public:
  UcpEndpoint() = default;
  explicit UcpEndpoint(ucp_ep_h endpoint) : endpoint_(endpoint) {}
  UcpEndpoint(UcpEndpoint&& other) noexcept : endpoint_(std::exchange(other.endpoint_, nullptr)) {}
  UcpEndpoint& operator=(UcpEndpoint&& other) noexcept {
    if (this != &other) {
      close(true);
      endpoint_ = std::exchange(other.endpoint_, nullptr);
    }
    return *this;
  }
  UcpEndpoint(const UcpEndpoint&) = delete;
  UcpEndpoint& operator=(const UcpEndpoint&) = delete;
  ~UcpEndpoint() { close(true); }

  ucp_ep_h get() const { return endpoint_; }
  explicit operator bool() const { return endpoint_ != nullptr; }

  /// Closes the endpoint; the close's request, empty when it finished (or
  /// failed) at once or the endpoint was closed already.
  UcpRequest close(bool force) {
    if (endpoint_ == nullptr) return {};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(std::exchange(endpoint_, nullptr), &param);
    if (request == nullptr || UCS_PTR_IS_ERR(request)) return {};
    return UcpRequest(request);
  }

 private:
  ucp_ep_h endpoint_ = nullptr;
};

/// This host's name, for the address a leader away from the rendezvous host serves joins at.
std::string host_name() {
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0) return "localhost";
  return name.data();
}

Error ucx_error(std::string_view what, ucs_status_t status) {
  return make_error(ErrorKind::kPeer, "UCX: {}: {}", what, ucs_status_string(status));
}

/// An operation in flight and what it keeps alive until it completes.
struct Pending {
  UcpRequest request;
  int peer = -1;
  std::vector<std::byte> payload;  ///< a send's bytes, or a probed receive's buffer
  uint8_t channel = 0;             ///< for probed receives: whose handler gets it
  bool is_receive = false;
  uint32_t incarnation = 0;  ///< of `peer`: a failure of an earlier one (before a join) is not the new one's
};

/// A UCP context and worker, made before the rendezvous: the worker's
/// address is what the rendezvous carries, and a joining process learns its
/// rank only from it.
struct UcxWorker {
  UcpContext context;  ///< declared before the worker: the worker goes first
  UcpWorker worker;
  int worker_fd = -1;
  std::vector<std::byte> address;
};

/// The transports between ranks of one host, unless the user named them
/// (UCX_TLS): TCP for messages (loopback here) and CMA for large ones, not
/// UCX's shared-memory FIFOs (posix, sysv). Those give each process ONE
/// receive FIFO that all its local senders write into, in order: a sender
/// killed between taking an element and marking it written leaves the
/// receiver deaf to every sender from then on, and it takes live ranks for
/// lost (tests/unit/test_comm_ucx.cpp, UcxKilledSender). A killed sender's
/// TCP connection is its own, and the kernel resets it at once. What that
/// costs against the FIFOs is in bench/RESULTS.md (issue 16's shm-deaf).
///
/// UCX 1.13 also keeps CMA, and the FIFOs where a user names them, away
/// from endpoints that ask for peer error handling unless told they may
/// claim them: CMA cannot invalidate a registration, the FIFOs have no
/// failure reporting of their own. Peer failure is still seen: TCP's reset
/// and UCX's keepalive, and the heartbeats here mark a silent peer lost.
/// CMA's rendezvous has the receiver read the sender's buffer (get), so a
/// peer found lost can at most read a send buffer of this rank, never write
/// into its memory. A UCX_* variable the user set wins.
///
/// A run that ends at its first loss (UcxOptions::fifos) keeps the FIFOs.
void choose_transports(ucp_config_t* config, bool fifos) {
  const auto user_set = [](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(), [](const char* n) { return std::getenv(n) != nullptr; });
  };
  // Every transport UCX finds (InfiniBand across hosts too) but the FIFOs.
  if (!fifos && !user_set({"UCX_TLS"})) ucp_config_modify(config, "TLS", "^posix,sysv");
  // For a user who names posix or sysv in UCX_TLS, knowing the risk above.
  if (!user_set({"UCX_MM_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_POSIX_ERROR_HANDLING"})) {
    ucp_config_modify(config, "MM_ERROR_HANDLING", "y");  // unknown to another UCX: ignored
  }
  // CMA's memory domain reads its options without the CMA_ prefix.
  if (!user_set({"UCX_CMA_MEMORY_INVALIDATE"})) ucp_config_modify(config, "MEMORY_INVALIDATE", "y");
  // A peer that died without a reset (a host gone, a cut link; a local one
  // over the FIFOs) is seen by that keepalive every 20 s by default: every
  // second instead.
  if (!user_set({"UCX_KEEPALIVE_INTERVAL"})) ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
}

Result<UcxWorker> open_worker(bool fifos) {
  // UCX logs to stdout, where --json goes; unless the user asked for UCX's
  // own logging, keep only its errors (they still name the transport).
  if (std::getenv("UCX_LOG_LEVEL") == nullptr) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_ERROR;
  ucp_config_t* read_config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &read_config);
  if (status != UCS_OK) return ucx_error("reading the UCX configuration", status);
  const UcpConfig config(read_config);
  choose_transports(config.get(), fifos);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  UcxWorker out;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config.get(), &context);
  if (status != UCS_OK) return ucx_error("ucp_init", status);
  out.context.reset(context);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Created here, then used by the progress thread or by the caller of a
  // collective, whichever holds worker_mutex_: serialized, never concurrent.
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  status = ucp_worker_create(out.context.get(), &worker_params, &worker);
  if (status != UCS_OK) return ucx_error("ucp_worker_create", status);
  out.worker.reset(worker);
  if (ucp_worker_get_efd(worker, &out.worker_fd) != UCS_OK) out.worker_fd = -1;  // then the thread polls

  ucp_address_t* got_address = nullptr;
  size_t address_length = 0;
  status = ucp_worker_get_address(worker, &got_address, &address_length);
  if (status != UCS_OK) return ucx_error("ucp_worker_get_address", status);
  const UcpAddress address(got_address, UcpAddressRelease{worker});
  const auto* address_bytes = reinterpret_cast<const std::byte*>(address.get());
  out.address.assign(address_bytes, address_bytes + address_length);
  return out;
}

class UcxCommunicator final : public CommunicatorBase {
 public:
  UcxCommunicator(int rank, int size, UcxOptions options, UcxWorker opened, bool joined)
      : CommunicatorBase(rank, size),
        rank_(rank),
        size_(size),
        joined_(joined),
        options_(options),
        context_(std::move(opened.context)),
        worker_(std::move(opened.worker)),
        worker_fd_(opened.worker_fd),
        silence_(size, std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.heartbeat_s)),
                 Clock::now()),
        starting_world_(*this, rank, size),
        collectives_(starting_world_) {
    incarnation_.assign(static_cast<size_t>(size), 0);
    current_context_.assign(static_cast<size_t>(size), nullptr);
  }

  ~UcxCommunicator() override { shutdown(); }

  /// Connects to every peer of `met` (the rendezvous' table) but the lost
  /// ones, and starts the progress thread and the join service (which
  /// serves while this rank leads: the lowest live rank). `rendezvous` is
  /// where joiners come: rank 0's listener, until rank 0 is lost.
  Status connect(Rendezvous& met, const RendezvousConfig& rendezvous) {
    endpoints_.clear();
    endpoints_.resize(static_cast<size_t>(size_));
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      if (peer < static_cast<int>(met.lost.size()) && met.lost[static_cast<size_t>(peer)]) {
        peers_.mark_lost(peer, "lost before this rank joined");
        continue;
      }
      CFMO_TRY(open_endpoint(peer, met.addresses[static_cast<size_t>(peer)]));
    }
    wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    silence_.reset(Clock::now());
    // The table before the progress thread starts: a membership note it
    // handles at once (a second joiner admitted while this one connects)
    // writes its entry there.
    addresses_ = std::move(met.addresses);
    description_ = rendezvous.description;
    join_host_ = rendezvous.host;
    join_port_ = rendezvous.port;
    grow_ = rendezvous.grow;
    first_size_ = met.first_size;
    progress_thread_ = std::thread([this] { progress_loop(); });
    if (met.listener) {
      join_listener_ = std::move(met.listener);
      std::lock_guard lock(join_mutex_);
      join_address_ = fmt::format("{}:{}", join_host_, join_port_);
    }
    join_thread_ = std::thread([this] { join_loop(); });
    return {};
  }

  bool joined() const override { return joined_; }
  std::string join_address() const override {
    std::lock_guard lock(join_mutex_);
    return join_address_;
  }
  void close_joins() override { joins_closed_ = true; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // The collectives are of the world this process started in: a rank that
  // came later takes part in none (its joiner's sequence is not theirs).
  Status all_reduce_sum(std::span<float> data) override {
    if (starting_world_.size() == 1) return {};
    return run_collective([this, data] { return collectives_.all_reduce_sum(data); });
  }

  Status all_to_all_v(const std::vector<std::span<const std::byte>>& send,
                      const std::vector<std::span<std::byte>>& recv) override {
    return run_collective([this, &send, &recv] { return collectives_.all_to_all_v(send, recv); });
  }

  Status barrier() override {
    if (starting_world_.size() == 1) return {};
    return run_collective([this] { return collectives_.barrier(); });
  }

  void post(int peer, Channel channel, std::vector<std::byte> payload) override {
    if (peer == rank_) {
      // To itself: straight to the handler, on the progress thread like any message.
      enqueue(
          [this, channel, payload = std::move(payload)]() mutable { handlers_.deliver(rank_, channel.id, payload); });
      return;
    }
    if (std::this_thread::get_id() == progress_thread_.get_id()) {
      send_now(peer, channel.id, 0, std::move(payload));
      return;
    }
    enqueue([this, peer, channel, payload = std::move(payload)]() mutable {
      send_now(peer, channel.id, 0, std::move(payload));
    });
  }

 private:
  // A joiner's exchange with the join service, from its hello to its table.
  static constexpr double kJoinTimeoutS = 10;
  // A tag has 24 bits for the source rank.
  static constexpr int kMaxRank = (1 << 24) - 1;

  struct ErrorContext {
    UcxCommunicator* self = nullptr;
    int peer = -1;
  };

  friend class StartingWorld<UcxCommunicator>;

  static void on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* context = static_cast<ErrorContext*>(arg);
    // An endpoint to an earlier process in that rank's place (before a join): not the peer's.
    if (context->self->current_context_[static_cast<size_t>(context->peer)] != context) return;
    context->self->mark_lost(context->peer, fmt::format("connection error: {}", ucs_status_string(status)));
  }

  void mark_lost(int peer, std::string why) { peers_.mark_lost(peer, std::move(why)); }
  bool departed(int peer) const { return peers_.departed(peer); }
  bool is_lost(int peer) const { return peers_.is_lost(peer); }

  /// Opens the endpoint to `peer` at `address` (again after a join: a new process in its place).
  Status open_endpoint(int peer, const std::vector<std::byte>& address) {
    const auto p = static_cast<size_t>(peer);
    ErrorContext& context = error_contexts_.emplace_back(ErrorContext{this, peer});
    current_context_[p] = &context;
    ucp_ep_params_t ep_params{};
    ep_params.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &UcxCommunicator::on_endpoint_error;
    ep_params.err_handler.arg = &context;
    ucp_ep_h endpoint = nullptr;
    const ucs_status_t status = ucp_ep_create(worker_.get(), &ep_params, &endpoint);
    if (status != UCS_OK) return ucx_error(fmt::format("connecting to rank {}", peer), status);
    endpoints_[p] = UcpEndpoint(endpoint);
    return {};
  }

  // ---- joins: on the thread that holds the worker, but for the join service's own thread ----

  /// A new process took `peer`'s place at `address`: the old endpoint goes
  /// (what it still had in flight fails without blaming the new process),
  /// the new one comes, and the peer is live again.
  void take_rejoined(int peer, const std::vector<std::byte>& address) {
    grow_to(peer + 1);
    const auto p = static_cast<size_t>(peer);
    ++incarnation_[p];
    current_context_[p] = nullptr;
    force_close(peer);
    if (Status opened = open_endpoint(peer, address); !opened) {
      mark_lost(peer, opened.error().message);
      return;
    }
    silence_.heard(peer, Clock::now());
    peers_.rejoined(peer);
    std::lock_guard lock(join_mutex_);
    addresses_[p] = address;  // should this rank come to lead: the table a joiner gets
  }

  /// The world grew to `size` ranks (a join with no rank lost): the peer
  /// tables first, then the health's, then the size others read, so that
  /// any rank below size() is known everywhere here. Ranks between the old
  /// size and the new one's last (notes this rank never got: cannot happen
  /// over one ordered link, but never index past a table) start lost.
  void grow_to(int size) {
    const int before = size_.load();
    if (size <= before) return;
    const auto n = static_cast<size_t>(size);
    endpoints_.resize(n);
    silence_.grow(size, Clock::now());
    incarnation_.resize(n, 0);
    current_context_.resize(n, nullptr);
    {
      std::lock_guard lock(join_mutex_);
      addresses_.resize(n);
    }
    peers_.grow(size);
    for (int r = before; r < size - 1; ++r) peers_.mark_lost(r, "joined while this rank did not hear of it");
    size_.store(size);
  }

  static std::vector<std::byte> membership_note(uint8_t kind, int rank, std::span<const std::byte> address = {}) {
    std::vector<std::byte> out(5 + address.size());
    out[0] = static_cast<std::byte>(kind);
    const auto who = static_cast<uint32_t>(rank);
    std::memcpy(out.data() + 1, &who, 4);
    if (!address.empty()) std::memcpy(out.data() + 5, address.data(), address.size());
    return out;
  }

  void on_membership(int from, const std::vector<std::byte>& m) {
    if (m.size() < 5) return;
    uint32_t who = 0;
    std::memcpy(&who, m.data() + 1, 4);
    // A rank past the end is a new one: the world grows (the leader's notes come in order).
    if (who > static_cast<uint32_t>(std::min(kMaxRank, size_.load() + 1024)) || static_cast<int>(who) == rank_) return;
    const auto kind = static_cast<uint8_t>(m[0]);
    // From the leader (the lowest live rank as it saw it: rank 0 until lost).
    if (kind == kRejoinedNote) {
      take_rejoined(static_cast<int>(who), std::vector<std::byte>(m.begin() + 5, m.end()));
      send_now(from, kMembership, 0, membership_note(kJoinAck, static_cast<int>(who)));
    } else if (kind == kJoinAck) {
      {
        std::lock_guard lock(join_mutex_);
        join_acks_.push_back(from);
      }
      join_cv_.notify_all();
    }
  }

  /// The lowest live rank (this one, if every lower rank is lost).
  int leader() const {
    for (int r = 0; r < rank_; ++r) {
      if (!is_lost(r)) return r;
    }
    return rank_;
  }

  /// The join service, while this rank leads: one process at a time, until
  /// this rank shuts down. Rank 0 serves on the rendezvous socket; a rank
  /// that comes to lead (rank 0 lost) listens at the rendezvous address
  /// itself where it can (that host's address: the local launcher's, a
  /// single host's run), else at the rendezvous port on every interface of
  /// its own host (join_address says which).
  void join_loop() {
    pthread_setname_np(pthread_self(), "cfmo-join");
    JoinHooks hooks;
    hooks.decide = [this](int rank, int size) { return decide_join(rank, size); };
    hooks.admit = [this](int rank, const std::vector<std::byte>& address) { return admit(rank, address); };
    auto tried = Clock::now() - std::chrono::seconds(1);
    while (!join_stop_.load()) {
      if (!join_listener_) {
        if (leader() != rank_ || peers_.stopping() || Clock::now() - tried < std::chrono::seconds(1)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          continue;
        }
        tried = Clock::now();
        // The port stays taken a moment after rank 0's process died: tried again each second.
        for (const std::string& host : {join_host_, std::string()}) {
          if (auto bound = listen_tcp(host, join_port_)) {
            join_listener_ = Fd(bound->first);
            std::lock_guard lock(join_mutex_);
            join_address_ = host.empty() ? fmt::format("{}:{}", host_name(), join_port_)
                                         : fmt::format("{}:{}", join_host_, join_port_);
            break;
          }
        }
        continue;
      }
      pollfd p{join_listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const Fd s(::accept4(join_listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (s.get() < 0) continue;
      // What goes wrong with one joiner concerns it alone: the run goes on.
      [[maybe_unused]] const Status served =
          serve_join(s.get(), size_.load(), first_size_, description_, hooks, kJoinTimeoutS);
    }
  }

  /// A joiner takes a lost rank above the leader's (this one's): the
  /// keeper's duties (the budget, checkpoints, the final model: the lowest
  /// live rank's) never move to a new process that knows nothing of them.
  /// With none lost, a run that may grow takes it as a new rank W (of W + 1).
  /// One join at a time (this thread serves them in turn), so two joiners
  /// never get the same rank.
  JoinHooks::Decision decide_join(int rank, int size) const {
    const int world = size_.load();
    if (size != 0 && size != world) {
      return {-1, fmt::format("the run has {} ranks; this process was started for {}", world, size), false};
    }
    if (peers_.stopping() || join_stop_.load() || joins_closed_.load()) {
      return {-1, "the run is ending", false, 0, /*ended=*/true};
    }
    // A rank below this one is lost (this is the lowest live rank): restarted
    // with its command, it takes a free place as any joiner does.
    if (rank == kAnyRank || (rank >= 0 && rank < rank_ && is_lost(rank))) {
      for (int r = rank_ + 1; r < world; ++r) {
        if (is_lost(r)) return {r, {}, true};
      }
      if (grow_ && world < kMaxRank) return {world, {}, true, world + 1};
      return {-1, fmt::format("no rank is free: all {} ranks are alive", world), true};
    }
    if (rank <= rank_ || rank >= world) {
      return {-1,
              fmt::format("rank {} cannot join a run of {} ranks whose rank {} serves the joins", rank, world, rank_),
              false};
    }
    if (!is_lost(rank)) return {-1, fmt::format("rank {} is still alive in the run", rank), true};
    return {rank, {}, true};
  }

  /// Takes the joiner in as `rank` here and at every live peer (each answers
  /// once it has; a peer lost meanwhile is not waited for), then gives it
  /// every rank's address and which are lost.
  Result<std::pair<std::vector<std::vector<std::byte>>, std::vector<bool>>> admit(
      int rank, const std::vector<std::byte>& address) {
    {
      std::lock_guard lock(join_mutex_);
      join_acks_.clear();
    }
    auto told = std::make_shared<std::promise<std::vector<int>>>();
    auto told_future = told->get_future();
    enqueue([this, rank, address, told] {
      take_rejoined(rank, address);
      std::vector<int> peers;
      const auto note = membership_note(kRejoinedNote, rank, address);
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_ || peer == rank || is_lost(peer) || departed(peer)) continue;
        send_now(peer, kMembership, 0, note);
        peers.push_back(peer);
      }
      told->set_value(std::move(peers));
    });
    const auto deadline = Clock::now() + std::chrono::duration<double>(options_.peer_timeout_s + 2);
    while (told_future.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
      if (join_stop_.load() || Clock::now() > deadline) {
        return make_error(ErrorKind::kPeer, "rank {} could not take rank {} in", rank_, rank);
      }
    }
    const std::vector<int> peers = told_future.get();
    {
      std::unique_lock lock(join_mutex_);
      join_cv_.wait_until(lock, deadline, [&] {
        return join_stop_.load() || std::all_of(peers.begin(), peers.end(), [&](int p) {
                 return is_lost(p) || std::find(join_acks_.begin(), join_acks_.end(), p) != join_acks_.end();
               });
      });
    }
    const int world = size_.load();
    std::vector<bool> lost(static_cast<size_t>(world), false);
    for (int r = 0; r < world; ++r) lost[static_cast<size_t>(r)] = r != rank && is_lost(r);
    std::lock_guard lock(join_mutex_);
    return std::pair{addresses_, lost};
  }

  void enqueue(std::function<void()> command) {
    {
      std::lock_guard lock(queue_mutex_);
      commands_.push_back(std::move(command));
      queued_.store(true);
    }
    wake();
  }

  /// Wakes the thread that holds the worker if it sleeps (or is about to):
  /// it counts itself in `sleeping_` before it looks at the queue a last
  /// time, and this is called after queueing, so one of the two sees the other.
  void wake() {
    if (sleeping_.load() == 0) return;
    const uint64_t one = 1;
    if (wake_fd_) [[maybe_unused]]
      auto n = ::write(wake_fd_.get(), &one, sizeof one);
  }

  /// Runs `body` on the caller's thread, which takes the worker over from
  /// the progress thread until the collective is done. Handing the
  /// collective to the progress thread instead costs two wake-ups per call
  /// (the progress thread's, then the caller's), most of a small
  /// all-to-all's time (figures in bench/RESULTS.md, "The collectives over
  /// point-to-point"); Open MPI's caller, too, progresses its own transfers. Meanwhile the
  /// progress thread sleeps, and what it would have done (messages for the
  /// channels' handlers, queued sends, heartbeats) is done by the caller's
  /// waits, so handlers then run on the caller's thread, still one at a time.
  Status run_collective(const std::function<Status()>& body) {
    CFMO_TRY(health());
    std::lock_guard one_at_a_time(collective_call_mutex_);
    const auto start = Clock::now();
    // The progress thread lets go of the worker at its next turn and naps
    // until this flag drops; if it sleeps, it does not hold the worker. The
    // flag drops however the body ends (an exception too), and without a
    // wake-up: the progress thread sees it within a nap. Waking it cost a
    // context switch per collective, and between two collectives back to
    // back (a barrier, then an all-to-all) it then held the worker when the
    // second one's caller wanted it.
    struct Active {
      std::atomic<bool>& flag;
      explicit Active(std::atomic<bool>& f) : flag(f) { flag.store(true); }
      ~Active() { flag.store(false); }
    };
    Status result;
    {
      const Active active(caller_active_);
      std::lock_guard worker(worker_mutex_);
      result = body();
    }
    add_collective_wait(std::chrono::duration<double>(Clock::now() - start).count());
    return result;
  }

  // ---- everything below runs on the thread that holds worker_mutex_ ----

  void send_now(int peer, uint8_t channel, uint32_t sequence, std::vector<std::byte> payload) {
    if (is_lost(peer) || !endpoints_[static_cast<size_t>(peer)]) return;
    if (channel != kHeartbeat && channel != kGoodbye) {
      stats_bytes_sent_ += payload.size();
      ++stats_messages_sent_;
    }
    ucp_request_param_t param{};
    void* request = ucp_tag_send_nbx(endpoints_[static_cast<size_t>(peer)].get(), payload.data(), payload.size(),
                                     make_tag(channel, rank_, sequence), &param);
    if (request == nullptr) return;  // done already, the bytes were copied out
    if (UCS_PTR_IS_ERR(request)) {
      mark_lost(peer, fmt::format("send failed: {}", ucs_status_string(UCS_PTR_STATUS(request))));
      return;
    }
    pending_.push_back(Pending{UcpRequest(request), peer, std::move(payload), channel, false,
                               incarnation_[static_cast<size_t>(peer)]});
  }

  /// Probes for messages on channels that have a handler, starting their receives.
  bool probe_channels() {
    bool any = false;
    // Which channels to probe: this runs on every turn of the progress loop,
    // also while a collective waits, so the list is rebuilt only after a
    // handler changed.
    if (const uint64_t generation = handlers_.generation(); generation != probed_generation_) {
      probed_generation_ = generation;
      probed_.clear();
      for (int c = 1; c < 256; ++c) {
        const auto channel = static_cast<uint8_t>(c);
        if (handlers_.has(channel) || channel == kHeartbeat || channel == kGoodbye || channel == kMembership) {
          probed_.push_back(channel);
        }
      }
    }
    for (const uint8_t channel : probed_) {
      for (;;) {
        ucp_tag_recv_info_t info{};
        ucp_tag_message_h message = ucp_tag_probe_nb(worker_.get(), ucp_tag_t{channel} << 56, kChannelMask, 1, &info);
        if (message == nullptr) break;
        any = true;
        const int from = tag_source(info.sender_tag);
        silence_.heard(from, Clock::now());
        Pending p;
        p.peer = from;
        p.channel = channel;
        p.is_receive = true;
        p.payload.resize(info.length);
        ucp_request_param_t param{};
        ucp_tag_recv_info_t done_info{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
        param.recv_info.tag_info = &done_info;
        void* request = ucp_tag_msg_recv_nbx(worker_.get(), p.payload.data(), p.payload.size(), message, &param);
        if (UCS_PTR_IS_ERR(request)) continue;
        if (request == nullptr) {
          complete_receive(p);
        } else {
          p.request = UcpRequest(request);
          pending_.push_back(std::move(p));
        }
      }
    }
    return any;
  }

  void complete_receive(Pending& p) {
    if (p.peer < 0 || p.peer >= size_) return;  // a rank this one does not know yet: nobody could read it
    if (p.channel != kHeartbeat && p.channel != kGoodbye && p.channel != kMembership) {
      stats_bytes_received_ += p.payload.size();
      ++stats_messages_received_;
    }
    if (p.channel == kGoodbye) {
      peers_.on_goodbye(p.peer, p.payload);
    } else if (p.channel == kMembership) {
      on_membership(p.peer, p.payload);
    } else if (p.channel != kHeartbeat) {
      handlers_.deliver(p.peer, p.channel, p.payload);
    }
  }

  /// Retires finished sends and receives; returns true if any finished.
  bool retire_pending() {
    bool any = false;
    for (size_t i = 0; i < pending_.size();) {
      const ucs_status_t status = pending_[i].request.status();
      if (status == UCS_INPROGRESS) {
        ++i;
        continue;
      }
      any = true;
      // Out of the vector first: a handler run below may post, and so grow pending_.
      Pending p = std::move(pending_[i]);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
      p.request.reset();
      if (status == UCS_OK && p.is_receive) complete_receive(p);
      if (status != UCS_OK && status != UCS_ERR_CANCELED && p.peer >= 0 && p.peer < size_ &&
          p.incarnation == incarnation_[static_cast<size_t>(p.peer)]) {
        mark_lost(p.peer, fmt::format("transfer failed: {}", ucs_status_string(status)));
      }
    }
    return any;
  }

  void heartbeat() {
    const auto now = Clock::now();
    if (now - last_heartbeat_ >= std::chrono::duration<double>(options_.heartbeat_s)) {
      last_heartbeat_ = now;
      for (int peer = 0; peer < size_; ++peer) {
        if (peer != rank_) send_now(peer, kHeartbeat, 0, std::vector<std::byte>(1));
      }
    }
    // Silence is measured in seconds: looking every few milliseconds is enough.
    if (now - last_silence_check_ < std::chrono::milliseconds(5)) return;
    last_silence_check_ = now;
    // Counted in time this rank listened: a stall of its own (or of the
    // whole host) is no silence of its peers (comm/silence_clock.h).
    silence_.listened(now);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_ || departed(peer)) continue;
      const double silent = silence_.silent_s(peer);
      if (silent > options_.peer_timeout_s && !is_lost(peer)) {
        mark_lost(peer, fmt::format("no message for {:.1f}s", silent));
      }
    }
  }

  /// Runs the commands queued by other threads; true if there were any.
  bool run_commands() {
    if (!queued_.load(std::memory_order_acquire)) return false;
    {
      std::lock_guard lock(queue_mutex_);
      running_.swap(commands_);
      queued_.store(false);
    }
    for (auto& c : running_) c();
    const bool any = !running_.empty();
    running_.clear();
    return any;
  }

  /// One round of everything except starting a collective; true if work was done.
  bool service() {
    bool any = run_commands();
    while (ucp_worker_progress(worker_.get()) != 0) any = true;
    any |= probe_channels();
    any |= retire_pending();
    heartbeat();
    return any;
  }

  void progress_loop() {
    pthread_setname_np(pthread_self(), "cfmo-progress");
    auto nap = kCallerNap;
    // Every wake-up of a rank that waits costs a turn on a shared core: 4
    // ranks on 2 cores woken every 200 us spent a fifth of their CPU time
    // here (bench/RESULTS.md). Events still wake it at once.
    auto event_wait = kEventWait;
    while (!stop_thread_.load()) {
      if (caller_active_.load()) {
        std::this_thread::sleep_for(nap);  // the caller of a collective has the worker
        nap = std::min(nap * 2, kCallerNapMax);
        continue;
      }
      nap = kCallerNap;
      std::unique_lock worker(worker_mutex_);
      if (service()) {
        last_activity_ = Clock::now();
        event_wait = kEventWait;
        continue;
      }
      // Spin (yielding the core) for a moment after traffic: replies tend to
      // follow requests closely. Not longer: a yielding thread steals turns
      // from ranks that compute and reacts no faster on a busy host than one
      // that sleeps on UCX's event fd, which shared memory and TCP signal.
      if (Clock::now() - last_activity_ < kIdleSpin) {
        worker.unlock();
        std::this_thread::yield();
        continue;
      }
      idle_wait(&worker, event_wait);
      event_wait = std::min(event_wait * 2, kEventWaitMax);
    }
  }

  /// Sleeps until UCX or another thread has something, at most `wait` (UCX
  /// does not promise an event for every kind of progress a transport makes).
  /// The progress thread lets go of the worker while it sleeps (`worker`),
  /// the caller of a collective keeps it (null).
  void idle_wait(std::unique_lock<std::mutex>* worker = nullptr, std::chrono::microseconds wait = kEventWait) {
    sleeping_.fetch_add(1);
    struct Awake {
      std::atomic<int>& count;
      ~Awake() { count.fetch_sub(1); }
    } awake{sleeping_};
    if (queued_.load()) return;  // queued before the flag was up: no wake-up will come
    uint64_t drained = 0;
    if (wake_fd_) [[maybe_unused]]
      auto n = ::read(wake_fd_.get(), &drained, sizeof drained);
    if (queued_.load()) return;
    if (worker_fd_ >= 0 && ucp_worker_arm(worker_.get()) != UCS_OK) return;  // events pending: go round again
    if (worker != nullptr) worker->unlock();
    pollfd fds[2] = {{wake_fd_.get(), POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    const timespec timeout{0, static_cast<long>(std::chrono::nanoseconds(wait).count())};
    ::ppoll(fds, worker_fd_ >= 0 ? 2 : 1, &timeout, nullptr);
  }

  /// Ends the requests of a collective that cannot finish, before the
  /// caller's buffers go away. Cancelling ends the receives nothing matched
  /// yet, not a send or a receive under way: over UCX's shared-memory FIFOs
  /// (where UCX_TLS names them) nothing ever fails those when the peer died
  /// (UCX's keepalive takes a dead process that is not yet reaped for a live
  /// one), nor over a cut link before the keepalive, so the lost peer's endpoint is
  /// closed by force, which ends everything on it with an error. What still
  /// involves a live peer gets a second, then that endpoint is closed too:
  /// the run is failing, and no request should outlive its buffer. A receive
  /// that even that does not end (a message half arrived from a dead peer)
  /// is left to UCX after another second rather than hanging the caller.
  void abandon(std::vector<std::pair<UcpRequest, int>>& requests, int lost_peer) {
    for (auto& [r, peer] : requests) {
      if (r.in_flight()) ucp_request_cancel(worker_.get(), r.get());
    }
    force_close(lost_peer);
    const auto close_more = Clock::now() + std::chrono::seconds(1);
    const auto give_up = close_more + std::chrono::seconds(1);
    for (;;) {
      ucp_worker_progress(worker_.get());
      const auto open =
          std::find_if(requests.begin(), requests.end(), [&](const auto& rp) { return rp.first.in_flight(); });
      if (open == requests.end() || Clock::now() > give_up) break;
      if (Clock::now() > close_more) force_close(open->second);
    }
    for (auto& [r, peer] : requests) r.reset();
  }

  /// Closes the endpoint to `peer` at once, ending its requests with an error.
  void force_close(int peer) {
    const UcpRequest request = endpoints_[static_cast<size_t>(peer)].close(true);
    if (!request) return;
    const auto deadline = Clock::now() + std::chrono::seconds(1);  // a forced close needs no peer: bounded anyway
    while (request.in_flight() && Clock::now() < deadline) ucp_worker_progress(worker_.get());
    if (request.in_flight()) unclosed_endpoints_ = true;
  }

  /// Waits for `requests` (each with the peer it involves) while serving
  /// everything else; fails when a peer with a request still in flight is lost.
  Status wait_all(std::vector<std::pair<UcpRequest, int>>& requests, std::string_view what) {
    auto idle_since = Clock::now();
    for (;;) {
      bool done = true;
      int lost_peer = -1;
      for (auto& [r, peer] : requests) {
        if (!r.in_flight()) continue;
        done = false;
        if (is_lost(peer) || departed(peer)) lost_peer = peer;
      }
      if (done) break;
      if (lost_peer >= 0) {
        abandon(requests, lost_peer);
        return peers_.failure_of(what, lost_peer);
      }
      // Spin while the peers answer promptly, then sleep until UCX has
      // news (or 200 us pass), for the reason given in progress_loop.
      if (service()) {
        idle_since = Clock::now();
      } else if (Clock::now() - idle_since > kWaitSpin) {
        idle_wait();
      } else {
        std::this_thread::yield();
      }
    }
    Status result;
    for (auto& [r, peer] : requests) {
      if (!r) continue;
      const ucs_status_t status = r.status();
      r.reset();
      if (status != UCS_OK && result) {
        result = make_error(ErrorKind::kPeer, "{} with rank {}: {}", what, peer, ucs_status_string(status));
      }
    }
    return result;
  }

  void* post_recv(int peer, void* buffer, size_t bytes, uint32_t sequence) {
    ucp_request_param_t param{};
    ucp_tag_recv_info_t info{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
    param.recv_info.tag_info = &info;
    void* request =
        ucp_tag_recv_nbx(worker_.get(), buffer, bytes, make_tag(kCollective, peer, sequence), kFullMask, &param);
    if (UCS_PTR_IS_ERR(request)) {
      mark_lost(peer, fmt::format("receive failed: {}", ucs_status_string(UCS_PTR_STATUS(request))));
      return nullptr;
    }
    silence_.heard(peer, Clock::now());
    return request;
  }

  void* post_send(int peer, const void* buffer, size_t bytes, uint32_t sequence) {
    ucp_request_param_t param{};
    // A collective's mid-size messages go eagerly (copied through the
    // receiver's FIFO, UCX's protocol for sends that must complete fast)
    // instead of by rendezvous, whose request, reply and acknowledgement each
    // wait for the other rank to be scheduled: on a busy host that wait, not
    // the copy, is the cost. Larger ones go by rendezvous (between
    // ranks of one host, read in place over CMA: one copy).
    if (bytes <= kEagerCollectiveBytes) param.op_attr_mask |= UCP_OP_ATTR_FLAG_FAST_CMPL;
    if (!endpoints_[static_cast<size_t>(peer)]) {  // closed after a failure
      mark_lost(peer, "its endpoint was closed after a failure");
      return nullptr;
    }
    void* request = ucp_tag_send_nbx(endpoints_[static_cast<size_t>(peer)].get(), buffer, bytes,
                                     make_tag(kCollective, rank_, sequence), &param);
    if (UCS_PTR_IS_ERR(request)) {
      mark_lost(peer, fmt::format("send failed: {}", ucs_status_string(UCS_PTR_STATUS(request))));
      return nullptr;
    }
    stats_bytes_sent_ += bytes;
    return request;
  }

  /// The point-to-point seam under the collectives: receives and sends
  /// posted alternately (a receive before the send to the same step's peer).
  Status exchange(uint32_t tag, std::span<const SendTo> sends, std::span<const ReceiveFrom> receives,
                  std::string_view what) {
    std::vector<std::pair<UcpRequest, int>> requests;
    requests.reserve(sends.size() + receives.size());
    for (size_t i = 0; i < std::max(sends.size(), receives.size()); ++i) {
      if (i < receives.size()) {
        const ReceiveFrom& r = receives[i];
        requests.emplace_back(UcpRequest(post_recv(r.peer, r.into.data(), r.into.size(), tag)), r.peer);
        stats_bytes_received_ += r.into.size();
      }
      if (i < sends.size()) {
        const SendTo& t = sends[i];
        requests.emplace_back(UcpRequest(post_send(t.peer, t.bytes.data(), t.bytes.size(), tag)), t.peer);
      }
    }
    return wait_all(requests, what);
  }

  void shutdown() {
    join_stop_ = true;
    join_cv_.notify_all();
    if (join_thread_.joinable()) join_thread_.join();
    if (!progress_thread_.joinable()) {
      release();
      return;
    }
    // Goodbye first, on the same endpoints as everything this rank sent, so
    // peers see it after the last real message and before the disconnect.
    enqueue([this] {
      const std::vector<std::byte> payload = peers_.goodbye();
      for (int peer = 0; peer < size_; ++peer) {
        if (peer != rank_) send_now(peer, kGoodbye, 0, payload);
      }
    });
    const auto goodbye_deadline = Clock::now() + std::chrono::milliseconds(200);
    while (Clock::now() < goodbye_deadline) {
      {
        std::lock_guard lock(queue_mutex_);
        if (commands_.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    peers_.set_stopping();
    stop_thread_ = true;
    const uint64_t one = 1;
    if (wake_fd_) [[maybe_unused]]
      auto n = ::write(wake_fd_.get(), &one, sizeof one);
    progress_thread_.join();
    // What the progress thread did not get to (on a loaded host it may not
    // run within the wait above): the last posts (a report to the keeper)
    // and the goodbye still go, in order, rather than vanish with the queue.
    run_commands();
    // Let queued sends leave, briefly: peers are shutting down too.
    const auto deadline = Clock::now() + std::chrono::milliseconds(500);
    while (!pending_.empty() && Clock::now() < deadline) {
      ucp_worker_progress(worker_.get());
      retire_pending();
    }
    // Requests that did not finish (a peer that left without reading them)
    // are cancelled; their endpoints may still hold them: see release().
    if (!pending_.empty()) unclosed_endpoints_ = true;
    for (Pending& p : pending_) ucp_request_cancel(worker_.get(), p.request.get());
    pending_.clear();  // frees the requests
    discard_unexpected();
    release();
  }

  /// Receives and drops what arrived but nobody will read (late heartbeats,
  /// goodbyes), so UCX does not warn about unmatched messages at exit.
  void discard_unexpected() {
    for (int guard = 0; guard < 100000; ++guard) {
      ucp_worker_progress(worker_.get());
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h message = ucp_tag_probe_nb(worker_.get(), 0, 0, 1, &info);
      if (message == nullptr) return;
      std::vector<std::byte> sink(info.length);
      ucp_request_param_t param{};
      ucp_tag_recv_info_t done{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
      param.recv_info.tag_info = &done;
      void* receiving = ucp_tag_msg_recv_nbx(worker_.get(), sink.data(), sink.size(), message, &param);
      if (receiving == nullptr || UCS_PTR_IS_ERR(receiving)) continue;
      const UcpRequest request(receiving);
      while (request.in_flight()) ucp_worker_progress(worker_.get());
    }
  }

  void release() {
    // Flush-close live endpoints so the last messages reach their peers (a
    // forced close may drop bytes a peer is still waiting for); force-close
    // the lost ones. Bounded: a peer may be gone already.
    std::vector<UcpRequest> closing;
    for (size_t peer = 0; peer < endpoints_.size(); ++peer) {
      if (!endpoints_[peer]) continue;
      UcpRequest request = endpoints_[peer].close(is_lost(static_cast<int>(peer)));
      if (request) closing.push_back(std::move(request));
    }
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (worker_ != nullptr && Clock::now() < deadline &&
           std::any_of(closing.begin(), closing.end(), [](const UcpRequest& r) { return r.in_flight(); })) {
      ucp_worker_progress(worker_.get());
    }
    // After a failure UCX (1.13) can keep a force-closed endpoint, with
    // requests a dead peer will never answer, even once every close here
    // reported done: seen in cfmo-train's kill tests.
    bool unfinished = unclosed_endpoints_ || peers_.saw_failure();
    for (UcpRequest& r : closing) {
      if (r.in_flight()) {
        ucp_request_cancel(worker_.get(), r.get());
        unfinished = true;
      }
    }
    closing.clear();  // freed before the worker goes
    // An endpoint whose close did not finish (its peer died or left while a
    // send was still on it) still holds requests, and destroying the worker
    // under them aborts the process inside UCX (an assertion on proto_reqs
    // in ucp_ep_destroy_base, exit 134 in place of the documented 4). Then
    // the worker and context are left to the process's exit, let go of here
    // on purpose: a failing run loses nothing by it.
    if (worker_ != nullptr && !unfinished) {
      discard_unexpected();  // what arrived while the endpoints closed
      worker_.reset();       // before the context it came from
      context_.reset();
    } else {
      [[maybe_unused]] ucp_worker_h left_worker = worker_.release();
      [[maybe_unused]] ucp_context_h left_context = context_.release();
    }
    wake_fd_.reset();
  }

  const int rank_;
  std::atomic<int> size_;            ///< the world now: grows with joins (changed on the thread that holds the worker)
  const bool joined_;                ///< this rank joined a run under way
  bool unclosed_endpoints_ = false;  ///< a forced close that did not finish: see release()
  const UcxOptions options_;
  UcpContext context_;  ///< declared before the worker: the worker goes first
  UcpWorker worker_;
  std::vector<UcpEndpoint> endpoints_;          ///< after the worker: they go first
  std::deque<ErrorContext> error_contexts_;     ///< one per endpoint ever opened (their addresses stay)
  std::vector<ErrorContext*> current_context_;  ///< per peer: its endpoint's now
  std::vector<uint32_t> incarnation_;           ///< per peer: how many processes took its place (joins)
  int worker_fd_ = -1;
  Fd wake_fd_;

  std::thread progress_thread_;
  std::atomic<bool> stop_thread_{false};

  std::mutex queue_mutex_;  ///< guards commands_
  std::vector<std::function<void()>> commands_;
  std::atomic<bool> queued_{false};   ///< commands_ holds something
  std::atomic<int> sleeping_{0};      ///< threads that may be asleep with the worker: wake() writes the eventfd
  std::mutex collective_call_mutex_;  ///< one blocking collective at a time
  std::mutex worker_mutex_;           ///< held by whoever uses the worker: the progress thread or a collective's caller
  std::atomic<bool> caller_active_{false};      ///< a collective's caller has or wants the worker
  std::vector<std::function<void()>> running_;  ///< the commands being run

  // State of the thread that holds worker_mutex_.
  std::vector<Pending> pending_;
  std::vector<uint8_t> probed_;     ///< the channels probe_channels() looks at
  uint64_t probed_generation_ = 0;  ///< handlers_generation_ when probed_ was built
  Clock::time_point last_silence_check_{};
  SilenceClock silence_;  ///< each peer's silence, in time this rank listened
  Clock::time_point last_heartbeat_{};
  Clock::time_point last_activity_{};
  StartingWorld<UcxCommunicator> starting_world_;  ///< the ranks the collectives run among
  Collectives collectives_;                        ///< on the thread that holds worker_mutex_

  // The join service (its own thread, cfmo-join), serving while this rank leads.
  Fd join_listener_;  ///< join thread (rank 0's from the start)
  std::thread join_thread_;
  std::atomic<bool> join_stop_{false};
  std::atomic<bool> joins_closed_{false};          ///< close_joins: the run is ending
  std::vector<std::vector<std::byte>> addresses_;  ///< every rank's address now, under join_mutex_
  std::string description_;                        ///< what a joiner is shown
  std::string join_host_;                          ///< the rendezvous address, where joiners come
  uint16_t join_port_ = 0;
  bool grow_ = false;              ///< a join with no rank lost makes the world grow (RendezvousConfig::grow)
  int first_size_ = 0;             ///< the world's size when the run started: a joiner is told it
  std::string join_address_;       ///< under join_mutex_: where this rank serves joins, empty while it does not
  mutable std::mutex join_mutex_;  ///< guards join_acks_, addresses_, join_address_
  std::condition_variable join_cv_;
  std::vector<int> join_acks_;  ///< the peers that took up the join being admitted
};

}  // namespace

Result<std::unique_ptr<Communicator>> connect_ucx(int rank, int size, const RendezvousConfig& rendezvous,
                                                  const UcxOptions& options, int* first_size, bool* run_ended) {
  if (rank != kAnyRank && (size < 1 || rank < 0 || rank >= size)) {
    return make_error(ErrorKind::kUsage, "rank {} is not in a world of {} ranks", rank, size);
  }
  CFMO_ASSIGN_OR_RETURN(UcxWorker opened, open_worker(options.fifos));
  CFMO_ASSIGN_OR_RETURN(Rendezvous met, exchange_addresses(rendezvous, rank, size, opened.address));
  if (met.run_ended) {
    if (run_ended == nullptr) {
      return make_error(ErrorKind::kPeer, "the run at {}:{} ended as this process came", rendezvous.host,
                        rendezvous.port);
    }
    *run_ended = true;
    return std::unique_ptr<Communicator>();
  }
  if (first_size != nullptr) *first_size = met.first_size;
  auto comm = std::make_unique<UcxCommunicator>(met.rank, met.size, options, std::move(opened), met.joined);
  CFMO_TRY(comm->connect(met, rendezvous));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace cfmo::comm
