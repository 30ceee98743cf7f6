// The bias add and tanh-GELU after a Linear layer's GEMM: y = gelu_tanh(h + b), with h the GEMM's
// output without its bias.
//
// Forward: one read of h, one write of y; the bias is added in fp32 on the way (the GEMM's own
// bias epilogue would round h + b to the storage type first). With 16-bit storage the tanh runs on
// the SFU (tanh.approx, error below the storage's rounding): with tanhf, a dozen FP32 instructions
// per element, both passes were bound by arithmetic rather than by memory on an H200.
// Backward: one read of dy and h, one write of dh = dy · gelu'(h + b), and the bias gradient
// db = Σ_rows dh from the same pass: each block sums its rows' dh per column in registers and
// shared memory and writes one fp32 partial per column; bias_grad.cuh's second pass sums them.
// ATen runs the backward as a GELU-backward kernel and then a separate column reduction that reads
// dh again, the whole [rows, width] activation of the MLP's widest layer.
//
// Layout: a block is 32 × 8 threads over 256 columns (8 per thread: one 16-byte load of bf16/fp16,
// two of fp32; common.cuh's load8) and a strip of rows; each of its 8 warps takes every 8th row of
// the strip.
#pragma once

#include "common.cuh"

namespace sk::kernels::bias_gelu {

// y = gelu_tanh(h + bias) over h [rows, width]; y in h's type. Entry points
// bias_gelu_forward_<h>_<bias>.
struct Forward {
  SK_KERNEL_ENTRY("bias_gelu.cuh", "bias_gelu_forward");
  const void* h;
  const void* bias;
  void* y;
  int rows;
  int width;
  int rows_per_block;
  int vectorised;  // the width a multiple of 8 and every row aligned to 8 elements
};

// dh = dy · gelu'(h + bias), and per strip of rows the column sums of dh into `partials`
// [strips, width] fp32; dy and dh in h's type. Entry points bias_gelu_backward_<h>_<bias>.
struct Backward {
  SK_KERNEL_ENTRY("bias_gelu.cuh", "bias_gelu_backward");
  const void* dy;
  const void* h;
  const void* bias;
  void* dh;
  float* partials;
  int rows;
  int width;
  int rows_per_block;
  int vectorised;
};

}  // namespace sk::kernels::bias_gelu

#ifdef __CUDACC_RTC__

namespace sk {

constexpr int GELU_COLUMNS_PER_THREAD = 8;
constexpr int GELU_WARPS = 8;

// ATen's constants for the tanh approximation (aten/src/ATen/native/cuda/ActivationGeluKernel.cu).
constexpr float GELU_BETA = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_KAPPA = 0.044715f;

// `Fast`: tanh on the SFU (common.cuh's tanh_approx), for results stored in 16 bits; tanhf for fp32.
template <bool Fast>
__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.f + (Fast ? tanh_approx(inner) : tanhf(inner)));
}

template <bool Fast>
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float x_sq = x * x;
  const float inner = GELU_BETA * (x + GELU_KAPPA * x_sq * x);
  const float t = Fast ? tanh_approx(inner) : tanhf(inner);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_BETA * (1.f + 3.f * GELU_KAPPA * x_sq);
}

// Whether a kernel storing TY may use the SFU's tanh.
template <typename TY>
__device__ __forceinline__ constexpr bool gelu_fast() { return sizeof(TY) == 2; }

// The first of the thread's eight columns. They move as vectors when the host says the rows allow
// it (`vectorised`: the width a multiple of 8, every pointer aligned to 8 elements) and all eight
// lie inside the row.
__device__ __forceinline__ int gelu_first_column() {
  return (blockIdx.x * 32 + threadIdx.x) * GELU_COLUMNS_PER_THREAD;
}

template <typename TH, typename TB, typename TY>
__device__ void bias_gelu_forward(const TH* __restrict__ h, const TB* __restrict__ bias, TY* __restrict__ y,
                                  int rows, int width, int rows_per_block, int vectorised) {
  const int c0 = gelu_first_column();
  if (c0 >= width) return;
  const int n = min(GELU_COLUMNS_PER_THREAD, width - c0);
  const bool vector = vectorised && n == GELU_COLUMNS_PER_THREAD;
  float b[GELU_COLUMNS_PER_THREAD];
  for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) b[k] = k < n ? to_float(bias[c0 + k]) : 0.f;
  const int first = blockIdx.y * rows_per_block, last = min(rows, first + rows_per_block);
  if (vector) {
    // Two rows per iteration, so that each thread has two loads in flight.
#pragma unroll 2
    for (int r = first + threadIdx.y; r < last; r += GELU_WARPS) {
      const size_t offset = static_cast<size_t>(r) * width + c0;
      float v[GELU_COLUMNS_PER_THREAD];
      load8(h + offset, v);
#pragma unroll
      for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) v[k] = gelu_tanh<gelu_fast<TY>()>(v[k] + b[k]);
      store8(y + offset, v);
    }
    return;
  }
  for (int r = first + threadIdx.y; r < last; r += GELU_WARPS) {
    const size_t offset = static_cast<size_t>(r) * width + c0;
    for (int k = 0; k < n; ++k) y[offset + k] = from_float<TY>(gelu_tanh<gelu_fast<TY>()>(to_float(h[offset + k]) + b[k]));
  }
}

