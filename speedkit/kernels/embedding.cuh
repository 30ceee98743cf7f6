// Token embedding with an optional learned position embedding, GPT's input layer:
// out[b, t] = table[tokens[b, t]] + positions[t].
//
// Forward: one warp per output row; the row of the table and the row of the position table are
// read once and their sum written in the table's type. A token outside the table stops the kernel
// with a device-side assert, as ATen's embedding does.
//
// Backward, deterministic (no atomics, every sum in a fixed order):
// - dtable[v] = Σ dout[p] over the positions p holding token v, in increasing p. The host sorts the
//   tokens stably, carrying their positions along (cub's radix sort over the bits a token can
//   have), so each token's positions form one run in increasing order. A warp per table row finds
//   its run with a warp-wide search and adds the rows of dout it lists; a row whose token does not
//   occur gets zeros, so dtable is written whole without a separate fill.
// - dpositions[t] = Σ_b dout[b, t], in increasing b: a block per position, its warps each summing
//   every WARPS-th batch row, then the warps' sums added in warp order.
// ATen's dense embedding backward sorts 64-bit keys over all their bits, then runs four kernels to
// segment and reduce; the position gradient is a separate column reduction over the batch, and the
// forward is a gather followed by a broadcast add.
//
// The device part below is compiled by NVRTC (shim/kernels.cpp); the host part at the end, the
// launchers, is compiled into the shim by the host compiler.
#pragma once

#include "common.cuh"

namespace sk::kernels::embedding {

// out[r] = table[tokens[r]] (+ positions[r % seq]) over [rows, width], in the table's type; a token
// outside [0, vocab) is a device-side assert. Entry points embedding_forward_<table>.
struct Forward {
  SK_KERNEL_ENTRY("embedding.cuh", "embedding_forward");
  const long long* tokens;
  const void* table;
  const void* positions;  // or null
  void* out;
  int rows;
  int seq;
  int width;
  long long vocab;
  int vectorised;  // the width a multiple of 4 and every row aligned to 4 elements
};

// dtable[v] = Σ dout[p] over the positions p of token v, from the tokens sorted stably (`sorted`)
// and their positions (`order`). Entry points embedding_backward_table_<table>.
struct TableBackward {
  SK_KERNEL_ENTRY("embedding.cuh", "embedding_backward_table");
  const long long* sorted;
  const int* order;
  const void* dout;
  void* dtable;
  int rows;
  int vocab;
  int width;
  int vectorised;
};

// dpositions[t] = Σ_b dout[b, t]. Entry points embedding_backward_positions_<table>.
struct PositionsBackward {
  SK_KERNEL_ENTRY("embedding.cuh", "embedding_backward_positions");
  const void* dout;
  void* dpositions;
  int batch;
  int seq;
  int width;
  int vectorised;
};

}  // namespace sk::kernels::embedding

#ifdef __CUDACC_RTC__

