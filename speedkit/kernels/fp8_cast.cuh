// Casts to FP8 for speedkit::nn::Linear's FP8 GEMMs (shim/fp8.cpp): q = saturate(t · s) in e4m3 or
// e5m2 with s = FP8_MAX / amax, and, when asked, qᵀ, which the backward GEMMs take as their
// column-major operands (instead of a transposed copy of q). The scale is per tensor, or per row
// (the `rowwise` recipe: q by each row's amax, qᵀ by each column's; see "row-wise scaling" below).
//
// The scale never leaves the device. `dynamic` scaling needs this step's amax before the cast, so it
// takes two passes over t: fp8_amax (a max reduction into a device fp32 slot), then the cast, which
// computes s from that slot. `delayed` scaling (Transformer Engine's recipe) takes s from the largest
// amax of the last steps' history, so one pass both casts and records this step's amax into the
// history's newest entry: fp8_history_roll first shifts the history by one and leaves the past
// maximum in a slot; fp8_amax still launches but returns at once unless the history is all zero
// (the first step), when the scale falls back to this step's amax as in the dynamic recipe.
//
// The arithmetic is ATen's composite op for op: scale = (1 / max(amax, 1e-12)) · FP8_MAX in fp32,
// q = fp8(clamp(float(t) · scale, ±FP8_MAX)) rounded to nearest even, 1 / scale for _scaled_mm; so
// the kernel's bytes equal the composite's bit for bit. The amax is the largest |t| compared as the
// bit patterns of non-negative floats, which orders them like the floats, lets NaN win like ATen's
// max does, and makes the result independent of the order the blocks finish in.
//
// Both casts work on 64 × 64 tiles (fp8_cast_tile): 16-byte loads along the rows where the row
// length and the pointer allow it, the FP8 bytes written row-major from registers and kept in shared
// memory, from where the transposed tile is written with 8-byte stores. Edge tiles go element by
// element.
//
// The device part below is compiled by NVRTC (shim/kernels.cpp); the host part at the end, the
// launchers, is compiled into the shim by the host compiler.
#pragma once

#include "common.cuh"

namespace sk::kernels::fp8_cast {

// The delayed recipe's history step, one block of up to 1024 threads: *past = max(history), then
// history = [0, history[0 .. length-1]]. Entry point fp8_history_roll.
struct HistoryRoll {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_history_roll");
  float* history;
  int length;
  float* past;
};

// out[c] = Σ_g partials[g, c] over the cast's row tiles, in a fixed order. Entry point
// fp8_column_sum.
struct ColumnSum {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_column_sum");
  const float* partials;
  int groups;
  long long cols;
  float* out;
};

// *slot = max(*slot, amax(x)), skipped when *skip_if_positive > 0. Entry points fp8_amax_<x>.
struct Amax {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_amax");
  const void* x;
  long long n;
  float* slot;
  const float* skip_if_positive;  // or null
  int vector_ok;                  // x 16-byte aligned
};

// q = fp8(x · s), qᵀ and the column partials where asked (non-null), s from *amax or, when *past is
// positive, from it; the delayed recipe also records x's amax in *amax_out. Entry points
// fp8_cast_transpose_<x>_<e4m3|e5m2>.
struct CastTranspose {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_cast_transpose");
  const void* x;
  long long rows;
  long long cols;
  const float* amax;
  const float* past;        // or null
  float* amax_out;          // or null
  float* inverse_out;
  void* q;
  void* qt;                 // or null
  float* column_partials;   // or null
  int vector_ok;            // x 16-byte aligned and cols a multiple of the vector
};

// Row and column maxima of x in one read. Entry points fp8_axis_amax_<x>.
struct AxisAmax {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_axis_amax");
  const void* x;
  long long rows;
  long long cols;
  float* row_amax;
  float* col_amax;
  int vector_ok;
};

// q by each row's scale and qᵀ by each column's, with their inverse scales and the column partials
// where asked. Entry points fp8_cast_axiswise_<x>_<e4m3|e5m2>.
struct CastAxiswise {
  SK_KERNEL_ENTRY("fp8_cast.cuh", "fp8_cast_axiswise");
  const void* x;
  long long rows;
  long long cols;
  const float* row_amax;
  const float* col_amax;
  void* q;
  float* row_inverse;
  void* qt;                 // or null
  float* col_inverse;       // or null
  float* column_partials;   // or null
  int vector_ok;
};

}  // namespace sk::kernels::fp8_cast

