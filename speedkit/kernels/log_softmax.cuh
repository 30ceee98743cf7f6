// log_softmax over the last dimension of bf16/fp16 logits into fp32, and its backward into the
// logits' type: what autocast's log_softmax computes, without the fp32 copy of the logits it makes
// first nor the fp32 gradient it casts back after.
//
// One block per row of [rows, width]. Forward: each thread keeps a running (max, sum of exp) over
// its columns, merged across the block; a second pass writes y = x - lse, lse = max + log(sum),
// and lse is kept per row. The backwards read the logits and lse, not y: exp(y) = exp(x - lse),
// the same float operations, from half the bytes (and the fp32 y need not outlive the forward).
// Where the result is deferred (speedkit/src/overrides/log_softmax.rs), the forward is the first
// pass alone (the lse), and the second runs only if something reads the result. Backward: dx = dy -
// exp(y) · Σ dy, the sum in a first pass. The second pass re-reads a row the first just read (200 KB
// at most at a 50k vocabulary in fp32), mostly from L2. Columns go 8 at a time (one 16-byte load of
// bf16) when the width is a multiple of 8, one at a time otherwise. The host launches `threads` a
// multiple of 32, at most 1024.
//
// Each entry point takes one params struct (below, before the NVRTC-only part), launched from Rust
// through speedkit::cuda's typed launches with a #[repr(C)] mirror of it (log_softmax.rs): pointers
// and 64-bit fields first, then the 32-bit ones, and the struct's size asserted on both sides. The
// logits' pointers (and their gradient's) are `const void*` / `void*`, cast by each entry point to
// its type.
#pragma once

#include "common.cuh"

namespace sk::kernels::log_softmax {

// y = log_softmax(x) fp32 over rows of `width`, and lse [rows]. Entry points log_softmax_forward_<x>.
struct Forward {
  SK_KERNEL_ENTRY("log_softmax.cuh", "log_softmax_forward");
  const void* x;
  float* y;
  float* lse;
  int width;
};

// The forward's first pass alone: lse [rows]. Entry points log_softmax_lse_<x>.
struct Lse {
  SK_KERNEL_ENTRY("log_softmax.cuh", "log_softmax_lse");
  const void* x;
  float* lse;
  int width;
};

// The forward's second pass from a kept lse: y. Entry points log_softmax_write_<x>.
struct Write {
  SK_KERNEL_ENTRY("log_softmax.cuh", "log_softmax_write");
  const void* x;
  const float* lse;
  float* y;
  int width;
};

// dx in the logits' type from the fp32 dy, the logits and lse. Entry points log_softmax_backward_<x>.
struct Backward {
  SK_KERNEL_ENTRY("log_softmax.cuh", "log_softmax_backward");
  const float* dy;
  const void* x;
  const float* lse;
  void* dx;
  int width;
};

// dx of nll_loss(log_softmax(x)) from the logits, lse, the int64 targets [rows], the loss's
// gradient and total weight (one fp32 each); `mean` 1 for a mean over rows, 0 for a sum. Entry
// points log_softmax_nll_backward_<x>.
struct NllBackward {
  SK_KERNEL_ENTRY("log_softmax.cuh", "log_softmax_nll_backward");
  const void* x;
  const float* lse;
  const long long* targets;
  const float* grad;
  const float* total_weight;
  void* dx;
  long long ignore_index;
  int width;
  int mean;
};

// The sizes log_softmax.rs asserts of its mirrors.
static_assert(sizeof(Forward) == 32, "Forward's layout is mirrored in Rust");
static_assert(sizeof(Lse) == 24, "Lse's layout is mirrored in Rust");
static_assert(sizeof(Write) == 32, "Write's layout is mirrored in Rust");
static_assert(sizeof(Backward) == 40, "Backward's layout is mirrored in Rust");
static_assert(sizeof(NllBackward) == 64, "NllBackward's layout is mirrored in Rust");

}  // namespace sk::kernels::log_softmax

#ifdef __CUDACC_RTC__

namespace {

// (m, s) ← the running max and sum of exp of two sets merged. An empty set is (-inf, 0).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  const float a = m == mx ? s : s * __expf(m - mx);
  const float b = m2 == mx ? s2 : s2 * __expf(m2 - mx);
  m = mx;
  s = a + b;
}

// The block's merged (m, s), in every thread.
__device__ void block_merge(float& m, float& s) {
  __shared__ float ms[32], ss[32];
  for (int offset = 16; offset > 0; offset >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = lane < warps ? ms[lane] : -sk::infinity();
  s = lane < warps ? ss[lane] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1)
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
}

// The block's sum, in every thread.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  v = sk::warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return sk::warp_sum(lane < warps ? partial[lane] : 0.f);
}

// The row's log-sum-exp, in every thread of the block.
template <typename T>
__device__ float row_lse(const T* xr, int width) {
  float m = -sk::infinity(), s = 0.f;
  if (width % 8 == 0) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float v[8];
      sk::load8(xr + c, v);
      float m8 = v[0];
      for (int k = 1; k < 8; ++k) m8 = fmaxf(m8, v[k]);
      float s8 = 0.f;
      if (m8 != -sk::infinity())
        for (int k = 0; k < 8; ++k) s8 += __expf(v[k] - m8);
      merge(m, s, m8, s8);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
      const float v = sk::to_float(xr[c]);
      merge(m, s, v, v == -sk::infinity() ? 0.f : 1.f);
    }
  }
  block_merge(m, s);
  return m + logf(s);
}