namespace sk {

// A warp covers a row in slabs of 32 lanes × EMBEDDING_CHUNKS × 4 columns, each lane keeping its
// columns of the slab in registers, so all of a slab's loads are in flight together.
constexpr int EMBEDDING_CHUNKS = 8;
constexpr int EMBEDDING_SLAB = 32 * EMBEDDING_CHUNKS * 4;
constexpr int EMBEDDING_POSITION_WARPS = 8;

// acc[k] += row[c0 + (32k + lane)·4 ...+4] for the chunks inside the row (vectorised rows: width a
// multiple of 4, rows aligned to 4 elements).
template <typename T>
__device__ __forceinline__ void add_slab(const T* __restrict__ row, int c0, int width, float (&acc)[EMBEDDING_CHUNKS][4]) {
  const int lane = threadIdx.x % 32;
  float v[EMBEDDING_CHUNKS][4];
#pragma unroll
  for (int k = 0; k < EMBEDDING_CHUNKS; ++k) {
    const int c = c0 + (k * 32 + lane) * 4;
    if (c < width) load4(row + c, v[k]);
  }
#pragma unroll
  for (int k = 0; k < EMBEDDING_CHUNKS; ++k) {
    if (c0 + (k * 32 + lane) * 4 < width) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[k][j] += v[k][j];
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_slab(T* __restrict__ row, int c0, int width, const float (&acc)[EMBEDDING_CHUNKS][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < EMBEDDING_CHUNKS; ++k) {
    const int c = c0 + (k * 32 + lane) * 4;
    if (c < width) store4(row + c, acc[k]);
  }
}

__device__ __forceinline__ void clear_slab(float (&acc)[EMBEDDING_CHUNKS][4]) {
#pragma unroll
  for (int k = 0; k < EMBEDDING_CHUNKS; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[k][j] = 0.f;
}

// tokens [rows]; table [vocab, width]; positions [≥ seq, width] or null, row r taking position r % seq.
template <typename T>
__device__ void embedding_forward(const long long* __restrict__ tokens, const T* __restrict__ table,
                                  const T* __restrict__ positions, T* __restrict__ out, int rows, int seq, int width,
                                  long long vocab, int vectorised) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const long long token = tokens[row];
  assert(token >= 0 && token < vocab);
  const T* source = table + token * width;
  const T* position = positions != nullptr ? positions + static_cast<size_t>(row % seq) * width : nullptr;
  T* target = out + static_cast<size_t>(row) * width;
  if (vectorised) {
    for (int c0 = 0; c0 < width; c0 += EMBEDDING_SLAB) {
      float acc[EMBEDDING_CHUNKS][4];
      clear_slab(acc);
      add_slab(source, c0, width, acc);
      if (position != nullptr) add_slab(position, c0, width, acc);
      store_slab(target, c0, width, acc);
    }
  } else {
    for (int c = lane; c < width; c += 32) {
      float v = to_float(source[c]);
      if (position != nullptr) v += to_float(position[c]);
      target[c] = from_float<T>(v);
    }
  }
}

// The first index of sorted[0, n) not below key, found by the whole warp (every lane calls it with
// the same key): each round the 32 lanes probe 32 evenly spaced points of the range still open,
// narrowing it 32-fold, so 16384 tokens take 3 rounds of loads where a bisection takes 14 in a row.
// With a warp per table row the search is what a warp waits on longest.
__device__ __forceinline__ int warp_lower_bound(const long long* __restrict__ sorted, int n, long long key) {
  const int lane = threadIdx.x % 32;
  int lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 31) / 32;
    const int probe = lo + lane * step;
    const unsigned below = __ballot_sync(0xffffffffu, probe < hi && sorted[probe] < key);
    // The tokens are sorted, so the probes below the key are a prefix of the lanes: the answer lies
    // after the last of them and at or before the first probe that is not below.
    const int count = __popc(below);
    const int first_not_below = lo + count * step;
    if (count > 0) lo += (count - 1) * step + 1;
    hi = min(hi, first_not_below);
  }
  return lo;
}

// sorted [rows]: the tokens in increasing order, stably; order [rows]: the position each came from.
// A warp per row of dtable [vocab, width].
template <typename T>
__device__ void embedding_backward_table(const long long* __restrict__ sorted, const int* __restrict__ order,
                                         const T* __restrict__ dout, T* __restrict__ dtable, int rows, int vocab,
                                         int width, int vectorised) {
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (token >= vocab) return;
  const int first = warp_lower_bound(sorted, rows, token);
  const int last = warp_lower_bound(sorted, rows, static_cast<long long>(token) + 1);
  T* target = dtable + static_cast<size_t>(token) * width;
  if (vectorised) {
    for (int c0 = 0; c0 < width; c0 += EMBEDDING_SLAB) {
      float acc[EMBEDDING_CHUNKS][4];
      clear_slab(acc);
      for (int i = first; i < last; ++i) add_slab(dout + static_cast<size_t>(order[i]) * width, c0, width, acc);
      store_slab(target, c0, width, acc);
    }
  } else {
    for (int c = lane; c < width; c += 32) {
      float acc = 0.f;
      for (int i = first; i < last; ++i) acc += to_float(dout[static_cast<size_t>(order[i]) * width + c]);
      target[c] = from_float<T>(acc);
    }
  }
}

// A block of EMBEDDING_POSITION_WARPS warps per row t of dpositions [max_seq, width]: warp w sums
// dout[b, t] for b = w, w + WARPS, ...; the block then adds its warps' sums in warp order. Rows
// t ≥ seq (positions the batch did not reach) get zeros.
template <typename T>
__device__ void embedding_backward_positions(const T* __restrict__ dout, T* __restrict__ dpositions, int batch,
                                             int seq, int width, int vectorised) {
  __shared__ float sums[EMBEDDING_POSITION_WARPS][EMBEDDING_SLAB];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int t = blockIdx.x;
  T* target = dpositions + static_cast<size_t>(t) * width;
  const int reached = t < seq ? batch : 0;
  for (int c0 = 0; c0 < width; c0 += EMBEDDING_SLAB) {
    float acc[EMBEDDING_CHUNKS][4];
    clear_slab(acc);
    if (vectorised) {
      for (int b = warp; b < reached; b += EMBEDDING_POSITION_WARPS)
        add_slab(dout + (static_cast<size_t>(b) * seq + t) * width, c0, width, acc);
    } else {
      // Scalar rows: lane-strided columns, acc[k][j] holding column c0 + lane + 32 (4k + j).
      for (int b = warp; b < reached; b += EMBEDDING_POSITION_WARPS) {
        const T* row = dout + (static_cast<size_t>(b) * seq + t) * width;
#pragma unroll
        for (int k = 0; k < EMBEDDING_CHUNKS; ++k)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int c = c0 + lane + 32 * (4 * k + j);
            if (c < width) acc[k][j] += to_float(row[c]);
          }
      }
    }
#pragma unroll
    for (int k = 0; k < EMBEDDING_CHUNKS; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int slot = vectorised ? (k * 32 + lane) * 4 + j : lane + 32 * (4 * k + j);
        sums[warp][slot] = acc[k][j];
      }
    __syncthreads();
    for (int i = threadIdx.x; i < EMBEDDING_SLAB && c0 + i < width; i += blockDim.x) {
      float total = 0.f;
      for (int w = 0; w < EMBEDDING_POSITION_WARPS; ++w) total += sums[w][i];
      target[c0 + i] = from_float<T>(total);
    }
    __syncthreads();
  }
}

}  // namespace sk

