// LayerNorm over the last dimension, optionally of a residual sum: y = LN(x [+ r]) · weight + bias.
//
// Forward: one warp per row; two passes over the row for the mean and the variance (the row stays
// in L1/L2), a third writes y in the output type (the autocast type, so no cast kernel follows) and
// mean and rstd in fp32 for the backward. With a residual, the first pass also writes s = x + r and
// the later passes read s back, so y is exactly LN of the stored sum.
//
// Backward: one pass over dy and x gives dx and the weight/bias gradients together. Each warp owns a
// row at a time and adds its dy·x̂ and dy into its own shared-memory accumulators (no atomics, so the
// result is bitwise reproducible); at the end the block sums its warps in a fixed order into one
// fp32 partial per block, and a second small kernel sums the partials per column in a fixed order.
// This replaces ATen's separate GammaBeta column reduction, which reads dy and x a second time.
//
// The device part below is compiled by NVRTC (shim/kernels.cpp); the host part at the end, the
// launchers, is compiled into the shim by the host compiler.
#pragma once

#include "common.cuh"

namespace sk::kernels::layernorm {

// y = LN(x [+ residual]) · weight + bias over rows of `width`, y in its own type; with a residual
// also sum = x + residual; mean and rstd fp32 [rows]. Entry points layernorm_forward_<x>_<r>_<w>_<y>.
struct Forward {
  SK_KERNEL_ENTRY("layernorm.cuh", "layernorm_forward");
  const void* x;
  const void* residual;  // or null
  const void* weight;    // or null
  const void* bias;      // or null
  void* sum;             // with a residual, else null
  void* y;
  float* mean;
  float* rstd;
  int rows;
  int width;
  float eps;
  int in_registers;  // the row fits the lanes' registers (layernorm::rows_fit_registers)
};

// dx (and dx_branch in dy's type, when asked), and per block the partial dweight and dbias [blocks,
// 2, width] fp32. Entry points layernorm_backward_<x>_<w>_<dy>, and with a compile-time width
// layernorm_backward_<x>_f32_<dy>_<width> (which ignore `width` and `in_registers`).
struct Backward {
  SK_KERNEL_ENTRY("layernorm.cuh", "layernorm_backward");
  const void* dy;
  const void* x;
  const void* weight;  // or null
  const float* mean;
  const float* rstd;
  const void* dsum;    // the gradient arriving at the sum from its other uses, or null
  void* dx;
  void* dx_branch;     // or null
  float* partials;
  int rows;
  int width;
  int in_registers;
};

// dweight and dbias (either may be null) from the backward's partials. Entry points
// layernorm_param_grad_<w>.
struct ParamGrad {
  SK_KERNEL_ENTRY("layernorm.cuh", "layernorm_param_grad");
  const float* partials;
  int blocks;
  int width;
  void* dweight;
  void* dbias;
};

}  // namespace sk::kernels::layernorm

#ifdef __CUDACC_RTC__

