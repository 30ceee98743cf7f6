// The classifier's loss: softmax cross-entropy over the vocabulary, mean over the rows whose target
// is not ignore_index, and its gradient with respect to the logits.
//
// Forward: one warp per row, eight rows per block (a row's statistics reduce with warp shuffles, with
// no block-wide synchronisation), one pass over the logits with an online softmax (a running maximum
// and a sum of exponentials rescaled when the maximum grows), giving the row's log-sum-exp and loss.
// Nothing of size rows × vocabulary is written: no fp32 copy of the logits, no probabilities.
// Backward: one warp per row again, one pass, writing dlogits = (softmax − onehot) · dloss / n in
// the logits' type, with dloss and n read from device memory (no host synchronisation; under a
// GradScaler dloss is the scale). llm.c fuses this into the forward because it knows dloss there;
// a library does not (the scale lives on the device), and doing it here costs no extra pass: one
// read in the forward, one read and one write in the backward, against ATen's cast to fp32,
// log-softmax, NLL and their backwards.
// Forward and backward together (the chunked classifier, which computes the gradient in its forward
// for a loss gradient of 1): one block per row, the row kept in shared memory between its statistics
// and its gradient where it fits, so the logits are read once and overwritten once. A block of rows
// of the chunked classifier has a few thousand rows of tens of thousands of classes: a warp per row
// leaves most of the GPU's warps idle there, a block per row does not.
#pragma once

#include "common.cuh"

namespace sk::kernels::classifier {

// Per row of logits [rows, vocab]: the loss (0 for an ignored row) and the log-sum-exp, fp32.
// Entry points cross_entropy_forward_<logits>.
struct Forward {
  SK_KERNEL_ENTRY("classifier.cuh", "cross_entropy_forward");
  const void* logits;
  const long long* targets;
  float* row_loss;
  float* row_lse;
  int rows;
  int vocab;
  long long ignore_index;
};

// dlogits = (softmax − onehot) · dloss / count in the logits' type, dloss and count fp32 scalars on
// the device. Entry points cross_entropy_backward_<logits>.
struct Backward {
  SK_KERNEL_ENTRY("classifier.cuh", "cross_entropy_backward");
  const void* logits;
  const long long* targets;
  const float* row_lse;
  const float* dloss;
  const float* count;
  void* dlogits;
  int rows;
  int vocab;
  long long ignore_index;
};

// Per row of logits [rows, vocab], overwritten with their gradient: the loss and the log-sum-exp as
// Forward writes them, and dlogits = (softmax − onehot) · dloss / count as Backward writes it. A row
// of 16-byte vectors waits in dynamic shared memory (vocab · element bytes) between the two passes;
// any other row is read again element by element. Entry points
// cross_entropy_forward_backward_<logits>.
struct ForwardBackward {
  SK_KERNEL_ENTRY("classifier.cuh", "cross_entropy_forward_backward");
  void* logits;
  const long long* targets;
  float* row_loss;
  float* row_lse;
  const float* dloss;
  const float* count;
  int vocab;
  long long ignore_index;
};

// Threads of a ForwardBackward block.
constexpr int kRowThreads = 512;

}  // namespace sk::kernels::classifier

#ifdef __CUDACC_RTC__

namespace sk {

// Combines two (max, sum of exp(v - max)) pairs.
__device__ __forceinline__ void softmax_merge(float& max, float& sum, float other_max, float other_sum) {
  const float new_max = fmaxf(max, other_max);
  if (new_max == -infinity()) return;  // both empty
  sum = sum * __expf(max - new_max) + other_sum * __expf(other_max - new_max);
  max = new_max;
}

// Warp-wide (max, sum) reduction with shuffles; every lane gets the result.
__device__ __forceinline__ void warp_softmax_stats(float& max, float& sum) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, max, offset);
    const float s = __shfl_xor_sync(0xffffffffu, sum, offset);
    softmax_merge(max, sum, m, s);
  }
}

// 16-byte vectors per lane that the forward loads before reducing them together, and per thread in
// the forward and backward's first pass (a block per row has fewer vectors per thread in flight).
constexpr int CE_GROUP = 2;
constexpr int CE_ROW_GROUP = 4;

