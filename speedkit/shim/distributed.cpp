// Data parallelism through libtorch's c10d: the rendezvous store (TCPStore), a process group with
// Gloo (CPU tensors) or NCCL (CUDA tensors) behind it, the blocking collectives speedkit needs at
// start-up and for the GradScaler, and the C++ Reducer that Python's DistributedDataParallel drives
// (bucketed gradient all-reduce launched from autograd hooks while the backward pass runs, averaged
// by the world size, waited on at the end of backward).
//
// Every blocking call here is bounded: the store by its timeout (connect and every get), Gloo by its
// per-operation timeout, NCCL by ProcessGroupNCCL's watchdog (which aborts the communicator and the
// process after the timeout). A peer that dies makes Gloo fail at once ("connection closed").
#include "shim.h"

#include <ATen/Functions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#if SK_WITH_CUDA && SK_WITH_NCCL
#include <c10/core/Event.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

enum Backend : int { kGloo = 0, kNccl = 1 };
enum Op : int { kSum = 0, kMax = 1 };

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int backend;
};

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case kSum: return c10d::ReduceOp::SUM;
    case kMax: return c10d::ReduceOp::MAX;
    default: TORCH_CHECK(false, "unknown reduce op ", op);
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Gloo binds to the address the host name resolves to, which containers often get wrong; on one
// machine (loopback rendezvous) the loopback interface is always right. GLOO_SOCKET_IFNAME wins, as
// in PyTorch.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (is_loopback(master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, std::chrono::milliseconds timeout,
                                            const std::string& master_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device(master_addr));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
}

#if SK_WITH_CUDA && SK_WITH_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                            int world, int local_rank,
                                            std::chrono::milliseconds timeout) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
}
#endif

void wait(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }

// `tensor` reduced in place across `pg` by `op` (speedkit.h's sk_reduce_op), waited for.
void blocking_all_reduce(c10d::ProcessGroup& pg, const at::Tensor& tensor, int op) {
  std::vector<at::Tensor> one{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op);
  wait(pg.allreduce(one, options));
}

// The rendezvous store outlives the groups built over it: a process that trains under several
// contexts one after another (a benchmark runner, an #[accelerate] function called twice) builds a
// group per context. Were each to open its own store on the same port, a fast rank could reach the
// store of the group rank 0 is still tearing down and read its stale keys. So every process keeps
// one connection (rank 0: the server) per rendezvous address, and the n-th group of the process
// takes its keys under its own prefix; ranks build their groups in the same order, so the n-th
// group of every rank meets under the same prefix. Never freed: it lives as long as the process.
struct SharedStore {
  std::string host;
  int port;
  int rank;
  int world;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  std::int64_t groups;
};

std::mutex shared_store_mutex;
SharedStore* shared_store = nullptr;

// The store for the next group at host:port, and that group's key prefix.
std::pair<c10::intrusive_ptr<c10d::Store>, c10::intrusive_ptr<c10d::TCPStore>> next_group_store(
    const std::string& host, int port, int rank, int world, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(shared_store_mutex);
  const bool same = shared_store && shared_store->host == host && shared_store->port == port &&
                    shared_store->rank == rank && shared_store->world == world;
  if (!same) {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(port);
    options.isServer = rank == 0;
    options.numWorkers = static_cast<std::size_t>(world);
    options.waitWorkers = true;
    options.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(host, options);
    // A previous store (another address) is left to the groups that still hold it.
    shared_store = new SharedStore{host, port, rank, world, tcp, 0};
  }
  shared_store->tcp->setTimeout(timeout);
  const std::string prefix = "speedkit/" + std::to_string(shared_store->groups++) + "/";
  return {c10::make_intrusive<c10d::PrefixStore>(prefix, shared_store->tcp), shared_store->tcp};
}

}  // namespace

extern "C" {

// Rendezvous at master_addr:port (rank 0 serves the store and waits for all `world` ranks; later
// groups of the process reuse it, see SharedStore), then builds the process group. `timeout_ms` bounds the rendezvous, every store access and every
// collective. On success *out owns a Group (free with sk_dist_free).
int sk_dist_init(int backend, const char* master_addr, int port, int rank, int world,
                 int local_rank, int64_t timeout_ms, void** out) {
  SK_TRY({
    const std::string host(master_addr);
    const std::chrono::milliseconds timeout(timeout_ms);
    auto [store, tcp] = next_group_store(host, port, rank, world, timeout);

    auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
    if (backend == kGloo) {
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                     make_gloo(store, rank, world, timeout, host));
    } else {
#if SK_WITH_CUDA && SK_WITH_NCCL
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL,
                     make_nccl(store, rank, world, local_rank, timeout));
#else
      TORCH_CHECK(false,
                  "the NCCL backend needs speedkit built against a CUDA libtorch with the NCCL "
                  "headers (nvidia/nccl/include next to torch)");
#endif
    }
    *out = new Group{tcp, pg, backend};
  })
}

