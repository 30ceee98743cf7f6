// A Linear layer's bias gradient: db = Σ_rows dy, the column sums of the output gradient
// dy [rows, width], in two passes that each read their input once.
//
// Pass 1 (bias_grad_partials): a block is 32 × 8 threads over 256 columns (8 per thread: one 16-byte
// load of bf16/fp16, two of fp32) and a strip of rows; each of its 8 warps takes every 8th row of the
// strip, and the block writes one fp32 partial sum per column. Enough strips to fill the GPU.
// Pass 2 (bias_grad_finish): a block is 32 columns × 32 threads over the strips' partials; it sums
// them in a fixed order and writes db in the bias's type.
//
// Pass 1 has a second form (bias_grad_concat_partials) for a layer whose output was used as equal
// column blocks, a qkv projection split into q, k and v: the blocks' gradients arrive as separate
// tensors, and the pass writes them side by side into dy while it sums them, where autograd would
// run a cat kernel and pass 1 would read its result again.
//
// Every sum runs in a fixed order, so the result is the same from run to run (no atomics). ATen
// sums a column of a row-major matrix with its generic reduce_kernel, which reaches about a quarter
// of HBM bandwidth at a transformer's shapes (16384 × 768 bf16: 24.5 µs for 25 MB on an H200).
// bias_gelu.cuh writes the same partials from its GELU-backward pass and finishes with pass 2.
#pragma once

#include "common.cuh"

namespace sk::kernels::bias_grad {

// Up to kMaxParts column blocks of one gradient, each [rows, part_width] contiguous.
constexpr int kMaxParts = 4;
struct ColumnBlocks {
  const void* part[kMaxParts];
};

// Pass 1: per strip of rows, the column sums of dy [rows, width] into `partials` [strips, width]
// fp32. Entry points bias_grad_partials_<dy>.
struct Partials {
  SK_KERNEL_ENTRY("bias_grad.cuh", "bias_grad_partials");
  const void* dy;
  float* partials;
  int rows;
  int width;
  int rows_per_block;
  int vectorised;  // the width a multiple of 8 and every row aligned to 8 elements
};

// Pass 1 over dy = [part 0 | part 1 | ...] [rows, width], writing dy as it goes. Entry points
// bias_grad_concat_partials_<dy>.
struct ConcatPartials {
  SK_KERNEL_ENTRY("bias_grad.cuh", "bias_grad_concat_partials");
  ColumnBlocks blocks;
  int part_width;
  void* dy;
  float* partials;
  int rows;
  int width;
  int rows_per_block;
  int vectorised;
};

// Pass 2: db[c] = Σ_s partials[s, c] in db's type. Entry points bias_grad_finish_<db>.
struct Finish {
  SK_KERNEL_ENTRY("bias_grad.cuh", "bias_grad_finish");
  const float* partials;
  void* db;
  int strips;
  int width;
};

}  // namespace sk::kernels::bias_grad

#ifdef __CUDACC_RTC__

