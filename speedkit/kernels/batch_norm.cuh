// BatchNorm in training mode over channels-last activations, forward and backward: what ATen's
// native_batch_norm and native_batch_norm_backward compute, each pass reading its inputs once at
// close to the memory's bandwidth.
//
// The activations are a matrix x [rows, C]: rows = N·H·W positions of channels-last [N, C, H, W]
// (or the rows of [N, C]), C channels contiguous. ATen's channels-last kernels for these shapes
// reach a fifth to a half of HBM bandwidth on an H100 (the statistics of a ResNet-18 step take
// 0.59 ms for 315 MB read).
//
// Every reduction here is a pair of passes:
// - *partials*: a block is `ct` column groups × R rows of threads (ct · R = 256), a column group
//   VEC channels (8: one 16-byte load of bf16/fp16, two of fp32; 1 where C is not a multiple of
//   8). Each thread sums its channels over every R-th row of the block's strip of rows; the block
//   adds its rows of threads in a fixed order and writes one partial per channel and quantity,
//   partials [strips, 2, C] fp32.
// - *finish*: a block is 32 channels × 32 threads over the strips; it adds them in a fixed order and
//   writes the per-channel results.
// No atomics: the results are the same from run to run.
//
// The statistics sum x - x[0, c] and its square rather than x and x²: a shift by one of the
// channel's own values keeps E[d²] - E[d]² from cancelling where the mean is large against the
// spread, at the cost of one 16-byte load per thread. The element-wise passes (the normalisation,
// the input's gradient) keep each thread on one column group, its per-channel coefficients in
// registers, and stride over rows.
//
// Each entry point takes one params struct (below, before the NVRTC-only part), launched from Rust
// (speedkit/src/overrides/batch_norm/) through speedkit::cuda's typed launches with a #[repr(C)]
// mirror of it (batch_norm/params.rs): pointers and 64-bit fields first, then the 32-bit ones, and
// the struct's size asserted on both sides. Pointers of the activation type are `const void*` /
// `void*`, cast by each entry point to its type.
#pragma once

#include "common.cuh"

namespace sk::kernels::batch_norm {

// Partials of Σ (x - x[0]) and Σ (x - x[0])² per channel of x [rows, channels]: partials [strips, 2,
// channels] fp32, one strip of strip_rows rows per blockIdx.y. Entry points
// batch_norm_stats_partials_<x>_v<VEC>.
struct StatsPartials {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_stats_partials");
  const void* x;
  float* partials;
  long long rows;
  long long strip_rows;
  int channels;
};

// The statistics from StatsPartials' partials: save_mean, save_invstd, the running statistics, and
// the normalisation's coefficients [3, channels]. weight, bias and the running statistics are read
// only as `flags` says (kWeight, kBias, kRunning), and may be null otherwise. Entry points
// batch_norm_stats_finish_<x>.
struct StatsFinish {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_stats_finish");
  const float* partials;
  const void* x;
  const float* weight;
  const float* bias;
  float* save_mean;
  float* save_invstd;
  float* running_mean;
  float* running_var;
  float* coefficients;
  long long rows;
  int strips;
  int channels;
  float eps;
  float momentum;
  int flags;
};

// y = x normalised by its coefficients [3, channels], plus the addend ADD names (`other`, or `other`
// normalised by other_coefficients; each null where ADD does not read it), ReLU'd where RELU. Entry
// points batch_norm_normalize_<x>_v<VEC>_r<RELU>_a<ADD>.
struct Normalize {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_normalize");
  const void* x;
  const float* coefficients;
  const void* other;
  const float* other_coefficients;
  void* y;
  long long rows;
  int channels;
};

// Partials of Σ dy and Σ dy · (x - mean) per channel, as StatsPartials'. Entry points
// batch_norm_backward_partials_<x>_v<VEC>.
struct BackwardPartials {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_backward_partials");
  const void* dy;
  const void* x;
  const float* mean;
  float* partials;
  long long rows;
  long long strip_rows;
  int channels;
};

// The parameters' gradients (as `flags` says: kGradWeight, kGradBias) and the input gradient's
// coefficients [4, channels] from BackwardPartials' partials; weight read only with kWeight. Entry
// point batch_norm_backward_finish.
struct BackwardFinish {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_backward_finish");
  const float* partials;
  const float* save_mean;
  const float* save_invstd;
  const float* weight;
  float* grad_weight;
  float* grad_bias;
  float* coefficients;
  long long rows;
  int strips;
  int channels;
  int flags;
};

// dx from dy, x and BackwardFinish's coefficients. Entry points batch_norm_backward_input_<x>_v<VEC>.
struct BackwardInput {
  SK_KERNEL_ENTRY("batch_norm.cuh", "batch_norm_backward_input");
  const void* dy;
  const void* x;
  const float* coefficients;
  void* dx;
  long long rows;
  int channels;
};

// The sizes batch_norm/params.rs asserts of its mirrors.
static_assert(sizeof(StatsPartials) == 40, "StatsPartials' layout is mirrored in Rust");
static_assert(sizeof(StatsFinish) == 104, "StatsFinish's layout is mirrored in Rust");
static_assert(sizeof(Normalize) == 56, "Normalize's layout is mirrored in Rust");
static_assert(sizeof(BackwardPartials) == 56, "BackwardPartials' layout is mirrored in Rust");
static_assert(sizeof(BackwardFinish) == 80, "BackwardFinish's layout is mirrored in Rust");
static_assert(sizeof(BackwardInput) == 48, "BackwardInput's layout is mirrored in Rust");

}  // namespace sk::kernels::batch_norm