#ifdef __CUDACC_RTC__

#include <cuda_fp8.h>

namespace sk {

constexpr int kFp8Tile = 64;
constexpr int kFp8Threads = 256;
// Shared-memory row stride of a tile in bytes: 68 = 17 words, so a column read spreads over banks.
constexpr int kFp8TileStride = kFp8Tile + 4;

struct E4m3 {
  static constexpr __nv_fp8_interpretation_t kind = __NV_E4M3;
  static constexpr float max = 448.f;
};
struct E5m2 {
  static constexpr __nv_fp8_interpretation_t kind = __NV_E5M2;
  static constexpr float max = 57344.f;
};

typedef unsigned long long u64;

__device__ __forceinline__ unsigned magnitude_bits(float v) { return __float_as_uint(fabsf(v)); }

__device__ __forceinline__ unsigned warp_max_bits(unsigned v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The block's largest value, valid in thread 0. Every thread of the block must call it.
__device__ unsigned block_max_bits(unsigned v) {
  __shared__ unsigned partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_max_bits(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_max_bits(lane < static_cast<int>((blockDim.x + 31) / 32) ? partial[lane] : 0u);
  return v;
}

__device__ __forceinline__ void record_max(unsigned local, float* slot) {
  const unsigned block = block_max_bits(local);
  if (threadIdx.x == 0 && block != 0u) atomicMax(reinterpret_cast<unsigned*>(slot), block);
}

// FP8_MAX / amax as ATen's composite computes it; `past` (the history's maximum) wins when positive.
// A NaN amax passes through the lower bound, as it does through clamp_min.
__device__ __forceinline__ float fp8_scale(const float* amax, const float* past, float fp8_max) {
  float from = (past != nullptr && *past > 0.f) ? *past : *amax;
  if (from < 1e-12f) from = 1e-12f;
  return (1.f / from) * fp8_max;
}

template <typename F>
__device__ __forceinline__ unsigned char to_fp8(float v, float scale) {
  // Saturating, round-to-nearest-even: the same bytes as clamp(v · scale, ±max) then the cast.
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, F::kind));
}

// Largest |x| over n elements into *slot (non-negative fp32, zero or an earlier maximum before the
// launch). With `skip_if_positive` set and positive, the launch does nothing.
template <typename T>
__device__ void fp8_amax(const T* __restrict__ x, long long n, float* slot, const float* skip_if_positive,
                         int vector_ok) {
  if (skip_if_positive != nullptr && *skip_if_positive > 0.f) return;
  constexpr int kVec = 16 / sizeof(T);
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  unsigned local = 0u;
  long long done = 0;
  if (vector_ok) {
    const long long vectors = n / kVec;
    for (long long v = first; v < vectors; v += stride) {
      const uint4 raw = reinterpret_cast<const uint4*>(x)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) local = max(local, magnitude_bits(to_float(e[i])));
    }
    done = vectors * kVec;
  }
  for (long long i = done + first; i < n; i += stride) local = max(local, magnitude_bits(to_float(x[i])));
  record_max(local, slot);
}