namespace sk {

template <typename TX, typename TR, typename TW, typename TY>
__device__ void layernorm_forward(const TX* __restrict__ x, const TR* __restrict__ residual,
                                  const TW* __restrict__ weight, const TW* __restrict__ bias,
                                  TX* __restrict__ sum_out, TY* __restrict__ y, float* __restrict__ mean_out,
                                  float* __restrict__ rstd_out, int rows, int width, float eps) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const size_t offset = static_cast<size_t>(row) * width;
  const TX* in = x + offset;
  float total = 0.f;
  if (residual != nullptr) {
    const TR* r = residual + offset;
    TX* s = sum_out + offset;
    for (int c = lane; c < width; c += 32) {
      TX v = from_float<TX>(to_float(in[c]) + to_float(r[c]));
      s[c] = v;
      total += to_float(v);
    }
    in = s;
  } else {
    for (int c = lane; c < width; c += 32) total += to_float(in[c]);
  }
  const float mean = warp_sum(total) / width;
  float squares = 0.f;
  for (int c = lane; c < width; c += 32) {
    float d = to_float(in[c]) - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(warp_sum(squares) / width + eps);
  TY* out = y + offset;
  for (int c = lane; c < width; c += 32) {
    float v = (to_float(in[c]) - mean) * rstd;
    if (weight != nullptr) v *= to_float(weight[c]);
    if (bias != nullptr) v += to_float(bias[c]);
    out[c] = from_float<TY>(v);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Rows of at most kRowChunks × 128 columns, a multiple of 4, with every pointer aligned to four
// elements: each lane keeps its columns in registers (chunks of four, loaded and stored 8 or 16 bytes
// at a time), so the row is read from memory once instead of once per pass.
constexpr int kRowChunks = 8;

template <typename TX, typename TR, typename TW, typename TY>
__device__ void layernorm_forward_in_registers(const TX* __restrict__ x, const TR* __restrict__ residual,
                                               const TW* __restrict__ weight, const TW* __restrict__ bias,
                                               TX* __restrict__ sum_out, TY* __restrict__ y,
                                               float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                               int rows, int width, float eps) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const size_t offset = static_cast<size_t>(row) * width;
  float v[kRowChunks][4];
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kRowChunks; ++k) {
    const int c = (k * 32 + lane) * 4;
    if (c >= width) break;
    load4(x + offset + c, v[k]);
    if (residual != nullptr) {
      float r[4];
      load4(residual + offset + c, r);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[k][j] = to_float(from_float<TX>(v[k][j] + r[j]));
      store4(sum_out + offset + c, v[k]);
    }
    total += (v[k][0] + v[k][1]) + (v[k][2] + v[k][3]);
  }
  const float mean = warp_sum(total) / width;
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < kRowChunks; ++k) {
    if ((k * 32 + lane) * 4 >= width) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float d = v[k][j] - mean;
      squares += d * d;
    }
  }
  const float rstd = rsqrtf(warp_sum(squares) / width + eps);