#ifdef __CUDACC_RTC__

namespace {

constexpr int kThreads = 256;
constexpr int kFinish = 32;

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[8]) {
  sk::load8(p, v);
}
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[1]) {
  v[0] = sk::to_float(*p);
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[8]) {
  sk::store8(p, v);
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[1]) {
  *p = sk::from_float<T>(v[0]);
}

// This thread's first channel; C when its column group lies past the last channel.
template <int VEC>
__device__ __forceinline__ int first_channel(int C) {
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  return c0 < C ? c0 : C;
}

// The block's sums of `a` and `b` over its rows of threads, as partials[blockIdx.y] of
// [strips, 2, C]. Every thread of the block must call it.
template <int VEC>
__device__ void write_partials(const float (&a)[VEC], const float (&b)[VEC], int C, float* partials) {
  __shared__ float sums[kThreads * 8 * 2];
  const int width = blockDim.x * VEC;  // the block's channels
  const int row = threadIdx.y * 2 * width;
  for (int k = 0; k < VEC; ++k) {
    sums[row + threadIdx.x * VEC + k] = a[k];
    sums[row + width + threadIdx.x * VEC + k] = b[k];
  }
  __syncthreads();
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  for (int out = thread; out < 2 * width; out += kThreads) {
    float total = 0.f;
    for (int y = 0; y < blockDim.y; ++y) total += sums[y * 2 * width + out];
    const int quantity = out / width, c = blockIdx.x * width + out % width;
    if (c < C) partials[(static_cast<size_t>(blockIdx.y) * 2 + quantity) * C + c] = total;
  }
}

// Rows [first, last) of the block's strip.
struct Strip {
  long long first, last;
};
__device__ __forceinline__ Strip strip_of_block(long long rows, long long strip_rows) {
  const long long first = blockIdx.y * strip_rows;
  return {first, first + strip_rows < rows ? first + strip_rows : rows};
}

// Partials of Σ (x - x[0]) and Σ (x - x[0])² per channel.
template <typename T, int VEC>
__device__ void stats_partials(const T* x, float* partials, long long rows, int C, long long strip_rows) {
  const int c0 = first_channel<VEC>(C);
  float shift[VEC], s1[VEC], s2[VEC];
  for (int k = 0; k < VEC; ++k) shift[k] = s1[k] = s2[k] = 0.f;
  if (c0 < C) {
    load_vec(x + c0, shift);
    const Strip s = strip_of_block(rows, strip_rows);
#pragma unroll 4
    for (long long m = s.first + threadIdx.y; m < s.last; m += blockDim.y) {
      float v[VEC];
      load_vec(x + m * C + c0, v);
      for (int k = 0; k < VEC; ++k) {
        const float d = v[k] - shift[k];
        s1[k] += d;
        s2[k] = fmaf(d, d, s2[k]);
      }
    }
  }
  write_partials<VEC>(s1, s2, C, partials);
}