// 16-byte loads and stores: N elements of TL at a time, where the row allows (vocab a multiple of N,
// the logits 16-byte aligned); one max and one rescale per N elements instead of per element.
template <typename TL>
struct Vec16 {
  static constexpr int N = 16 / sizeof(TL);
  static __device__ __forceinline__ bool fits(const void* base, int vocab) {
    return vocab % N == 0 && reinterpret_cast<unsigned long long>(base) % 16 == 0;
  }
};

// G 16-byte vectors of logits into a running (max, sum of exp(v - max)): one maximum and one
// rescale for all of them.
template <typename TL, int G>
__device__ __forceinline__ void softmax_add_vectors(const uint4 (&raw)[G], float& max, float& sum) {
  constexpr int N = Vec16<TL>::N;
  float v[G * N], chunk_max = -infinity();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const TL* e = reinterpret_cast<const TL*>(&raw[g]);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[g * N + k] = to_float(e[k]);
      chunk_max = fmaxf(chunk_max, v[g * N + k]);
    }
  }
  if (chunk_max == -infinity()) return;  // every class masked
  float chunk_sum = 0.f;
#pragma unroll
  for (int k = 0; k < G * N; ++k) chunk_sum += __expf(v[k] - chunk_max);
  softmax_merge(max, sum, chunk_max, chunk_sum);
}

// One logit into a running (max, sum of exp(v - max)).
__device__ __forceinline__ void softmax_add(float v, float& max, float& sum) {
  if (v == -infinity()) return;  // a masked class: exp gives 0, and -inf - -inf would be NaN
  if (v > max) {
    sum = sum * __expf(max - v) + 1.f;
    max = v;
  } else {
    sum += __expf(v - max);
  }
}

template <typename TL>
__device__ void cross_entropy_forward(const TL* __restrict__ logits, const long long* __restrict__ targets,
                                      float* __restrict__ row_loss, float* __restrict__ row_lse, int rows,
                                      int vocab, long long ignore_index) {
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const TL* l = logits + static_cast<size_t>(row) * vocab;
  float max = -infinity(), sum = 0.f;
  constexpr int N = Vec16<TL>::N;
  const bool vectorised = Vec16<TL>::fits(logits, vocab);
  const int vectors = vectorised ? vocab / N : 0;
  const uint4* row_vectors = reinterpret_cast<const uint4*>(l);
  // Groups of CE_GROUP 16-byte vectors per lane: the group's loads issued together, then one
  // maximum and one rescale per group. One vector at a time (a rescale, two exponentials, per 8
  // bf16 logits) ran at 3.6 TB/s on an H200 at 16384 × 8192, groups of two at 3.9.
  int i = threadIdx.x;
  for (; i + 32 * (CE_GROUP - 1) < vectors; i += 32 * CE_GROUP) {
    uint4 raw[CE_GROUP];
#pragma unroll
    for (int g = 0; g < CE_GROUP; ++g) raw[g] = row_vectors[i + 32 * g];
    softmax_add_vectors<TL>(raw, max, sum);
  }
  for (; i < vectors; i += 32) {
    const uint4 raw[1] = {row_vectors[i]};
    softmax_add_vectors<TL>(raw, max, sum);
  }
  for (int c = threadIdx.x; !vectorised && c < vocab; c += 32) softmax_add(to_float(l[c]), max, sum);
  warp_softmax_stats(max, sum);
  if (threadIdx.x == 0) {
    const float lse = max + logf(sum);
    const long long target = targets[row];
    row_lse[row] = lse;
    if (target == ignore_index) {
      row_loss[row] = 0.f;
    } else if (target < 0 || target >= vocab) {
      row_loss[row] = __int_as_float(0x7fc00000);  // NaN: an out-of-range target poisons the loss
    } else {
      row_loss[row] = lse - to_float(l[target]);
    }
  }
}

