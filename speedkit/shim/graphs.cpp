// CUDA graphs (at::cuda::CUDAGraph, memory from the caching allocator's graph pools).
#include "shim.h"

#if SK_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#endif

extern "C" {

int sk_cuda_graph_pool_handle(uint64_t* first, uint64_t* second) {
#if SK_WITH_CUDA
  SK_TRY({
    auto id = at::cuda::graph_pool_handle();
    *first = id.first;
    *second = id.second;
  })
#else
  (void)first; (void)second;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_new(void** out) {
#if SK_WITH_CUDA
  SK_TRY(*out = new at::cuda::CUDAGraph())
#else
  (void)out;
  SK_NO_CUDA();
#endif
}

// Begins capture on the current stream, which must not be the default stream (see SideStream).
int sk_cuda_graph_capture_begin(void* graph, uint64_t pool_first, uint64_t pool_second) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_begin({pool_first, pool_second}))
#else
  (void)graph; (void)pool_first; (void)pool_second;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_capture_end(void* graph) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->capture_end())
#else
  (void)graph;
  SK_NO_CUDA();
#endif
}

int sk_cuda_graph_replay(void* graph) {
#if SK_WITH_CUDA
  SK_TRY(static_cast<at::cuda::CUDAGraph*>(graph)->replay())
#else
  (void)graph;
  SK_NO_CUDA();
#endif
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