#define SK_EMBEDDING(tag, T, ...)                                                                                \
  SK_ENTRY(embedding_forward_##tag, (const sk::kernels::embedding::Forward p) {                                  \
    sk::embedding_forward<T>(p.tokens, static_cast<const T*>(p.table), static_cast<const T*>(p.positions),       \
                             static_cast<T*>(p.out), p.rows, p.seq, p.width, p.vocab, p.vectorised);             \
  })                                                                                                             \
  SK_ENTRY(embedding_backward_table_##tag, (const sk::kernels::embedding::TableBackward p) {                     \
    sk::embedding_backward_table<T>(p.sorted, p.order, static_cast<const T*>(p.dout), static_cast<T*>(p.dtable), \
                                    p.rows, p.vocab, p.width, p.vectorised);                                     \
  })                                                                                                             \
  SK_ENTRY(embedding_backward_positions_##tag, (                                                                 \
      const sk::kernels::embedding::PositionsBackward p) {                                                       \
    sk::embedding_backward_positions<T>(static_cast<const T*>(p.dout), static_cast<T*>(p.dpositions), p.batch,   \
                                        p.seq, p.width, p.vectorised);                                           \
  })
SK_TYPES_1(SK_EMBEDDING, )

#else  // host: the launchers

#include "kernels.h"

#include <ATen/cuda/cub.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <initializer_list>