#pragma unroll
  for (int k = 0; k < kRowChunks; ++k) {
    const int c = (k * 32 + lane) * 4;
    if (c >= width) break;
    float w[4] = {1.f, 1.f, 1.f, 1.f}, b[4] = {0.f, 0.f, 0.f, 0.f}, out[4];
    if (weight != nullptr) load4(weight + c, w);
    if (bias != nullptr) load4(bias + c, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = (v[k][j] - mean) * rstd * w[j] + b[j];
    store4(y + offset + c, out);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// The backwards' per-warp accumulators in dynamic shared memory, [warp][dweight, dbias][column]:
// zeroed by the whole block before the rows are taken.
__device__ __forceinline__ void clear_accumulators(float* accumulators, int warps, int width) {
  for (int i = threadIdx.x; i < warps * 2 * width; i += blockDim.x) accumulators[i] = 0.f;
  __syncthreads();
}

// The block's warps' accumulators added in warp order into its row of partials [gridDim.x, 2, width].
__device__ __forceinline__ void write_block_partials(const float* accumulators, int warps, int width,
                                                     float* __restrict__ partials) {
  __syncthreads();
  float* block_partial = partials + static_cast<size_t>(blockIdx.x) * 2 * width;
  for (int i = threadIdx.x; i < 2 * width; i += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += accumulators[static_cast<size_t>(w) * 2 * width + i];
    block_partial[i] = total;
  }
}

// As layernorm_backward_in_registers below, for rows of exactly CHUNKS × 128 columns (widths 128,
// 256, ..., 1024): with the width a compile-time constant the compiler issues every load of a row
// before the first is used, and the weight stays in registers across rows. With a width known only
// at run time the unrolled loop waits on each chunk's loads in turn, guarded or not: at 16384 × 768
// (fp32 x and dsum, bf16 dy) on an H200, 53 µs (3.8 TB/s) here against 70 µs (2.8 TB/s).
template <int CHUNKS, typename TX, typename TW, typename TY>
__device__ void layernorm_backward_exact(const TY* __restrict__ dy, const TX* __restrict__ x,
                                         const TW* __restrict__ weight, const float* __restrict__ mean,
                                         const float* __restrict__ rstd, const TX* __restrict__ dsum,
                                         TX* __restrict__ dx, TY* __restrict__ dx_branch,
                                         float* __restrict__ partials, int rows) {
  constexpr int width = CHUNKS * 128;
  extern __shared__ float accumulators[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  clear_accumulators(accumulators, warps, width);
  float* dweight_acc = accumulators + static_cast<size_t>(warp) * 2 * width;
  float* dbias_acc = dweight_acc + width;
  float w[CHUNKS][4];
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k) {
    if (weight != nullptr) load4(weight + (k * 32 + lane) * 4, w[k]);
    else w[k][0] = w[k][1] = w[k][2] = w[k][3] = 1.f;
  }
  for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
    const size_t offset = static_cast<size_t>(row) * width;
    const float mu = mean[row];
    const float rs = rstd[row];
    float d[CHUNKS][4], in[CHUNKS][4];
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      load4(dy + offset + (k * 32 + lane) * 4, d[k]);
      load4(x + offset + (k * 32 + lane) * 4, in[k]);
    }
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = (k * 32 + lane) * 4;
      float4 dw = *reinterpret_cast<float4*>(dweight_acc + c);
      float4 db = *reinterpret_cast<float4*>(dbias_acc + c);
      float* dwv = reinterpret_cast<float*>(&dw);
      float* dbv = reinterpret_cast<float*>(&db);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float xhat = (in[k][j] - mu) * rs;
        // Rounded once (no FMA contraction), as in the other backwards.
        const float g = __fmul_rn(d[k][j], w[k][j]);
        sum_g += g;
        sum_gx += g * xhat;
        dwv[j] += d[k][j] * xhat;
        dbv[j] += d[k][j];
      }
      *reinterpret_cast<float4*>(dweight_acc + c) = dw;
      *reinterpret_cast<float4*>(dbias_acc + c) = db;
    }
    const float mean_g = warp_sum(sum_g) / width;
    const float mean_gx = warp_sum(sum_gx) / width;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = (k * 32 + lane) * 4;
      float out[4], extra[4] = {0.f, 0.f, 0.f, 0.f};
      if (dsum != nullptr) load4(dsum + offset + c, extra);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float xhat = (in[k][j] - mu) * rs;
        out[j] = rs * (__fmul_rn(d[k][j], w[k][j]) - mean_g - xhat * mean_gx) + extra[j];
      }
      store4(dx + offset + c, out);
      if (dx_branch != nullptr) store4(dx_branch + offset + c, out);
    }
  }
  write_block_partials(accumulators, warps, width, partials);
}

// As layernorm_backward below, with the row's dy and x in registers and the accumulators updated
// four columns at a time.
template <typename TX, typename TW, typename TY>
__device__ void layernorm_backward_in_registers(const TY* __restrict__ dy, const TX* __restrict__ x,
                                                const TW* __restrict__ weight, const float* __restrict__ mean,
                                                const float* __restrict__ rstd, const TX* __restrict__ dsum,
                                                TX* __restrict__ dx, TY* __restrict__ dx_branch,
                                                float* __restrict__ partials, int rows, int width) {
  extern __shared__ float accumulators[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  clear_accumulators(accumulators, warps, width);
  float* dweight_acc = accumulators + static_cast<size_t>(warp) * 2 * width;
  float* dbias_acc = dweight_acc + width;
  for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
    const size_t offset = static_cast<size_t>(row) * width;
    const float mu = mean[row];
    const float rs = rstd[row];
    float g[kRowChunks][4], xhat[kRowChunks][4];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < kRowChunks; ++k) {
      const int c = (k * 32 + lane) * 4;
      if (c >= width) break;
      float d[4], in[4], w[4] = {1.f, 1.f, 1.f, 1.f};
      load4(dy + offset + c, d);
      load4(x + offset + c, in);
      if (weight != nullptr) load4(weight + c, w);
      float4 dw = *reinterpret_cast<float4*>(dweight_acc + c);
      float4 db = *reinterpret_cast<float4*>(dbias_acc + c);
      float* dwv = reinterpret_cast<float*>(&dw);
      float* dbv = reinterpret_cast<float*>(&db);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        xhat[k][j] = (in[j] - mu) * rs;
        // Rounded once (no FMA contraction): for width 1, gw − mean_g must be exactly 0.
        g[k][j] = weight != nullptr ? __fmul_rn(d[j], w[j]) : d[j];
        sum_g += g[k][j];
        sum_gx += g[k][j] * xhat[k][j];
        dwv[j] += d[j] * xhat[k][j];
        dbv[j] += d[j];
      }
      *reinterpret_cast<float4*>(dweight_acc + c) = dw;
      *reinterpret_cast<float4*>(dbias_acc + c) = db;
    }
    const float mean_g = warp_sum(sum_g) / width;
    const float mean_gx = warp_sum(sum_gx) / width;
