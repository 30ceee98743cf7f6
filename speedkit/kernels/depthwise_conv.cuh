// A depthwise 2-D convolution over channels-last tensors (groups = channels, one K × K filter per
// channel, stride 1, no dilation): its forward and its input's gradient, which is the same
// convolution of the output's gradient by the filters turned 180°, padded by K - 1 - padding.
//
// y[n, h, w, c] = Σ_{i, j < K} x[n, h + i - pad_h, w + j - pad_w, c] · weight[c, i, j]
//
// A block computes a tile of the output: 32 channels of `block_rows` · R rows by `strips_per_row`
// · 8 columns of one image. It first copies the input the tile reads, halo included, into shared
// memory as fp32 (16-byte loads of 8 channels, eight in flight a thread, zeros where the padding
// is) and the tile's filters beside it; then each thread computes 2 channels of R rows by 8
// columns, sliding along the rows of the shared tile, every product accumulated in fp32.
// cuDNN's depthwise kernels (conv2d_c1_k1_nhwc, dgrad2d_c1_k1_nhwc) take 96 and 221 µs for the 7×7
// filters of a ConvNeXt-T stage over 128 images of 32 × 32 × 96 channels in bf16 on an H200; these
// kernels 84 each. At 3×3 over large images cuDNN's are the faster.
// Which runs is timed once per problem (shim/depthwise_conv.cpp).
//
// The device part below is compiled by NVRTC (shim/kernels.cpp); the host part at the end, the
// launcher, is compiled into the shim by the host compiler.
#pragma once

#include "common.cuh"

namespace sk::kernels::depthwise_conv {

// Channels a block covers (16 threads of 2 channels), output columns a thread covers, output
// strips (a thread's rows by its columns) a block covers.
constexpr int kBlockChannels = 32;
constexpr int kStripWidth = 8;
constexpr int kBlockStrips = 16;

// x [batch, height, width, channels] and y [batch, out_height, out_width, channels] channels-last,
// weight [channels, K, K] dense, all of one type, bf16 or fp16; `flip` reads the filters turned
// 180° (the input's gradient). The grid: x over batch · tiles_h · tiles_w tiles, y over the
// channels' blocks of 32.
// Entry points depthwise_conv_forward_<type>_k<K>r<R>, R the rows a thread computes.
struct Forward {
  SK_KERNEL_ENTRY("depthwise_conv.cuh", "depthwise_conv_forward");
  const void* x;
  const void* weight;
  void* y;
  int height;
  int width;
  int channels;
  int out_height;
  int out_width;
  int pad_h;
  int pad_w;
  int block_rows;      // rows of threads in a block; the tile is block_rows · R output rows high
  int strips_per_row;  // threads along a row; the tile is strips_per_row · 8 output columns wide
  int tiles_h;
  int tiles_w;
  int flip;
};

}  // namespace sk::kernels::depthwise_conv

#ifdef __CUDACC_RTC__