namespace sk {

constexpr int BIAS_GRAD_COLUMNS_PER_THREAD = 8;
constexpr int BIAS_GRAD_WARPS = 8;
constexpr int BIAS_GRAD_FINISH_ROWS = 32;

// A pass-1 thread's share: its first column c0 (8 per thread), how many of its 8 lie inside the row
// (n), and the rows [first, last) of its block's strip.
struct ColumnStrip {
  int c0, n, first, last;
};
__device__ __forceinline__ ColumnStrip column_strip(int rows, int width, int rows_per_block) {
  const int c0 = (blockIdx.x * 32 + threadIdx.x) * BIAS_GRAD_COLUMNS_PER_THREAD;
  const int first = blockIdx.y * rows_per_block;
  return {c0, c0 < width ? min(BIAS_GRAD_COLUMNS_PER_THREAD, width - c0) : 0, first,
          min(rows, first + rows_per_block)};
}

// partials: gridDim.y × width fp32, block (·, y) writing row y.
template <typename T>
__device__ void bias_grad_partials(const T* __restrict__ dy, float* __restrict__ partials, int rows, int width,
                                   int rows_per_block, int vectorised) {
  const auto [c0, n, first, last] = column_strip(rows, width, rows_per_block);
  float sum[BIAS_GRAD_COLUMNS_PER_THREAD];
  for (int k = 0; k < BIAS_GRAD_COLUMNS_PER_THREAD; ++k) sum[k] = 0.f;
  if (vectorised && n == BIAS_GRAD_COLUMNS_PER_THREAD) {
    // Four rows per iteration, so that each thread has four loads in flight.
#pragma unroll 4
    for (int r = first + threadIdx.y; r < last; r += BIAS_GRAD_WARPS) {
      float v[BIAS_GRAD_COLUMNS_PER_THREAD];
      load8(dy + static_cast<size_t>(r) * width + c0, v);
#pragma unroll
      for (int k = 0; k < BIAS_GRAD_COLUMNS_PER_THREAD; ++k) sum[k] += v[k];
    }
  } else {
    for (int r = first + threadIdx.y; n > 0 && r < last; r += BIAS_GRAD_WARPS)
      for (int k = 0; k < n; ++k) sum[k] += to_float(dy[static_cast<size_t>(r) * width + c0 + k]);
  }
  write_column_partials<BIAS_GRAD_WARPS>(sum, n, c0, width, partials);
}

// As bias_grad_partials over dy = [part 0 | part 1 | ...] [rows, width], writing dy as it goes.
template <typename T>
__device__ void bias_grad_concat_partials(const kernels::bias_grad::ColumnBlocks& blocks, int part_width, T* __restrict__ dy,
                                          float* __restrict__ partials, int rows, int width, int rows_per_block,
                                          int vectorised) {
  const auto [c0, n, first, last] = column_strip(rows, width, rows_per_block);
  float sum[BIAS_GRAD_COLUMNS_PER_THREAD];
  for (int k = 0; k < BIAS_GRAD_COLUMNS_PER_THREAD; ++k) sum[k] = 0.f;
  if (vectorised && n == BIAS_GRAD_COLUMNS_PER_THREAD) {
    // part_width is a multiple of 8 here, so a thread's 8 columns lie in one block.
    const int part = c0 / part_width;
    const T* source = static_cast<const T*>(blocks.part[part]) + (c0 - part * part_width);
#pragma unroll 4
    for (int r = first + threadIdx.y; r < last; r += BIAS_GRAD_WARPS) {
      float v[BIAS_GRAD_COLUMNS_PER_THREAD];
      load8(source + static_cast<size_t>(r) * part_width, v);
      store8(dy + static_cast<size_t>(r) * width + c0, v);
#pragma unroll
      for (int k = 0; k < BIAS_GRAD_COLUMNS_PER_THREAD; ++k) sum[k] += v[k];
    }
  } else {
    for (int r = first + threadIdx.y; n > 0 && r < last; r += BIAS_GRAD_WARPS)
      for (int k = 0; k < n; ++k) {
        const int c = c0 + k, part = c / part_width;
        const T v = static_cast<const T*>(blocks.part[part])[static_cast<size_t>(r) * part_width + (c - part * part_width)];
        dy[static_cast<size_t>(r) * width + c] = v;
        sum[k] += to_float(v);
      }
  }
  write_column_partials<BIAS_GRAD_WARPS>(sum, n, c0, width, partials);
}

// db[c] = Σ_s partials[s, c]; thread (x, y) of a block sums strips y, y + 32, ... of column x.
template <typename TB>
__device__ void bias_grad_finish(const float* __restrict__ partials, TB* __restrict__ db, int strips, int width) {
  __shared__ float sums[BIAS_GRAD_FINISH_ROWS][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sum = 0.f;
  if (c < width)
    for (int s = threadIdx.y; s < strips; s += BIAS_GRAD_FINISH_ROWS) sum += partials[static_cast<size_t>(s) * width + c];
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= width) return;
  float total = 0.f;
  for (int y = 0; y < BIAS_GRAD_FINISH_ROWS; ++y) total += sums[y][threadIdx.x];
  db[c] = from_float<TB>(total);
}

}  // namespace sk

#define SK_BIAS_GRAD(tag, T, ...)                                                                                \
  SK_ENTRY(bias_grad_partials_##tag, (const sk::kernels::bias_grad::Partials p) {                                \
    sk::bias_grad_partials<T>(static_cast<const T*>(p.dy), p.partials, p.rows, p.width, p.rows_per_block,        \
                              p.vectorised);                                                                     \
  })                                                                                                             \
  SK_ENTRY(bias_grad_finish_##tag, (const sk::kernels::bias_grad::Finish p) {                                    \
    sk::bias_grad_finish<T>(p.partials, static_cast<T*>(p.db), p.strips, p.width);                               \
  })                                                                                                             \
  SK_ENTRY(bias_grad_concat_partials_##tag, (const __grid_constant__                                             \
                                                             sk::kernels::bias_grad::ConcatPartials p) {         \
    sk::bias_grad_concat_partials<T>(p.blocks, p.part_width, static_cast<T*>(p.dy), p.partials, p.rows, p.width, \
                                     p.rows_per_block, p.vectorised);                                            \
  })
SK_TYPES_1(SK_BIAS_GRAD, )

#else  // host: the launchers

#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace sk::kernels::bias_grad {

constexpr int kColumnsPerBlock = 256;  // 32 threads × 8 columns
constexpr int kWarps = 8;
constexpr unsigned kFinishRows = 32;

// The launch shape of `kernel`, a pass over [rows, width] in blocks of 32 × 8 threads (this file's
// pass 1, bias_gelu.cuh's passes): column tiles across x, strips of rows across y, as many blocks as
// are resident on the GPU at once (registers decide how many per SM), so that they run as one full
// wave (fewer strips also means fewer partial rows to finish).
struct Strips {
  unsigned column_tiles, strips;
  int rows_per_block;
};