// The FP8 tile in shared memory (row-major bytes of x's tile at r0, c0) written to qt [cols, rows]:
// 8-byte stores along qt's rows for a full tile, element by element at the edges. The caller has
// synchronised the block after filling the tile.
__device__ __forceinline__ void write_transposed_tile(const unsigned char (*tile)[kFp8TileStride],
                                                      unsigned char* __restrict__ qt, long long rows,
                                                      long long cols, long long r0, long long c0, bool full) {
  if (full && rows % 8 == 0) {
    // Thread t writes rows 8·(t % 8) … +7 of the tile's column t / 8 (and t / 8 + 32) as 8 bytes.
    const int r = (threadIdx.x % 8) * 8;
    for (int c = threadIdx.x / 8; c < kFp8Tile; c += kFp8Threads / 8) {
      u64 packed = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) packed |= static_cast<u64>(tile[r + i][c]) << (8 * i);
      *reinterpret_cast<u64*>(qt + (c0 + c) * rows + r0 + r) = packed;
    }
  } else {
    for (int i = threadIdx.x; i < kFp8Tile * kFp8Tile; i += kFp8Threads) {
      const int c = i / kFp8Tile, r = i % kFp8Tile;
      if (r0 + r < rows && c0 + c < cols) qt[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
  }
}

// A full tile's 16-byte loads: thread t holds kVec consecutive columns from c = (t % kPerRow) ·
// kVec of the rows r + p · kRowsPerPass, p < kPasses, with r = t / kPerRow. Every load is issued
// before any is used: more bytes in flight per thread.
template <typename T>
struct TileLoads {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kPerRow = kFp8Tile / kVec;             // threads across a tile row
  static constexpr int kRowsPerPass = kFp8Threads / kPerRow;  // 32 (16-bit types) or 16 (fp32)
  static constexpr int kPasses = kFp8Tile / kRowsPerPass;
  int r, c;
  uint4 raw[kPasses];

  __device__ TileLoads(const T* __restrict__ x, long long cols, long long r0, long long c0)
      : r(threadIdx.x / kPerRow), c((threadIdx.x % kPerRow) * kVec) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
      raw[p] = *reinterpret_cast<const uint4*>(x + (r0 + r + p * kRowsPerPass) * cols + c0 + c);
  }
  // The kVec elements of pass p.
  __device__ const T* pass(int p) const { return reinterpret_cast<const T*>(&raw[p]); }
};

// How a cast tile scales: one scale for q and qᵀ (per tensor), or q by its rows' scales and qᵀ by
// the columns' (row-wise).
struct TensorScale {
  static constexpr bool kOneScale = true;
  float scale;
  __device__ float row(long long) const { return scale; }
  __device__ float column(long long) const { return scale; }
};
template <typename F>
struct AxisScales {
  static constexpr bool kOneScale = false;
  const float* row_amax;
  const float* col_amax;
  __device__ float row(long long r) const { return fp8_scale(row_amax + r, nullptr, F::max); }
  __device__ float column(long long c) const { return fp8_scale(col_amax + c, nullptr, F::max); }
};