// dloss: the gradient of the mean loss (one float); count: the number of rows that count (one float).
template <typename TL>
// dlogits may be logits itself (the shim writes the gradient over the logits where nothing else
// reads them): each element is read once, by the thread that then writes it, so neither pointer is
// __restrict__.
__device__ void cross_entropy_backward(const TL* logits, const long long* __restrict__ targets,
                                       const float* __restrict__ row_lse, const float* __restrict__ dloss,
                                       const float* __restrict__ count, TL* dlogits, int rows,
                                       int vocab, long long ignore_index) {
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const size_t offset = static_cast<size_t>(row) * vocab;
  const long long target = targets[row];
  TL* out = dlogits + offset;
  if (target == ignore_index) {
    for (int c = threadIdx.x; c < vocab; c += 32) out[c] = from_float<TL>(0.f);
    return;
  }
  const TL* l = logits + offset;
  const float lse = row_lse[row];
  const float scale = *dloss / *count;
  constexpr int N = Vec16<TL>::N;
  const bool vectorised = Vec16<TL>::fits(logits, vocab) && Vec16<TL>::fits(dlogits, vocab);
#pragma unroll 4
  for (int i = threadIdx.x; vectorised && i < vocab / N; i += 32) {
    const uint4 raw = reinterpret_cast<const uint4*>(l)[i];
    const TL* e = reinterpret_cast<const TL*>(&raw);
    uint4 packed;
    TL* o = reinterpret_cast<TL*>(&packed);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int c = i * N + k;
      const float p = __expf(to_float(e[k]) - lse);
      o[k] = from_float<TL>((p - (c == target ? 1.f : 0.f)) * scale);
    }
    reinterpret_cast<uint4*>(out)[i] = packed;
  }
  for (int c = threadIdx.x; !vectorised && c < vocab; c += 32) {
    const float p = __expf(to_float(l[c]) - lse);
    out[c] = from_float<TL>((p - (c == target ? 1.f : 0.f)) * scale);
  }
}

// Block-wide (max, sum) reduction; every thread gets the result. Each warp merges the warps' pairs
// in the same order, so no second synchronisation is needed and every thread gets the same bits.
__device__ __forceinline__ void block_softmax_stats(float& max, float& sum) {
  __shared__ float maxes[32], sums[32];
  warp_softmax_stats(max, sum);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    maxes[warp] = max;
    sums[warp] = sum;
  }
  __syncthreads();
  const bool present = lane < static_cast<int>(blockDim.x / 32);
  max = present ? maxes[lane] : -infinity();
  sum = present ? sums[lane] : 0.f;
  warp_softmax_stats(max, sum);
}

// The gradient of one 16-byte vector of logits starting at class c0: softmax · scale, less scale
// at the target. `shift` is lse · log2(e): exp(v − lse) is one fused multiply-add and one exp2.
template <typename TL>
__device__ __forceinline__ uint4 softmax_gradient_vector(const uint4& raw, int c0, float shift, long long target,
                                                         float scale) {
  constexpr int N = Vec16<TL>::N;
  constexpr float kLog2e = 1.4426950408889634f;
  const TL* e = reinterpret_cast<const TL*>(&raw);
  float g[N];
#pragma unroll
  for (int k = 0; k < N; ++k) g[k] = exp2f(fmaf(to_float(e[k]), kLog2e, -shift)) * scale;
  const long long at = target - c0;
  if (at >= 0 && at < N) {
#pragma unroll
    for (int k = 0; k < N; ++k) g[k] -= k == at ? scale : 0.f;
  }
  uint4 packed;
  TL* o = reinterpret_cast<TL*>(&packed);
#pragma unroll
  for (int k = 0; k < N; ++k) o[k] = from_float<TL>(g[k]);
  return packed;
}

