// speedkit's gradient all-reduce over distributed.cpp's process groups, as work of the step
// (sk_grad_sync_*): only stream work, which a CUDA graph captures with the step (ProcessGroupNCCL
// records a collective issued during a capture into it and leaves it out of its watchdog). Each
// bucket holds parameters of one type; its gradients are copied into a flat buffer in the wire
// type, all-reduced in place and averaged (NCCL's AVG; a division for Gloo, which has none), cast
// back where the wire type differs, and the parameters' gradients become views of the result, so
// the fp32 wire costs no copy back.
//
// Two schedules. Armed before a backward pass (sk_grad_sync_arm), a post-accumulate-grad hook on
// each parameter copies its gradient into the bucket as autograd produces it and frees it, and a
// bucket's all-reduce starts as soon as its last gradient arrives (buckets start in index order on
// every rank, as NCCL requires), on ProcessGroupNCCL's own stream, so communication overlaps the
// rest of the backward pass; the run after the backward pass starts what is left and joins them.
// Unarmed, the run copies every gradient after the backward pass and all-reduces bucket by bucket.
// Holding only the bucket, never the gradient beside it, the gradients cost no more memory than
// PyTorch's DDP with gradient_as_bucket_view.
//
// Sharded (ZeRO-1), a bucket is padded to a multiple of the world size and reduce-scattered
// instead: rank r keeps the average of elements [r * chunk, (r + 1) * chunk) only, which become
// the gradients of its pieces of the parameters (detached views, each a contiguous stretch of one
// parameter), and the whole gradients are dropped: this rank's own, they are not the average. The
// bucket's parameters move into one flat buffer laid out as the gradients' (set_data: values,
// shapes and autograd identity kept), so that OptimizerShard all-gathers the pieces the optimizer
// updated straight into the parameters, with no copy in or out (optimizer_shard.cpp).
#include "distributed.h"
#include "replay_watchdog.h"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

using sk::dist::GradientSync;
using sk::dist::views_of;
using sk::dist::kNccl;
using sk::dist::wait;

namespace {

// A stretch of one parameter inside this rank's part of a sharded bucket.
struct ShardPiece {
  size_t param;     // its index in the bucket
  int64_t begin;    // its offset in this rank's part
  at::Tensor view;  // flat, detached: the optimizer's "parameter"
  int64_t offset;   // its first element's place in its parameter's flattened values
};

struct GradientBucket {
  std::vector<at::Tensor> params;
  std::vector<size_t> index;  // each parameter's position in the list sk_grad_sync_new was given
  // One parameter sent in its own type (a parameter at least the bucket size: an embedding, a big
  // projection) needs no flat buffer: its gradient is all-reduced where autograd left it, without
  // a copy in or out.
  bool direct = false;
  int64_t numel = 0;
  int64_t padded = 0;  // the flat buffer's length: `numel`, sharded rounded up to the world size
  at::ScalarType wire_type = at::kFloat;
  std::vector<ShardPiece> shard;  // sharded: this rank's pieces
  at::Tensor flat;                // sharded: the parameters' flat buffer, `padded` long
  // Made when the bucket's first gradient arrives (inside the backward pass, where a capture's
  // pool reuses the memory activations free) and let go once averaged: from then on only the
  // parameters hold their gradients, views of it, as they would hold autograd's own.
  at::Tensor wire;                  // flat, in the wire type; direct: the gradient itself
  std::vector<at::Tensor> wire_views;  // one per parameter, shaped like it
  std::vector<bool> arrived;        // armed: whose gradient arrived this backward pass
  // ZeRO-3's pinned unit keeps its arrived gradients on their parameters (in the compute type)
  // until its last one arrives, and only then fills the wire: its first gradient (the head's) comes
  // at the start of the backward pass and its last (the embedding's) at the end, so it holds half
  // the bytes through the pass. A block's gradients arrive together: they go into the wire one by
  // one, which never holds them all beside it.
  bool hold_until_complete = false;
  bool filled = false;
  size_t pending = 0;               // armed: how many have not arrived
  c10::intrusive_ptr<c10d::Work> work;  // its all-reduce, once started
  at::Tensor reduced;                   // sharded: this rank's averaged part, once started
};

// Where a parameter's gradient goes.
struct Slot {
  GradientSync* sync;
  size_t bucket, index;
};

struct ArrivalHook : torch::autograd::PostAccumulateGradHook {
  explicit ArrivalHook(Slot s) : slot(s) {}
  void operator()(const torch::autograd::Variable& param) override;
  Slot slot;
};

}  // namespace

