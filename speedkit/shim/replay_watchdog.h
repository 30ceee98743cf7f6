// The watchdog over a captured training step's replays (replay_watchdog.cpp), which a GradientSync
// (gradient_sync.cpp) keeps for the collectives captured inside the step.
#pragma once

#include "heartbeat.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <string>

namespace sk::dist {

// Bounds the replays of a captured step on the collectives inside it: c10d's watchdog only
// follows the collectives it launched itself, not those a CUDA graph replays, so a peer that died
// or hangs would leave this rank waiting forever. The state (an event per replay, a thread that
// checks them) lives in replay_watchdog.cpp, so that its users parse no CUDA header.
class ReplayWatchdog {
 public:
  ReplayWatchdog();
  ~ReplayWatchdog();
  ReplayWatchdog(const ReplayWatchdog&) = delete;
  ReplayWatchdog& operator=(const ReplayWatchdog&) = delete;

  // After a replay on the current stream: ends the process unless the replay is done within
  // `limit`, naming the lost ranks by their `heartbeat` (the first call's `group`, `limit`, `rank`
  // and `heartbeat` hold for every later one).
  void watch(const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::chrono::milliseconds limit,
             const std::string& rank, std::shared_ptr<Heartbeat> heartbeat);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace sk::dist