// One 64 × 64 tile of x [rows, cols] per block: q = fp8(x · row scale) into q [rows, cols] when q
// is given, fp8(x · column scale) into qt [cols, rows] when qt is given (the same bytes under one
// scale); this tile's amax into *amax_out when that is given; and, when column_partials is given,
// the tile's column sums of x into its row blockIdx.y ([row tiles, cols] fp32, summed by
// fp8_column_sum). `vector_ok`: x is 16-byte aligned and cols a multiple of the 16-byte vector (so
// every row starts aligned).
template <typename T, typename F, typename Scales>
__device__ void fp8_cast_tile(const T* __restrict__ x, long long rows, long long cols, const Scales& scales,
                              float* amax_out, unsigned char* __restrict__ q, unsigned char* __restrict__ qt,
                              float* __restrict__ column_partials, int vector_ok) {
  using Loads = TileLoads<T>;
  constexpr int kVec = Loads::kVec, kRowsPerPass = Loads::kRowsPerPass;
  __shared__ unsigned char tile[kFp8Tile][kFp8TileStride];
  // Column sums, one row per group of threads that share columns, added in a fixed order at the end.
  __shared__ float sums[kRowsPerPass][kFp8Tile];
  const long long r0 = static_cast<long long>(blockIdx.y) * kFp8Tile;
  const long long c0 = static_cast<long long>(blockIdx.x) * kFp8Tile;
  const bool full = vector_ok && r0 + kFp8Tile <= rows && c0 + kFp8Tile <= cols;
  unsigned local = 0u;
  int groups;
  if (full) {
    groups = kRowsPerPass;
    const Loads loads(x, cols, r0, c0);
    const int r = loads.r, c = loads.c;
    float column[kVec], column_scale[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      column[i] = 0.f;
      column_scale[i] = scales.column(c0 + c + i);
    }
#pragma unroll
    for (int p = 0; p < Loads::kPasses; ++p) {
      const int row = r + p * kRowsPerPass;
      const float row_scale = scales.row(r0 + row);
      const T* e = loads.pass(p);
      u64 packed = 0;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float v = to_float(e[i]);
        column[i] += v;
        local = max(local, magnitude_bits(v));
        const unsigned char b = to_fp8<F>(v, row_scale);
        tile[row][c + i] = Scales::kOneScale ? b : to_fp8<F>(v, column_scale[i]);
        packed |= static_cast<u64>(b) << (8 * i);
      }
      if (q != nullptr) {
        unsigned char* out = q + (r0 + row) * cols + c0 + c;
        if (kVec == 8) {
          *reinterpret_cast<u64*>(out) = packed;
        } else {
          *reinterpret_cast<unsigned*>(out) = static_cast<unsigned>(packed);
        }
      }
    }
    if (column_partials != nullptr) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) sums[r][c + i] = column[i];
    }
  } else {
    // Thread t always has column t % 64 (256 threads stride a 64-wide tile) and rows t / 64 + 4k.
    groups = kFp8Threads / kFp8Tile;
    float column = 0.f;
    for (int i = threadIdx.x; i < kFp8Tile * kFp8Tile; i += kFp8Threads) {
      const int r = i / kFp8Tile, c = i % kFp8Tile;
      if (r0 + r >= rows || c0 + c >= cols) continue;
      const long long offset = (r0 + r) * cols + c0 + c;
      const float v = to_float(x[offset]);
      column += v;
      local = max(local, magnitude_bits(v));
      const unsigned char b = to_fp8<F>(v, scales.row(r0 + r));
      tile[r][c] = Scales::kOneScale ? b : to_fp8<F>(v, scales.column(c0 + c));
      if (q != nullptr) q[offset] = b;
    }
    if (column_partials != nullptr) sums[threadIdx.x / kFp8Tile][threadIdx.x % kFp8Tile] = column;
  }
  if (amax_out != nullptr) record_max(local, amax_out);
  if (qt == nullptr && column_partials == nullptr) return;
  __syncthreads();
  if (column_partials != nullptr && threadIdx.x < kFp8Tile && c0 + threadIdx.x < cols) {
    float total = 0.f;
    for (int g = 0; g < groups; ++g) total += sums[g][threadIdx.x];
    column_partials[blockIdx.y * cols + c0 + threadIdx.x] = total;
  }
  if (qt != nullptr) write_transposed_tile(tile, qt, rows, cols, r0, c0, full);
}

// The per-tensor cast of one tile: the scale from *amax (dynamic) or, when positive, *past (the
// delayed recipe's history maximum); block 0 writes 1 / scale to *inverse_out.
template <typename T, typename F>
__device__ void fp8_cast_transpose(const T* __restrict__ x, long long rows, long long cols, const float* amax,
                                   const float* past, float* amax_out, float* inverse_out,
                                   unsigned char* __restrict__ q, unsigned char* __restrict__ qt,
                                   float* __restrict__ column_partials, int vector_ok) {
  const TensorScale scale{fp8_scale(amax, past, F::max)};
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inverse_out = 1.f / scale.scale;
  fp8_cast_tile<T, F>(x, rows, cols, scale, amax_out, q, qt, column_partials, vector_ok);
}

// ----- row-wise scaling ----------------------------------------------------------------------------
// Each row of q gets its own scale from its row's amax, and each row of qᵀ (a column of x) from
// that column's amax: every GEMM operand is scaled along the axis the GEMM sums over, which is what
// _scaled_mm's row-wise mode multiplies back. A scale needs its whole row or column reduced first,
// so this takes two passes: fp8_axis_amax reduces both axes at once, then fp8_cast_axiswise writes
// q and qᵀ. Scales, bytes and inverses are ATen's composite's, element for element.

