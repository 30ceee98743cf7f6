// Versions, CUDA device properties, caching-allocator statistics, CUDA events (timing) and streams.
#include "shim.h"

#include <ATen/Context.h>
#include <torch/headeronly/version.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <tuple>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

extern "C" {

int sk_versions_get(sk_versions* out) {
  SK_TRY({
    std::memset(out, 0, sizeof(*out));
    out->torch_major = TORCH_VERSION_MAJOR;
    out->torch_minor = TORCH_VERSION_MINOR;
    out->torch_patch = TORCH_VERSION_PATCH;
#if SK_WITH_CUDA
    out->built_with_cuda = 1;
    auto& ctx = at::globalContext();
    if (ctx.hasCUDA()) {
      out->cuda_runtime = ctx.versionCUDART();
      if (ctx.hasCuDNN()) out->cudnn = ctx.versionCuDNN();
    }
#endif
  })
}

// Without CUDA there are no devices: 0, not an error.
int sk_cuda_device_count(int* out) {
#if SK_WITH_CUDA
  SK_TRY(*out = at::globalContext().hasCUDA() ? static_cast<int>(c10::cuda::device_count()) : 0)
#else
  *out = 0;
  return 0;
#endif
}

int sk_cuda_device_props(int index, sk_device_props* out) {
  SK_CUDA_TRY({
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
    std::memset(out, 0, sizeof(*out));
    // The name up to its NUL or the field's last byte, which the memset left NUL.
    std::memcpy(out->name, p->name, strnlen(p->name, sizeof(out->name) - 1));
    out->major = p->major;
    out->minor = p->minor;
    out->multiprocessors = p->multiProcessorCount;
    out->total_memory = static_cast<int64_t>(p->totalGlobalMem);
    out->l2_cache_bytes = static_cast<int64_t>(p->l2CacheSize);
  })
}

// Bytes currently allocated, peak allocated since the last reset, and reserved by the caching allocator.
int sk_cuda_memory_stats(int index, int64_t* allocated, int64_t* peak, int64_t* reserved) {
  SK_CUDA_TRY({
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    using Stat = c10::CachingDeviceAllocator::StatType;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    const auto all = static_cast<size_t>(Stat::AGGREGATE);
    *allocated = stats.allocated_bytes[all].current;
    *peak = stats.allocated_bytes[all].peak;
    *reserved = stats.reserved_bytes[all].current;
  })
}

int sk_cuda_reset_peak_memory(int index) {
  SK_CUDA_TRY(c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index)))
}

// Peak bytes reserved by the caching allocator since the last reset (what
// torch.cuda.max_memory_reserved reports).
int sk_cuda_peak_reserved_memory(int index, int64_t* out) {
  SK_CUDA_TRY({
    using Stat = c10::CachingDeviceAllocator::StatType;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    *out = stats.reserved_bytes[static_cast<size_t>(Stat::AGGREGATE)].peak;
  })
}

// The totals from the allocator's counters; the groups from its snapshot (segments without their
// trace history), summed by (pool, stream).
int sk_cuda_memory_snapshot(int index, sk_memory_totals* totals, sk_memory_pool* pools, int64_t capacity,
                            int64_t* count) {
  SK_CUDA_TRY({
    using Stat = c10::CachingDeviceAllocator::StatType;
    namespace allocator = c10::cuda::CUDACachingAllocator;
    // The allocator exists only once CUDA is initialised; before the first CUDA tensor its counters
    // would be read from nothing.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    const auto device = static_cast<c10::DeviceIndex>(index);
    const auto stats = allocator::getDeviceStats(device);
    const auto all = static_cast<size_t>(Stat::AGGREGATE);
    *totals = sk_memory_totals{stats.allocated_bytes[all].current,
                               stats.reserved_bytes[all].current,
                               stats.active_bytes[all].current,
                               stats.inactive_split_bytes[all].current,
                               stats.allocated_bytes[all].peak,
                               stats.reserved_bytes[all].peak,
                               stats.num_alloc_retries,
                               stats.num_ooms,
                               stats.segment[all].current};
    std::map<std::tuple<uint64_t, uint64_t, uint64_t>, sk_memory_pool> groups;
    for (const auto& segment : allocator::snapshot({0, 0}, /*include_traces=*/false).segments) {
      if (segment.device != device) continue;
      const auto key = std::make_tuple(segment.owner_private_pool_id.first, segment.owner_private_pool_id.second,
                                       reinterpret_cast<uint64_t>(segment.stream));
      sk_memory_pool& group = groups[key];
      group.pool_first = std::get<0>(key);
      group.pool_second = std::get<1>(key);
      group.stream = std::get<2>(key);
      group.segments += 1;
      group.reserved += static_cast<int64_t>(segment.total_size);
      group.allocated += static_cast<int64_t>(segment.allocated_size);
    }
    *count = static_cast<int64_t>(groups.size());
    int64_t written = 0;
    for (const auto& [key, group] : groups) {
      if (written == capacity) break;
      pools[written++] = group;
    }
  })
}