void sk_dist_free(void* group) {
  auto* g = static_cast<Group*>(group);
  try {
    g->pg->shutdown();
  } catch (...) {
    // A peer already gone makes shutdown report it; the group is released either way.
  }
  delete g;
}

int sk_dist_broadcast_(void* group, const sk_tensor* tensors, int64_t n, int root) {
  SK_TRY({
    auto* g = static_cast<Group*>(group);
    auto list = sk::tensor_list(tensors, n);
    c10d::BroadcastOptions options;
    options.rootRank = root;
    for (auto& t : list) {
      std::vector<at::Tensor> one{t};
      wait(g->pg->broadcast(one, options));
    }
  })
}

int sk_dist_all_reduce_(void* group, sk_tensor tensor, int op) {
  SK_TRY({
    blocking_all_reduce(*static_cast<Group*>(group)->pg, *tensor, op);
  })
}

// Every rank's `tensor`, stacked along a new first dimension (rank order).
int sk_dist_all_gather(void* group, sk_tensor tensor, sk_tensor* out) {
  SK_TRY({
    auto* g = static_cast<Group*>(group);
    std::vector<at::Tensor> input{*tensor};
    std::vector<at::Tensor> slots;
    for (int r = 0; r < g->pg->getSize(); ++r) slots.push_back(at::empty_like(*tensor));
    std::vector<std::vector<at::Tensor>> outputs{slots};
    wait(g->pg->allgather(outputs, input));
    *out = new at::Tensor(at::stack(outputs[0]));
  })
}

int sk_dist_barrier(void* group) {
  SK_TRY({
    auto* g = static_cast<Group*>(group);
    wait(g->pg->barrier());
  })
}

// A Reducer over `params` (in registration order) with buckets of `bucket_bytes` (the first one
// `first_bucket_bytes`, so the last layers' gradients leave early), assigned in reverse parameter
// order as DistributedDataParallel does: gradients become ready roughly from the last layer back.
int sk_reducer_new(void* group, const sk_tensor* params, int64_t n, int64_t bucket_bytes,
                   int64_t first_bucket_bytes, void** out) {
  SK_TRY({
    auto* g = static_cast<Group*>(group);
    auto list = sk::tensor_list(params, n);
    std::vector<bool> sparse(list.size(), false);
    std::vector<size_t> caps{static_cast<size_t>(first_bucket_bytes),
                             static_cast<size_t>(bucket_bytes)};
    std::vector<int64_t> order(list.size());
    for (size_t i = 0; i < list.size(); ++i) order[i] = static_cast<int64_t>(list.size() - 1 - i);
    std::vector<at::Tensor> reversed(list.rbegin(), list.rend());
    auto [buckets, limits] =
        c10d::compute_bucket_assignment_by_size(reversed, caps, sparse, order);
    std::reverse(buckets.begin(), buckets.end());
    std::vector<int64_t> cap_list(limits.rbegin(), limits.rend());
    std::unordered_map<size_t, std::string> names;
    *out = new c10d::Reducer(list, buckets, g->pg, sparse, bucket_bytes,
                             /*find_unused_parameters=*/false,
                             /*gradient_as_bucket_view=*/false, names, first_bucket_bytes,
                             /*skip_all_reduce_unused_params=*/false,
                             /*use_python_reducer=*/false, cap_list);
  })
}

// Before each backward pass: after the first iteration the buckets are rebuilt once in the order
// gradients actually became ready (agreed with rank 0), then the hooks are armed for one backward.
int sk_reducer_prepare(void* reducer) {
  SK_TRY({
    auto* r = static_cast<c10d::Reducer*>(reducer);
    r->rebuild_buckets();
    r->prepare_for_backward({});
  })
}

void sk_reducer_free(void* reducer) {
  try {
    delete static_cast<c10d::Reducer*>(reducer);
  } catch (...) {
    // ~Reducer is noexcept(false) in c10d; nothing useful can be done with its complaint here.
  }
}

}  // extern "C"