// The channel's two sums over every strip, in thread (x, 0) of a 32 × 32 block; `c` its channel.
struct ChannelSums {
  int c;
  float a, b;
  bool writer;
};
__device__ ChannelSums finish_sums(const float* partials, int strips, int C) {
  __shared__ float sa[kFinish][kFinish + 1], sb[kFinish][kFinish + 1];
  const int c = blockIdx.x * kFinish + threadIdx.x;
  float a = 0.f, b = 0.f;
  if (c < C)
    for (int s = threadIdx.y; s < strips; s += kFinish) {
      a += partials[(static_cast<size_t>(s) * 2) * C + c];
      b += partials[(static_cast<size_t>(s) * 2 + 1) * C + c];
    }
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  a = b = 0.f;
  if (threadIdx.y == 0)
    for (int y = 0; y < kFinish; ++y) {
      a += sa[y][threadIdx.x];
      b += sb[y][threadIdx.x];
    }
  return {c, a, b, threadIdx.y == 0 && c < C};
}

// Flags of the optional tensors (the host passes null where one is absent).
constexpr int kWeight = 1, kBias = 2, kRunning = 4;

// The statistics: save_mean, save_invstd, the running statistics (unbiased variance, as ATen), and
// the normalisation's coefficients [3, C]: mean, invstd · weight, bias.
template <typename T>
__device__ void stats_finish(const float* partials, const T* x, const float* weight, const float* bias,
                             float* save_mean, float* save_invstd, float* running_mean, float* running_var,
                             float* coefficients, int strips, int C, long long rows, float eps, float momentum,
                             int flags) {
  const ChannelSums s = finish_sums(partials, strips, C);
  if (!s.writer) return;
  const int c = s.c;
  const float n = static_cast<float>(rows);
  const float d = s.a / n;
  const float mean = sk::to_float(x[c]) + d;
  const float var = fmaxf(s.b / n - d * d, 0.f);
  const float invstd = rsqrtf(var + eps);
  save_mean[c] = mean;
  save_invstd[c] = invstd;
  if (flags & kRunning) {
    running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean;
    running_var[c] = (1.f - momentum) * running_var[c] + momentum * var * n / (n - 1.f);
  }
  coefficients[c] = mean;
  coefficients[C + c] = invstd * ((flags & kWeight) ? weight[c] : 1.f);
  coefficients[2 * C + c] = (flags & kBias) ? bias[c] : 0.f;
}

// What the normalisation of x adds to its result before the ReLU, if any: nothing, a tensor laid
// out as x (a residual), or the normalisation of another input (a projected residual).
constexpr int kAddNothing = 0, kAddTensor = 1, kAddNormalized = 2;

// One column group's normalisation, from the coefficients [3, C]: mean, invstd · weight, bias.
template <int VEC>
struct Affine {
  float mean[VEC], scale[VEC], bias[VEC];
  __device__ Affine(const float* coefficients, int C, int c0) {
    for (int k = 0; k < VEC; ++k) {
      mean[k] = coefficients[c0 + k];
      scale[k] = coefficients[C + c0 + k];
      bias[k] = coefficients[2 * C + c0 + k];
    }
  }
  __device__ __forceinline__ float operator()(float v, int k) const { return (v - mean[k]) * scale[k] + bias[k]; }
};

