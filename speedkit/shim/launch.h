// Typed kernel launches. Every kernel entry point of speedkit/kernels/*.cuh takes one parameter: a
// params struct declared in its .cuh, which NVRTC and the host compiler both see, passed by value
// (flash-attention's Flash_fwd_params, one struct per kernel). A TypedKernel<Params> launches with
// that struct and no other: a launch with the wrong struct does not compile, and loading checks the
// compiled kernel's parameter against sizeof(Params) (kernels.cpp), so a kernel and a struct that
// drifted apart are refused before the first launch. This header needs no libtorch, so a test can
// compile it alone.
#pragma once

#include <string>

namespace sk::kernels {

// Grid and block dimensions (the driver API's, without its header).
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// A loaded kernel on one device.
struct Kernel {
  void* function = nullptr;  // CUfunction
  int device = 0;
  std::string name;
};

// A kernel whose one parameter is a `Params`.
template <typename Params>
struct TypedKernel : Kernel {};

// Launches `kernel` with `args` (one pointer per parameter) on PyTorch's current stream of its device:
// no synchronisation, so kernels run in order with ATen's and can be captured in CUDA graphs.
void launch_raw(const Kernel& kernel, Dim3 grid, Dim3 block, int shared_bytes, void** args);

// Launches `kernel` with `params`, its one parameter.
template <typename Params>
void launch(const TypedKernel<Params>& kernel, Dim3 grid, Dim3 block, int shared_bytes, const Params& params) {
  void* args[] = {const_cast<Params*>(&params)};
  launch_raw(kernel, grid, block, shared_bytes, args);
}

}  // namespace sk::kernels