namespace {

// The gradient all-reduce as work of the step (sk_grad_sync_*): only stream work, which a CUDA
// graph captures with the step (ProcessGroupNCCL records a collective issued during a capture into
// it and leaves it out of its watchdog). Each bucket holds parameters of one type; its gradients
// are copied into a flat buffer in the wire type, all-reduced in place and averaged (NCCL's AVG; a
// division for Gloo, which has none), cast back where the wire type differs, and the parameters'
// gradients become views of the result, so the fp32 wire costs no copy back.
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
// updated straight into the parameters, with no copy in or out.

// A stretch of one parameter inside this rank's part of a sharded bucket.
struct ShardPiece {
  size_t param;     // its index in the bucket
  int64_t begin;    // its offset in this rank's part
  at::Tensor view;  // flat, detached: the optimizer's "parameter"
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
  std::vector<bool> arrived;        // armed: whose gradient is in `wire` this backward pass
  size_t pending = 0;               // armed: how many have not arrived
  c10::intrusive_ptr<c10d::Work> work;  // its all-reduce, once started
  at::Tensor reduced;                   // sharded: this rank's averaged part, once started
};

struct GradientSync;

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

// Bounds the replays of a captured step on the collectives inside it: c10d's watchdog only
// follows the collectives it launched itself, not those a CUDA graph replays, so a peer that died
// or hangs would leave this rank waiting forever. After each replay an event is recorded on the
// replay's stream; a thread checks the oldest one every 50 ms, and one not done by its deadline
// ends the process as c10d's watchdog does after its timeout: a message naming the rank, NCCL's
// communicators aborted (which also frees the peers' kernels), and exit status 1.
struct ReplayWatchdog {
#if SK_WITH_CUDA && SK_WITH_NCCL
  // c10::Event, not at::cuda::CUDAEvent: it reaches CUDA through c10's device guard, so the shim
  // needs no CUDA runtime of its own.
  struct Pending {
    c10::Event done;
    std::chrono::steady_clock::time_point deadline;
  };
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::string who;
  std::chrono::milliseconds timeout{0};
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Pending> pending;
  bool stopping = false;
  std::thread thread;

  void watch(const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::chrono::milliseconds limit,
             const std::string& rank) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!thread.joinable()) {
      pg = group;
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
      std::fprintf(stderr,
                   "speedkit: %s: a replay of the training step's CUDA graph, whose gradient all-reduce "
                   "waits on every rank, did not finish within the %lld s timeout (distributed.timeout_s): a "
                   "peer died or hangs. Aborting NCCL's communicators and exiting.\n",
                   who.c_str(), static_cast<long long>(timeout.count() / 1000));
      std::fflush(stderr);
      try {
        pg->abort();
      } catch (...) {
        // Exiting either way.
      }
      std::_Exit(1);
    }
  }

  ~ReplayWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_one();
    if (thread.joinable()) thread.join();
  }
#else
  void watch(const c10::intrusive_ptr<c10d::ProcessGroup>&, std::chrono::milliseconds, const std::string&) {
    TORCH_CHECK(false, "a CUDA graph replay needs speedkit built with CUDA and NCCL");
  }
#endif
};