template <typename TL>
__device__ void cross_entropy_forward_backward(TL* logits, const long long* __restrict__ targets,
                                               float* __restrict__ row_loss, float* __restrict__ row_lse,
                                               const float* __restrict__ dloss, const float* __restrict__ count,
                                               int vocab, long long ignore_index) {
  extern __shared__ uint4 kept_vectors[];
  const int row = blockIdx.x;
  TL* l = logits + static_cast<size_t>(row) * vocab;
  const long long target = targets[row];
  const bool counted = target != ignore_index, in_range = target >= 0 && target < vocab;
  // Read before the block's first synchronisation, after which the row is overwritten.
  const float target_logit = threadIdx.x == 0 && counted && in_range ? to_float(l[target]) : 0.f;
  constexpr int N = Vec16<TL>::N;
  const bool vectorised = Vec16<TL>::fits(logits, vocab);
  const int vectors = vectorised ? vocab / N : 0, stride = blockDim.x;
  uint4* row_vectors = reinterpret_cast<uint4*>(l);
  float max = -infinity(), sum = 0.f;
  // Each thread keeps and later reads back only its own vectors: the shared memory needs no
  // synchronisation of its own.
  int i = threadIdx.x;
  for (; i + stride * (CE_ROW_GROUP - 1) < vectors; i += stride * CE_ROW_GROUP) {
    uint4 raw[CE_ROW_GROUP];
#pragma unroll
    for (int g = 0; g < CE_ROW_GROUP; ++g) raw[g] = row_vectors[i + stride * g];
#pragma unroll
    for (int g = 0; g < CE_ROW_GROUP; ++g) kept_vectors[i + stride * g] = raw[g];
    softmax_add_vectors<TL>(raw, max, sum);
  }
  for (; i < vectors; i += stride) {
    const uint4 raw[1] = {row_vectors[i]};
    kept_vectors[i] = raw[0];
    softmax_add_vectors<TL>(raw, max, sum);
  }
  for (int c = threadIdx.x; !vectorised && c < vocab; c += stride) softmax_add(to_float(l[c]), max, sum);
  block_softmax_stats(max, sum);
  const float lse = max + logf(sum);
  if (threadIdx.x == 0) {
    row_lse[row] = lse;
    // NaN for an out-of-range target: it poisons the loss, as the forward's does.
    row_loss[row] = !counted ? 0.f : in_range ? lse - target_logit : __int_as_float(0x7fc00000);
  }
  if (!counted) {  // an ignored row's gradient is 0, whatever its logits
    for (int j = threadIdx.x; j < vectors; j += stride) row_vectors[j] = make_uint4(0, 0, 0, 0);
    for (int c = threadIdx.x; !vectorised && c < vocab; c += stride) l[c] = from_float<TL>(0.f);
    return;
  }
  const float scale = *dloss / *count, shift = lse * 1.4426950408889634f;
#pragma unroll 4
  for (int j = threadIdx.x; j < vectors; j += stride) {
    row_vectors[j] = softmax_gradient_vector<TL>(kept_vectors[j], j * N, shift, target, scale);
  }
  for (int c = threadIdx.x; !vectorised && c < vocab; c += stride) {
    const float p = __expf(to_float(l[c]) - lse);
    l[c] = from_float<TL>((p - (c == target ? 1.f : 0.f)) * scale);
  }
}

}  // namespace sk

#define SK_CE(tl_tag, TL, ...)                                                                                \
  SK_ENTRY(cross_entropy_forward_##tl_tag, (const sk::kernels::classifier::Forward p) {                       \
    sk::cross_entropy_forward<TL>(static_cast<const TL*>(p.logits), p.targets, p.row_loss, p.row_lse, p.rows, \
                                  p.vocab, p.ignore_index);                                                   \
  })                                                                                                          \
  SK_ENTRY(cross_entropy_backward_##tl_tag, (const sk::kernels::classifier::Backward p) {                     \
    sk::cross_entropy_backward<TL>(static_cast<const TL*>(p.logits), p.targets, p.row_lse, p.dloss, p.count,  \
                                   static_cast<TL*>(p.dlogits), p.rows, p.vocab, p.ignore_index);             \
  })                                                                                                          \
  SK_ENTRY_BOUNDED(sk::kernels::classifier::kRowThreads, cross_entropy_forward_backward_##tl_tag,             \
                   (const sk::kernels::classifier::ForwardBackward p) {                                       \
                     sk::cross_entropy_forward_backward<TL>(static_cast<TL*>(p.logits), p.targets, p.row_loss, \
                                                            p.row_lse, p.dloss, p.count, p.vocab,             \
                                                            p.ignore_index);                                  \
                   })
SK_TYPES_1(SK_CE, )

#else  // host: the launchers

#include "kernels.h"

#include <algorithm>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace sk::kernels::classifier {

// Rows per block, one warp each, in both directions.
constexpr unsigned kRowsPerBlock = 8;