namespace sk {

namespace depthwise {
using kernels::depthwise_conv::kBlockChannels;
using kernels::depthwise_conv::kStripWidth;

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  p[0] = from_float<T>(a);
  p[1] = from_float<T>(b);
}

// Copies the input the tile reads, [rows][cols][32 channels] from (h0 - pad_h, w0 - pad_w), into
// `tile` as fp32; zeros outside the image and past the last channel.
template <typename T>
__device__ void load_tile(const kernels::depthwise_conv::Forward& p, const T* __restrict__ x, float* tile, int rows,
                          int cols, int n, int h0, int w0, int c0) {
  constexpr int kVectors = kBlockChannels / 8;  // 16-byte loads of 8 channels a pixel
  constexpr int kInFlight = 8;
  const int count = rows * cols * kVectors;
  for (int base = threadIdx.x; base < count; base += blockDim.x * kInFlight) {
    float v[kInFlight][8];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = base + u * blockDim.x;
      const int pixel = e / kVectors;
      const int hx = h0 + pixel / cols - p.pad_h, wx = w0 + pixel % cols - p.pad_w;
      const int c = c0 + (e % kVectors) * 8;
      if (e < count && hx >= 0 && hx < p.height && wx >= 0 && wx < p.width && c < p.channels) {
        load8(x + ((static_cast<size_t>(n) * p.height + hx) * p.width + wx) * p.channels + c, v[u]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[u][k] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = base + u * blockDim.x;
      if (e < count) store8(tile + static_cast<size_t>(e) * 8, v[u]);
    }
  }
}

}  // namespace depthwise

template <typename T, int K, int R>
__device__ void depthwise_conv_forward(const kernels::depthwise_conv::Forward& p) {
  using depthwise::kBlockChannels;
  using depthwise::kStripWidth;
  extern __shared__ float shared[];
  const int rows = p.block_rows * R + K - 1, cols = p.strips_per_row * kStripWidth + K - 1;
  float* tile = shared;                                  // [rows][cols][32]
  float* filters = shared + rows * cols * kBlockChannels;  // [K · K][32]

  const int tile_w = blockIdx.x % p.tiles_w, tile_h = blockIdx.x / p.tiles_w % p.tiles_h;
  const int n = blockIdx.x / p.tiles_w / p.tiles_h;
  const int h0 = tile_h * p.block_rows * R, w0 = tile_w * p.strips_per_row * kStripWidth;
  const int c0 = blockIdx.y * kBlockChannels;
  const T* weight = static_cast<const T*>(p.weight);
  for (int e = threadIdx.x; e < K * K * kBlockChannels; e += blockDim.x) {
    const int tap = e / kBlockChannels, c = c0 + e % kBlockChannels;
    filters[e] = c < p.channels ? to_float(weight[static_cast<size_t>(c) * K * K + (p.flip ? K * K - 1 - tap : tap)])
                                : 0.f;
  }
  depthwise::load_tile(p, static_cast<const T*>(p.x), tile, rows, cols, n, h0, w0, c0);
  __syncthreads();

  // Thread: channels 2·pair and 2·pair + 1 of the block's, output rows row·R ... + R - 1 and
  // columns strip·8 ... + 7 of the tile.
  const int pair = threadIdx.x % (kBlockChannels / 2), s = threadIdx.x / (kBlockChannels / 2);
  const int row = s / p.strips_per_row, strip = s % p.strips_per_row;
  float acc[R][kStripWidth][2] = {};
#pragma unroll
  for (int r = 0; r < K + R - 1; ++r) {  // the tile's input rows this thread's outputs read
    const float* source = tile + ((row * R + r) * cols + strip * kStripWidth) * kBlockChannels + 2 * pair;
    float2 window[kStripWidth + K - 1];
#pragma unroll
    for (int j = 0; j < kStripWidth + K - 1; ++j)
      window[j] = *reinterpret_cast<const float2*>(source + j * kBlockChannels);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int i = r - q;  // the filter row input row r meets output row q at
      if (i < 0 || i >= K) continue;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const float2 f = *reinterpret_cast<const float2*>(filters + (i * K + j) * kBlockChannels + 2 * pair);
#pragma unroll
        for (int t = 0; t < kStripWidth; ++t) {
          acc[q][t][0] = fmaf(window[t + j].x, f.x, acc[q][t][0]);
          acc[q][t][1] = fmaf(window[t + j].y, f.y, acc[q][t][1]);
        }
      }
    }
  }
  const int c = c0 + 2 * pair;
  if (c >= p.channels) return;
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const int h = h0 + row * R + q;
    if (h >= p.out_height) break;
#pragma unroll
    for (int t = 0; t < kStripWidth; ++t) {
      const int w = w0 + strip * kStripWidth + t;
      if (w < p.out_width)
        depthwise::store2(y + ((static_cast<size_t>(n) * p.out_height + h) * p.out_width + w) * p.channels + c,
                          acc[q][t][0], acc[q][t][1]);
    }
  }
}

}  // namespace sk

#define SK_DEPTHWISE_CONV_SHAPE(tag, T, K, R)                                                     \
  SK_ENTRY_BOUNDED(256, depthwise_conv_forward_##tag##_k##K##r##R,                                \
                   (const sk::kernels::depthwise_conv::Forward p) { sk::depthwise_conv_forward<T, K, R>(p); })
