// The bias add and tanh-GELU after a Linear layer's GEMM: y = gelu_tanh(h + b), with h the GEMM's
// output without its bias.
//
// Forward: one read of h, one write of y; the bias is added in fp32 on the way (the GEMM's own
// bias epilogue would round h + b to the storage type first).
// Backward: one read of dy and h, one write of dh = dy · gelu'(h + b), and the bias gradient
// db = Σ_rows dh from the same pass: each block sums its rows' dh per column in registers and
// shared memory and writes one fp32 partial per column; the host sums the partials (a few rows).
// ATen runs the backward as a GELU-backward kernel and then a separate column reduction that reads
// dh again, the whole [rows, width] activation of the MLP's widest layer.
//
// Layout: a block is 32 × 8 threads over 256 columns (8 per thread, as two 4-element loads) and a
// strip of rows; each of its 8 warps takes every 8th row of the strip.
#ifdef __CUDACC_RTC__
#include "common.cuh"

namespace sk {

constexpr int GELU_COLUMNS_PER_THREAD = 8;
constexpr int GELU_WARPS = 8;

// ATen's constants for the tanh approximation (aten/src/ATen/native/cuda/ActivationGeluKernel.cu).
constexpr float GELU_BETA = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_KAPPA = 0.044715f;

__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.f + tanhf(inner));
}

__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float x_sq = x * x;
  const float t = tanhf(GELU_BETA * (x + GELU_KAPPA * x_sq * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_BETA * (1.f + 3.f * GELU_KAPPA * x_sq);
}

// Eight consecutive elements as fp32 (two 4-element loads: 16 bytes each in fp32, 8 in bf16/fp16).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float v[8]) {
  load4(p, v);
  load4(p + 4, v + 4);
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float v[8]) {
  store4(p, v);
  store4(p + 4, v + 4);
}

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
  for (int r = first + threadIdx.y; r < last; r += GELU_WARPS) {
    const size_t offset = static_cast<size_t>(r) * width + c0;
    float v[GELU_COLUMNS_PER_THREAD];
    if (vector) {
      load8(h + offset, v);
#pragma unroll
      for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) v[k] = gelu_tanh(v[k] + b[k]);
      store8(y + offset, v);
    } else {
      for (int k = 0; k < n; ++k) y[offset + k] = from_float<TY>(gelu_tanh(to_float(h[offset + k]) + b[k]));
    }
  }
}

// partials: gridDim.y × width fp32, block (·, y) writing row y.
template <typename TH, typename TB, typename TY>
__device__ void bias_gelu_backward(const TY* __restrict__ dy, const TH* __restrict__ h, const TB* __restrict__ bias,
                                   TH* __restrict__ dh, float* __restrict__ partials, int rows, int width,
                                   int rows_per_block, int vectorised) {
  __shared__ float column_sums[GELU_WARPS][32 * GELU_COLUMNS_PER_THREAD];
  const int c0 = gelu_first_column();
  const int n = c0 < width ? min(GELU_COLUMNS_PER_THREAD, width - c0) : 0;
  const bool vector = vectorised && n == GELU_COLUMNS_PER_THREAD;
  float b[GELU_COLUMNS_PER_THREAD], sum[GELU_COLUMNS_PER_THREAD];
  for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) {
    b[k] = k < n ? to_float(bias[c0 + k]) : 0.f;
    sum[k] = 0.f;
  }
  const int first = blockIdx.y * rows_per_block, last = min(rows, first + rows_per_block);
  for (int r = first + threadIdx.y; n > 0 && r < last; r += GELU_WARPS) {
    const size_t offset = static_cast<size_t>(r) * width + c0;
    float g[GELU_COLUMNS_PER_THREAD], x[GELU_COLUMNS_PER_THREAD];
    if (vector) {
      load8(dy + offset, g);
      load8(h + offset, x);
#pragma unroll
      for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k) {
        g[k] *= gelu_tanh_grad(x[k] + b[k]);
        sum[k] += g[k];
      }
      store8(dh + offset, g);
    } else {
      for (int k = 0; k < n; ++k) {
        const float d = to_float(dy[offset + k]) * gelu_tanh_grad(to_float(h[offset + k]) + b[k]);
        sum[k] += d;
        dh[offset + k] = from_float<TH>(d);
      }
    }
  }
  // The block's 8 warps each hold a sum over their rows; warp 0 adds them in a fixed order.
  for (int k = 0; k < GELU_COLUMNS_PER_THREAD; ++k)
    column_sums[threadIdx.y][threadIdx.x * GELU_COLUMNS_PER_THREAD + k] = sum[k];
  __syncthreads();
  if (threadIdx.y != 0) return;
  for (int k = 0; k < n; ++k) {
    float total = 0.f;
    for (int w = 0; w < GELU_WARPS; ++w) total += column_sums[w][threadIdx.x * GELU_COLUMNS_PER_THREAD + k];
    partials[static_cast<size_t>(blockIdx.y) * width + c0 + k] = total;
  }
}

}  // namespace sk

