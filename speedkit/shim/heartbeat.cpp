// Heartbeats (heartbeat.h): a counter per rank under the group's prefix in the rendezvous store,
// advanced every second by a thread of this rank; read twice, three beats apart, to name the ranks
// that stopped. The thread holds the state by a shared pointer, so that its last store call, which
// may wait out the client's timeout after the store is gone, never touches freed memory: the
// Heartbeat's destructor asks it to stop and does not wait for it.
#include "heartbeat.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

namespace sk::dist {

namespace {
constexpr std::chrono::milliseconds kBeat{1000};
constexpr std::chrono::milliseconds kStoreTimeout{5000};
}  // namespace

struct Heartbeat::State {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string prefix;
  int rank;
  int world;
  std::mutex mutex;
  std::condition_variable wake;
  bool stopping = false;

  std::string key(int r) const { return prefix + "alive/" + std::to_string(r); }

  void beat() {
    std::unique_lock<std::mutex> lock(mutex);
    while (!stopping) {
      lock.unlock();
      try {
        store->add(key(rank), 1);
      } catch (...) {
        // The store is gone (rank 0 with it) or slow: the next beat tries again.
      }
      lock.lock();
      wake.wait_for(lock, kBeat, [this] { return stopping; });
    }
  }

  // Every rank's counter now (`add 0` reads without waiting for a key nobody wrote yet).
  std::vector<int64_t> counters() const {
    std::vector<int64_t> values;
    for (int r = 0; r < world; ++r) values.push_back(store->add(key(r), 0));
    return values;
  }
};

Heartbeat::Heartbeat(const std::string& host, int port, const std::string& prefix, int rank, int world)
    : state_(std::make_shared<State>()) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = kStoreTimeout;
  state_->store = c10::make_intrusive<c10d::TCPStore>(host, options);
  state_->prefix = prefix;
  state_->rank = rank;
  state_->world = world;
  std::thread([state = state_] { state->beat(); }).detach();
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->wake.notify_all();
}

std::string Heartbeat::lost_ranks() const {
  std::vector<int64_t> before, after;
  try {
    before = state_->counters();
    std::this_thread::sleep_for(3 * kBeat);
    after = state_->counters();
  } catch (const std::exception&) {
    return "rank 0 is lost: the rendezvous store it serves does not answer";
  }
  std::vector<int> silent;
  for (int r = 0; r < state_->world; ++r)
    if (r != state_->rank && after[r] == before[r]) silent.push_back(r);
  if (silent.empty()) return "every rank still answers (a hang, not a lost rank)";
  std::ostringstream text;
  text << "rank(s) [";
  for (size_t i = 0; i < silent.size(); ++i) text << (i ? ", " : "") << silent[i];
  text << "] lost: no heartbeat in the rendezvous store for " << 3 * kBeat.count() / 1000 << " s";
  return text.str();
}

}  // namespace sk::dist
