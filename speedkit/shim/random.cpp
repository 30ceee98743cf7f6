// The CUDA generator's Philox state for a generated kernel that draws dropout's random numbers.
//
// ATen's dropout (native_dropout on CUDA, Dropout.cu) reserves a stretch of the default generator's
// Philox counter for each call: as many curand4 calls per thread as its grid needs, rounded to
// whole groups of four, from a grid of 256-thread blocks capped at what the device keeps resident.
// A generated kernel that computes the same dropout reserves the same stretch in the same way, so
// the generator moves as ATen's kernel would have moved it, everything drawn after it draws the
// same numbers, and the kernel can draw each element's number exactly where ATen's thread did.
// Inside a CUDA-graph capture the generator hands out pointers to its seed and offset instead of
// their values (ATen's graph-safe RNG), so every replay draws fresh numbers.
#include "shim.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

extern "C" {

int sk_dropout_philox_draw(int64_t numel, sk_philox_draw* out) {
  SK_CUDA_TRY({
    TORCH_CHECK(numel > 0, "a dropout of ", numel, " elements draws nothing");
    std::memset(out, 0, sizeof(*out));
    // ATen's grid (Dropout.cu, dropout_cuda): 256 threads a block, at most what stays resident.
    constexpr int64_t kBlock = 256;
    constexpr int64_t kUnroll = 4;
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    const int64_t resident = static_cast<int64_t>(props->multiProcessorCount) *
                             (props->maxThreadsPerMultiProcessor / kBlock);
    const int64_t blocks = std::min(resident, (numel + kBlock - 1) / kBlock);
    const int64_t increment = ((numel - 1) / (kBlock * blocks * kUnroll) + 1) * kUnroll;
    auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
    at::PhiloxCudaState state;
    {
      // As ATen's kernels take it (Note [Acquire lock when using random generators]).
      std::lock_guard<std::mutex> lock(gen->mutex_);
      state = gen->philox_cuda_state(static_cast<uint64_t>(increment));
    }
    out->captured = state.captured_ ? 1 : 0;
    out->seed = state.captured_ ? reinterpret_cast<uint64_t>(state.seed_.ptr) : state.seed_.val;
    out->offset = state.captured_ ? reinterpret_cast<uint64_t>(state.offset_.ptr) : state.offset_.val;
    out->intragraph = state.offset_intragraph_;
    out->threads = static_cast<uint32_t>(blocks * kBlock);
  })
}

}  // extern "C"