inline unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// What the forward keeps per row: fp32 [rows] each.
struct Rows {
  at::Tensor loss, lse;
};

// logits: [rows, vocab] contiguous; targets: [rows] int64 contiguous.
inline Rows forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const auto floats = logits.options().dtype(at::kFloat);
  Rows out{at::empty({rows}, floats), at::empty({rows}, floats)};
  if (rows == 0) return out;
  launch(get<Forward>({logits.scalar_type()}, logits.device()), {blocks_for(rows), 1, 1}, {32, kRowsPerBlock, 1}, 0,
         Forward{.logits = logits.data_ptr(),
                 .targets = reinterpret_cast<const long long*>(targets.data_ptr<int64_t>()),
                 .row_loss = out.loss.data_ptr<float>(),
                 .row_lse = out.lse.data_ptr<float>(),
                 .rows = static_cast<int>(rows),
                 .vocab = static_cast<int>(vocab),
                 .ignore_index = ignore_index});
  return out;
}

// dloss, count: fp32 scalars on the device.
// The gradient of the mean loss with respect to the logits; written over `logits` when `in_place`.
inline at::Tensor backward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& row_lse,
                           const at::Tensor& dloss, const at::Tensor& count, int64_t ignore_index,
                           bool in_place = false) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor dlogits = in_place ? logits : at::empty_like(logits);
  if (rows == 0) return dlogits;
  launch(get<Backward>({logits.scalar_type()}, logits.device()), {blocks_for(rows), 1, 1}, {32, kRowsPerBlock, 1}, 0,
         Backward{.logits = logits.data_ptr(),
                  .targets = reinterpret_cast<const long long*>(targets.data_ptr<int64_t>()),
                  .row_lse = row_lse.data_ptr<float>(),
                  .dloss = dloss.data_ptr<float>(),
                  .count = count.data_ptr<float>(),
                  .dlogits = dlogits.data_ptr(),
                  .rows = static_cast<int>(rows),
                  .vocab = static_cast<int>(vocab),
                  .ignore_index = ignore_index});
  return dlogits;
}

// The loss and log-sum-exp of each row of `logits` (as forward), and their gradient for a loss
// gradient `dloss` and a row count `count` (as backward), written over the logits.
inline Rows forward_backward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                             const at::Tensor& dloss, const at::Tensor& count) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  // A row of 16-byte vectors waits in shared memory, as much as a block may have (227 KiB on
  // Hopper: a vocabulary of 116k in bf16). A longer one runs the two passes as two kernels.
  const int64_t row_bytes = vocab * static_cast<int64_t>(logits.element_size());
  const bool vectors = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  if (rows > 0 && vectors && row_bytes > max_dynamic_shared_memory(logits.device())) {
    Rows out = forward(logits, targets, ignore_index);
    backward(logits, targets, out.lse, dloss, count, ignore_index, /*in_place=*/true);
    return out;
  }
  const auto floats = logits.options().dtype(at::kFloat);
  Rows out{at::empty({rows}, floats), at::empty({rows}, floats)};
  if (rows == 0) return out;
  const auto kernel = get<ForwardBackward>({logits.scalar_type()}, logits.device());
  const int shared = vectors ? static_cast<int>(row_bytes) : 0;
  if (vectors) allow_dynamic_shared_memory(kernel, shared);
  // A thread per 16-byte vector of the row up to a block's most (a small vocabulary leaves none idle).
  const auto threads = static_cast<unsigned>(std::min<int64_t>(kRowThreads, ((row_bytes + 15) / 16 + 31) / 32 * 32));
  launch(kernel, {static_cast<unsigned>(rows), 1, 1}, {threads, 1, 1}, shared,
         ForwardBackward{.logits = logits.data_ptr(),
                         .targets = reinterpret_cast<const long long*>(targets.data_ptr<int64_t>()),
                         .row_loss = out.loss.data_ptr<float>(),
                         .row_lse = out.lse.data_ptr<float>(),
                         .dloss = dloss.data_ptr<float>(),
                         .count = count.data_ptr<float>(),
                         .vocab = static_cast<int>(vocab),
                         .ignore_index = ignore_index});
  return out;
}

}  // namespace sk::kernels::classifier

#endif
