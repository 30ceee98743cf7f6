// Data parallelism through libtorch's c10d: the rendezvous store (TCPStore), a process group with
// Gloo (CPU tensors) or NCCL (CUDA tensors) behind it, the blocking collectives speedkit needs at
// start-up and for the GradScaler, and the C++ Reducer that Python's DistributedDataParallel drives
// (bucketed gradient all-reduce launched from autograd hooks while the backward pass runs, averaged
// by the world size, waited on at the end of backward). speedkit's own gradient all-reduce over
// these groups is gradient_sync.cpp; its ZeRO-1 optimizer shard, optimizer_shard.cpp.
//
// Every blocking call here is bounded: the store by its timeout (connect and every get), Gloo by its
// per-operation timeout, NCCL by ProcessGroupNCCL's watchdog (which aborts the communicator and the
// process after the timeout). A peer that dies makes Gloo fail at once ("connection closed").
#include "distributed.h"

#include <ATen/Functions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#if SK_WITH_CUDA && SK_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

using sk::dist::blocking_all_reduce;
using sk::dist::Group;
using sk::dist::Heartbeat;
using sk::dist::kGloo;
using sk::dist::wait;

namespace {

enum Op : int { kSum = 0, kMax = 1 };

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
  // NCCL's stream at high priority: a collective issued during the backward pass or beside the
  // optimizer step gets its thread blocks scheduled ahead of the compute kernels' waiting blocks,
  // rather than after a whole grid of them (TORCH_NCCL_HIGH_PRIORITY=1 does the same in PyTorch).
  auto options = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/true);
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
}
#endif

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

// The store for the next group at host:port: the group's view (its key prefix), the shared store
// under it, and the prefix.
struct GroupStore {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  std::string prefix;
};

GroupStore next_group_store(
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
  return {c10::make_intrusive<c10d::PrefixStore>(prefix, shared_store->tcp), shared_store->tcp, prefix};
}

}  // namespace

void sk::dist::blocking_all_reduce(c10d::ProcessGroup& pg, const at::Tensor& tensor, int op) {
  std::vector<at::Tensor> one{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce_op(op);
  wait(pg.allreduce(one, options));
}

extern "C" {

// Rendezvous at master_addr:port (rank 0 serves the store and waits for all `world` ranks; later
// groups of the process reuse it, see SharedStore), then builds the process group. `timeout_ms` bounds the rendezvous, every store access and every
// collective. On success *out owns a Group (free with sk_dist_free).
int sk_dist_init(int backend, const char* master_addr, int port, int rank, int world,
                 int local_rank, int64_t timeout_ms, void** out) {
  SK_TRY({
    const std::string host(master_addr);
    const std::chrono::milliseconds timeout(timeout_ms);
    auto [store, tcp, prefix] = next_group_store(host, port, rank, world, timeout);

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
    *out = new Group{tcp, pg, backend, std::make_shared<Heartbeat>(host, port, prefix, rank, world)};
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

int sk_dist_lost_ranks(void* group, const char** text) {
  SK_TRY(sk::hand_out(static_cast<Group*>(group)->heartbeat->lost_ranks(), text))
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