// Both axes' amax of one 64 × 64 tile of x per block, merged into row_amax [rows] and col_amax
// [cols] (zero before the launch) with one atomic per row and column of the tile.
template <typename T>
__device__ void fp8_axis_amax(const T* __restrict__ x, long long rows, long long cols, float* row_amax,
                              float* col_amax, int vector_ok) {
  using Loads = TileLoads<T>;
  constexpr int kVec = Loads::kVec, kPerRow = Loads::kPerRow, kRowsPerPass = Loads::kRowsPerPass;
  __shared__ unsigned row_max[kFp8Tile];
  __shared__ unsigned col_max[kRowsPerPass][kFp8Tile];
  const long long r0 = static_cast<long long>(blockIdx.y) * kFp8Tile;
  const long long c0 = static_cast<long long>(blockIdx.x) * kFp8Tile;
  const bool full = vector_ok && r0 + kFp8Tile <= rows && c0 + kFp8Tile <= cols;
  int groups;
  if (full) {
    groups = kRowsPerPass;
    const Loads loads(x, cols, r0, c0);
    const int r = loads.r, c = loads.c;
    unsigned column[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) column[i] = 0u;
#pragma unroll
    for (int p = 0; p < Loads::kPasses; ++p) {
      const T* e = loads.pass(p);
      unsigned row = 0u;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const unsigned m = magnitude_bits(to_float(e[i]));
        row = max(row, m);
        column[i] = max(column[i], m);
      }
      // The kPerRow threads of a row are neighbouring lanes of one warp.
#pragma unroll
      for (int offset = kPerRow / 2; offset > 0; offset >>= 1)
        row = max(row, __shfl_xor_sync(0xffffffffu, row, offset));
      if (threadIdx.x % kPerRow == 0) row_max[r + p * kRowsPerPass] = row;
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) col_max[r][c + i] = column[i];
  } else {
    // Thread t has column t % 64 and rows t / 64 + 4k; a row's maximum gathers in shared memory.
    groups = kFp8Threads / kFp8Tile;
    if (threadIdx.x < kFp8Tile) row_max[threadIdx.x] = 0u;
    __syncthreads();
    unsigned column = 0u;
    for (int i = threadIdx.x; i < kFp8Tile * kFp8Tile; i += kFp8Threads) {
      const int r = i / kFp8Tile, c = i % kFp8Tile;
      if (r0 + r >= rows || c0 + c >= cols) continue;
      const unsigned m = magnitude_bits(to_float(x[(r0 + r) * cols + c0 + c]));
      column = max(column, m);
      atomicMax(&row_max[r], m);
    }
    col_max[threadIdx.x / kFp8Tile][threadIdx.x % kFp8Tile] = column;
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < kFp8Tile && r0 + t < rows && row_max[t] != 0u)
    atomicMax(reinterpret_cast<unsigned*>(row_amax + r0 + t), row_max[t]);
  if (t >= kFp8Tile && t < 2 * kFp8Tile && c0 + t - kFp8Tile < cols) {
    unsigned m = 0u;
    for (int g = 0; g < groups; ++g) m = max(m, col_max[g][t - kFp8Tile]);
    if (m != 0u) atomicMax(reinterpret_cast<unsigned*>(col_amax + c0 + t - kFp8Tile), m);
  }
}

// The row-wise cast of one tile, with the amaxes of fp8_axis_amax: q by each row's scale, qᵀ by
// each column's. The blocks of the first tile column write 1 / row scale to row_inverse [rows],
// those of the first tile row 1 / column scale to col_inverse [cols] when it is given.
template <typename T, typename F>
__device__ void fp8_cast_axiswise(const T* __restrict__ x, long long rows, long long cols, const float* row_amax,
                                  const float* col_amax, unsigned char* __restrict__ q, float* row_inverse,
                                  unsigned char* __restrict__ qt, float* col_inverse,
                                  float* __restrict__ column_partials, int vector_ok) {
  const AxisScales<F> scales{row_amax, col_amax};
  const long long r0 = static_cast<long long>(blockIdx.y) * kFp8Tile;
  const long long c0 = static_cast<long long>(blockIdx.x) * kFp8Tile;
  const int t = threadIdx.x;
  if (blockIdx.x == 0 && t < kFp8Tile && r0 + t < rows) row_inverse[r0 + t] = 1.f / scales.row(r0 + t);
  const long long c = c0 + t - kFp8Tile;
  if (col_inverse != nullptr && blockIdx.y == 0 && t >= kFp8Tile && t < 2 * kFp8Tile && c < cols)
    col_inverse[c] = 1.f / scales.column(c);
  fp8_cast_tile<T, F>(x, rows, cols, scales, nullptr, q, qt, column_partials, vector_ok);
}

}  // namespace sk