#pragma unroll
    for (int k = 0; k < kRowChunks; ++k) {
      const int c = (k * 32 + lane) * 4;
      if (c >= width) break;
      float out[4], extra[4] = {0.f, 0.f, 0.f, 0.f};
      if (dsum != nullptr) load4(dsum + offset + c, extra);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] = rs * (g[k][j] - mean_g - xhat[k][j] * mean_gx) + extra[j];
      store4(dx + offset + c, out);
      if (dx_branch != nullptr) store4(dx_branch + offset + c, out);
    }
  }
  write_block_partials(accumulators, warps, width, partials);
}

// Dynamic shared memory: (blockDim.x / 32) warps × 2 × width floats ([warp][dweight, dbias][column]).
// `partials` receives gridDim.x × 2 × width floats. `dsum`, when given, is the gradient arriving at
// the residual sum s itself (its other uses), added to dx. `dx_branch`, when given, receives dx again
// in dy's type: the gradient of a bf16/fp16 branch that joined an fp32 residual stream, which would
// otherwise take a separate cast kernel.
template <typename TX, typename TW, typename TY>
__device__ void layernorm_backward(const TY* __restrict__ dy, const TX* __restrict__ x,
                                   const TW* __restrict__ weight, const float* __restrict__ mean,
                                   const float* __restrict__ rstd, const TX* __restrict__ dsum,
                                   TX* __restrict__ dx, TY* __restrict__ dx_branch, float* __restrict__ partials,
                                   int rows, int width) {
  extern __shared__ float accumulators[];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  clear_accumulators(accumulators, warps, width);
  float* dweight_acc = accumulators + static_cast<size_t>(warp) * 2 * width;
  float* dbias_acc = dweight_acc + width;
  for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
    const size_t offset = static_cast<size_t>(row) * width;
    const TY* g = dy + offset;
    const TX* in = x + offset;
    const float mu = mean[row];
    const float rs = rstd[row];
    float sum_g = 0.f, sum_gx = 0.f;
    for (int c = lane; c < width; c += 32) {
      const float d = to_float(g[c]);
      const float xhat = (to_float(in[c]) - mu) * rs;
      // Rounded once (no FMA contraction), the same as in the second loop: for width 1,
      // gw − mean_g must be exactly 0.
      const float gw = weight != nullptr ? __fmul_rn(d, to_float(weight[c])) : d;
      sum_g += gw;
      sum_gx += gw * xhat;
      dweight_acc[c] += d * xhat;
      dbias_acc[c] += d;
    }
    const float mean_g = warp_sum(sum_g) / width;
    const float mean_gx = warp_sum(sum_gx) / width;
    TX* out = dx + offset;
    for (int c = lane; c < width; c += 32) {
      const float d = to_float(g[c]);
      const float xhat = (to_float(in[c]) - mu) * rs;
      const float gw = weight != nullptr ? __fmul_rn(d, to_float(weight[c])) : d;
      float v = rs * (gw - mean_g - xhat * mean_gx);
      if (dsum != nullptr) v += to_float(dsum[offset + c]);
      out[c] = from_float<TX>(v);
      if (dx_branch != nullptr) dx_branch[offset + c] = from_float<TY>(v);
    }
  }
  write_block_partials(accumulators, warps, width, partials);
}

