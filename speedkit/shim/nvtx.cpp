// NVTX ranges for timeline tools such as Nsight Systems. NVTX3 is header-only: until a tool is
// attached, a push/pop is a call through a null-checked function pointer and nothing else.
#include "shim.h"

#if SK_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

extern "C" {

void sk_nvtx_range_push(const char* name) {
#if SK_WITH_CUDA
  nvtxRangePushA(name);
#else
  (void)name;
#endif
}

void sk_nvtx_range_pop() {
#if SK_WITH_CUDA
  nvtxRangePop();
#endif
}

}  // extern "C"