// The delayed recipe's history step: the newest entry, about to receive this step's amax, first.
SK_ENTRY(fp8_history_roll, (const sk::kernels::fp8_cast::HistoryRoll p) {
  const int i = threadIdx.x;
  const float v = i < p.length ? p.history[i] : 0.f;
  const unsigned largest = sk::block_max_bits(i < p.length ? __float_as_uint(v) : 0u);
  if (i == 0) *p.past = __uint_as_float(largest);
  __syncthreads();
  if (i + 1 < p.length) p.history[i + 1] = v;
  if (i == 0) p.history[0] = 0.f;
})

// The column sums of x (the bias gradient when x is the output gradient) without a second pass
// over x.
SK_ENTRY(fp8_column_sum, (const sk::kernels::fp8_cast::ColumnSum p) {
  const long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= p.cols) return;
  float total = 0.f;
  for (int g = 0; g < p.groups; ++g) total += p.partials[g * p.cols + c];
  p.out[c] = total;
})

#define SK_FP8_AMAX(tag, T, ...)                                                               \
  SK_ENTRY_BOUNDED(sk::kFp8Threads, fp8_amax_##tag, (const sk::kernels::fp8_cast::Amax p) {    \
    sk::fp8_amax<T>(static_cast<const T*>(p.x), p.n, p.slot, p.skip_if_positive, p.vector_ok); \
  })
SK_TYPES_1(SK_FP8_AMAX, )

#define SK_FP8_CAST(tag, T, fp8_tag, F)                                                                  \
  SK_ENTRY_BOUNDED(sk::kFp8Threads, fp8_cast_transpose_##tag##_##fp8_tag, (                              \
      const sk::kernels::fp8_cast::CastTranspose p) {                                                    \
    sk::fp8_cast_transpose<T, F>(static_cast<const T*>(p.x), p.rows, p.cols, p.amax, p.past, p.amax_out, \
                                 p.inverse_out, static_cast<unsigned char*>(p.q),                        \
                                 static_cast<unsigned char*>(p.qt), p.column_partials, p.vector_ok);     \
  })
#define SK_FP8_CAST_BOTH(tag, T, ...) SK_FP8_CAST(tag, T, e4m3, sk::E4m3) SK_FP8_CAST(tag, T, e5m2, sk::E5m2)
SK_TYPES_1(SK_FP8_CAST_BOTH, )

// The row-wise recipe's two passes.
#define SK_FP8_AXIS_AMAX(tag, T, ...)                                                                      \
  SK_ENTRY_BOUNDED(sk::kFp8Threads, fp8_axis_amax_##tag, (                                                 \
      const sk::kernels::fp8_cast::AxisAmax p) {                                                           \
    sk::fp8_axis_amax<T>(static_cast<const T*>(p.x), p.rows, p.cols, p.row_amax, p.col_amax, p.vector_ok); \
  })
SK_TYPES_1(SK_FP8_AXIS_AMAX, )

#define SK_FP8_CAST_AXISWISE(tag, T, fp8_tag, F)                                                     \
  SK_ENTRY_BOUNDED(sk::kFp8Threads, fp8_cast_axiswise_##tag##_##fp8_tag, (                           \
      const sk::kernels::fp8_cast::CastAxiswise p) {                                                 \
    sk::fp8_cast_axiswise<T, F>(static_cast<const T*>(p.x), p.rows, p.cols, p.row_amax, p.col_amax,  \
                                static_cast<unsigned char*>(p.q), p.row_inverse,                     \
                                static_cast<unsigned char*>(p.qt), p.col_inverse, p.column_partials, \
                                p.vector_ok);                                                        \
  })
#define SK_FP8_CAST_AXISWISE_BOTH(tag, T, ...) \
  SK_FP8_CAST_AXISWISE(tag, T, e4m3, sk::E4m3) SK_FP8_CAST_AXISWISE(tag, T, e5m2, sk::E5m2)
SK_TYPES_1(SK_FP8_CAST_AXISWISE_BOTH, )

#else  // host: the launchers

#include "kernels.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace sk::kernels::fp8_cast {

constexpr int kTile = 64;
constexpr int kThreads = 256;
// The history roll runs in one block of at most this many threads.
constexpr int64_t kMaxHistory = 1024;

