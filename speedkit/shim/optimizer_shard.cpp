// ZeRO-1's second half (sk_optimizer_shard_*): a sharded GradientSync (gradient_sync.cpp) leaves
// each rank the averaged gradients of its pieces of the parameters only; the optimizer updates
// those pieces, and every rank's part of each bucket's flat parameter buffer is all-gathered in
// place, which writes every parameter, and their kept autocast copies are refreshed. The
// all-gathers can start bucket by bucket, each as soon as the optimizer updated its pieces, and be
// joined together at the end.
#include "distributed.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdint>

using sk::dist::kNccl;
using sk::dist::wait;

namespace {

// What the sharded sync handed over, with references of its own (the shard may outlive the sync),
// and the all-gathers started and not yet joined.
struct OptimizerShard {
  sk::dist::ShardedParams sharded;
  std::vector<c10::intrusive_ptr<c10d::Work>> started;
  std::vector<at::Tensor> sent;  // Gloo: the copies it gathers from, alive until joined
};

// Starts the all-gather of bucket `k`'s flat parameter buffer from every rank's part of it.
// (ZeRO-3: the bucket's unit is refreshed instead, to be gathered where the next step uses it.)
void gather_bucket(OptimizerShard& s, int64_t k) {
  at::NoGradGuard no_grad;
  const auto& sharded = s.sharded;
  TORCH_CHECK(k >= 0 && k < static_cast<int64_t>(sharded.flats.size()), "no parameter bucket ", k);
  if (sharded.residency) {
    sk::dist::refresh(*sharded.residency, static_cast<size_t>(k));
    return;
  }
  at::Tensor& flat = const_cast<at::Tensor&>(sharded.flats[static_cast<size_t>(k)]);
  const int64_t world = sharded.pg->getSize(), rank = sharded.pg->getRank();
  const int64_t chunk = flat.numel() / world;
  at::Tensor mine = flat.narrow(0, rank * chunk, chunk);
  // NCCL gathers in place (the input where the output keeps this rank's part); Gloo is given a
  // copy, as it makes no such promise.
  if (sharded.backend != kNccl) {
    mine = mine.clone();
    s.sent.push_back(mine);
  }
  s.started.push_back(sharded.pg->_allgather_base(flat, mine));
}

// Joins every started all-gather into the current stream; the parameters' kept autocast copies
// are then refreshed from the gathered values.
void finish_gather(OptimizerShard& s) {
  if (s.sharded.residency) {
    sk::dist::after_step(*s.sharded.residency);
    return;
  }
  for (auto& work : s.started) wait(work);
  s.started.clear();
  s.sent.clear();
  sk::weight_casts::refresh(s.sharded.params);
}

void gather(OptimizerShard& s) {
  if (s.sharded.residency) {
    sk::dist::after_step(*s.sharded.residency);
    return;
  }
  for (int64_t k = 0; k < static_cast<int64_t>(s.sharded.flats.size()); ++k) gather_bucket(s, k);
  finish_gather(s);
}

}  // namespace

extern "C" {

int sk_optimizer_shard_new(void* sync, void** out) {
  SK_TRY({
    *out = new OptimizerShard{sk::dist::sharded_params(*static_cast<const sk::dist::GradientSync*>(sync)), {}, {}};
  })
}

int sk_optimizer_shard_pieces(void* shard, sk_tensor* pieces, int64_t* params, int64_t* offsets, int64_t capacity,
                              int64_t* count) {
  SK_TRY({
    const auto& s = static_cast<OptimizerShard*>(shard)->sharded;
    *count = static_cast<int64_t>(s.pieces.size());
    for (int64_t i = 0; i < std::min(capacity, *count); ++i) {
      pieces[i] = sk::give(s.pieces[i]);
      params[i] = s.piece_params[i];
      offsets[i] = s.piece_offsets[i];
    }
  })
}

int sk_optimizer_shard_gather(void* shard) { SK_TRY(gather(*static_cast<OptimizerShard*>(shard))) }

int sk_optimizer_shard_gather_bucket(void* shard, int64_t bucket) {
  SK_TRY(gather_bucket(*static_cast<OptimizerShard*>(shard), bucket))
}

int sk_optimizer_shard_finish_gather(void* shard) { SK_TRY(finish_gather(*static_cast<OptimizerShard*>(shard))) }

int sk_optimizer_shard_all_reduce_(void* shard, sk_tensor tensor, int op) {
  SK_TRY({
    sk::dist::blocking_all_reduce(*static_cast<OptimizerShard*>(shard)->sharded.pg, *tensor, op);
  })
}

void sk_optimizer_shard_free(void* shard) { delete static_cast<OptimizerShard*>(shard); }

}  // extern "C"