inline Strips strips_for(int64_t rows, int64_t width, const Kernel& kernel, const c10::Device& device) {
  const int64_t tiles = (width + kColumnsPerBlock - 1) / kColumnsPerBlock;
  const int64_t resident = std::clamp<int64_t>(resident_blocks_per_sm(kernel, 32 * kWarps, 0), 1, 8) *
                           static_cast<int64_t>(multiprocessors(device));
  const int64_t wanted = std::max<int64_t>(1, resident / std::max<int64_t>(tiles, 1));
  const int64_t strips = std::clamp<int64_t>(std::min(wanted, (rows + kWarps - 1) / kWarps), 1, 65535);
  const int64_t per_block = (rows + strips - 1) / strips;
  return {static_cast<unsigned>(tiles), static_cast<unsigned>((rows + per_block - 1) / per_block),
          static_cast<int>(per_block)};
}

// Whether 8 consecutive elements of every row move as one vector: the width a multiple of 8 and
// every tensor aligned to 8 elements.
inline int vectorised(int64_t width, std::initializer_list<const at::Tensor*> tensors) {
  return width % 8 == 0 && aligned_to(8, tensors) ? 1 : 0;
}

// Σ over the rows of partials [strips, width] fp32, as a [width] tensor of type `out`.
inline at::Tensor finish(const at::Tensor& partials, at::ScalarType out) {
  const int64_t strips = partials.size(0), width = partials.size(1);
  at::Tensor db = at::empty({width}, partials.options().dtype(out));
  if (width == 0) return db;
  launch(get<Finish>({out}, partials.device()), {static_cast<unsigned>((width + 31) / 32), 1, 1}, {32, kFinishRows, 1},
         0,
         Finish{.partials = partials.data_ptr<float>(),
                .db = db.data_ptr(),
                .strips = static_cast<int>(strips),
                .width = static_cast<int>(width)});
  return db;
}

// Σ over the rows of dy [rows, width] (contiguous, fp32/bf16/fp16), as a [width] tensor of type `out`.
inline at::Tensor column_sums(const at::Tensor& dy, at::ScalarType out) {
  const int64_t rows = dy.size(0), width = dy.size(1);
  if (rows == 0 || width == 0) return at::zeros({width}, dy.options().dtype(out));
  const auto kernel = get<Partials>({dy.scalar_type()}, dy.device());
  const Strips s = strips_for(rows, width, kernel, dy.device());
  at::Tensor partials = at::empty({static_cast<int64_t>(s.strips), width}, dy.options().dtype(at::kFloat));
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0,
         Partials{.dy = dy.data_ptr(),
                  .partials = partials.data_ptr<float>(),
                  .rows = static_cast<int>(rows),
                  .width = static_cast<int>(width),
                  .rows_per_block = s.rows_per_block,
                  .vectorised = vectorised(width, {&dy})});
  return finish(partials, out);
}

// dy = the parts side by side, [rows, parts · part_width] (each part [rows, part_width] contiguous,
// one type, at most kMaxParts of them), and its column sums as a [width] tensor of type `out`, from
// one pass over the parts.
inline std::pair<at::Tensor, at::Tensor> concat_and_column_sums(const std::vector<at::Tensor>& parts,
                                                                 at::ScalarType out) {
  TORCH_CHECK(!parts.empty() && parts.size() <= static_cast<size_t>(kMaxParts),
              "bias_grad: between 1 and ", kMaxParts, " column blocks, got ", parts.size());
  const int64_t rows = parts[0].size(0), part_width = parts[0].size(1);
  const int64_t width = part_width * static_cast<int64_t>(parts.size());
  at::Tensor dy = at::empty({rows, width}, parts[0].options());
  if (rows == 0 || width == 0) return {dy, at::zeros({width}, dy.options().dtype(out))};
  const auto kernel = get<ConcatPartials>({dy.scalar_type()}, dy.device());
  const Strips s = strips_for(rows, width, kernel, dy.device());
  at::Tensor partials = at::empty({static_cast<int64_t>(s.strips), width}, dy.options().dtype(at::kFloat));
  ColumnBlocks blocks{};
  bool aligned = part_width % 8 == 0 && aligned_to(8, {&dy});
  for (size_t i = 0; i < parts.size(); ++i) {
    blocks.part[i] = parts[i].data_ptr();
    aligned = aligned && aligned_to(8, {&parts[i]});
  }
  launch(kernel, {s.column_tiles, s.strips, 1}, {32, kWarps, 1}, 0,
         ConcatPartials{.blocks = blocks,
                        .part_width = static_cast<int>(part_width),
                        .dy = dy.data_ptr(),
                        .partials = partials.data_ptr<float>(),
                        .rows = static_cast<int>(rows),
                        .width = static_cast<int>(width),
                        .rows_per_block = s.rows_per_block,
                        .vectorised = aligned ? 1 : 0});
  return {dy, finish(partials, out)};
}

}  // namespace sk::kernels::bias_grad

#endif