// y = (x - mean) · invstd · weight + bias, plus ADD's addend, and max(y, 0) where RELU: the
// normalised tensor and the sum never written. `other` and `other_coefficients` are read only as
// ADD says.
template <typename T, int VEC, bool RELU, int ADD>
__device__ void normalize(const T* x, const float* coefficients, const T* other, const float* other_coefficients,
                          T* y, long long rows, int C) {
  const int c0 = first_channel<VEC>(C);
  if (c0 >= C) return;
  const Affine<VEC> first(coefficients, C, c0);
  const Affine<VEC> second(ADD == kAddNormalized ? other_coefficients : coefficients, C, c0);
#pragma unroll 4
  for (long long m = blockIdx.y * blockDim.y + threadIdx.y; m < rows; m += gridDim.y * blockDim.y) {
    const long long at = m * C + c0;
    float v[VEC], u[VEC];
    load_vec(x + at, v);
    if (ADD != kAddNothing) load_vec(other + at, u);
    for (int k = 0; k < VEC; ++k) {
      float r = first(v[k], k);
      if (ADD == kAddTensor) r += u[k];
      if (ADD == kAddNormalized) r += second(u[k], k);
      v[k] = RELU ? fmaxf(r, 0.f) : r;
    }
    store_vec(y + at, v);
  }
}

// Partials of Σ dy and Σ dy · (x - mean) per channel.
template <typename T, int VEC>
__device__ void backward_partials(const T* dy, const T* x, const float* mean, float* partials, long long rows,
                                  int C, long long strip_rows) {
  const int c0 = first_channel<VEC>(C);
  float mu[VEC], sdy[VEC], sdyx[VEC];
  for (int k = 0; k < VEC; ++k) mu[k] = sdy[k] = sdyx[k] = 0.f;
  if (c0 < C) {
    for (int k = 0; k < VEC; ++k) mu[k] = mean[c0 + k];
    const Strip s = strip_of_block(rows, strip_rows);
#pragma unroll 4
    for (long long m = s.first + threadIdx.y; m < s.last; m += blockDim.y) {
      float g[VEC], v[VEC];
      load_vec(dy + m * C + c0, g);
      load_vec(x + m * C + c0, v);
      for (int k = 0; k < VEC; ++k) {
        sdy[k] += g[k];
        sdyx[k] = fmaf(g[k], v[k] - mu[k], sdyx[k]);
      }
    }
  }
  write_partials<VEC>(sdy, sdyx, C, partials);
}

constexpr int kGradWeight = 8, kGradBias = 16;

// The parameters' gradients, and the input gradient's coefficients [4, C]: mean, invstd · weight,
// mean of dy, and invstd² · mean of dy · (x - mean).
__device__ void backward_finish(const float* partials, const float* save_mean, const float* save_invstd,
                                const float* weight, float* grad_weight, float* grad_bias, float* coefficients,
                                int strips, int C, long long rows, int flags) {
  const ChannelSums s = finish_sums(partials, strips, C);
  if (!s.writer) return;
  const int c = s.c;
  const float n = static_cast<float>(rows);
  const float invstd = save_invstd[c];
  if (flags & kGradWeight) grad_weight[c] = s.b * invstd;
  if (flags & kGradBias) grad_bias[c] = s.a;
  coefficients[c] = save_mean[c];
  coefficients[C + c] = invstd * ((flags & kWeight) ? weight[c] : 1.f);
  coefficients[2 * C + c] = s.a / n;
  coefficients[3 * C + c] = invstd * invstd * s.b / n;
}

// dx = (dy - mean(dy) - (x - mean) · invstd² · mean(dy · (x - mean))) · invstd · weight.
template <typename T, int VEC>
__device__ void backward_input(const T* dy, const T* x, const float* coefficients, T* dx, long long rows, int C) {
  const int c0 = first_channel<VEC>(C);
  if (c0 >= C) return;
  float mean[VEC], scale[VEC], mean_dy[VEC], k_x[VEC];
  for (int k = 0; k < VEC; ++k) {
    mean[k] = coefficients[c0 + k];
    scale[k] = coefficients[C + c0 + k];
    mean_dy[k] = coefficients[2 * C + c0 + k];
    k_x[k] = coefficients[3 * C + c0 + k];
  }
#pragma unroll 4
  for (long long m = blockIdx.y * blockDim.y + threadIdx.y; m < rows; m += gridDim.y * blockDim.y) {
    float g[VEC], v[VEC];
    load_vec(dy + m * C + c0, g);
    load_vec(x + m * C + c0, v);
    for (int k = 0; k < VEC; ++k) g[k] = (g[k] - mean_dy[k] - (v[k] - mean[k]) * k_x[k]) * scale[k];
    store_vec(dx + m * C + c0, g);
  }
}

}  // namespace

