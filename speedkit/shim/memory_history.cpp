// The caching allocator's history: every allocation and free with the C++ stack that made it,
// written as the snapshot file PyTorch's memory tools read (torch.cuda.memory._dump_snapshot's).
#include "shim.h"

#include <fstream>

#if SK_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

extern "C" {

int sk_cuda_memory_history_enabled(int* out) {
  SK_CUDA_TRY(*out = c10::cuda::CUDACachingAllocator::isHistoryEnabled() ? 1 : 0)
}

int sk_cuda_memory_history_record(int enabled, int64_t max_entries) {
  SK_CUDA_TRY({
    if (enabled && max_entries <= 0) throw std::invalid_argument("a history keeps at least one event");
    // The allocator records only on devices it has set up: before the first CUDA tensor, none.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    // "all": the allocator's state and its trace of events, each with the stack that caused it
    // (C++ here: a Rust program has no Python frames to add).
    std::optional<std::string> what = enabled ? std::optional<std::string>("all") : std::nullopt;
    torch::cuda::_record_memory_history(what, what, "all", static_cast<size_t>(max_entries));
  })
}

int sk_cuda_memory_history_write(const char* path) {
  SK_CUDA_TRY({
    const std::string pickled = torch::cuda::_memory_snapshot_pickled();
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    if (!file) throw std::runtime_error(std::string("cannot create ") + path);
    file.write(pickled.data(), static_cast<std::streamsize>(pickled.size()));
    file.close();
    if (!file) throw std::runtime_error(std::string("cannot write ") + path);
  })
}

}  // extern "C"
