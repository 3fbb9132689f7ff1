// The UCX transport for real: several processes on this machine, over shared
// memory and over TCP on loopback, exchanging through the rendezvous; and
// the same contract over the in-process loopback transport (threads).
#include "comm/loopback.h"
#include "comm/rendezvous.h"
#include "comm/solo_communicator.h"
#include "comm/ucx_communicator.h"
#include "core/fd.h"

#include <ucp/api/ucp.h>

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

namespace cfmo::comm {
namespace {

constexpr Channel kTestChannel{8};

// How a rank of the loopback world dies mid-test (kill -9 for a process):
// set by run_ranks on each rank's thread.
thread_local std::function<void()> die_here;

// Ends the calling rank at once, without a word to the others.
bool die() {
  if (die_here) {
    die_here();
    return true;  // the rank's thread ends; its peers see a dead peer
  }
  _exit(0);
}

// The same bodies over the in-process loopback transport, a thread per rank.
std::vector<int> run_loopback_ranks(int size, const std::function<bool(Communicator&)>& body, UcxOptions options) {
  LoopbackOptions loopback;
  loopback.peer_timeout_s = options.peer_timeout_s;
  auto world = make_loopback_world(size, loopback);
  std::vector<int> codes(static_cast<size_t>(size), 0);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto& comm = world.ranks[static_cast<size_t>(rank)];
      die_here = [&] { world.network->kill(rank); };
      const bool ok = body(*comm);
      comm.reset();  // leave properly: goodbye
      codes[static_cast<size_t>(rank)] = ok ? 0 : 11;
    });
  }
  for (auto& t : threads) t.join();
  return codes;
}

// Runs `body(comm)` in `size` forked processes and returns their exit codes
// ("loopback": in threads over the loopback transport, with exit codes alike).
// A child exits 0 when body returns true; failures print their reason.
std::vector<int> run_ranks(int size, const std::string& tls, const std::function<bool(Communicator&)>& body,
                           UcxOptions options = {}, const std::function<void(int)>& before = nullptr) {
  if (tls == "loopback") return run_loopback_ranks(size, body, options);
  auto listener = listen_tcp("127.0.0.1", 0);
  EXPECT_TRUE(listener) << listener.error().message;
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (!tls.empty()) setenv("UCX_TLS", tls.c_str(), 1);
      if (rank != 0) close(listener->first);
      if (before) before(rank);
      RendezvousConfig config;
      config.port = listener->second;
      config.listen_fd = rank == 0 ? listener->first : -1;
      config.timeout_s = 30;
      auto comm = connect_ucx(rank, size, config, options);
      if (!comm) {
        fprintf(stderr, "rank %d: %s\n", rank, comm.error().message.c_str());
        _exit(10);
      }
      const bool ok = body(**comm);
      comm->reset();  // leave properly: goodbye, flush, close
      fflush(stderr);
      _exit(ok ? 0 : 11);
    }
    children.push_back(pid);
  }
  close(listener->first);
  std::vector<int> codes;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

class UcxTransports : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxTransports, RingAllReduceSumsForOddSizesAndRankCounts) {
  for (int size : {2, 3, 4}) {
    SCOPED_TRACE(size);
    auto codes = run_ranks(size, GetParam(), [size](Communicator& comm) {
      for (size_t n : {size_t{1}, size_t{2}, size_t{7}, size_t{1001}, size_t{100003}}) {
        std::vector<float> data(n);
        for (size_t i = 0; i < n; ++i) data[i] = static_cast<float>(comm.rank() + 1) * static_cast<float>(i % 97);
        if (auto status = comm.all_reduce_sum(data); !status) {
          fprintf(stderr, "rank %d: %s\n", comm.rank(), status.error().message.c_str());
          return false;
        }
        const float factor = static_cast<float>(size * (size + 1) / 2);
        for (size_t i = 0; i < n; ++i) {
          if (data[i] != factor * static_cast<float>(i % 97)) {
            fprintf(stderr, "rank %d: n=%zu element %zu = %g\n", comm.rank(), n, i, data[i]);
            return false;
          }
        }
      }
      auto status = comm.barrier();
      if (!status) fprintf(stderr, "rank %d: barrier: %s\n", comm.rank(), status.error().message.c_str());
      return static_cast<bool>(status);
    });
    for (int code : codes) EXPECT_EQ(code, 0);
  }
}

TEST_P(UcxTransports, NobodyLeavesABarrierBeforeEveryRankEnteredIt) {
  for (int size : {2, 3, 5}) {  // dissemination rounds: 1, 2, 3 (5 is no power of two)
    SCOPED_TRACE(size);
    auto codes = run_ranks(size, GetParam(), [](Communicator& comm) {
      // Rank r enters r * 50 ms late; then every rank learns when each one
      // entered (the monotonic clock is the same for every process of the
      // host) and checks that it left after the last of them.
      std::this_thread::sleep_for(std::chrono::milliseconds(50 * comm.rank()));
      const int64_t entered = std::chrono::steady_clock::now().time_since_epoch().count();
      if (!comm.barrier()) return false;
      const int64_t left = std::chrono::steady_clock::now().time_since_epoch().count();
      const auto w = static_cast<size_t>(comm.size());
      std::vector<int64_t> in(w, 0);
      std::vector<std::span<const std::byte>> send(w, std::as_bytes(std::span<const int64_t>(&entered, 1)));
      std::vector<std::span<std::byte>> recv;
      for (auto& e : in) recv.push_back(std::as_writable_bytes(std::span<int64_t>(&e, 1)));
      if (!comm.all_to_all_v(send, recv)) return false;
      const int64_t last = *std::max_element(in.begin(), in.end());
      if (left < last)
        fprintf(stderr, "rank %d left %lld ns before the last rank entered\n", comm.rank(),
                static_cast<long long>(last - left));
      return left >= last;
    });
    for (int code : codes) EXPECT_EQ(code, 0);
  }
}

