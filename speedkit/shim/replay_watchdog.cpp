// The watchdog over a captured step's replays (replay_watchdog.h says why it exists). After each
// replay an event is recorded on the replay's stream; a thread checks the oldest one every 50 ms,
// and one not done by its deadline ends the process as c10d's watchdog does after its timeout: a
// message naming the rank and the ranks lost (their heartbeats), NCCL's communicators aborted (at
// most 5 s waited for), and exit status 1.
#include "replay_watchdog.h"

#include <c10/util/Exception.h>

#if SK_WITH_CUDA && SK_WITH_NCCL
#include <c10/core/Event.h>
#include <c10/cuda/CUDAStream.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#endif

namespace sk::dist {

#if SK_WITH_CUDA && SK_WITH_NCCL
struct ReplayWatchdog::State {
  // c10::Event, not at::cuda::CUDAEvent: it reaches CUDA through c10's device guard, so the shim
  // needs no CUDA runtime of its own.
  struct Pending {
    c10::Event done;
    std::chrono::steady_clock::time_point deadline;
  };
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::shared_ptr<Heartbeat> heartbeat;
  std::string who;
  std::chrono::milliseconds timeout{0};
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Pending> pending;
  bool stopping = false;
  std::thread thread;

  void watch(const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::chrono::milliseconds limit,
             const std::string& rank, std::shared_ptr<Heartbeat> beat) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!thread.joinable()) {
      pg = group;
      heartbeat = std::move(beat);
      who = rank;
      timeout = limit;
      thread = std::thread([this] { loop(); });
    }
    Pending p{c10::Event(c10::DeviceType::CUDA), std::chrono::steady_clock::now() + timeout};
    p.done.record(c10::cuda::getCurrentCUDAStream().unwrap());
    pending.push_back(std::move(p));
    wake.notify_one();
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      wake.wait_for(lock, std::chrono::milliseconds(50));
      while (!pending.empty() && pending.front().done.query()) pending.pop_front();
      if (pending.empty() || std::chrono::steady_clock::now() < pending.front().deadline) continue;
      const std::string lost = heartbeat ? heartbeat->lost_ranks() : "a peer died or hangs";
      std::fprintf(stderr,
                   "speedkit: %s: a replay of the training step's CUDA graph, whose gradient all-reduce "
                   "waits on every rank, did not finish within the %lld s timeout (distributed.timeout_s): "
                   "%s. Aborting NCCL's communicators and exiting.\n",
                   who.c_str(), static_cast<long long>(timeout.count() / 1000), lost.c_str());
      std::fflush(stderr);
      // NCCL's abort can block behind the kernels the replay left waiting on the lost peer (c10d
      // gives up on it after 10 s and keeps waiting): it runs on a thread of its own, and the exit
      // waits for it a few seconds at most. Exiting ends the context and its kernels either way.
      auto aborted = std::make_shared<std::promise<void>>();
      std::future<void> done = aborted->get_future();
      std::thread([group = pg, aborted] {
        try {
          group->abort();
        } catch (...) {
          // Exiting either way.
        }
        aborted->set_value();
      }).detach();
      done.wait_for(std::chrono::seconds(5));
      std::_Exit(1);
    }
  }

  ~State() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_one();
    if (thread.joinable()) thread.join();
  }
};
#else
struct ReplayWatchdog::State {
  void watch(const c10::intrusive_ptr<c10d::ProcessGroup>&, std::chrono::milliseconds, const std::string&,
             std::shared_ptr<Heartbeat>) {
    TORCH_CHECK(false, "a CUDA graph replay needs speedkit built with CUDA and NCCL");
  }
};
#endif

ReplayWatchdog::ReplayWatchdog() : state_(std::make_unique<State>()) {}

ReplayWatchdog::~ReplayWatchdog() = default;

void ReplayWatchdog::watch(const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::chrono::milliseconds limit,
                           const std::string& rank, std::shared_ptr<Heartbeat> heartbeat) {
  state_->watch(group, limit, rank, std::move(heartbeat));
}

}  // namespace sk::dist
