// log_softmax over the last dimension of bf16/fp16 logits into fp32, and its backward into the
// logits' type: what autocast's log_softmax computes, without the fp32 copy of the logits it makes
// first nor the fp32 gradient it casts back after.
//
// One block per row of [rows, width]. Forward: each thread keeps a running (max, sum of exp) over
// its columns, merged across the block; a second pass writes x - max - log(sum). Backward:
// dx = dy - exp(y) · Σ dy, the sum in a first pass. The second pass re-reads a row the first just
// read (200 KB at most at a 50k vocabulary in fp32), mostly from L2. Columns go 8 at a time (one
// 16-byte load of bf16) when the width is a multiple of 8, one at a time otherwise. The host
// launches `threads` a multiple of 32, at most 1024.
#include "common.cuh"

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

template <typename T>
__device__ void forward(const T* x, float* y, int width) {
  const long long row = blockIdx.x;
  const T* xr = x + row * width;
  float* yr = y + row * width;
  float m = -sk::infinity(), s = 0.f;
  const bool vector = width % 8 == 0;
  if (vector) {
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
  const float shift = m + logf(s);
  if (vector) {
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
__device__ void backward(const float* dy, const float* y, T* dx, int width) {
  const long long row = blockIdx.x;
  const float* dyr = dy + row * width;
  const float* yr = y + row * width;
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
      float g[8], o[8];
      sk::load8(dyr + c, g);
      sk::load8(yr + c, o);
      for (int k = 0; k < 8; ++k) g[k] -= __expf(o[k]) * s;
      sk::store8(dxr + c, g);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x)
      dxr[c] = sk::from_float<T>(dyr[c] - __expf(yr[c]) * s);
  }
}

// The backward of nll_loss(log_softmax(x)) from the log-probabilities y alone, when the NLL's
// gradient reached log_softmax only through speedkit's nll_loss (log_softmax.rs): with t the row's
// target and k = grad / total_weight (mean) or grad (sum), dx = k · (exp(y) - [c == t]), 0 for a row
// whose target is ignore_index. One pass: y read once, dx written once, and no dense gradient of
// the NLL ([rows, width] fp32, all zeros but one per row) in between.
template <typename T>
__device__ void nll_backward(const float* y, const long long* targets, const float* grad,
                             const float* total_weight, T* dx, int width, long long ignore_index, int mean) {
  const long long row = blockIdx.x;
  const float* yr = y + row * width;
  T* dxr = dx + row * width;
  const long long target = targets[row];
  const float k = target == ignore_index ? 0.f : (mean ? *grad / *total_weight : *grad);
  if (width % 8 == 0) {
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
      float v[8];
      sk::load8(yr + c, v);
      for (int i = 0; i < 8; ++i) v[i] = k * (__expf(v[i]) - (c + i == target ? 1.f : 0.f));
      sk::store8(dxr + c, v);
    }
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x)
      dxr[c] = sk::from_float<T>(k * (__expf(yr[c]) - (c == target ? 1.f : 0.f)));
  }
}

}  // namespace

#define SK_LOG_SOFTMAX_ENTRIES(tag, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(1024) log_softmax_forward_##tag(const T* x, float* y,     \
                                                                              int width) {              \
    forward<T>(x, y, width);                                                                           \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(1024)                                                     \
      log_softmax_backward_##tag(const float* dy, const float* y, T* dx, int width) {                     \
    backward<T>(dy, y, dx, width);                                                                     \
  }                                                                                                      \
  extern "C" __global__ void __launch_bounds__(1024) log_softmax_nll_backward_##tag(                     \
      const float* y, const long long* targets, const float* grad, const float* total_weight, T* dx,     \
      int width, long long ignore_index, int mean) {                                                     \
    nll_backward<T>(y, targets, grad, total_weight, dx, width, ignore_index, mean);                      \
  }
SK_LOG_SOFTMAX_ENTRIES(bf16, sk::bf16)
SK_LOG_SOFTMAX_ENTRIES(f16, sk::f16)
