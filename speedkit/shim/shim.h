// speedkit's C ABI over the parts of libtorch that tch does not expose. One file per concept:
// flags.cpp (PyTorch's global speed flags), amp.cpp (autocast state, the GradScaler's unscale),
// device.cpp (versions, device properties, allocator statistics, events, streams), graphs.cpp (CUDA
// graphs), optim.cpp (fused/multi-tensor AdamW and the parameter-list helpers), profiler.cpp (the
// Kineto step profiler), nvtx.cpp (NVTX ranges), autograd.cpp (the backward graph), weight_casts.cpp
// (weights' autocast-type copies kept across steps); kernels.h lists the kernel layer's files. This
// header holds what they share: the error contract and the tensor-list helpers.
//
// Contract, for every `sk_*` function that returns `int`: 0 on success; otherwise non-zero, and
// `sk_last_error()` holds the message (per thread) until the next failing call. No C++ exception ever
// crosses into Rust: each entry point runs its body inside SK_TRY. Tensors cross as tch's handles
// (`at::Tensor*`, owned by Rust); tensors returned to Rust are heap-allocated and owned by the caller.
//
// The CUDA parts compile only when libtorch was built with CUDA and the CUDA headers are present
// (SK_WITH_CUDA, decided by build.rs); without them the CUDA entry points fail with a clear message.
// The CUDA parts only call functions exported by libtorch_cuda/libc10_cuda (events through c10's
// device-generic c10::Event), never the CUDA runtime directly: c10's header-inline helpers would make
// every executable depend on libcudart, which a host's loader path need not contain.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace sk {

// The calling thread's last error message (defined in flags.cpp, next to sk_last_error()).
std::string& last_error();

inline void set_error(const char* message) { last_error() = message ? message : "unknown error"; }

// ATen's messages end with a C++ backtrace; the first line is what a user needs.
inline void set_error_from(const std::exception& e) {
  std::string what = e.what();
  auto cut = what.find("\nException raised from");
  if (cut != std::string::npos) what.resize(cut);
  last_error() = what;
}

inline std::vector<at::Tensor> tensor_list(at::Tensor** tensors, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(*tensors[i]);
  return out;
}

inline std::optional<at::Tensor> optional_tensor(at::Tensor* t) {
  if (t == nullptr) return std::nullopt;
  return *t;
}

// weight_casts.cpp: fp32 weights' copies in the autocast type, kept across steps.
namespace weight_casts {
// `weight` in `type`: its kept copy where that is current (same version counter and data), else a fresh cast,
// kept when `weight` is a CUDA parameter (a leaf that requires grad).
at::Tensor get(const at::Tensor& weight, at::ScalarType type);
// Re-casts the kept copies of `params` in one multi-tensor copy; the optimizers call it right after
// their in-place update.
void refresh(const std::vector<at::Tensor>& params);
// `param`'s kept copy (current or not), or an undefined tensor when it has none.
at::Tensor copy_of(const at::Tensor& param);
// Records that `param`'s copy was rewritten together with `param` (by speedkit's AdamW kernel).
void mark_current(const at::Tensor& param);
}  // namespace weight_casts

// `t` when `present`, else an empty tensor with `like`'s options: an autograd Function's apply()
// records every tensor argument and cannot take an undefined one, so an absent optional input is
// passed as this placeholder (defined in autograd.cpp).
at::Tensor placeholder_unless(bool present, const at::Tensor& t, const at::Tensor& like);

}  // namespace sk

#define SK_TRY(...)                                      \
  try {                                                  \
    __VA_ARGS__;                                         \
    return 0;                                            \
  } catch (const std::exception& e) {                    \
    sk::set_error_from(e);                               \
    return 1;                                            \
  } catch (...) {                                        \
    sk::set_error("unknown C++ exception in libtorch"); \
    return 1;                                            \
  }

#define SK_NO_CUDA()                                                                                \
  sk::set_error("speedkit was built against a libtorch without CUDA support (or without the CUDA " \
                "headers), so this CUDA operation is unavailable");                                 \
  return 2
