// CUDA graphs (at::cuda::CUDAGraph, memory from the caching allocator's graph pools).
#include "shim.h"

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

extern "C" {

int sk_cuda_graph_pool_handle(uint64_t* first, uint64_t* second) {
  SK_CUDA_TRY({
    auto id = at::cuda::graph_pool_handle();
    *first = id.first;
    *second = id.second;
  })
}

int sk_cuda_graph_new(void** out) {
  SK_CUDA_TRY(*out = new at::cuda::CUDAGraph())
}

// Begins capture on the current stream, which must not be the default stream (see SideStream).
int sk_cuda_graph_capture_begin(void* graph, uint64_t pool_first, uint64_t pool_second) {
  SK_CUDA_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_begin({pool_first, pool_second}))
}

int sk_cuda_graph_capture_end(void* graph) {
  SK_CUDA_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_end())
}

int sk_cuda_graph_replay(void* graph) {
  SK_CUDA_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->replay())
}

void sk_cuda_graph_free(void* graph) {
#if SK_WITH_CUDA
  try {
    delete static_cast<at::cuda::CUDAGraph*>(graph);
  } catch (...) {
    // A destructor that throws during teardown has nothing useful to report to; swallow it.
  }
#else
  (void)graph;
#endif
}

}  // extern "C"