TEST_P(UcxTransports, AllToAllVWithUnevenAndZeroCounts) {
  const int size = 3;
  auto codes = run_ranks(size, GetParam(), [](Communicator& comm) {
    const int w = comm.size();
    // Rank r sends (r + 2 * p) % 4 bytes to rank p, each byte r * 16 + p.
    auto count = [](int from, int to) { return static_cast<size_t>((from + 2 * to) % 4); };
    std::vector<std::vector<std::byte>> out(static_cast<size_t>(w));
    std::vector<std::vector<std::byte>> in(static_cast<size_t>(w));
    std::vector<std::span<const std::byte>> send;
    std::vector<std::span<std::byte>> recv;
    for (int p = 0; p < w; ++p) {
      out[static_cast<size_t>(p)].assign(count(comm.rank(), p), static_cast<std::byte>(comm.rank() * 16 + p));
      in[static_cast<size_t>(p)].assign(count(p, comm.rank()), std::byte{0xEE});
    }
    for (int p = 0; p < w; ++p) {
      send.emplace_back(out[static_cast<size_t>(p)]);
      recv.emplace_back(in[static_cast<size_t>(p)]);
    }
    if (!comm.all_to_all_v(send, recv)) return false;
    for (int p = 0; p < w; ++p) {
      for (std::byte b : in[static_cast<size_t>(p)]) {
        if (b != static_cast<std::byte>(p * 16 + comm.rank())) return false;
      }
    }
    return static_cast<bool>(comm.barrier());
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST_P(UcxTransports, AllToAllVWithLargeUnevenZeroCountsOnOddRankCounts) {
  for (int size : {3, 5}) {
    SCOPED_TRACE(size);
    auto codes = run_ranks(size, GetParam(), [](Communicator& comm) {
      const int w = comm.size();
      // Rank 1 sends nothing at all; the others send from 0 bytes up to
      // about 300 KB (eager and rendezvous protocols), a different size to each peer.
      auto count = [](int from, int to) -> size_t {
        if (from == 1 || (from + to) % 3 == 0) return 0;
        return static_cast<size_t>(1 + (from * 7919 + to * 104729) % 300000);
      };
      auto byte_at = [](int from, int to, size_t i) { return static_cast<std::byte>((from * 31 + to * 7 + i) & 0xFF); };
      for (int round = 0; round < 3; ++round) {
        std::vector<std::vector<std::byte>> out(static_cast<size_t>(w));
        std::vector<std::vector<std::byte>> in(static_cast<size_t>(w));
        std::vector<std::span<const std::byte>> send;
        std::vector<std::span<std::byte>> recv;
        for (int p = 0; p < w; ++p) {
          auto& o = out[static_cast<size_t>(p)];
          o.resize(count(comm.rank(), p));
          for (size_t i = 0; i < o.size(); ++i) o[i] = byte_at(comm.rank(), p, i);
          in[static_cast<size_t>(p)].assign(count(p, comm.rank()), std::byte{0xEE});
        }
        for (int p = 0; p < w; ++p) {
          send.emplace_back(out[static_cast<size_t>(p)]);
          recv.emplace_back(in[static_cast<size_t>(p)]);
        }
        if (auto status = comm.all_to_all_v(send, recv); !status) {
          fprintf(stderr, "rank %d: %s\n", comm.rank(), status.error().message.c_str());
          return false;
        }
        for (int p = 0; p < w; ++p) {
          const auto& got = in[static_cast<size_t>(p)];
          for (size_t i = 0; i < got.size(); ++i) {
            if (got[i] != byte_at(p, comm.rank(), i)) {
              fprintf(stderr, "rank %d: from %d byte %zu wrong\n", comm.rank(), p, i);
              return false;
            }
          }
        }
      }
      return static_cast<bool>(comm.barrier());
    });
    for (int code : codes) EXPECT_EQ(code, 0);
  }
}

TEST_P(UcxTransports, OwnedHandlersTakeTheReceivedBuffers) {
  auto codes = run_ranks(3, GetParam(), [](Communicator& comm) {
    std::mutex mutex;
    std::vector<std::vector<std::byte>> got;
    comm.on_message_owned(kTestChannel, [&](int from, std::vector<std::byte> payload) {
      if (payload.empty() || payload[0] != static_cast<std::byte>(from)) return;
      std::lock_guard lock(mutex);
      got.push_back(std::move(payload));
    });
    if (!comm.barrier()) return false;
    const std::vector<size_t> sizes = {1, 100, 70000, 1 << 20};
    for (size_t n : sizes) {
      for (int p = 0; p < comm.size(); ++p) {
        std::vector<std::byte> payload(n, static_cast<std::byte>(comm.rank()));
        comm.post(p, kTestChannel, std::move(payload));
      }
    }
    const size_t expected = sizes.size() * static_cast<size_t>(comm.size());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
      {
        std::lock_guard lock(mutex);
        if (got.size() >= expected) break;
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!comm.barrier()) return false;
    comm.on_message_owned(kTestChannel, nullptr);
    std::lock_guard lock(mutex);
    size_t bytes = 0;
    for (const auto& g : got) {
      bytes += g.size();
      for (std::byte b : g) {
        if (b != g[0]) return false;
      }
    }
    return got.size() == expected && bytes == (1 + 100 + 70000 + (1 << 20)) * static_cast<size_t>(comm.size());
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST_P(UcxTransports, AsyncMessagesArriveExactlyOnce) {
  constexpr int kMessages = 200;
  auto codes = run_ranks(3, GetParam(), [](Communicator& comm) {
    std::mutex mutex;
    std::vector<std::vector<int>> seen(static_cast<size_t>(comm.size()));
    comm.on_message(kTestChannel, [&](int from, std::span<const std::byte> payload) {
      int value = 0;
      std::memcpy(&value, payload.data(), sizeof value);
      std::lock_guard lock(mutex);
      seen[static_cast<size_t>(from)].push_back(value);
    });
    if (!comm.barrier()) return false;  // every handler is registered before anyone posts
    for (int i = 0; i < kMessages; ++i) {
      for (int p = 0; p < comm.size(); ++p) {
        // Sizes up to 64 KiB so both eager and rendezvous protocols are used.
        std::vector<std::byte> payload(sizeof(int) + static_cast<size_t>(i % 5) * 16000);
        std::memcpy(payload.data(), &i, sizeof i);
        comm.post(p, kTestChannel, std::move(payload));
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
      {
        std::lock_guard lock(mutex);
        bool all = true;
        for (const auto& s : seen) all &= s.size() >= kMessages;
        if (all) break;
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!comm.barrier()) return false;
    std::lock_guard lock(mutex);
    for (auto& s : seen) {
      if (s.size() != kMessages) return false;
      std::sort(s.begin(), s.end());
      for (int i = 0; i < kMessages; ++i) {
        if (s[static_cast<size_t>(i)] != i) return false;
      }
    }
    return comm.stats().bytes_sent > 0;
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

// A collective's caller serves the messages that arrive meanwhile: handlers
// run, and may post, while their rank waits in a barrier. Rank 2 enters the
// barrier only once rank 0's handler, in that barrier, has had every reply
// rank 1's handler posted from inside it; without that service the barrier
// could only end after rank 2 gave up waiting.
TEST_P(UcxTransports, HandlersRunAndPostWhileTheirRankWaitsInACollective) {
  constexpr int kPings = 50;
  auto codes = run_ranks(3, GetParam(), [](Communicator& comm) {
    std::atomic<int> pongs{0};
    std::atomic<bool> go{false};
    comm.on_message(kTestChannel, [&](int from, std::span<const std::byte> payload) {
      if (comm.rank() == 1 && from == 0) {
        comm.post(0, kTestChannel, std::vector<std::byte>(payload.begin(), payload.end()));  // the pong
      } else if (comm.rank() == 0 && from == 1) {
        if (++pongs == kPings) comm.post(2, kTestChannel, std::vector<std::byte>(1));
      } else if (comm.rank() == 2 && from == 0) {
        go = true;
      }
    });
    if (!comm.barrier()) return false;  // every handler is registered before anyone posts
    if (comm.rank() == 0) {
      for (int i = 0; i < kPings; ++i) comm.post(1, kTestChannel, std::vector<std::byte>(64));
    }
    if (comm.rank() == 2) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!go && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!go) fprintf(stderr, "rank 2: no go from rank 0 within 30 s\n");
    }
    const bool passed = static_cast<bool>(comm.barrier());
    comm.on_message(kTestChannel, nullptr);
    if (comm.rank() == 0) return passed && pongs == kPings;
    return passed && (comm.rank() != 2 || go);
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST_P(UcxTransports, ALostRankFailsTheCollectiveNamingIt) {
  UcxOptions options;
  options.peer_timeout_s = 2;
  auto codes = run_ranks(
      3, GetParam(),
      [](Communicator& comm) {
        if (!comm.barrier()) return false;
        if (comm.rank() == 2) return die();  // gone without a word, like kill -9
        std::vector<float> data(1000, 1.0f);
        const auto start = std::chrono::steady_clock::now();
        Status status;
        for (int i = 0; i < 1000 && status; ++i) status = comm.all_reduce_sum(data);
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (status) return false;
        fprintf(stderr, "rank %d after %.1fs: %s\n", comm.rank(), waited, status.error().message.c_str());
        return status.error().kind == ErrorKind::kPeer && status.error().message.find("rank 2") != std::string::npos;
      },
      options);
  for (int code : codes) EXPECT_EQ(code, 0);
}

// Issue 19: a rank that fails on its own (a file it cannot write) made the
// others fail with "barrier: rank 1 left the run", a peer failure (4). Its
// goodbye carries the root cause: the others fail with its kind and message,
// and find it lost, so that nobody waits for its answers.
TEST_P(UcxTransports, ARankLeavingOnAFailurePassesItsRootCauseOn) {
  auto codes = run_ranks(3, GetParam(), [](Communicator& comm) {
    if (!comm.barrier()) return false;
    if (comm.rank() == 1) {
      comm.leave_with(Error{ErrorKind::kInternal, "metrics.jsonl: No space left on device"});
      return true;  // run_ranks destroys the communicator: the goodbye
    }
    Status status;
    for (int i = 0; i < 100000 && status; ++i) status = comm.barrier();
    if (status) return false;
    fprintf(stderr, "rank %d: %s\n", comm.rank(), status.error().message.c_str());
    const auto lost = comm.lost_ranks();
    return status.error().kind == ErrorKind::kInternal &&
           status.error().message.find("rank 1 failed: metrics.jsonl: No space left on device") != std::string::npos &&
           std::find(lost.begin(), lost.end(), 1) != lost.end();
  });
  for (int code : codes) EXPECT_EQ(code, 0);
}

TEST_P(UcxTransports, ALostRankFailsLargeAllToAllsInFlightNamingIt) {
  // Rendezvous-sized messages (read in place over CMA between ranks of one
  // host): the survivors' requests to and from the dead rank must end in an
  // error naming it, not a crash or a hang.
  UcxOptions options;
  options.peer_timeout_s = 2;
  auto codes = run_ranks(
      3, GetParam(),
      [](Communicator& comm) {
        const size_t bytes = 1 << 20;
        std::vector<std::vector<std::byte>> out(3, std::vector<std::byte>(bytes, std::byte{1}));
        std::vector<std::vector<std::byte>> in(3, std::vector<std::byte>(bytes));
        std::vector<std::span<const std::byte>> send(out.begin(), out.end());
        std::vector<std::span<std::byte>> recv(in.begin(), in.end());
        if (!comm.all_to_all_v(send, recv)) return false;
        Status status;
        for (int i = 0; i < 100000 && status; ++i) {
          if (comm.rank() == 2 && i == 3) return die();  // gone mid-run, like kill -9
          status = comm.all_to_all_v(send, recv);
        }
        if (status) return false;
        fprintf(stderr, "rank %d: %s\n", comm.rank(), status.error().message.c_str());
        return status.error().kind == ErrorKind::kPeer && status.error().message.find("rank 2") != std::string::npos;
      },
      options);
  for (int code : codes) EXPECT_EQ(code, 0);
}

// "posix,cma,self": shared memory and CMA alone, no TCP to fall back on, so
// the communicator must get them even though its endpoints ask for peer
// error handling (UCX withholds them unless told they may claim it).
INSTANTIATE_TEST_SUITE_P(Transports, UcxTransports,
                         ::testing::Values("", "tcp", "posix,cma,self,tcp", "posix,cma,self", "loopback"),
                         [](const auto& info) {
                           return info.param.empty()                   ? std::string("Default")
                                  : info.param == "loopback"           ? std::string("Loopback")
                                  : info.param == "tcp"                ? std::string("Tcp")
                                  : info.param == "posix,cma,self,tcp" ? std::string("SharedMemory")
                                                                       : std::string("SharedMemoryOnly");
                         });

// Every rank's process id, from every rank (an all-to-all of four bytes each).
std::vector<pid_t> pids_of_ranks(Communicator& comm) {
  const auto n = static_cast<size_t>(comm.size());
  const pid_t own = getpid();
  std::vector<std::byte> out(sizeof own);
  std::memcpy(out.data(), &own, sizeof own);
  std::vector<std::vector<std::byte>> in(n, std::vector<std::byte>(sizeof(pid_t)));
  const std::vector<std::span<const std::byte>> send(n, std::span<const std::byte>(out));
  std::vector<std::span<std::byte>> recv(in.begin(), in.end());
  if (!comm.all_to_all_v(send, recv)) return {};
  std::vector<pid_t> pids(n);
  for (size_t r = 0; r < n; ++r) std::memcpy(&pids[r], in[r].data(), sizeof(pid_t));
  return pids;
}

// Stops `pids` (SIGSTOP) for `seconds`, then lets them go on, from a
// process of its own (the caller may be among them); the caller reaps it.
pid_t stop_for(const std::vector<pid_t>& pids, double seconds) {
  const pid_t freezer = fork();
  if (freezer == 0) {
    for (const pid_t pid : pids) ::kill(pid, SIGSTOP);
    const auto whole = static_cast<time_t>(seconds);
    const timespec pause{whole, static_cast<long>((seconds - static_cast<double>(whole)) * 1e9)};
    nanosleep(&pause, nullptr);
    for (const pid_t pid : pids) ::kill(pid, SIGCONT);
    _exit(0);
  }
  return freezer;
}

bool reaped(pid_t pid) {
  int status = 0;
  pid_t got = -1;
  do {
    got = waitpid(pid, &status, 0);
  } while (got < 0 && errno == EINTR);
  return got == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Real processes stopped and continued (SIGSTOP, SIGCONT): no loopback.
class UcxStalls : public ::testing::TestWithParam<std::string> {};

// Under load every process of a host can stand still at once, for seconds
// (seen in CI and on a loaded 2-core machine: ranks of several runs waking
// in the same millisecond after 1 to 3 s). On waking, a rank found every
// peer silent for the whole stall and took live ranks for lost, although
// none of them could have spoken, nor it listened. Here all three ranks stop
// for twice the peer timeout: nobody is lost, and the collectives go on.
TEST_P(UcxStalls, ARankThatItselfStoodStillTakesNoLivePeerForLost) {
  UcxOptions options;
  options.peer_timeout_s = 2;
  auto codes = run_ranks(
      3, GetParam(),
      [](Communicator& comm) {
        const std::vector<pid_t> pids = pids_of_ranks(comm);
        if (pids.empty() || !comm.barrier()) return false;
        if (comm.rank() == 0 && !reaped(stop_for(pids, 4.0))) return false;  // returns after the stall
        // Past the stall, for longer than the timeout (as many barriers on
        // every rank, 50 ms apart): every rank still in.
        for (int i = 0; i < 60; ++i) {
          if (Status s = comm.barrier(); !s) {
            fprintf(stderr, "rank %d: %s\n", comm.rank(), s.error().message.c_str());
            return false;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return comm.lost_ranks().empty();
      },
      options);
  for (int code : codes) EXPECT_EQ(code, 0);
}

// ... while a peer stopped alone (SIGSTOP) is still lost after the peer
// timeout, by every rank that kept listening.
TEST_P(UcxStalls, APeerStoppedAloneIsStillLost) {
  UcxOptions options;
  options.peer_timeout_s = 2;
  auto codes = run_ranks(
      3, GetParam(),
      [](Communicator& comm) {
        const std::vector<pid_t> pids = pids_of_ranks(comm);
        if (pids.empty() || !comm.barrier()) return false;
        if (comm.rank() == 2) {
          // Stopped by rank 0 meanwhile; once going on, it is lost for the others.
          std::this_thread::sleep_for(std::chrono::seconds(8));
          return true;
        }
        pid_t freezer = -1;
        if (comm.rank() == 0) freezer = stop_for({pids[2]}, 6.0);
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
        bool lost = false;
        while (!lost && std::chrono::steady_clock::now() < until) {
          const auto ranks = comm.lost_ranks();
          lost = ranks == std::vector<int>{2};
          if (!ranks.empty() && !lost) return false;  // a live rank taken for lost
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        if (freezer > 0 && !reaped(freezer)) return false;
        fprintf(stderr, "rank %d: rank 2 lost: %s\n", comm.rank(), comm.lost_reason(2).c_str());
        return lost && comm.lost_reason(2).find("no message for") != std::string::npos;
      },
      options);
  for (int code : codes) EXPECT_EQ(code, 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxStalls, ::testing::Values("", "tcp"), [](const auto& info) {
  return info.param.empty() ? std::string("Default") : std::string("Tcp");
});

TEST(SoloCommunicator, CollectivesAreCopiesAndMessagesReachTheHandler) {
  auto comm = make_solo_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  std::vector<float> data = {1, 2, 3};
  EXPECT_TRUE(comm->all_reduce_sum(data));
  EXPECT_EQ(data, (std::vector<float>{1, 2, 3}));
  std::vector<std::byte> out(5, std::byte{7});
  std::vector<std::byte> in(5);
  EXPECT_TRUE(comm->all_to_all_v({std::span<const std::byte>(out)}, {std::span<std::byte>(in)}));
  EXPECT_EQ(in, out);
  std::vector<std::byte> wrong(4);
  EXPECT_FALSE(comm->all_to_all_v({std::span<const std::byte>(out)}, {std::span<std::byte>(wrong)}));
  size_t seen = 0;
  comm->on_message(kTestChannel, [&](int from, std::span<const std::byte> payload) {
    EXPECT_EQ(from, 0);
    seen += payload.size();
  });
  comm->post(0, kTestChannel, std::vector<std::byte>(3));
  EXPECT_EQ(seen, 3u);
  EXPECT_TRUE(comm->health());
  EXPECT_TRUE(comm->lost_ranks().empty());
}

TEST(Rendezvous, ParsesHostPort) {
  EXPECT_EQ(parse_rendezvous("127.0.0.1:29500")->port, 29500);
  EXPECT_EQ(parse_rendezvous("node7:1")->host, "node7");
  EXPECT_EQ(parse_rendezvous("[::1]:80")->host, "::1");
  for (const char* bad : {"", "host", "host:", ":80", "host:0", "host:70000", "host:x", "[::1]80"}) {
    auto r = parse_rendezvous(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().kind, ErrorKind::kUsage);
  }
}

TEST(Rendezvous, MissingRankZeroTimesOutNamingTheAddress) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener);
  const uint16_t port = listener->second;
  close(listener->first);  // nobody listens there now
  RendezvousConfig config;
  config.port = port;
  config.timeout_s = 0.5;
  auto table = exchange_addresses(config, 1, 2, std::vector<std::byte>(4));
  ASSERT_FALSE(table);
  EXPECT_EQ(table.error().kind, ErrorKind::kPeer);
  EXPECT_NE(table.error().message.find(std::to_string(port)), std::string::npos) << table.error().message;
}

// A joiner (kAnyRank) that finds nobody at the address cannot tell a run
// that ended from one not started: it says so, naming the address.
TEST(Rendezvous, AJoinerThatFindsNobodySaysNoRunListensThere) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener);
  const uint16_t port = listener->second;
  close(listener->first);  // nobody listens there now
  RendezvousConfig config;
  config.port = port;
  config.timeout_s = 0.5;
  auto joined = exchange_addresses(config, kAnyRank, 0, std::vector<std::byte>(4));
  ASSERT_FALSE(joined);
  EXPECT_EQ(joined.error().kind, ErrorKind::kPeer);
  EXPECT_NE(joined.error().message.find(fmt::format("nobody answered at 127.0.0.1:{}", port)), std::string::npos)
      << joined.error().message;
  EXPECT_NE(joined.error().message.find("no run listens there (it ended, or has not started)"), std::string::npos)
      << joined.error().message;
}

TEST(Rendezvous, RankZeroNamesTheRanksThatNeverCame) {
  RendezvousConfig config;
  config.timeout_s = 0.5;
  auto table = exchange_addresses(config, 0, 3, std::vector<std::byte>(4));
  ASSERT_FALSE(table);
  EXPECT_NE(table.error().message.find("1, 2"), std::string::npos) << table.error().message;
}

}  // namespace
// After the start rank 0 serves joins on its listener: a process that asks
// for any rank is offered a free one with the run's description, declines
// one that does not fit (its check's error, the run's hooks never asked to
// admit it), or accepts and gets the table and the lost ranks.
TEST(Rendezvous, AJoinerIsOfferedAFreeRankAndMayDecline) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener);
  const Fd socket(listener->first);
  std::atomic<int> admitted{-1};
  JoinHooks hooks;
  hooks.decide = [](int rank, int size) {
    EXPECT_EQ(rank, kAnyRank);
    EXPECT_EQ(size, 0);
    return JoinHooks::Decision{2, {}, true};
  };
  hooks.admit = [&](int rank, const std::vector<std::byte>& address) {
    admitted = rank;
    EXPECT_EQ(address.size(), 4u);
    return Result<std::pair<std::vector<std::vector<std::byte>>, std::vector<bool>>>(std::pair{
        std::vector<std::vector<std::byte>>(3, std::vector<std::byte>(8)), std::vector<bool>{false, true, false}});
  };
  auto serve_one = [&] {
    return std::thread([&] {
      const Fd peer(::accept4(socket.get(), nullptr, nullptr, SOCK_CLOEXEC));
      ASSERT_GE(peer.get(), 0);
      EXPECT_TRUE(serve_join(peer.get(), 3, 3, "model = 'mlp:8'", hooks, 5));
    });
  };
  RendezvousConfig config;
  config.port = listener->second;
  config.timeout_s = 5;
  config.check = [](std::string_view description) -> Status {
    if (description.find("mlp:8") == std::string_view::npos) return {};
    return make_error(ErrorKind::kUsage, "--join: the run trains with --model 'mlp:8'");
  };
  std::thread server = serve_one();
  auto declined = exchange_addresses(config, kAnyRank, 0, std::vector<std::byte>(4));
  server.join();
  ASSERT_FALSE(declined);
  EXPECT_EQ(declined.error().kind, ErrorKind::kUsage);
  EXPECT_EQ(admitted.load(), -1);

  config.check = nullptr;
  server = serve_one();
  auto joined = exchange_addresses(config, kAnyRank, 0, std::vector<std::byte>(4));
  server.join();
  ASSERT_TRUE(joined) << joined.error().message;
  EXPECT_TRUE(joined->joined);
  EXPECT_EQ(joined->rank, 2);
  EXPECT_EQ(joined->size, 3);
  EXPECT_EQ(joined->lost, (std::vector<bool>{false, true, false}));
  EXPECT_EQ(admitted.load(), 2);
}

// A joiner (or a rank restarted into its run) that the leader refuses
// because the run is ending came too late, through no fault of its own:
// no error, but Rendezvous::run_ended; connect_ucx then gives no
// communicator where the caller asked to hear of it, else a kPeer error.
TEST(Rendezvous, AJoinerRefusedAsTheRunEndsIsToldSoNotFailed) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener);
  const Fd socket(listener->first);
  JoinHooks hooks;
  hooks.decide = [](int, int) { return JoinHooks::Decision{-1, "the run is ending", false, 0, /*ended=*/true}; };
  hooks.admit = [](int, const std::vector<std::byte>&) {
    ADD_FAILURE() << "a refused process is not admitted";
    return Result<std::pair<std::vector<std::vector<std::byte>>, std::vector<bool>>>(
        make_error(ErrorKind::kInternal, "admitted"));
  };
  auto serve = [&](int count) {
    return std::thread([&, count] {
      for (int i = 0; i < count; ++i) {
        const Fd peer(::accept4(socket.get(), nullptr, nullptr, SOCK_CLOEXEC));
        ASSERT_GE(peer.get(), 0);
        EXPECT_TRUE(serve_join(peer.get(), 2, 2, "model = 'mlp:8'", hooks, 5));
      }
    });
  };
  RendezvousConfig config;
  config.port = listener->second;
  config.timeout_s = 5;
  std::thread server = serve(2);
  auto late = exchange_addresses(config, kAnyRank, 0, std::vector<std::byte>(4));
  ASSERT_TRUE(late) << late.error().message;
  EXPECT_TRUE(late->run_ended);
  EXPECT_FALSE(late->joined);
  auto restarted = exchange_addresses(config, 1, 2, std::vector<std::byte>(4));  // a rank restarted with its command
  server.join();
  ASSERT_TRUE(restarted) << restarted.error().message;
  EXPECT_TRUE(restarted->run_ended);

  server = serve(2);
  bool ended = false;
  auto none = connect_ucx(kAnyRank, 0, config, {}, nullptr, &ended);
  ASSERT_TRUE(none) << none.error().message;
  EXPECT_TRUE(ended);
  EXPECT_EQ(none->get(), nullptr);
  auto unasked = connect_ucx(kAnyRank, 0, config);
  server.join();
  ASSERT_FALSE(unasked);
  EXPECT_EQ(unasked.error().kind, ErrorKind::kPeer);
  EXPECT_NE(unasked.error().message.find("ended as this process came"), std::string::npos) << unasked.error().message;
}

}  // namespace cfmo::comm

namespace cfmo::comm {
namespace {

// Waits until `comm` has `size` ranks, then sends every other rank its rank
// and waits to hear from each: true when every rank of the grown world heard
// from every other, once.
bool everyone_hears_everyone(Communicator& comm, int size) {
  std::mutex mutex;
  std::vector<int> heard;
  comm.on_message(kTestChannel, [&](int from, std::span<const std::byte> payload) {
    int said = -1;
    if (payload.size() == sizeof said) std::memcpy(&said, payload.data(), sizeof said);
    std::lock_guard lock(mutex);
    heard.push_back(said == from ? from : -1);
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (comm.size() < size) {
    if (std::chrono::steady_clock::now() > deadline) {
      fprintf(stderr, "rank %d: the world has %d ranks, not %d\n", comm.rank(), comm.size(), size);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int p = 0; p < size; ++p) {
    if (p == comm.rank()) continue;
    std::vector<std::byte> payload(sizeof(int));
    const int me = comm.rank();
    std::memcpy(payload.data(), &me, sizeof me);
    comm.post(p, kTestChannel, std::move(payload));
  }
  for (;;) {
    {
      std::lock_guard lock(mutex);
      if (static_cast<int>(heard.size()) >= size - 1) break;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  comm.on_message(kTestChannel, nullptr);
  std::sort(heard.begin(), heard.end());
  std::vector<int> others;
  for (int p = 0; p < size; ++p) {
    if (p != comm.rank()) others.push_back(p);
  }
  if (heard != others || !comm.lost_ranks().empty() || comm.size() != size) {
    fprintf(stderr, "rank %d heard from the wrong ranks\n", comm.rank());
    return false;
  }
  return true;
}

// Rank 2 as a bare UCX process: it says a few heartbeats to rank 0 (its
// endpoint is wired up, over shared memory when both sides offer it: rank 2
// does, as connect_ucx did before it left out UCX's shared-memory FIFOs),
// then sends rank 0 one message and is killed while UCX writes it: the
// message's packing (a generic datatype's pack) runs after UCX took an
// element of rank 0's shared-memory receive FIFO and before it marked the
// element written (over TCP: after it began the message on the stream), as
// SIGKILL can catch a process that sends. Never returns.
[[noreturn]] void killed_while_sending_to_rank_zero(uint16_t port) {
  setenv("UCX_MM_ERROR_HANDLING", "y", 1);  // the FIFOs allowed for peer error handling
  ucp_config_t* config = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_address_t* address = nullptr;
  size_t length = 0;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK || ucp_init(&params, config, &context) != UCS_OK ||
      ucp_worker_create(context, &worker_params, &worker) != UCS_OK ||
      ucp_worker_get_address(worker, &address, &length) != UCS_OK) {
    _exit(20);
  }
  const auto* first = reinterpret_cast<const std::byte*>(address);
  RendezvousConfig rendezvous;
  rendezvous.port = port;
  rendezvous.timeout_s = 30;
  auto met = exchange_addresses(rendezvous, 2, 3, std::vector<std::byte>(first, first + length));
  if (!met) _exit(21);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(met->addresses[0].data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ucp_ep_h endpoint = nullptr;
  if (ucp_ep_create(worker, &ep_params, &endpoint) != UCS_OK) _exit(22);
  // Heartbeats (channel 0xFF, from rank 2), as a live rank's, for a second.
  const ucp_tag_t heartbeat = (ucp_tag_t{0xFF} << 56) | (ucp_tag_t{2} << 32);
  const std::byte beat{1};
  for (int i = 0; i < 10; ++i) {
    ucp_request_param_t send{};
    void* request = ucp_tag_send_nbx(endpoint, &beat, 1, heartbeat, &send);
    if (UCS_PTR_IS_ERR(request)) _exit(23);
    while (request != nullptr && ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker);
    if (request != nullptr) ucp_request_free(request);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    while (std::chrono::steady_clock::now() < until) ucp_worker_progress(worker);
  }
  ucp_generic_dt_ops_t ops{};
  ops.start_pack = [](void* context, const void*, size_t) -> void* { return context; };
  ops.packed_size = [](void*) -> size_t { return 2000; };  // eager, copied through the FIFO
  ops.pack = [](void*, size_t, void*, size_t) -> size_t {
    ::raise(SIGKILL);
    return 0;
  };
  ops.finish = [](void*) {};
  ucp_datatype_t killing = 0;
  if (ucp_dt_create_generic(&ops, nullptr, &killing) != UCS_OK) _exit(24);
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
  send.datatype = killing;
  const std::byte unused{0};
  void* request = ucp_tag_send_nbx(endpoint, &unused, 1, heartbeat, &send);
  for (;;) {
    if (UCS_PTR_IS_ERR(request)) _exit(25);
    ucp_worker_progress(worker);  // a send not packed at once is packed here
  }
}

// A rank killed while it writes a message to rank 0 (over `tls`, "" for
// UCX's choice) is lost; the other ranks, which kept talking, are not. Rank
// 0 and rank 1 exchange messages for four peer timeouts after rank 2's
// death: neither may take the other for lost, and rank 0 finds rank 2 lost.
void expect_only_the_rank_killed_while_sending_lost(const std::string& tls) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener) << listener.error().message;
  const uint16_t port = listener->second;
  std::vector<pid_t> children;
  for (int rank = 0; rank < 3; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (!tls.empty()) setenv("UCX_TLS", tls.c_str(), 1);
      if (rank != 0) close(listener->first);
      if (rank == 2) killed_while_sending_to_rank_zero(port);
      RendezvousConfig config;
      config.port = port;
      config.listen_fd = rank == 0 ? listener->first : -1;
      config.timeout_s = 30;
      UcxOptions options;
      options.peer_timeout_s = 2;
      auto comm = connect_ucx(rank, 3, config, options);
      if (!comm) {
        fprintf(stderr, "rank %d: %s\n", rank, comm.error().message.c_str());
        _exit(10);
      }
      std::atomic<int> heard{0};
      (*comm)->on_message(kTestChannel, [&](int, std::span<const std::byte>) { ++heard; });
      const int other = 1 - rank;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
      bool ok = true;
      while (ok && std::chrono::steady_clock::now() < until) {
        (*comm)->post(other, kTestChannel, std::vector<std::byte>(8));
        const auto lost = (*comm)->lost_ranks();
        ok = std::find(lost.begin(), lost.end(), other) == lost.end();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const auto lost = (*comm)->lost_ranks();
      fprintf(stderr, "rank %d: heard %d messages from rank %d; lost:", rank, heard.load(), other);
      for (const int r : lost) fprintf(stderr, " %d (%s)", r, (*comm)->lost_reason(r).c_str());
      fprintf(stderr, "\n");
      ok = lost == std::vector<int>{2};
      comm->reset();
      fflush(stderr);
      _exit(ok ? 0 : 11);
    }
    children.push_back(pid);
  }
  close(listener->first);
  // Rank 2 first, reaped as soon as it dies (a zombie passes for alive to UCX's keepalive).
  for (const pid_t pid : {children[2], children[0], children[1]}) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (pid == children[2]) {
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "rank 2 was not killed while sending: " << status;
    } else {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    }
  }
}

TEST(UcxKilledSender, OverTcpOnlyTheKilledRankIsLost) { expect_only_the_rank_killed_while_sending_lost("tcp,self"); }

// Over the transports connect_ucx picks between ranks of one host (TCP and
// CMA, not UCX's shared-memory FIFOs: choose_transports in
// ucx_communicator.cpp): the cause of live ranks taken for lost in
// cfmo-train's kill tests (CfmoKilledWorkersRejoinAndAJoinWithOtherFlagsIsRefused,
// CfmoExpertParallelWorkersGoOnWithoutAKilledRank, about 1 run in 10 under
// load) while the FIFOs were among them.
TEST(UcxKilledSender, OnOneHostOnlyTheKilledRankIsLost) { expect_only_the_rank_killed_while_sending_lost(""); }

// Fails, by UCX's design, kept as the reproducer of what the test above
// guards against: a user whose UCX_TLS names posix or sysv gets UCX's
// shared-memory FIFOs back, and they give each receiving process ONE
// receive FIFO that all its senders write into. A sender takes the next
// element (an atomic step of the FIFO's head), writes the message, then
// marks the element written; the receiver reads elements in order. A sender
// killed between the two leaves an element that is never marked, and the
// receiver reads nothing after it again, from any sender: rank 0 hears no
// rank from rank 2's death on and takes the live rank 1 for lost one peer
// timeout later ("no message for ..."), while rank 1 still hears rank 0.
// UCX 1.13 has no way out (the receiver cannot tell a dead writer from a
// slow one); peer error handling over the FIFOs is UCX's experimental
// MM_ERROR_HANDLING.
TEST(UcxKilledSender, DISABLED_OverSharedMemoryFifosOnlyTheKilledRankIsLost) {
  expect_only_the_rank_killed_while_sending_lost("posix,cma,self");
}

// A run that may grow (RendezvousConfig::grow) takes two processes that
// join at once, no rank being lost, as new ranks 2 and 3: each its own rank,
// every rank learns of both and reaches them, and the collectives stay among
// the two ranks the world started with.
TEST(UcxGrowth, TwoJoinsAtOnceWithNoRankLostGrowTheWorldByTwoRanks) {
  auto listener = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener) << listener.error().message;
  const uint16_t port = listener->second;
  std::vector<pid_t> children;
  for (int process = 0; process < 4; ++process) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (process != 0) close(listener->first);
      RendezvousConfig config;
      config.port = port;
      config.listen_fd = process == 0 ? listener->first : -1;
      config.timeout_s = 30;
      config.grow = true;
      // Processes 2 and 3 join (any rank) once the run is under way; they ask until it is.
      auto comm = connect_ucx(process < 2 ? process : kAnyRank, process < 2 ? 2 : 0, config, {});
      if (!comm) {
        fprintf(stderr, "process %d: %s\n", process, comm.error().message.c_str());
        _exit(10);
      }
      bool ok = process < 2 || ((*comm)->joined() && (*comm)->rank() >= 2);
      if (process < 2) ok = ok && static_cast<bool>((*comm)->barrier());  // the start's world, before and after
      ok = ok && everyone_hears_everyone(**comm, 4);
      if (process < 2) ok = ok && static_cast<bool>((*comm)->barrier()) && (*comm)->joined_ranks().size() == 2;
      comm->reset();
      fflush(stderr);
      _exit(ok ? 0 : 11);
    }
    children.push_back(pid);
  }
  close(listener->first);
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
}

}  // namespace
}  // namespace cfmo::comm