namespace sk::kernels::embedding {

// Rows (warps) per block of the forward and of the table's backward; the positions' backward has
// its own warps per block in the device part (EMBEDDING_POSITION_WARPS, 8).
constexpr int kWarps = 8;
constexpr unsigned kPositionThreads = 32 * 8;

// Whether rows move four elements at a time: the width a multiple of 4 and every tensor aligned to
// four elements.
inline int vectorised(int64_t width, std::initializer_list<const at::Tensor*> tensors) {
  return width % 4 == 0 && aligned_to(4, tensors) ? 1 : 0;
}

inline unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

inline const long long* token_ids(const at::Tensor& t) {
  return reinterpret_cast<const long long*>(t.const_data_ptr<int64_t>());
}

// tokens: [rows] int64, contiguous; table: [vocab, width] contiguous, fp32/bf16/fp16; positions:
// [≥ seq, width] contiguous of the table's type, or undefined; row r takes position r % seq.
// Returns [rows, width] in the table's type.
inline at::Tensor forward(const at::Tensor& tokens, const at::Tensor& table, const at::Tensor& positions,
                          int64_t seq) {
  const int64_t rows = tokens.numel(), width = table.size(1);
  at::Tensor out = at::empty({rows, width}, table.options());
  if (rows == 0 || width == 0) return out;
  launch(get<Forward>({table.scalar_type()}, table.device()), {blocks_for(rows), 1, 1}, {32 * kWarps, 1, 1}, 0,
         Forward{.tokens = token_ids(tokens),
                 .table = table.data_ptr(),
                 .positions = positions.defined() ? positions.data_ptr() : nullptr,
                 .out = out.data_ptr(),
                 .rows = static_cast<int>(rows),
                 .seq = static_cast<int>(seq),
                 .width = static_cast<int>(width),
                 .vocab = table.size(0),
                 .vectorised = vectorised(width, {&table, &positions, &out})});
  return out;
}

// dtable [vocab, width] from dout [rows, width] (contiguous, the table's type) and the forward's
// tokens [rows].
inline at::Tensor table_grad(const at::Tensor& dout, const at::Tensor& tokens, int64_t vocab) {
  const int64_t rows = dout.size(0), width = dout.size(1);
  at::Tensor dtable = at::empty({vocab, width}, dout.options());
  if (vocab == 0 || width == 0) return dtable;
  if (rows == 0) return dtable.zero_();
  at::Tensor sorted = at::empty_like(tokens);
  at::Tensor order = at::empty({rows}, tokens.options().dtype(at::kInt));
  const at::Tensor positions = at::arange(rows, tokens.options().dtype(at::kInt));
  // Stable, so the positions of one token stay in increasing order; only the bits a token below
  // `vocab` can have take part.
  at::cuda::cub::radix_sort_pairs<int64_t, int32_t>(
      tokens.const_data_ptr<int64_t>(), sorted.mutable_data_ptr<int64_t>(), positions.const_data_ptr<int32_t>(),
      order.mutable_data_ptr<int32_t>(), rows, false, 0, at::cuda::cub::get_num_bits(static_cast<uint64_t>(vocab)));
  launch(get<TableBackward>({dout.scalar_type()}, dout.device()), {blocks_for(vocab), 1, 1}, {32 * kWarps, 1, 1}, 0,
         TableBackward{.sorted = token_ids(sorted),
                       .order = order.const_data_ptr<int32_t>(),
                       .dout = dout.data_ptr(),
                       .dtable = dtable.data_ptr(),
                       .rows = static_cast<int>(rows),
                       .vocab = static_cast<int>(vocab),
                       .width = static_cast<int>(width),
                       .vectorised = vectorised(width, {&dout, &dtable})});
  return dtable;
}

// dpositions [max_seq, width] from dout [batch · seq, width] (contiguous, the table's type).
inline at::Tensor positions_grad(const at::Tensor& dout, int64_t seq, int64_t max_seq) {
  const int64_t width = dout.size(1);
  at::Tensor dpositions = at::empty({max_seq, width}, dout.options());
  if (max_seq == 0 || width == 0) return dpositions;
  launch(get<PositionsBackward>({dout.scalar_type()}, dout.device()), {static_cast<unsigned>(max_seq), 1, 1},
         {kPositionThreads, 1, 1}, 0,
         PositionsBackward{.dout = dout.data_ptr(),
                           .dpositions = dpositions.data_ptr(),
                           .batch = static_cast<int>(seq > 0 ? dout.size(0) / seq : 0),
                           .seq = static_cast<int>(seq),
                           .width = static_cast<int>(width),
                           .vectorised = vectorised(width, {&dout, &dpositions})});
  return dpositions;
}

}  // namespace sk::kernels::embedding

#endif