struct Quantized {
  at::Tensor data;           // FP8 [rows, cols]
  at::Tensor transpose;      // FP8 [cols, rows], or undefined when not asked for
  // fp32, data · inverse_scale ≈ the input: a scalar (per-tensor scaling) or one per row, [rows].
  at::Tensor inverse_scale;
  at::Tensor column_sums;    // fp32 [cols], Σ over rows of the input, or undefined when not asked for
  // fp32, transpose · transpose_inverse_scale ≈ the input's transpose: the same scalar, or one per
  // row of the transpose, [cols]. Undefined when the transpose is.
  at::Tensor transpose_inverse_scale;
};

// Why the kernels cannot cast `t` with `history` (undefined or empty for dynamic scaling), or an
// empty string when they can. The caller then takes ATen's composite.
inline std::string unsupported(const at::Tensor& t, const at::Tensor& history) {
  if (!t.is_cuda()) return "the tensor is not on a CUDA device";
  if (t.dim() != 2 || !t.is_contiguous()) return "the tensor is not a contiguous matrix";
  const auto type = t.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf)
    return std::string("input type ") + c10::toString(type) + " (the kernels take fp32, bf16, fp16)";
  if ((t.size(0) + kTile - 1) / kTile > 65535 || (t.size(1) + kTile - 1) / kTile > INT32_MAX)
    return "more rows or columns than one grid of 64 × 64 tiles covers";
  if (history.defined() && history.numel() > 0 &&
      (history.scalar_type() != at::kFloat || !history.is_contiguous() || history.numel() > kMaxHistory ||
       history.device() != t.device()))
    return "the amax history is not a contiguous fp32 vector of at most 1024 entries on the tensor's device";
  return {};
}

inline const char* format_tag(at::ScalarType fp8) {
  return fp8 == at::kFloat8_e5m2 ? "e5m2" : "e4m3";
}

// 64-wide tiles covering n, at least one (so that an empty tensor's launch still writes its scales).
inline unsigned tiles(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, (n + kTile - 1) / kTile)); }

// sums[c] = Σ over the partials' rows (one per row tile of the cast) of partials[·, c].
inline void sum_partials(const at::Tensor& partials, const at::Tensor& sums) {
  const int64_t cols = partials.size(1);
  launch(get<ColumnSum>({}, sums.device()), {static_cast<unsigned>((cols + kThreads - 1) / kThreads), 1, 1},
         {kThreads, 1, 1}, 0,
         ColumnSum{.partials = partials.data_ptr<float>(),
                   .groups = static_cast<int>(partials.size(0)),
                   .cols = cols,
                   .out = sums.data_ptr<float>()});
}

inline float* floats_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
inline void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// q = fp8(t · s) and, with `transpose`, qᵀ, with `column_sums` Σ_rows t in fp32; s from t's amax
// (`history` undefined or empty) or from the history, which then records t's amax as its newest
// entry. The caller has checked unsupported(t, history) is empty. No host synchronisation:
// everything runs on the current stream.
inline Quantized cast(const at::Tensor& t, at::ScalarType fp8, const at::Tensor& history, bool transpose,
                      bool column_sums = false) {
  const int64_t rows = t.size(0), cols = t.size(1);
  const auto floats = t.options().dtype(at::kFloat);
  const auto bytes = t.options().dtype(fp8);
  Quantized out{at::empty({rows, cols}, bytes), transpose ? at::empty({cols, rows}, bytes) : at::Tensor(),
                at::empty({}, floats), column_sums ? at::empty({cols}, floats) : at::Tensor(), at::Tensor()};
  // One row of partial column sums per row tile (the cast writes each, zeros for an empty input).
  at::Tensor partials = column_sums ? at::empty({tiles(rows), cols}, floats) : at::Tensor();
  const bool delayed = history.defined() && history.numel() > 0;
  at::Tensor slots = at::zeros({2}, floats);  // [amax (dynamic), past maximum (delayed)]
  float* amax = delayed ? history.data_ptr<float>() : slots.data_ptr<float>();
  float* past = delayed ? slots.data_ptr<float>() + 1 : nullptr;
  if (delayed) {
    const int length = static_cast<int>(history.numel());
    launch(get<HistoryRoll>({}, t.device()), {1, 1, 1}, {static_cast<unsigned>((length + 31) / 32 * 32), 1, 1}, 0,
           HistoryRoll{.history = amax, .length = length, .past = past});
  }
  const int vector = 16 / static_cast<int>(t.element_size());
  const bool aligned = aligned_to(vector, {&t});
  const int64_t n = t.numel();
  const int64_t wanted = (n + static_cast<int64_t>(kThreads) * vector - 1) / (kThreads * vector);
  const int64_t amax_blocks = std::clamp<int64_t>(wanted, 1, 4 * static_cast<int64_t>(multiprocessors(t.device())));
  launch(get<Amax>({t.scalar_type()}, t.device()), {static_cast<unsigned>(amax_blocks), 1, 1}, {kThreads, 1, 1}, 0,
         Amax{.x = t.data_ptr(), .n = n, .slot = amax, .skip_if_positive = past, .vector_ok = aligned ? 1 : 0});
  // At least one block, so that the inverse scale is written for an empty tensor too.
  launch(get<CastTranspose>({t.scalar_type()}, t.device(), format_tag(fp8)), {tiles(cols), tiles(rows), 1},
         {kThreads, 1, 1}, 0,
         CastTranspose{.x = t.data_ptr(),
                       .rows = rows,
                       .cols = cols,
                       .amax = amax,
                       .past = past,
                       .amax_out = delayed ? amax : nullptr,
                       .inverse_out = out.inverse_scale.data_ptr<float>(),
                       .q = out.data.data_ptr(),
                       .qt = data_or_null(out.transpose),
                       .column_partials = floats_or_null(partials),
                       .vector_ok = aligned && cols % vector == 0 ? 1 : 0});
  if (column_sums) sum_partials(partials, out.column_sums);
  if (transpose) out.transpose_inverse_scale = out.inverse_scale;
  return out;
}