// What a `void* sync` of speedkit.h points at (sk_grad_sync_new).
struct sk::dist::GradientSync {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::shared_ptr<Heartbeat> heartbeat;  // the group's, for the replay watchdog's message
  int backend;
  bool sharded = false;
  std::vector<GradientBucket> buckets;
  std::shared_ptr<sk::dist::Residency> residency;  // sharded over parameters (ZeRO-3)
  std::mutex mutex;  // the hooks run on autograd's device threads
  bool armed = false;
  size_t next = 0;   // armed: the next bucket to start
  ReplayWatchdog watchdog;

  ~GradientSync() {
    for (GradientBucket& b : buckets)
      for (at::Tensor& p : b.params) {
        auto& hook = torch::autograd::impl::post_acc_grad_hooks(p);
        if (dynamic_cast<ArrivalHook*>(hook.get()) != nullptr) hook.reset();
      }
  }
};

namespace {

GradientBucket make_bucket(std::vector<at::Tensor> params, std::vector<size_t> index,
                           std::optional<at::ScalarType> wire_type) {
  GradientBucket b;
  for (const at::Tensor& p : params) b.numel += p.numel();
  b.padded = b.numel;
  b.index = std::move(index);
  b.wire_type = wire_type.value_or(params[0].scalar_type());
  b.arrived.assign(params.size(), false);
  b.direct = params.size() == 1 && b.wire_type == params[0].scalar_type();
  b.params = std::move(params);
  return b;
}

// The parameters of a sharded bucket in one flat buffer: a lone parameter that needs no padding
// is its own, the others move into a new one.
void flatten_params(GradientBucket& b) {
  if (b.params.size() == 1 && b.padded == b.numel && b.params[0].is_contiguous()) {
    b.flat = b.params[0].detach().view({-1});
    return;
  }
  at::NoGradGuard no_grad;
  b.flat = at::empty({b.padded}, b.params[0].options().requires_grad(false));
  if (b.padded > b.numel) b.flat.narrow(0, b.numel, b.padded - b.numel).zero_();
  const std::vector<at::Tensor> views = views_of(b.flat, b.params);
  for (size_t i = 0; i < b.params.size(); ++i) {
    views[i].copy_(b.params[i]);
    b.params[i].set_data(views[i]);
  }
}

// Rank `rank`'s part of a bucket sharded over `world` ranks: the padding, the parameters' flat
// buffer, and the pieces of the parameters that fall in this rank's part. A bucket needs a flat
// gradient buffer unless it is one parameter that needs no padding.
void shard_bucket(GradientBucket& b, int rank, int world) {
  b.padded = (b.numel + world - 1) / world * world;
  b.direct = b.direct && b.padded == b.numel;
  flatten_params(b);
  const int64_t chunk = b.padded / world, lo = rank * chunk, hi = lo + chunk;
  int64_t offset = 0;
  for (size_t i = 0; i < b.params.size(); ++i) {
    const at::Tensor& p = b.params[i];
    const int64_t begin = std::max(offset, lo), end = std::min(offset + p.numel(), hi);
    if (begin < end) b.shard.push_back({i, begin - lo, b.flat.narrow(0, begin, end - begin), begin - offset});
    offset += p.numel();
  }
}

// ZeRO-3: the bucket's parameters become a unit of `residency`, and this rank's pieces are
// stretches of the unit's fp32 part.
void shard_unit(GradientSync& sync, GradientBucket& b, at::ScalarType compute, bool pinned) {
  const size_t unit = sk::dist::add_unit(*sync.residency, b.params, compute, pinned);
  const at::Tensor& master = sk::dist::master_of(*sync.residency, unit);
  const int64_t chunk = master.numel(), lo = sync.pg->getRank() * chunk, hi = lo + chunk;
  b.padded = chunk * sync.pg->getSize();
  b.direct = false;
  b.flat = master;
  int64_t offset = 0;
  for (size_t i = 0; i < b.params.size(); ++i) {
    const int64_t begin = std::max(offset, lo), end = std::min(offset + b.params[i].numel(), hi);
    if (begin < end) b.shard.push_back({i, begin - lo, master.narrow(0, begin - lo, end - begin), begin - offset});
    offset += b.params[i].numel();
  }
}

// Buckets of the parameters by unit (`units[i]`: parameter i's; negative: the pinned one), each
// unit's bucket placed by its first parameter, the last first: a unit's gradients are all in once
// the backward pass reaches its first parameter (the pinned unit, with the embedding, goes last).
std::vector<GradientBucket> unit_buckets(const std::vector<at::Tensor>& list, const int64_t* units,
                                         std::optional<at::ScalarType> wire) {
  std::map<int64_t, std::pair<std::vector<at::Tensor>, std::vector<size_t>>> by_unit;
  std::map<int64_t, size_t> first;
  for (size_t k = 0; k < list.size(); ++k) {
    auto& [params, index] = by_unit[units[k]];
    params.push_back(list[k]);
    index.push_back(k);
    first.emplace(units[k], k);
  }
  std::vector<std::pair<size_t, int64_t>> order;
  for (const auto& [unit, k] : first) order.emplace_back(k, unit);
  std::sort(order.rbegin(), order.rend());
  std::vector<GradientBucket> buckets;
  for (const auto& [k, unit] : order) {
    auto& [params, index] = by_unit[unit];
    buckets.push_back(make_bucket(std::move(params), std::move(index), wire));
  }
  return buckets;
}

// The bucket's flat buffer, made at first use in this backward pass (its padding zeroed).
void make_wire(GradientBucket& b) {
  if (b.wire.defined()) return;
  b.wire = at::empty({b.padded}, b.params[0].options().requires_grad(false).dtype(b.wire_type));
  if (b.padded > b.numel) b.wire.narrow(0, b.numel, b.padded - b.numel).zero_();
  b.wire_views = views_of(b.wire, b.params);
}

void start(GradientSync& sync, GradientBucket& b) {
  const c10d::ReduceOp op = sync.backend == kNccl ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  if (sync.sharded) {
    b.reduced = at::empty({b.padded / sync.pg->getSize()}, b.wire.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = op;
    at::Tensor input = b.wire.view({-1});  // (direct: the gradient, in its parameter's shape)
    b.work = sync.pg->_reduce_scatter_base(b.reduced, input, options);
    if (sync.residency) {
      // ZeRO-3 holds no whole gradient past its reduce-scatter: c10d's work keeps what it reads
      // until it is joined (start_ready joins all but the last kUnitsInFlight).
      b.wire = at::Tensor();
      b.wire_views.clear();
    }
    return;
  }
  std::vector<at::Tensor> one{b.wire};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  b.work = sync.pg->allreduce(one, options);
}

// Sharded: this rank's averaged part becomes its pieces' gradients; the whole gradients go.
void finish_shard(GradientSync& sync, GradientBucket& b) {
  if (sync.backend != kNccl) b.reduced.div_(sync.pg->getSize());
  // The pieces' type: the parameters' under ZeRO-1, fp32 (their master copy) under ZeRO-3.
  const at::Tensor grads = b.shard.empty() ? b.reduced : b.reduced.to(b.shard[0].view.scalar_type());
  for (ShardPiece& piece : b.shard) piece.view.mutable_grad() = grads.narrow(0, piece.begin, piece.view.numel());
  for (at::Tensor& p : b.params) p.mutable_grad().reset();
  b.reduced = at::Tensor();
}

// Whole: the averaged bucket becomes the parameters' gradients (views of it).
void finish_whole(GradientSync& sync, GradientBucket& b) {
  if (sync.backend != kNccl) b.wire.div_(sync.pg->getSize());
  if (b.direct) return;  // the parameter's gradient is `wire` already
  const at::Tensor grads = b.wire.to(b.params[0].scalar_type());
  const std::vector<at::Tensor> views = views_of(grads, b.params);
  for (size_t i = 0; i < b.params.size(); ++i) b.params[i].mutable_grad() = views[i];
}

// Joins a started all-reduce (or reduce-scatter) into the current stream and finishes the average;
// nothing for a bucket joined already.
void finish(GradientSync& sync, GradientBucket& b) {
  if (!b.work) return;
  wait(b.work);
  b.work.reset();
  if (sync.sharded) {
    finish_shard(sync, b);
  } else {
    finish_whole(sync, b);
  }
  b.wire = at::Tensor();
  b.wire_views.clear();
}

// Copies into the bucket's wire (made if need be) the gradients its parameters hold, zeros for one
// without; those that arrived already are in it, unless `arrived_too`.
void copy_into_wire(GradientBucket& b, bool arrived_too) {
  make_wire(b);
  std::vector<at::Tensor> from, to;
  for (size_t i = 0; i < b.params.size(); ++i) {
    if (b.arrived[i] && !arrived_too) continue;
    const at::Tensor& grad = b.params[i].grad();
    if (grad.defined()) {
      from.push_back(grad);
      to.push_back(b.wire_views[i]);
    } else {
      b.wire_views[i].zero_();
    }
  }
  if (!from.empty()) at::_foreach_copy_(to, from);
}

// A held bucket's wire filled from every gradient its parameters hold, which they then let go.
void fill_wire(GradientBucket& b) {
  copy_into_wire(b, /*arrived_too=*/true);
  for (at::Tensor& p : b.params) p.mutable_grad().reset();
  b.filled = true;
}

// A direct bucket's gradient: the parameter's own, made contiguous where it is not, or zeros where
// it has none; the parameter keeps it as its gradient.
void take_direct(GradientBucket& b, const at::Tensor& param) {
  const at::Tensor& grad = param.grad();
  at::Tensor taken = grad.defined() ? grad.contiguous() : at::zeros_like(param);
  if (!taken.is_same(grad)) const_cast<at::Tensor&>(param).mutable_grad() = taken;
  b.wire = taken;
}

// Reduce-scatters ZeRO-3 lets run at once: c10d keeps each one's input, a unit's whole gradient,
// until it is joined, so a backward pass that outruns the wire would otherwise hold them all. One,
// as FSDP2: on two H200s `llama_large`'s step took as long as with two in flight, with 0.75 GiB
// less at its peak (docs/benchmarks/README.md).
constexpr size_t kUnitsInFlight = 1;

// Starts, in index order, every bucket from `next` on whose gradients have all arrived.
void start_ready(GradientSync& sync) {
  while (sync.next < sync.buckets.size() && sync.buckets[sync.next].pending == 0) {
    start(sync, sync.buckets[sync.next++]);
    if (sync.residency && sync.next > kUnitsInFlight) finish(sync, sync.buckets[sync.next - kUnitsInFlight - 1]);
  }
}

void ArrivalHook::operator()(const torch::autograd::Variable& param) {
  GradientSync& sync = *slot.sync;
  std::lock_guard<std::mutex> lock(sync.mutex);
  if (!sync.armed) return;
  GradientBucket& b = sync.buckets[slot.bucket];
  const at::Tensor& grad = param.grad();
  if (!grad.defined() || b.arrived[slot.index]) return;
  if (b.direct) {
    take_direct(b, param);
  } else if (!b.hold_until_complete) {
    make_wire(b);
    b.wire_views[slot.index].copy_(grad);
    // The bucket holds it now; the step's averaged gradient will be a view of the bucket.
    const_cast<torch::autograd::Variable&>(param).mutable_grad().reset();
  }
  b.arrived[slot.index] = true;
  --b.pending;
  if (sync.residency && b.pending == 0) {
    if (b.hold_until_complete) fill_wire(b);
    sk::dist::done_with(*sync.residency, slot.bucket);
  }
  start_ready(sync);
}

void arm(GradientSync& sync) {
  std::lock_guard<std::mutex> lock(sync.mutex);
  for (GradientBucket& b : sync.buckets) {
    b.arrived.assign(b.params.size(), false);
    b.pending = b.params.size();
    b.filled = false;
  }
  sync.next = 0;
  sync.armed = true;
}

// Armed: fills in what did not arrive (a parameter the loss does not reach: zeros, or a gradient
// set by hand) and starts the rest. Unarmed: the same from the gradients as they are.
void start_rest(GradientSync& sync) {
  std::lock_guard<std::mutex> lock(sync.mutex);
  if (!sync.armed) {
    for (GradientBucket& b : sync.buckets) {
      b.arrived.assign(b.params.size(), false);
      b.filled = false;
    }
    sync.next = 0;
  }
  sync.armed = false;
  for (size_t k = sync.next; k < sync.buckets.size(); ++k) {
    GradientBucket& b = sync.buckets[k];
    if (b.direct) {
      if (!b.arrived[0]) take_direct(b, b.params[0]);
      start(sync, b);
      continue;
    }
    if (b.hold_until_complete) {
      // The arrived gradients are still on their parameters unless the unit was complete.
      if (!b.filled) fill_wire(b);
      start(sync, b);
      continue;
    }
    copy_into_wire(b, /*arrived_too=*/false);
    start(sync, b);
  }
  sync.next = sync.buckets.size();
}

// Joins bucket `k` (every bucket where `k` is negative) into the current stream.
void join(GradientSync& sync, int64_t k) {
  std::lock_guard<std::mutex> lock(sync.mutex);
  TORCH_CHECK(k < static_cast<int64_t>(sync.buckets.size()), "no gradient bucket ", k, " of ", sync.buckets.size());
  if (k >= 0) {
    finish(sync, sync.buckets[static_cast<size_t>(k)]);
    return;
  }
  for (GradientBucket& b : sync.buckets) finish(sync, b);
}

}  // namespace

sk::dist::ShardedParams sk::dist::sharded_params(const GradientSync& sync) {
  TORCH_CHECK(sync.sharded, "this gradient sync was not made sharded");
  ShardedParams out{sync.backend, sync.pg, {}, {}, {}, {}, {}, sync.residency};
  for (const GradientBucket& b : sync.buckets) {
    out.flats.push_back(b.flat);
    out.params.insert(out.params.end(), b.params.begin(), b.params.end());
    for (const ShardPiece& piece : b.shard) {
      out.pieces.push_back(piece.view);
      out.piece_params.push_back(static_cast<int64_t>(b.index[piece.param]));
      out.piece_offsets.push_back(piece.offset);
    }
  }
  return out;
}

extern "C" {

int sk_grad_sync_new(void* group, const sk_tensor* params, int64_t n, const int64_t* units, int64_t bucket_bytes,
                     int wire_type, int shard, int param_type, void** out) {
  SK_TRY({
    auto* g = static_cast<sk::dist::Group*>(group);
    auto sync = std::make_unique<GradientSync>();
    sync->pg = g->pg;
    sync->heartbeat = g->heartbeat;
    sync->backend = g->backend;
    sync->sharded = shard != 0;
    TORCH_CHECK(shard != 2 || units != nullptr, "sharding the parameters needs their units");
    std::optional<at::ScalarType> wire;
    if (wire_type >= 0) wire = static_cast<at::ScalarType>(wire_type);
    std::vector<at::Tensor> list = sk::tensor_list(params, n);
    if (units != nullptr) sync->buckets = unit_buckets(list, units, wire);
    // Otherwise by size, in reverse registration order, as the Reducer's buckets: the last layers'
    // gradients first.
    std::vector<at::Tensor> pending;
    std::vector<size_t> pending_index;
    int64_t bytes = 0;
    const auto flush = [&] {
      if (!pending.empty()) sync->buckets.push_back(make_bucket(std::move(pending), std::move(pending_index), wire));
      pending.clear();
      pending_index.clear();
      bytes = 0;
    };
    for (size_t k = units != nullptr ? 0 : list.size(); k-- > 0;) {
      // The parameter itself, not a detached alias: its gradient lives on it.
      const at::Tensor& p = list[k];
      const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
      // A parameter of a bucket's size or more gets a bucket of its own (all-reduced in place).
      const bool alone = size >= bucket_bytes;
      if (!pending.empty() && (pending[0].options().dtype() != p.options().dtype() || bytes >= bucket_bytes || alone))
        flush();
      pending.push_back(p);
      pending_index.push_back(k);
      bytes += size;
      if (alone) flush();
    }
    flush();
    if (shard == 2) {
      const auto compute = param_type >= 0 ? static_cast<at::ScalarType>(param_type) : list.at(0).scalar_type();
      sync->residency = sk::dist::make_residency(sync->pg, sync->backend);
      for (size_t k = 0; k < sync->buckets.size(); ++k) {
        GradientBucket& b = sync->buckets[k];
        const bool pinned = units[b.index[0]] < 0;
        shard_unit(*sync, b, compute, pinned);
        b.hold_until_complete = pinned;
      }
    } else if (sync->sharded) {
      for (GradientBucket& b : sync->buckets) shard_bucket(b, sync->pg->getRank(), sync->pg->getSize());
    }
    for (size_t k = 0; k < sync->buckets.size(); ++k)
      for (size_t i = 0; i < sync->buckets[k].params.size(); ++i) {
        const at::Tensor& p = sync->buckets[k].params[i];
        auto& hook = torch::autograd::impl::post_acc_grad_hooks(p);
        TORCH_CHECK(hook == nullptr,
                    "a parameter already has a post-accumulate-grad hook (another gradient all-reduce, or "
                    "torch's own): speedkit's in-step all-reduce needs it");
        torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<ArrivalHook>(Slot{sync.get(), k, i}));
      }
    if (sync->residency) sk::dist::start_observing(*sync->residency);
    *out = sync.release();
  })
}

int sk_grad_sync_arm(void* sync) { SK_TRY(arm(*static_cast<GradientSync*>(sync))) }

int sk_grad_sync_run(void* sync) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    start_rest(*s);
    join(*s, -1);
  })
}