// bias_gelu_forward_<h>_<b> (y in h's type) and bias_gelu_backward_<h>_<b> (dy and dh in h's type).
#define SK_BIAS_GELU(tb_tag, TB, th_tag, TH)                                                                  \
  extern "C" __global__ void bias_gelu_forward_##th_tag##_##tb_tag(const TH* h, const TB* bias, TH* y, int rows,  \
                                                                    int width, int rows_per_block,             \
                                                                    int vectorised) {                          \
    sk::bias_gelu_forward<TH, TB, TH>(h, bias, y, rows, width, rows_per_block, vectorised);                    \
  }                                                                                                             \
  extern "C" __global__ void bias_gelu_backward_##th_tag##_##tb_tag(                                           \
      const TH* dy, const TH* h, const TB* bias, TH* dh, float* partials, int rows, int width,                 \
      int rows_per_block, int vectorised) {                                                                     \
    sk::bias_gelu_backward<TH, TB, TH>(dy, h, bias, dh, partials, rows, width, rows_per_block, vectorised);    \
  }
#define SK_BIAS_GELU_H(th_tag, TH, ...) SK_TYPES_2(SK_BIAS_GELU, th_tag, TH)
SK_TYPES_1(SK_BIAS_GELU_H, )

#else  // host: the launchers

#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cstdint>

namespace sk::kernels::bias_gelu {

constexpr int kColumnsPerBlock = 256;  // 32 threads × 8 columns
constexpr int kWarps = 8;

// The launch shape: column tiles across x, strips of rows across y, enough blocks to fill the GPU
// about eight times over (fewer strips means fewer partial rows for the bias gradient).
struct Shape {
  unsigned column_tiles, strips;
  int rows_per_block;
};

inline Shape shape_for(int64_t rows, int64_t width, const c10::Device& device) {
  const int64_t tiles = (width + kColumnsPerBlock - 1) / kColumnsPerBlock;
  const int64_t wanted = std::max<int64_t>(1, 8 * multiprocessors(device) / std::max<int64_t>(tiles, 1));
  const int64_t strips = std::clamp<int64_t>(std::min(wanted, (rows + kWarps - 1) / kWarps), 1, 65535);
  const int64_t per_block = (rows + strips - 1) / strips;
  return {static_cast<unsigned>(tiles), static_cast<unsigned>((rows + per_block - 1) / per_block),
          static_cast<int>(per_block)};
}

inline int vectorised(int64_t width, std::initializer_list<const at::Tensor*> tensors) {
  if (width % 8 != 0) return 0;
  for (const at::Tensor* t : tensors)
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % (8 * t->element_size()) != 0) return 0;
  return 1;
}

inline std::string name(const char* direction, const at::Tensor& h, const at::Tensor& bias) {
  return std::string("bias_gelu_") + direction + "_" + type_tag(h.scalar_type()) + "_" + type_tag(bias.scalar_type());
}

// h: [rows, width] contiguous; bias: [width] contiguous. Returns y in h's type.
inline at::Tensor forward(const at::Tensor& h, const at::Tensor& bias) {
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor y = at::empty_like(h);
  if (rows == 0 || width == 0) return y;
  Kernel kernel = get("bias_gelu.cuh", name("forward", h, bias), h.device());
  const Shape s = shape_for(rows, width, h.device());
  const void* h_ptr = h.data_ptr();
  const void* bias_ptr = bias.data_ptr();
  void* y_ptr = y.data_ptr();
  int rows_arg = static_cast<int>(rows), width_arg = static_cast<int>(width), per_block = s.rows_per_block;
  int vector = vectorised(width, {&h, &y});
  void* args[] = {&h_ptr, &bias_ptr, &y_ptr, &rows_arg, &width_arg, &per_block, &vector};
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0, args);
  return y;
}

struct Backward {
  at::Tensor dh, dbias;
};

// dy, h: [rows, width] contiguous in h's type; dbias comes back in the bias's type.
inline Backward backward(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& bias) {
  const int64_t rows = h.size(0), width = h.size(1);
  at::Tensor dh = at::empty_like(h);
  if (rows == 0 || width == 0) return {dh, at::zeros_like(bias)};
  Kernel kernel = get("bias_gelu.cuh", name("backward", h, bias), h.device());
  const Shape s = shape_for(rows, width, h.device());
  at::Tensor partials = at::empty({static_cast<int64_t>(s.strips), width}, h.options().dtype(at::kFloat));
  const void* dy_ptr = dy.data_ptr();
  const void* h_ptr = h.data_ptr();
  const void* bias_ptr = bias.data_ptr();
  void* dh_ptr = dh.data_ptr();
  void* partials_ptr = partials.data_ptr();
  int rows_arg = static_cast<int>(rows), width_arg = static_cast<int>(width), per_block = s.rows_per_block;
  int vector = vectorised(width, {&dy, &h, &dh});
  void* args[] = {&dy_ptr, &h_ptr, &bias_ptr, &dh_ptr, &partials_ptr, &rows_arg, &width_arg, &per_block, &vector};
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0, args);
  return {dh, partials.sum(0).to(bias.scalar_type())};
}

}  // namespace sk::kernels::bias_gelu

#endif
