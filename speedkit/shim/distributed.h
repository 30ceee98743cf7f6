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

// `flat`'s consecutive stretches shaped like `like`'s tensors.
inline std::vector<at::Tensor> views_of(const at::Tensor& flat, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> views;
  int64_t offset = 0;
  for (const at::Tensor& p : like) {
    views.push_back(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return views;
}

struct GradientSync;
class Residency;

// ZeRO-3's parameters (parameter_residency.cpp), made by a GradientSync sharded over parameters:
// units of parameters whose memory exists only while a call of the step needs them.
std::shared_ptr<Residency> make_residency(c10::intrusive_ptr<c10d::ProcessGroup> pg, int backend);
// Moves `params` into a new unit (their values become this rank's fp32 part of it; they themselves
// become views, in `compute`, of a buffer gathered on use) and returns the unit's index.
size_t add_unit(Residency& r, const std::vector<at::Tensor>& params, at::ScalarType compute, bool pinned);
// Unit `unit`'s fp32 part on this rank: what the optimizer updates.
const at::Tensor& master_of(const Residency& r, size_t unit);
// Starts observing the calls of this thread (and of autograd's threads in its backward passes).
void start_observing(Residency& r);
// After the optimizer updated unit `unit`'s part: the gathered copy, now stale, is let go.
void refresh(Residency& r, size_t unit);
// The backward pass is done with `unit` (its gradients are all in): let it go, unless pinned.
void done_with(Residency& r, size_t unit);
// After the optimizer step: every unit refreshed; the next step gathers them again.
void after_step(Residency& r);
// Bytes of parameters this rank holds now: its fp32 parts and the units gathered.
int64_t resident_bytes(const Residency& r);
// Every unit's whole fp32 values (a collective), one tensor per parameter in unit order.
std::vector<at::Tensor> gather_masters(Residency& r);
// Ends the sharding: the parameters become whole fp32 tensors again (`gather`: a collective), or
// empty ones that a later use reports (after a failure, when the other ranks may be gone).
void unshard(Residency& r, bool gather);

// What a sharded GradientSync hands ZeRO-1's second half: the buffers the optimizer's updates are
// all-gathered into, and this rank's pieces of the parameters, which the optimizer updates.
struct ShardedParams {
  int backend;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::vector<at::Tensor> flats;   // each bucket's flat parameter buffer
  std::vector<at::Tensor> params;  // the parameters, for their autocast copies
  std::vector<at::Tensor> pieces;  // every piece, in bucket order
  std::vector<int64_t> piece_params;  // each piece's parameter, as sk_grad_sync_new was given them
  std::vector<int64_t> piece_offsets;  // each piece's first element in its parameter's flattened values
  std::shared_ptr<Residency> residency;  // ZeRO-3: the parameters' units; null for ZeRO-1
};

// Fails unless `sync` was made sharded.
ShardedParams sharded_params(const GradientSync& sync);

}  // namespace sk::dist
