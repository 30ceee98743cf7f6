// Each rank's heartbeat in the rendezvous store (heartbeat.cpp), so that a rank whose collective
// failed or whose replay timed out can say which peer is gone instead of "a peer died or hangs".
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace sk::dist {

// A thread that advances this rank's counter in the rendezvous store every second, over a store
// client of its own (a short timeout, so that a store gone with rank 0 stops nothing here).
class Heartbeat {
 public:
  // Starts beating for `rank` of `world`, under the group's key `prefix`, at the store host:port.
  Heartbeat(const std::string& host, int port, const std::string& prefix, int rank, int world);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Which ranks are gone, in a sentence: those whose counter did not move for three beats (this
  // call takes that long), or rank 0 when its store does not answer; "every rank still answers"
  // when none is silent (a hang, not a lost rank).
  std::string lost_ranks() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace sk::dist
