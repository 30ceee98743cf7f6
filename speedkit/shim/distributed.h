// What the data-parallel shim files share: the process group a `void* group` of speedkit.h points
// at (distributed.cpp), its blocking collectives, and the hand-over from a sharded GradientSync
// (gradient_sync.cpp) to the OptimizerShard built over it (optimizer_shard.cpp).
#pragma once

#include "shim.h"

#include "heartbeat.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace sk::dist {

// speedkit.h's sk_dist_backend.
enum Backend : int { kGloo = 0, kNccl = 1 };

// A process group and the rendezvous store it was built over (sk_dist_init).
struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int backend;
  // This rank's heartbeat, which names the lost ranks when a collective fails (heartbeat.h).
  std::shared_ptr<Heartbeat> heartbeat;
};

inline void wait(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }

// `tensor` reduced in place across `pg` by `op` (speedkit.h's sk_reduce_op), waited for.
void blocking_all_reduce(c10d::ProcessGroup& pg, const at::Tensor& tensor, int op);

struct GradientSync;

// What a sharded GradientSync hands ZeRO-1's second half: the buffers the optimizer's updates are
// all-gathered into, and this rank's pieces of the parameters, which the optimizer updates.
struct ShardedParams {
  int backend;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::vector<at::Tensor> flats;   // each bucket's flat parameter buffer
  std::vector<at::Tensor> params;  // the parameters, for their autocast copies
  std::vector<at::Tensor> pieces;  // every piece, in bucket order
  std::vector<int64_t> piece_params;  // each piece's parameter, as sk_grad_sync_new was given them
};

// Fails unless `sync` was made sharded.
ShardedParams sharded_params(const GradientSync& sync);

}  // namespace sk::dist
