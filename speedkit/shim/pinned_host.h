// What saved_offload.cpp uses of pinned host memory (pinned_host.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace sk::pinned_host {

// A byte tensor of `bytes` in pinned host memory from the process's pool, for copies with the CUDA
// `device`. Its memory goes back to the pool when the tensor dies; the pool lends it again only
// after every copy enqueued on the device by then has finished.
at::Tensor take(int64_t bytes, c10::Device device);

// Unpins and unmaps the pool's memory: at once when no tensor holds any of it, otherwise when the
// last one dies. The next take() pins afresh.
void release();

}  // namespace sk::pinned_host