// Block (32, 32): threadIdx.x picks the column, threadIdx.y strides over the partials; shared memory
// adds the 32 strands in a fixed order. Either output may be null (no weight or no bias).
template <typename TW>
__device__ void layernorm_param_grad(const float* __restrict__ partials, int blocks, int width,
                                     TW* __restrict__ dweight, TW* __restrict__ dbias) {
  __shared__ float strands[2][32][33];
  const int column = blockIdx.x * 32 + threadIdx.x;
  float dw = 0.f, db = 0.f;
  if (column < width) {
    for (int b = threadIdx.y; b < blocks; b += 32) {
      dw += partials[static_cast<size_t>(b) * 2 * width + column];
      db += partials[static_cast<size_t>(b) * 2 * width + width + column];
    }
  }
  strands[0][threadIdx.y][threadIdx.x] = dw;
  strands[1][threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && column < width) {
    dw = 0.f;
    db = 0.f;
    for (int s = 0; s < 32; ++s) {
      dw += strands[0][s][threadIdx.x];
      db += strands[1][s][threadIdx.x];
    }
    if (dweight != nullptr) dweight[column] = from_float<TW>(dw);
    if (dbias != nullptr) dbias[column] = from_float<TW>(db);
  }
}

}  // namespace sk

// Entry points: layernorm_forward_<x>_<r>_<w>_<y> per type of the input, the residual (the input's
// own without one), the weight and the output; layernorm_backward_<x>_<w>_<y> (y is the type of dy
// there); layernorm_param_grad_<w>. The residual differs from the input only for an fp32 residual
// stream with a bf16/fp16 branch output (autocast's mix), whose sum is fp32.
#define SK_LN_FORWARD(ty_tag, TY, tx_tag, TX, tr_tag, TR, tw_tag, TW)                                        \
  SK_ENTRY(layernorm_forward_##tx_tag##_##tr_tag##_##tw_tag##_##ty_tag, (                                    \
      const sk::kernels::layernorm::Forward p) {                                                             \
    const auto x = static_cast<const TX*>(p.x);                                                              \
    const auto residual = static_cast<const TR*>(p.residual);                                                \
    const auto weight = static_cast<const TW*>(p.weight);                                                    \
    const auto bias = static_cast<const TW*>(p.bias);                                                        \
    if (p.in_registers)                                                                                      \
      sk::layernorm_forward_in_registers<TX, TR, TW, TY>(x, residual, weight, bias, static_cast<TX*>(p.sum), \
                                                         static_cast<TY*>(p.y), p.mean, p.rstd, p.rows,      \
                                                         p.width, p.eps);                                    \
    else                                                                                                     \
      sk::layernorm_forward<TX, TR, TW, TY>(x, residual, weight, bias, static_cast<TX*>(p.sum),              \
                                            static_cast<TY*>(p.y), p.mean, p.rstd, p.rows, p.width, p.eps);  \
  })
#define SK_LN_BACKWARD(ty_tag, TY, tx_tag, TX, tw_tag, TW)                                                         \
  SK_ENTRY(layernorm_backward_##tx_tag##_##tw_tag##_##ty_tag, (                                                    \
      const sk::kernels::layernorm::Backward p) {                                                                  \
    const auto dy = static_cast<const TY*>(p.dy);                                                                  \
    const auto x = static_cast<const TX*>(p.x);                                                                    \
    const auto weight = static_cast<const TW*>(p.weight);                                                          \
    const auto dsum = static_cast<const TX*>(p.dsum);                                                              \
    if (p.in_registers)                                                                                            \
      sk::layernorm_backward_in_registers<TX, TW, TY>(dy, x, weight, p.mean, p.rstd, dsum, static_cast<TX*>(p.dx), \
                                                      static_cast<TY*>(p.dx_branch), p.partials, p.rows,           \
                                                      p.width);                                                    \
    else                                                                                                           \
      sk::layernorm_backward<TX, TW, TY>(dy, x, weight, p.mean, p.rstd, dsum, static_cast<TX*>(p.dx),              \
                                         static_cast<TY*>(p.dx_branch), p.partials, p.rows, p.width);              \
  })