int sk_grad_sync_start(void* sync) { SK_TRY(start_rest(*static_cast<GradientSync*>(sync))) }

int sk_grad_sync_join(void* sync, int64_t bucket) { SK_TRY(join(*static_cast<GradientSync*>(sync), bucket)) }

int sk_grad_sync_bucket_members(void* sync, int64_t bucket, int64_t* params, int64_t capacity, int64_t* count) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    TORCH_CHECK(bucket >= 0 && bucket < static_cast<int64_t>(s->buckets.size()), "no gradient bucket ", bucket);
    const std::vector<size_t>& index = s->buckets[static_cast<size_t>(bucket)].index;
    *count = static_cast<int64_t>(index.size());
    for (int64_t i = 0; i < std::min(capacity, *count); ++i) params[i] = static_cast<int64_t>(index[static_cast<size_t>(i)]);
  })
}

int sk_grad_sync_watch_replay(void* sync, int64_t timeout_ms, const char* rank) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    s->watchdog.watch(s->pg, std::chrono::milliseconds(timeout_ms), rank, s->heartbeat);
  })
}

int sk_grad_sync_shape(void* sync, int64_t* buckets, int64_t* wire_bytes) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    *buckets = static_cast<int64_t>(s->buckets.size());
    *wire_bytes = 0;
    for (const auto& b : s->buckets)
      *wire_bytes += b.padded * static_cast<int64_t>(c10::elementSize(b.wire_type));
  })
}