// partials: gridDim.y × width fp32, block (·, y) writing row y.
template <typename TH, typename TB, typename TY>
__device__ void bias_gelu_backward(const TY* __restrict__ dy, const TH* __restrict__ h, const TB* __restrict__ bias,
                                   TH* __restrict__ dh, float* __restrict__ partials, int rows, int width,
                                   int rows_per_block, int vectorised) {
  const int c0 = gelu_first_column();
  const int n = c0 < width ? min(GELU_COLUMNS_PER_THREAD, width - c0) : 0;
  const bool vector = vectorised && n == GELU_COLUMNS_PER_THREAD;
  float b[GELU_COLUMNS_PER_THREAD], sum[GELU_COLUMNS_PER_THREAD];
  for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) {
    b[k] = k < n ? to_float(bias[c0 + k]) : 0.f;
    sum[k] = 0.f;
  }
  const int first = blockIdx.y * rows_per_block, last = min(rows, first + rows_per_block);
  if (vector) {
    // Two rows per iteration: four 16-byte loads in flight per thread.
#pragma unroll 2
    for (int r = first + threadIdx.y; r < last; r += GELU_WARPS) {
      const size_t offset = static_cast<size_t>(r) * width + c0;
      float g[GELU_COLUMNS_PER_THREAD], x[GELU_COLUMNS_PER_THREAD];
      load8(dy + offset, g);
      load8(h + offset, x);
#pragma unroll
      for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) {
        g[k] *= gelu_tanh_grad<gelu_fast<TH>()>(x[k] + b[k]);
        sum[k] += g[k];
      }
      store8(dh + offset, g);
    }
  } else {
    for (int r = first + threadIdx.y; n > 0 && r < last; r += GELU_WARPS) {
      const size_t offset = static_cast<size_t>(r) * width + c0;
      for (int k = 0; k < n; ++k) {
        const float d = to_float(dy[offset + k]) * gelu_tanh_grad<gelu_fast<TH>()>(to_float(h[offset + k]) + b[k]);
        sum[k] += d;
        dh[offset + k] = from_float<TH>(d);
      }
    }
  }
  write_column_partials<GELU_WARPS>(sum, n, c0, width, partials);
}

}  // namespace sk

#define SK_BIAS_GELU(tb_tag, TB, th_tag, TH)                                                                   \
  SK_ENTRY(bias_gelu_forward_##th_tag##_##tb_tag, (const sk::kernels::bias_gelu::Forward p) {                  \
    sk::bias_gelu_forward<TH, TB, TH>(static_cast<const TH*>(p.h), static_cast<const TB*>(p.bias),             \
                                      static_cast<TH*>(p.y), p.rows, p.width, p.rows_per_block, p.vectorised); \
  })                                                                                                           \
  SK_ENTRY(bias_gelu_backward_##th_tag##_##tb_tag, (const sk::kernels::bias_gelu::Backward p) {                \
    sk::bias_gelu_backward<TH, TB, TH>(static_cast<const TH*>(p.dy), static_cast<const TH*>(p.h),              \
                                       static_cast<const TB*>(p.bias), static_cast<TH*>(p.dh), p.partials,     \
                                       p.rows, p.width, p.rows_per_block, p.vectorised);                       \
  })
#define SK_BIAS_GELU_H(th_tag, TH, ...) SK_TYPES_2(SK_BIAS_GELU, th_tag, TH)
SK_TYPES_1(SK_BIAS_GELU_H, )

#else  // host: the launchers

#include "bias_grad.cuh"
#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>

#include <cstdint>

namespace sk::kernels::bias_gelu {

constexpr int kWarps = 8;

// Forward and backward share bias_grad.cuh's launch shape (column tiles × strips of rows), and the
// backward's column partials are finished by its second pass.
using bias_grad::strips_for;
using bias_grad::vectorised;

// h: [rows, width] contiguous; bias: [width] contiguous. Returns y in h's type.
inline at::Tensor forward(const at::Tensor& h, const at::Tensor& bias) {
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor y = at::empty_like(h);
  if (rows == 0 || width == 0) return y;
  const auto kernel = get<Forward>({h.scalar_type(), bias.scalar_type()}, h.device());
  const bias_grad::Strips s = strips_for(rows, width, kernel, h.device());
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0,
         Forward{.h = h.data_ptr(),
                 .bias = bias.data_ptr(),
                 .y = y.data_ptr(),
                 .rows = static_cast<int>(rows),
                 .width = static_cast<int>(width),
                 .rows_per_block = s.rows_per_block,
                 .vectorised = vectorised(width, {&h, &y})});
  return y;
}

struct Gradients {
  at::Tensor dh, dbias;
};

// dy, h: [rows, width] contiguous in h's type; dbias comes back in the bias's type.
inline Gradients backward(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& bias) {
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor dh = at::empty_like(h);
  if (rows == 0 || width == 0) return {dh, at::zeros_like(bias)};
  const auto kernel = get<Backward>({h.scalar_type(), bias.scalar_type()}, h.device());
  const bias_grad::Strips s = strips_for(rows, width, kernel, h.device());
  at::Tensor partials = at::empty({static_cast<int64_t>(s.strips), width}, h.options().dtype(at::kFloat));
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0,
         Backward{.dy = dy.data_ptr(),
                  .h = h.data_ptr(),
                  .bias = bias.data_ptr(),
                  .dh = dh.data_ptr(),
                  .partials = partials.data_ptr<float>(),
                  .rows = static_cast<int>(rows),
                  .width = static_cast<int>(width),
                  .rows_per_block = s.rows_per_block,
                  .vectorised = vectorised(width, {&dy, &h, &dh})});
  return {dh, bias_grad::finish(partials, bias.scalar_type())};
}

}  // namespace sk::kernels::bias_gelu

#endif