// The normalisation's entry points: batch_norm_normalize_<tag>_v<VEC>_r<RELU>_a<ADD>.
#define SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, RELU, ADD)                                                     \
  SK_ENTRY_BOUNDED(kThreads, batch_norm_normalize_##tag##_v##VEC##_r##RELU##_a##ADD, (                            \
      const sk::kernels::batch_norm::Normalize p) {                                                               \
    normalize<T, VEC, RELU != 0, ADD>(static_cast<const T*>(p.x), p.coefficients, static_cast<const T*>(p.other), \
                                      p.other_coefficients, static_cast<T*>(p.y), p.rows, p.channels);            \
  })

// Entry points per activation type (tag) and column group width (1 or 8 channels).
#define SK_BATCH_NORM_VEC_ENTRIES(tag, T, VEC)                                                             \
  SK_ENTRY_BOUNDED(kThreads, batch_norm_stats_partials_##tag##_v##VEC, (                                   \
      const sk::kernels::batch_norm::StatsPartials p) {                                                    \
    stats_partials<T, VEC>(static_cast<const T*>(p.x), p.partials, p.rows, p.channels, p.strip_rows);      \
  })                                                                                                       \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 0, 0)                                                         \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 1, 0)                                                         \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 0, 1)                                                         \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 1, 1)                                                         \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 0, 2)                                                         \
  SK_BATCH_NORM_NORMALIZE_ENTRY(tag, T, VEC, 1, 2)                                                         \
  SK_ENTRY_BOUNDED(kThreads, batch_norm_backward_partials_##tag##_v##VEC, (                                \
      const sk::kernels::batch_norm::BackwardPartials p) {                                                 \
    backward_partials<T, VEC>(static_cast<const T*>(p.dy), static_cast<const T*>(p.x), p.mean, p.partials, \
                              p.rows, p.channels, p.strip_rows);                                           \
  })                                                                                                       \
  SK_ENTRY_BOUNDED(kThreads, batch_norm_backward_input_##tag##_v##VEC, (                                   \
      const sk::kernels::batch_norm::BackwardInput p) {                                                    \
    backward_input<T, VEC>(static_cast<const T*>(p.dy), static_cast<const T*>(p.x), p.coefficients,        \
                           static_cast<T*>(p.dx), p.rows, p.channels);                                     \
  })

#define SK_BATCH_NORM_ENTRIES(tag, T)                                                                     \
  SK_BATCH_NORM_VEC_ENTRIES(tag, T, 1)                                                                    \
  SK_BATCH_NORM_VEC_ENTRIES(tag, T, 8)                                                                    \
  SK_ENTRY_BOUNDED(kFinish* kFinish, batch_norm_stats_finish_##tag, (                                     \
      const sk::kernels::batch_norm::StatsFinish p) {                                                     \
    stats_finish<T>(p.partials, static_cast<const T*>(p.x), p.weight, p.bias, p.save_mean, p.save_invstd, \
                    p.running_mean, p.running_var, p.coefficients, p.strips, p.channels, p.rows, p.eps,   \
                    p.momentum, p.flags);                                                                 \
  })

SK_BATCH_NORM_ENTRIES(f32, sk::f32)
SK_BATCH_NORM_ENTRIES(bf16, sk::bf16)
SK_BATCH_NORM_ENTRIES(f16, sk::f16)

SK_ENTRY_BOUNDED(kFinish* kFinish, batch_norm_backward_finish, (const sk::kernels::batch_norm::BackwardFinish p) {
  backward_finish(p.partials, p.save_mean, p.save_invstd, p.weight, p.grad_weight, p.grad_bias, p.coefficients,
                  p.strips, p.channels, p.rows, p.flags);
})

#endif  // __CUDACC_RTC__