int sk_grad_sync_resident_bytes(void* sync, int64_t* bytes) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    TORCH_CHECK(s->residency, "this gradient sync does not shard the parameters");
    *bytes = sk::dist::resident_bytes(*s->residency);
  })
}

int sk_grad_sync_gather_parameters(void* sync, sk_tensor* out, int64_t capacity) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    TORCH_CHECK(s->residency, "this gradient sync does not shard the parameters");
    std::vector<at::Tensor> whole = sk::dist::gather_masters(*s->residency);
    size_t next = 0;
    for (const GradientBucket& b : s->buckets)
      for (size_t i = 0; i < b.params.size(); ++i, ++next) {
        const auto k = static_cast<int64_t>(b.index[i]);
        TORCH_CHECK(k < capacity, "room for ", capacity, " parameters, not ", k + 1);
        out[k] = sk::give(whole.at(next));
      }
  })
}

int sk_grad_sync_refresh_parameters(void* sync) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    TORCH_CHECK(s->residency, "this gradient sync does not shard the parameters");
    for (size_t k = 0; k < s->buckets.size(); ++k) sk::dist::refresh(*s->residency, k);
  })
}

int sk_grad_sync_unshard(void* sync, int gather) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    if (s->residency) sk::dist::unshard(*s->residency, gather != 0);
  })
}

void sk_grad_sync_free(void* sync) { delete static_cast<GradientSync*>(sync); }

}  // extern "C"
