// ZeRO-1's second half (sk_optimizer_shard_*): a sharded GradientSync (gradient_sync.cpp) leaves
// each rank the averaged gradients of its pieces of the parameters only; the optimizer updates
// those pieces, and every rank's part of each bucket's flat parameter buffer is all-gathered in
// place, which writes every parameter, and their kept autocast copies are refreshed.
#include "distributed.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdint>

using sk::dist::kNccl;
using sk::dist::wait;

namespace {

// What the sharded sync handed over, with references of its own: the shard may outlive the sync.
using OptimizerShard = sk::dist::ShardedParams;

void gather(OptimizerShard& s) {
  at::NoGradGuard no_grad;
  const int64_t world = s.pg->getSize(), rank = s.pg->getRank();
  for (at::Tensor& flat : s.flats) {
    const int64_t chunk = flat.numel() / world;
    at::Tensor mine = flat.narrow(0, rank * chunk, chunk);
    // NCCL gathers in place (the input where the output keeps this rank's part); Gloo is given a
    // copy, as it makes no such promise.
    if (s.backend != kNccl) mine = mine.clone();
    wait(s.pg->_allgather_base(flat, mine));
  }
  sk::weight_casts::refresh(s.params);
}

}  // namespace

extern "C" {

int sk_optimizer_shard_new(void* sync, void** out) {
  SK_TRY({
    *out = new OptimizerShard(sk::dist::sharded_params(*static_cast<const sk::dist::GradientSync*>(sync)));
  })
}

int sk_optimizer_shard_pieces(void* shard, sk_tensor* pieces, int64_t* params, int64_t capacity, int64_t* count) {
  SK_TRY({
    auto* s = static_cast<OptimizerShard*>(shard);
    *count = static_cast<int64_t>(s->pieces.size());
    for (int64_t i = 0; i < std::min(capacity, *count); ++i) {
      pieces[i] = sk::give(s->pieces[i]);
      params[i] = s->piece_params[i];
    }
  })
}

int sk_optimizer_shard_gather(void* shard) { SK_TRY(gather(*static_cast<OptimizerShard*>(shard))) }

int sk_optimizer_shard_all_reduce_(void* shard, sk_tensor tensor, int op) {
  SK_TRY({
    sk::dist::blocking_all_reduce(*static_cast<OptimizerShard*>(shard)->pg, *tensor, op);
  })
}

void sk_optimizer_shard_free(void* shard) { delete static_cast<OptimizerShard*>(shard); }

}  // extern "C"