#define SK_DEPTHWISE_CONV(tag, T, ...) \
  SK_DEPTHWISE_CONV_SHAPE(tag, T, 3, 1) SK_DEPTHWISE_CONV_SHAPE(tag, T, 3, 2) \
  SK_DEPTHWISE_CONV_SHAPE(tag, T, 5, 1) SK_DEPTHWISE_CONV_SHAPE(tag, T, 5, 2) \
  SK_DEPTHWISE_CONV_SHAPE(tag, T, 7, 1) SK_DEPTHWISE_CONV_SHAPE(tag, T, 7, 2)
// The types autocast runs convolutions in.
SK_DEPTHWISE_CONV(bf16, sk::bf16)
SK_DEPTHWISE_CONV(f16, sk::f16)

#else  // host: the launcher

#include "kernels.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace sk::kernels::depthwise_conv {

// The filter sizes the kernels are built for.
inline bool takes_filter_size(int64_t k) { return k == 3 || k == 5 || k == 7; }

// y = x ⋆ weight (flipped: turned 180°) with `pad_h`, `pad_w` zeros around x: x [N, C, H, W]
// channels-last of bf16 or fp16 with C a multiple of 8, weight [C, 1, K, K] of x's type and dense,
// K one of 3, 5, 7 no larger than the padded input. Returns y channels-last.
inline at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, int64_t pad_h, int64_t pad_w, bool flip) {
  const int64_t k = weight.size(2);
  const int64_t out_h = x.size(2) + 2 * pad_h - k + 1, out_w = x.size(3) + 2 * pad_w - k + 1;
  at::Tensor y = at::empty({x.size(0), x.size(1), out_h, out_w},
                           x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (y.numel() == 0) return y;
  // Two rows a thread where the image has the rows to share them; up to 16 strips a block, as
  // many along a row as it has.
  const int rows_per_thread = out_h >= 16 ? 2 : 1;
  const int64_t strips_per_row = std::min<int64_t>((out_w + kStripWidth - 1) / kStripWidth, kBlockStrips);
  const int64_t block_rows = std::max<int64_t>(
      1, std::min<int64_t>(kBlockStrips / strips_per_row, (out_h + rows_per_thread - 1) / rows_per_thread));
  const int64_t tiles_h = (out_h + block_rows * rows_per_thread - 1) / (block_rows * rows_per_thread);
  const int64_t tiles_w = (out_w + strips_per_row * kStripWidth - 1) / (strips_per_row * kStripWidth);
  const int64_t tile_floats =
      (block_rows * rows_per_thread + k - 1) * (strips_per_row * kStripWidth + k - 1) * kBlockChannels;
  const int shared = static_cast<int>((tile_floats + k * k * kBlockChannels) * sizeof(float));
  const auto kernel = get<Forward>({x.scalar_type()}, x.device(),
                                   "k" + std::to_string(k) + "r" + std::to_string(rows_per_thread));
  allow_dynamic_shared_memory(kernel, shared);
  const unsigned threads = static_cast<unsigned>(kBlockChannels / 2 * strips_per_row * block_rows);
  const Dim3 grid = {static_cast<unsigned>(x.size(0) * tiles_h * tiles_w),
                    static_cast<unsigned>((x.size(1) + kBlockChannels - 1) / kBlockChannels), 1};
  launch(kernel, grid, {threads, 1, 1}, shared,
         Forward{.x = x.data_ptr(),
                 .weight = weight.data_ptr(),
                 .y = y.data_ptr(),
                 .height = static_cast<int>(x.size(2)),
                 .width = static_cast<int>(x.size(3)),
                 .channels = static_cast<int>(x.size(1)),
                 .out_height = static_cast<int>(out_h),
                 .out_width = static_cast<int>(out_w),
                 .pad_h = static_cast<int>(pad_h),
                 .pad_w = static_cast<int>(pad_w),
                 .block_rows = static_cast<int>(block_rows),
                 .strips_per_row = static_cast<int>(strips_per_row),
                 .tiles_h = static_cast<int>(tiles_h),
                 .tiles_w = static_cast<int>(tiles_w),
                 .flip = flip ? 1 : 0});
  return y;
}

}  // namespace sk::kernels::depthwise_conv

#endif
