// CUDA graphs (at::cuda::CUDAGraph, memory from the caching allocator's graph pools).
#include "shim.h"

#if SK_WITH_CUDA
#include "quiet_warnings.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>

namespace {

// CUDAGraph::capture_end stops at cudaStreamEndCapture's error when the capture was invalidated (a
// host synchronisation inside it), before it tells the device's CUDA generator that the capture is
// over: the generator would then refuse every later random op on the device ("Offset increment
// outside graph capture encountered unexpectedly"), long after the step fell back to eager. An
// empty capture, begun and ended on a side stream, tells it. (PyTorch warns that the graph is
// empty: it is meant to be.)
void settle_generators_after_failed_capture() {
  // A stream swap by hand: c10::cuda::CUDAStreamGuard inlines CUDA runtime calls (see shim.h).
  struct OnSideStream {
    c10::cuda::CUDAStream previous = c10::cuda::getCurrentCUDAStream();
    OnSideStream() { c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool()); }
    ~OnSideStream() { c10::cuda::setCurrentCUDAStream(previous); }
  };
  try {
    const sk::QuietWarnings quiet;
    const OnSideStream side;
    at::cuda::CUDAGraph empty;
    empty.capture_begin();
    empty.capture_end();
  } catch (...) {
    // The capture's own error is the one to report.
  }
}

void end_capture(at::cuda::CUDAGraph& graph) {
  try {
    graph.capture_end();
  } catch (...) {
    settle_generators_after_failed_capture();
    throw;
  }
}

}  // namespace
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

// Ends the capture; where it fails, the device's CUDA generator is told it ended all the same.
int sk_cuda_graph_capture_end(void* graph) {
  SK_CUDA_TRY(end_capture(*static_cast<at::cuda::CUDAGraph*>(graph)))
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