struct GradientSync {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int backend;
  bool sharded = false;
  std::vector<GradientBucket> buckets;
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

std::vector<at::Tensor> views_of(const at::Tensor& flat, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> views;
  int64_t offset = 0;
  for (const at::Tensor& p : like) {
    views.push_back(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  return views;
}

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
    if (begin < end) b.shard.push_back({i, begin - lo, b.flat.narrow(0, begin, end - begin)});
    offset += p.numel();
  }
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
  const at::Tensor grads = b.reduced.to(b.params[0].scalar_type());
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

// Joins a started all-reduce (or reduce-scatter) into the current stream and finishes the average.
void finish(GradientSync& sync, GradientBucket& b) {
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

// A direct bucket's gradient: the parameter's own, made contiguous where it is not, or zeros where
// it has none; the parameter keeps it as its gradient.
void take_direct(GradientBucket& b, const at::Tensor& param) {
  const at::Tensor& grad = param.grad();
  at::Tensor taken = grad.defined() ? grad.contiguous() : at::zeros_like(param);
  if (!taken.is_same(grad)) const_cast<at::Tensor&>(param).mutable_grad() = taken;
  b.wire = taken;
}

// Starts, in index order, every bucket from `next` on whose gradients have all arrived.
void start_ready(GradientSync& sync) {
  while (sync.next < sync.buckets.size() && sync.buckets[sync.next].pending == 0) start(sync, sync.buckets[sync.next++]);
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
  } else {
    make_wire(b);
    b.wire_views[slot.index].copy_(grad);
    // The bucket holds it now; the step's averaged gradient will be a view of the bucket.
    const_cast<torch::autograd::Variable&>(param).mutable_grad().reset();
  }
  b.arrived[slot.index] = true;
  --b.pending;
  start_ready(sync);
}

void arm(GradientSync& sync) {
  std::lock_guard<std::mutex> lock(sync.mutex);
  for (GradientBucket& b : sync.buckets) {
    b.arrived.assign(b.params.size(), false);
    b.pending = b.params.size();
  }
  sync.next = 0;
  sync.armed = true;
}

// Armed: fills in what did not arrive (a parameter the loss does not reach: zeros, or a gradient
// set by hand), starts the rest and joins everything. Unarmed: the same from the gradients as
// they are.
void run(GradientSync& sync) {
  std::lock_guard<std::mutex> lock(sync.mutex);
  if (!sync.armed) {
    for (GradientBucket& b : sync.buckets) b.arrived.assign(b.params.size(), false);
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
    make_wire(b);
    std::vector<at::Tensor> from, to;
    for (size_t i = 0; i < b.params.size(); ++i) {
      if (b.arrived[i]) continue;
      const at::Tensor& grad = b.params[i].grad();
      if (grad.defined()) {
        from.push_back(grad);
        to.push_back(b.wire_views[i]);
      } else {
        b.wire_views[i].zero_();
      }
    }
    if (!from.empty()) at::_foreach_copy_(to, from);
    start(sync, b);
  }
  sync.next = sync.buckets.size();
  for (GradientBucket& b : sync.buckets) finish(sync, b);
}

// ZeRO-1's second half: the optimizer updated this rank's pieces of the parameters; every rank's
// part of each bucket's flat parameter buffer is all-gathered in place, which writes every
// parameter, and their kept autocast copies are refreshed.
struct OptimizerShard {
  int backend;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::vector<at::Tensor> flats;   // each bucket's flat parameter buffer
  std::vector<at::Tensor> params;  // the parameters, for their autocast copies
  std::vector<at::Tensor> pieces;  // every piece, in bucket order
  std::vector<int64_t> piece_params;  // each piece's parameter, as sk_grad_sync_new was given them
};

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

int sk_grad_sync_new(void* group, const sk_tensor* params, int64_t n, int64_t bucket_bytes, int wire_type,
                     int shard, void** out) {
  SK_TRY({
    auto* g = static_cast<Group*>(group);
    auto sync = std::make_unique<GradientSync>();
    sync->pg = g->pg;
    sync->backend = g->backend;
    sync->sharded = shard != 0;
    std::optional<at::ScalarType> wire;
    if (wire_type >= 0) wire = static_cast<at::ScalarType>(wire_type);
    // Reverse registration order, as the Reducer's buckets: the last layers' gradients first.
    std::vector<at::Tensor> list = sk::tensor_list(params, n);
    std::vector<at::Tensor> pending;
    std::vector<size_t> pending_index;
    int64_t bytes = 0;
    const auto flush = [&] {
      if (!pending.empty()) sync->buckets.push_back(make_bucket(std::move(pending), std::move(pending_index), wire));
      pending.clear();
      pending_index.clear();
      bytes = 0;
    };
    for (size_t k = list.size(); k-- > 0;) {
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
    if (sync->sharded)
      for (GradientBucket& b : sync->buckets) shard_bucket(b, sync->pg->getRank(), sync->pg->getSize());
    for (size_t k = 0; k < sync->buckets.size(); ++k)
      for (size_t i = 0; i < sync->buckets[k].params.size(); ++i) {
        const at::Tensor& p = sync->buckets[k].params[i];
        auto& hook = torch::autograd::impl::post_acc_grad_hooks(p);
        TORCH_CHECK(hook == nullptr,
                    "a parameter already has a post-accumulate-grad hook (another gradient all-reduce, or "
                    "torch's own): speedkit's in-step all-reduce needs it");
        torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<ArrivalHook>(Slot{sync.get(), k, i}));
      }
    *out = sync.release();
  })
}

int sk_grad_sync_arm(void* sync) { SK_TRY(arm(*static_cast<GradientSync*>(sync))) }

int sk_grad_sync_run(void* sync) { SK_TRY(run(*static_cast<GradientSync*>(sync))) }

int sk_grad_sync_watch_replay(void* sync, int64_t timeout_ms, const char* rank) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    s->watchdog.watch(s->pg, std::chrono::milliseconds(timeout_ms), rank);
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

void sk_grad_sync_free(void* sync) { delete static_cast<GradientSync*>(sync); }

int sk_optimizer_shard_new(void* sync, void** out) {
  SK_TRY({
    auto* s = static_cast<GradientSync*>(sync);
    TORCH_CHECK(s->sharded, "this gradient sync was not made sharded");
    auto shard = std::make_unique<OptimizerShard>();
    shard->backend = s->backend;
    shard->pg = s->pg;
    for (const GradientBucket& b : s->buckets) {
      shard->flats.push_back(b.flat);
      shard->params.insert(shard->params.end(), b.params.begin(), b.params.end());
      for (const ShardPiece& piece : b.shard) {
        shard->pieces.push_back(piece.view);
        shard->piece_params.push_back(static_cast<int64_t>(b.index[piece.param]));
      }
    }
    *out = shard.release();
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
    blocking_all_reduce(*static_cast<OptimizerShard*>(shard)->pg, *tensor, op);
  })
}

void sk_optimizer_shard_free(void* shard) { delete static_cast<OptimizerShard*>(shard); }

}  // extern "C"