#define SK_LN_BOTH(ty_tag, TY, tx_tag, TX, tw_tag, TW)          \
  SK_LN_FORWARD(ty_tag, TY, tx_tag, TX, tx_tag, TX, tw_tag, TW) \
  SK_LN_BACKWARD(ty_tag, TY, tx_tag, TX, tw_tag, TW)
#define SK_LN_OVER_Y(tw_tag, TW, tx_tag, TX) SK_TYPES_3(SK_LN_BOTH, tx_tag, TX, tw_tag, TW)
#define SK_LN_OVER_W(tx_tag, TX, ...) SK_TYPES_2(SK_LN_OVER_Y, tx_tag, TX)
SK_TYPES_1(SK_LN_OVER_W, )

// The mixed forwards: fp32 input and sum, bf16 or fp16 residual.
#define SK_LN_F32_RESIDUAL(ty_tag, TY, tr_tag, TR, tw_tag, TW) \
  SK_LN_FORWARD(ty_tag, TY, f32, sk::f32, tr_tag, TR, tw_tag, TW)
#define SK_LN_F32_OVER_Y(tw_tag, TW, tr_tag, TR) SK_TYPES_3(SK_LN_F32_RESIDUAL, tr_tag, TR, tw_tag, TW)
#define SK_LN_F32_OVER_W(tr_tag, TR) SK_TYPES_2(SK_LN_F32_OVER_Y, tr_tag, TR)
SK_LN_F32_OVER_W(bf16, sk::bf16)
SK_LN_F32_OVER_W(f16, sk::f16)

// The exact-width backwards, layernorm_backward_<x>_f32_<y>_<width> for widths 128 to 1024 in steps
// of 128, with an fp32 weight (the mixed-precision case) and dy of x's type or x fp32: the type
// combinations that sk::kernels::layernorm::has_exact_width lists. The other combinations take the
// runtime-width kernels above.
#define SK_LN_BACKWARD_EXACT_AT(chunks, width, ty_tag, TY, tx_tag, TX)                                          \
  SK_ENTRY(layernorm_backward_##tx_tag##_f32_##ty_tag##_##width, (                                              \
      const sk::kernels::layernorm::Backward p) {                                                               \
    sk::layernorm_backward_exact<chunks, TX, float, TY>(                                                        \
        static_cast<const TY*>(p.dy), static_cast<const TX*>(p.x), static_cast<const float*>(p.weight), p.mean, \
        p.rstd, static_cast<const TX*>(p.dsum), static_cast<TX*>(p.dx), static_cast<TY*>(p.dx_branch),          \
        p.partials, p.rows);                                                                                    \
  })