// y = x - shift over one row.
template <typename T>
__device__ void write_row(const T* xr, float shift, float* yr, int width) {
  if (width % 8 == 0) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float v[8];
      sk::load8(xr + c, v);
      for (int k = 0; k < 8; ++k) v[k] -= shift;
      sk::store8(yr + c, v);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x) yr[c] = sk::to_float(xr[c]) - shift;
  }
}

template <typename T>
__device__ void forward(const T* x, float* y, float* lse, int width) {
  const long long row = blockIdx.x;
  const float shift = row_lse(x + row * width, width);
  if (threadIdx.x == 0) lse[row] = shift;
  write_row(x + row * width, shift, y + row * width, width);
}

// The forward's first pass alone: lse, and no y. The y of a fused cross-entropy is deferred
// (log_softmax.rs), and written by `write` only if something besides the loss reads it.
template <typename T>
__device__ void forward_lse(const T* x, float* lse, int width) {
  const long long row = blockIdx.x;
  const float shift = row_lse(x + row * width, width);
  if (threadIdx.x == 0) lse[row] = shift;
}

// The forward's second pass from a kept lse: the same y, bit for bit.
template <typename T>
__device__ void write(const T* x, const float* lse, float* y, int width) {
  const long long row = blockIdx.x;
  write_row(x + row * width, lse[row], y + row * width, width);
}

template <typename T>
__device__ void backward(const float* dy, const T* x, const float* lse, T* dx, int width) {
  const long long row = blockIdx.x;
  const float* dyr = dy + row * width;
  const T* xr = x + row * width;
  const float shift = lse[row];
  T* dxr = dx + row * width;
  const bool vector = width % 8 == 0;
  float s = 0.f;
  if (vector) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float g[8];
      sk::load8(dyr + c, g);
      for (int k = 0; k < 8; ++k) s += g[k];
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x) s += dyr[c];
  }
  s = block_sum(s);
  if (vector) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float g[8], v[8];
      sk::load8(dyr + c, g);
      sk::load8(xr + c, v);
      for (int k = 0; k < 8; ++k) g[k] -= __expf(v[k] - shift) * s;
      sk::store8(dxr + c, g);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x)
      dxr[c] = sk::from_float<T>(dyr[c] - __expf(sk::to_float(xr[c]) - shift) * s);
  }
}

// The backward of nll_loss(log_softmax(x)) from the logits and their lse alone (log_softmax.rs's
// fused cross-entropy): with t the row's target and k = grad / total_weight (mean) or grad (sum),
// dx = k · (exp(x - lse) - [c == t]), 0 for a row whose target is ignore_index. One pass: x read
// once, dx written once, and neither the fp32 log-probabilities nor the NLL's dense gradient
// ([rows, width] fp32, all zeros but one per row) in between.
template <typename T>
__device__ void nll_backward(const T* x, const float* lse, const long long* targets, const float* grad,
                             const float* total_weight, T* dx, int width, long long ignore_index, int mean) {
  const long long row = blockIdx.x;
  const T* xr = x + row * width;
  const float shift = lse[row];
  T* dxr = dx + row * width;
  const long long target = targets[row];
  const float k = target == ignore_index ? 0.f : (mean ? *grad / *total_weight : *grad);
  if (width % 8 == 0) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float v[8];
      sk::load8(xr + c, v);
      for (int i = 0; i < 8; ++i) v[i] = k * (__expf(v[i] - shift) - (c + i == target ? 1.f : 0.f));
      sk::store8(dxr + c, v);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x)
      dxr[c] = sk::from_float<T>(k * (__expf(sk::to_float(xr[c]) - shift) - (c == target ? 1.f : 0.f)));
  }
}

}  // namespace

#define SK_LOG_SOFTMAX_ENTRIES(tag, T)                                                                     \
  SK_ENTRY_BOUNDED(1024, log_softmax_forward_##tag, (const sk::kernels::log_softmax::Forward p) {          \
    forward<T>(static_cast<const T*>(p.x), p.y, p.lse, p.width);                                           \
  })                                                                                                       \
  SK_ENTRY_BOUNDED(1024, log_softmax_lse_##tag, (const sk::kernels::log_softmax::Lse p) {                  \
    forward_lse<T>(static_cast<const T*>(p.x), p.lse, p.width);                                            \
  })                                                                                                       \
  SK_ENTRY_BOUNDED(1024, log_softmax_write_##tag, (const sk::kernels::log_softmax::Write p) {              \
    write<T>(static_cast<const T*>(p.x), p.lse, p.y, p.width);                                             \
  })                                                                                                       \
  SK_ENTRY_BOUNDED(1024, log_softmax_backward_##tag, (const sk::kernels::log_softmax::Backward p) {        \
    backward<T>(p.dy, static_cast<const T*>(p.x), p.lse, static_cast<T*>(p.dx), p.width);                  \
  })                                                                                                       \
  SK_ENTRY_BOUNDED(1024, log_softmax_nll_backward_##tag, (const sk::kernels::log_softmax::NllBackward p) { \
    nll_backward<T>(static_cast<const T*>(p.x), p.lse, p.targets, p.grad, p.total_weight,                  \
                    static_cast<T*>(p.dx), p.width, p.ignore_index, p.mean);                               \
  })
SK_LOG_SOFTMAX_ENTRIES(bf16, sk::bf16)
SK_LOG_SOFTMAX_ENTRIES(f16, sk::f16)

#endif  // __CUDACC_RTC__