// Releases every unused cached block to the driver (torch.cuda.empty_cache), so that the next
// benchmark's reserved figure is its own.
int sk_cuda_empty_cache() {
  SK_CUDA_TRY(c10::cuda::CUDACachingAllocator::emptyCache())
}

#if SK_WITH_CUDA
namespace {
c10::cuda::CUDAStream side_stream_of(c10::DeviceIndex device);

// The cuBLAS handles that have had a workspace on each stream. A stream's GEMMs come from more
// than one handle: cuBLAS hands each thread its own, and a backward runs on autograd's thread.
std::mutex handles_mutex;
std::map<const void*, std::set<void*>> handles_by_stream;

// Records the handles of `workspaces` (whose mutex the caller holds).
void remember_handles(const at::cuda::WorkspaceMapWithMutex& workspaces) {
  std::lock_guard<std::mutex> lock(handles_mutex);
  for (const auto& [key, workspace] : workspaces.map) handles_by_stream[std::get<1>(key)].insert(std::get<0>(key));
}

// Erases the workspaces of `map` on streams other than `keep` (all of them when `keep` is null);
// how many. Entries sharing one workspace (sk_cuda_share_blas_workspace) are on one stream, so
// they go together.
int64_t release_workspaces(at::cuda::WorkspaceMapWithMutex& workspaces, const void* keep) {
  std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
  remember_handles(workspaces);
  int64_t freed = 0;
  for (auto it = workspaces.map.begin(); it != workspaces.map.end();) {
    if (keep != nullptr && std::get<1>(it->first) == keep) {
      ++it;
      continue;
    }
    it = workspaces.map.erase(it);
    ++freed;
  }
  return freed;
}
}  // namespace
#endif

// cuBLAS and cuBLASLt allocate a workspace for each (handle, stream) at its first GEMM and keep it
// for the process: the default stream's, from whatever ran eagerly before a graph (a benchmark's
// calibration, the user's own eager code), and the side stream's, where the warm-up and the
// capture run, stay beside the graph's pool (32 MiB each on Hopper). The graph itself needs only
// the workspace it was captured with.
int sk_cuda_release_blas_workspaces(int index, int side_stream_too, int64_t* freed) {
  SK_CUDA_TRY({
    // A workspace may still be in use by queued work (a replay): freed only once that is done.
    c10::cuda::device_synchronize();
    const void* keep =
        side_stream_too != 0 ? nullptr : side_stream_of(static_cast<c10::DeviceIndex>(index)).stream();
    *freed = release_workspaces(at::cuda::cublas_handle_stream_to_workspace(), keep) +
             release_workspaces(at::cuda::cublaslt_handle_stream_to_workspace(), keep);
  })
}

// One cuBLAS workspace on the current stream for every handle that has run GEMMs on it: the
// forward's (the calling thread's handle) and the backward's (autograd's thread), which would each
// keep 32 MiB of their own. GEMMs on one stream run one after another, so sharing is safe;
// torch.compile's graphs get the same from capturing the forward and the backward apart and
// freeing the forward's workspace in between. Outside a capture, workspaces the handles have apart
// are replaced by one (after a device synchronisation: queued GEMMs may be using them). Inside
// one, the shared workspace is allocated in the graph's pool where none of them has one on the
// stream yet, and nothing is done otherwise (a live graph replays with the one it has). `capturing`:
// the current stream is capturing a graph.
int sk_cuda_share_blas_workspace(int index, int capturing, int* shared) {
  SK_CUDA_TRY({
    *shared = 0;
    const void* stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).stream();
    auto& workspaces = at::cuda::cublas_handle_stream_to_workspace();
    const auto on_stream = [&] {
      std::map<void*, void*> found;  // handle → its workspace on this stream
      for (const auto& [key, workspace] : workspaces.map)
        if (std::get<1>(key) == stream) found[std::get<0>(key)] = workspace.get();
      return found;
    };
    std::set<void*> handles;
    bool already_shared = false, any = false;
    {
      std::shared_lock<std::shared_mutex> lock(workspaces.mutex);
      remember_handles(workspaces);
      const auto found = on_stream();
      std::set<void*> pointers;
      for (const auto& [handle, data] : found) pointers.insert(data);
      std::lock_guard<std::mutex> handles_lock(handles_mutex);
      handles = handles_by_stream[stream];
      any = !found.empty();
      already_shared = found.size() == handles.size() && pointers.size() == 1;
    }
    if (handles.size() < 2 || already_shared || (capturing != 0 && any)) return 0;
    if (capturing == 0) c10::cuda::device_synchronize();
    std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
    for (auto it = workspaces.map.begin(); it != workspaces.map.end();)
      it = std::get<1>(it->first) == stream ? workspaces.map.erase(it) : std::next(it);
    at::DataPtr owner = c10::cuda::CUDACachingAllocator::get()->allocate(at::cuda::getChosenWorkspaceSize());
    void* data = owner.get();
    const c10::Device device = owner.device();
    bool first = true;
    for (void* handle : handles) {
      // The first entry owns the memory; the others point at it without owning it.
      workspaces.map.emplace(std::make_tuple(handle, const_cast<void*>(stream)),
                             first ? std::move(owner) : at::DataPtr(data, device));
      first = false;
    }
    *shared = static_cast<int>(handles.size());
  })
}