#define SK_LN_BACKWARD_EXACT(ty_tag, TY, tx_tag, TX, ...)   \
  SK_LN_BACKWARD_EXACT_AT(1, 128, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(2, 256, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(3, 384, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(4, 512, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(5, 640, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(6, 768, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(7, 896, ty_tag, TY, tx_tag, TX)  \
  SK_LN_BACKWARD_EXACT_AT(8, 1024, ty_tag, TY, tx_tag, TX)
SK_TYPES_1(SK_LN_BACKWARD_EXACT, f32, sk::f32)
SK_LN_BACKWARD_EXACT(bf16, sk::bf16, bf16, sk::bf16)
SK_LN_BACKWARD_EXACT(f16, sk::f16, f16, sk::f16)

#define SK_LN_PARAM_GRAD(tw_tag, TW, ...)                                                    \
  SK_ENTRY(layernorm_param_grad_##tw_tag, (const sk::kernels::layernorm::ParamGrad p) {      \
    sk::layernorm_param_grad<TW>(p.partials, p.blocks, p.width, static_cast<TW*>(p.dweight), \
                                 static_cast<TW*>(p.dbias));                                 \
  })
SK_TYPES_1(SK_LN_PARAM_GRAD, )

#else  // host: the launchers

#include "kernels.h"

#include <algorithm>
#include <initializer_list>

namespace sk::kernels::layernorm {

// Rows per forward block (one warp each).
constexpr int kForwardWarps = 8;
// Warps per backward block, at most: each needs 2 × width floats of shared memory.
constexpr int kBackwardWarps = 4;
// The widest row the kernels keep in registers (kRowChunks × 4 columns × 32 lanes).
constexpr int64_t kRegisterWidth = 1024;

// Whether the in-register path applies: the width fits, is a multiple of 4, and every tensor's rows
// start on a four-element boundary (its 8- or 16-byte loads).
inline int rows_fit_registers(int64_t width, std::initializer_list<const at::Tensor*> tensors) {
  return width % 4 == 0 && width <= kRegisterWidth && aligned_to(4, tensors) ? 1 : 0;
}

// Whether the backward has an exact-width kernel for these types and this width (the list the
// device part instantiates: an fp32 weight, dy of x's type or x fp32, widths 128 to 1024 in steps of
// 128), the rows aligned as rows_fit_registers asks.
inline bool has_exact_width(at::ScalarType x, at::ScalarType weight, at::ScalarType dy, int64_t width,
                            std::initializer_list<const at::Tensor*> tensors) {
  return weight == at::kFloat && (x == at::kFloat || dy == x) && width % 128 == 0 && width <= 1024 &&
         rows_fit_registers(width, tensors);
}

// What the forward leaves for the backward and returns: y, and with a residual the sum s = x + r
// (undefined without one); mean and rstd are fp32 [rows].
struct Normalised {
  at::Tensor y, sum, mean, rstd;
};

struct Gradients {
  at::Tensor dx, dweight, dbias;
  at::Tensor dx_branch;  // dx in dy's type, when asked for
};

// Warps per backward block for this width on this device, 0 when even one warp's accumulators do
// not fit in shared memory (the caller then takes the ATen path).
inline int backward_warps(int64_t width, const at::Device& device) {
  if (width <= 0) return 0;
  const int64_t per_warp = 2 * width * static_cast<int64_t>(sizeof(float));
  return static_cast<int>(std::min<int64_t>(kBackwardWarps, max_dynamic_shared_memory(device) / per_warp));
}

inline void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// x, residual: [rows, width] contiguous, the same type or x fp32 and residual bf16/fp16 (the sum is
// x's type); weight, bias: [width] contiguous or undefined.
inline Normalised forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          const at::Tensor& bias, double eps, at::ScalarType out_type) {
  const int64_t rows = x.size(0), width = x.size(1);
  const auto floats = x.options().dtype(at::kFloat);
  Normalised out{at::empty({rows, width}, x.options().dtype(out_type)),
                 residual.defined() ? at::empty_like(x) : at::Tensor(), at::empty({rows}, floats),
                 at::empty({rows}, floats)};
  if (rows == 0) return out;
  const auto weight_type = weight.defined() ? weight.scalar_type() : at::kFloat;
  const auto residual_type = residual.defined() ? residual.scalar_type() : x.scalar_type();
  const unsigned blocks = static_cast<unsigned>((rows + kForwardWarps - 1) / kForwardWarps);
  launch(get<Forward>({x.scalar_type(), residual_type, weight_type, out_type}, x.device()), {blocks, 1, 1},
         {32 * kForwardWarps, 1, 1}, 0,
         Forward{.x = x.data_ptr(),
                 .residual = data_or_null(residual),
                 .weight = data_or_null(weight),
                 .bias = data_or_null(bias),
                 .sum = data_or_null(out.sum),
                 .y = out.y.data_ptr(),
                 .mean = out.mean.data_ptr<float>(),
                 .rstd = out.rstd.data_ptr<float>(),
                 .rows = static_cast<int>(rows),
                 .width = static_cast<int>(width),
                 .eps = static_cast<float>(eps),
                 .in_registers = rows_fit_registers(width, {&x, &residual, &weight, &bias, &out.sum, &out.y})});
  return out;
}

// dy: [rows, width] in the forward's output type; x: the forward's normalised input (the sum s with
// a residual); dsum: the gradient arriving at s from its other uses, or undefined. The caller has
// checked backward_warps(width) > 0. With `branch_in_dy_type`, dx also comes back in dy's type
// (Gradients::dx_branch), from the same pass.
inline Gradients backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, bool has_bias,
                          const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& dsum,
                          bool branch_in_dy_type = false) {
  const int64_t rows = x.size(0), width = x.size(1);
  const auto weight_type = weight.defined() ? weight.scalar_type() : at::kFloat;
  const auto param_options = x.options().dtype(weight_type);
  Gradients out{at::empty_like(x), weight.defined() ? at::empty({width}, param_options) : at::Tensor(),
                has_bias ? at::empty({width}, param_options) : at::Tensor(),
                branch_in_dy_type ? at::empty_like(dy) : at::Tensor()};
  if (!out.dweight.defined() && !out.dbias.defined() && rows == 0) return out;
  const int warps = backward_warps(width, x.device());
  const int64_t row_blocks = (rows + warps - 1) / warps;
  const std::initializer_list<const at::Tensor*> rows_of = {&dy, &x, &weight, &dsum, &out.dx, &out.dx_branch};
  const bool exact = has_exact_width(x.scalar_type(), weight_type, dy.scalar_type(), width, rows_of);
  const auto kernel = get<Backward>({x.scalar_type(), weight_type, dy.scalar_type()}, x.device(),
                                    exact ? std::to_string(width) : std::string());
  const int shared = static_cast<int>(warps * 2 * width * sizeof(float));
  allow_dynamic_shared_memory(kernel, shared);
  // One wave of as many blocks as are resident on an SM at once (up to 8; registers and shared
  // memory decide): the row loop is bound by memory latency, a block's accumulators are its only
  // cost (one fp32 partial per block and column later), and a grid beyond one wave would leave a
  // partly filled second wave.
  const int64_t per_sm = std::clamp<int64_t>(resident_blocks_per_sm(kernel, 32 * warps, shared), 1, 8);
  const int blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(row_blocks, per_sm * static_cast<int64_t>(multiprocessors(x.device())))));
  at::Tensor partials = at::empty({blocks, 2, width}, x.options().dtype(at::kFloat));
  launch(kernel, {static_cast<unsigned>(blocks), 1, 1}, {static_cast<unsigned>(32 * warps), 1, 1}, shared,
         Backward{.dy = dy.data_ptr(),
                  .x = x.data_ptr(),
                  .weight = data_or_null(weight),
                  .mean = mean.data_ptr<float>(),
                  .rstd = rstd.data_ptr<float>(),
                  .dsum = data_or_null(dsum),
                  .dx = out.dx.data_ptr(),
                  .dx_branch = data_or_null(out.dx_branch),
                  .partials = partials.data_ptr<float>(),
                  .rows = static_cast<int>(rows),
                  .width = static_cast<int>(width),
                  .in_registers = rows_fit_registers(width, rows_of)});
  if (out.dweight.defined() || out.dbias.defined()) {
    launch(get<ParamGrad>({weight_type}, x.device()), {static_cast<unsigned>((width + 31) / 32), 1, 1}, {32, 32, 1}, 0,
           ParamGrad{.partials = partials.data_ptr<float>(),
                     .blocks = blocks,
                     .width = static_cast<int>(width),
                     .dweight = data_or_null(out.dweight),
                     .dbias = data_or_null(out.dbias)});
  }
  return out;
}

}  // namespace sk::kernels::layernorm

#endif