// q = fp8(t · s_row) with each row's own scale s_row = FP8_MAX / amax(row) and, with `transpose`,
// qᵀ = fp8(tᵀ · s_col) with each column's own scale; with `column_sums` Σ_rows t in fp32. The
// caller has checked unsupported(t, {}) is empty. Two passes over t, no host synchronisation.
inline Quantized cast_axiswise(const at::Tensor& t, at::ScalarType fp8, bool transpose, bool column_sums = false) {
  const int64_t rows = t.size(0), cols = t.size(1);
  const auto floats = t.options().dtype(at::kFloat);
  const auto bytes = t.options().dtype(fp8);
  Quantized out{at::empty({rows, cols}, bytes), transpose ? at::empty({cols, rows}, bytes) : at::Tensor(),
                at::empty({rows}, floats), column_sums ? at::empty({cols}, floats) : at::Tensor(),
                transpose ? at::empty({cols}, floats) : at::Tensor()};
  at::Tensor partials = column_sums ? at::empty({tiles(rows), cols}, floats) : at::Tensor();
  at::Tensor amax = at::zeros({rows + cols}, floats);  // [row maxima, column maxima]
  float* row_amax = amax.data_ptr<float>();
  float* col_amax = row_amax + rows;
  const int vector_ok = aligned_to(16 / t.element_size(), {&t}) && cols % (16 / t.element_size()) == 0 ? 1 : 0;
  const Dim3 grid{tiles(cols), tiles(rows), 1};
  launch(get<AxisAmax>({t.scalar_type()}, t.device()), grid, {kThreads, 1, 1}, 0,
         AxisAmax{.x = t.data_ptr(),
                  .rows = rows,
                  .cols = cols,
                  .row_amax = row_amax,
                  .col_amax = col_amax,
                  .vector_ok = vector_ok});
  launch(get<CastAxiswise>({t.scalar_type()}, t.device(), format_tag(fp8)), grid, {kThreads, 1, 1}, 0,
         CastAxiswise{.x = t.data_ptr(),
                      .rows = rows,
                      .cols = cols,
                      .row_amax = row_amax,
                      .col_amax = col_amax,
                      .q = out.data.data_ptr(),
                      .row_inverse = out.inverse_scale.data_ptr<float>(),
                      .qt = data_or_null(out.transpose),
                      .col_inverse = floats_or_null(out.transpose_inverse_scale),
                      .column_partials = floats_or_null(partials),
                      .vector_ok = vector_ok});
  if (column_sums) sum_partials(partials, out.column_sums);
  return out;
}

}  // namespace sk::kernels::fp8_cast

#endif