int sk_cuda_blas_workspaces(int64_t* entries, int64_t* distinct, int64_t* bytes) {
  SK_CUDA_TRY({
    auto& workspaces = at::cuda::cublas_handle_stream_to_workspace();
    std::shared_lock<std::shared_mutex> lock(workspaces.mutex);
    std::set<const void*> pointers;
    for (const auto& [key, workspace] : workspaces.map) pointers.insert(workspace.get());
    *entries = static_cast<int64_t>(workspaces.map.size());
    *distinct = static_cast<int64_t>(pointers.size());
    *bytes = static_cast<int64_t>(pointers.size() * at::cuda::getChosenWorkspaceSize());
  })
}

// ---------------------------------------------------------------------------------------------
// CUDA events (timing) and streams
// ---------------------------------------------------------------------------------------------

int sk_cuda_event_new(void** out) {
  // BACKEND_DEFAULT = cudaEventDefault: timing enabled.
  SK_CUDA_TRY(*out = new c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT))
}

int sk_cuda_event_record(void* event) {
  SK_CUDA_TRY(static_cast<c10::Event*>(event)->record(c10::cuda::getCurrentCUDAStream()))
}

int sk_cuda_event_elapsed_ms(void* start, void* end, double* out) {
  SK_CUDA_TRY({
    auto* e = static_cast<c10::Event*>(end);
    e->synchronize();
    *out = static_cast<c10::Event*>(start)->elapsedTime(*e);
  })
}

void sk_cuda_event_free(void* event) {
#if SK_WITH_CUDA
  delete static_cast<c10::Event*>(event);
#else
  (void)event;
#endif
}

int sk_cuda_synchronize(int index) {
  SK_CUDA_TRY(c10::cuda::device_synchronize(); (void)index)
}

#if SK_WITH_CUDA
namespace {
// The side stream of `device`: one for the process, taken from PyTorch's pool on first use. One,
// because the caching allocator keeps the blocks freed on a stream for that stream alone, and cuBLAS
// keeps a workspace per stream: warm-up steps on a new pool stream each would each reserve the
// step's memory again (+3 GiB per warm-up step of `transformer` on an H100) and leave workspaces
// behind (what torch.cuda.graph avoids with its one default capture stream).
c10::cuda::CUDAStream side_stream_of(c10::DeviceIndex device) {
  static std::mutex mutex;
  static auto* streams = new std::map<c10::DeviceIndex, c10::cuda::CUDAStream>();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams->find(device);
  if (it == streams->end()) it = streams->emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}

// The side stream made current for a scope: it first waits for the work already queued on the
// stream it replaces, and on exit that stream waits for everything queued on the side stream, so the
// two stay ordered without a host synchronisation (what torch.cuda.stream() + wait_stream do).
struct SideStream {
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream side;
  explicit SideStream(c10::DeviceIndex device)
      : previous(c10::cuda::getCurrentCUDAStream(device)), side(side_stream_of(device)) {
    c10::Event ready(c10::DeviceType::CUDA);
    ready.record(previous);
    ready.block(side);
    c10::cuda::setCurrentCUDAStream(side);
  }
  void exit() {
    c10::Event done(c10::DeviceType::CUDA);
    done.record(side);
    done.block(previous);
    c10::cuda::setCurrentCUDAStream(previous);
  }
};
}  // namespace
#endif

int sk_cuda_side_stream_enter(int index, void** out) {
  SK_CUDA_TRY(*out = new SideStream(static_cast<c10::DeviceIndex>(index)))
}

int sk_cuda_side_stream_exit(void* handle) {
  SK_CUDA_TRY({
    // Freed whether or not the exit succeeds: the handle is spent either way.
    std::unique_ptr<SideStream> side(static_cast<SideStream*>(handle));
    side->exit();
  })
}

}  // extern "C"
