// What every kernel file shares. For NVRTC and the host compiler alike: SK_KERNEL_ENTRY, which names
// a params struct's kernel (shim/launch.h launches each kernel with its one params struct). For
// NVRTC only: conversions between the storage types (fp32, bf16, fp16) and fp32 arithmetic, warp
// reductions, the entry-point macros (each compiled alone when a launch asks for it), and the
// X-macro of the storage types that the kernel files use to emit one extern "C" entry point per type
// combination, named as the host composes names (shim/kernels.h: sk::kernels::kernel_name), so no
// C++ name mangling or NVRTC name expressions need keeping in step.
#pragma once

// Inside a params struct: the kernel file that defines its entry points, and the entry points'
// common name, to which the host appends one type tag per templated type.
#define SK_KERNEL_ENTRY(file, name)          \
  static constexpr const char* kFile = file; \
  static constexpr const char* kName = name

#ifdef __CUDACC_RTC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sk {

typedef __nv_bfloat16 bf16;
typedef __half f16;
typedef float f32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(f16 v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ f16 from_float<f16>(float v) { return __float2half_rn(v); }

// NVRTC has no <cmath>, so no INFINITY macro.
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

// Four consecutive elements as fp32, in one load (16 bytes of fp32, 8 of bf16/fp16); the pointer
// must be aligned to four elements.
__device__ __forceinline__ void load4(const float* p, float v[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
template <typename T>
__device__ __forceinline__ void load4(const T* p, float v[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = to_float(e[k]);
}
__device__ __forceinline__ void store4(float* p, const float v[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float v[4]) {
  uint2 q;
  T* e = reinterpret_cast<T*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) e[k] = from_float<T>(v[k]);
  *reinterpret_cast<uint2*>(p) = q;
}

// Eight consecutive elements as fp32: one 16-byte load for bf16/fp16, two for fp32 (a single
// 16-byte access per thread is what keeps enough bytes in flight to reach HBM bandwidth). The
// pointer must be aligned to eight elements.
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  load4(p, v);
  load4(p + 4, v + 4);
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float v[8]) {
  const uint4 q = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_float(e[k]);
}
__device__ __forceinline__ void store8(float* p, const float v[8]) {
  store4(p, v);
  store4(p + 4, v + 4);
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float v[8]) {
  uint4 q;
  T* e = reinterpret_cast<T*>(&q);
#pragma unroll
  for (int k = 0; k < 8; ++k) e[k] = from_float<T>(v[k]);
  *reinterpret_cast<uint4*>(p) = q;
}

// tanh on the SFU in one instruction (PTX tanh.approx.f32, SM 7.5+): relative error about 2^-11,
// below the rounding of a 16-bit result (bf16 keeps 8 mantissa bits, fp16 11). tanhf is a dozen
// FP32 instructions, which makes an element-wise kernel with a tanh per element compute-bound on
// Hopper instead of bandwidth-bound. Kernels use it only where they store 16-bit results.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The last step of a pass that sums columns over a strip of rows (bias_grad.cuh, bias_gelu.cuh): a
// block of 32 × WARPS threads, thread (x, y) holding in `sum` its warp's sums of the 8 columns from
// c0 (n of them inside the row), adds its warps' sums in a fixed order and writes them as row
// blockIdx.y of `partials` [gridDim.y, width]. Every thread of the block must call it.
template <int WARPS>
__device__ void write_column_partials(const float (&sum)[8], int n, int c0, int width, float* partials) {
  __shared__ float column_sums[WARPS][32 * 8];
  for (int k = 0; k < 8; ++k) column_sums[threadIdx.y][threadIdx.x * 8 + k] = sum[k];
  __syncthreads();
  if (threadIdx.y != 0) return;
  for (int k = 0; k < n; ++k) {
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) total += column_sums[w][threadIdx.x * 8 + k];
    partials[static_cast<size_t>(blockIdx.y) * width + c0 + k] = total;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace sk

// SK_ENTRY(name, (params) { body }) defines the extern "C" kernel `name`; SK_ENTRY_BOUNDED(threads,
// name, ...) the same under __launch_bounds__(threads). A compile for one entry point (the kernel
// layer's, at a launch: -DSK_ONE_ENTRY_POINT -DSK_WANT_<name>=~,1) keeps that one definition and
// drops the others, so that a cold start compiles the instantiation it launches and not the file's
// every type combination (layernorm.cuh has 150: 20 s of NVRTC); without SK_ONE_ENTRY_POINT (CI's
// compile of the file) every entry point is kept. The test: SK_WANT_<name> defined as `~,1` puts
// the 1 in SK_PP_SECOND's second place, an undefined one leaves the 0 there.
#define SK_PP_CAT(a, b) SK_PP_CAT_(a, b)
#define SK_PP_CAT_(a, b) a##b
#define SK_PP_SECOND(a, b, ...) b
#define SK_PP_WANTED(probe) SK_PP_SECOND(probe, 0, ~)
#define SK_PP_KEEP_1(...) __VA_ARGS__
#define SK_PP_KEEP_0(...)
#ifdef SK_ONE_ENTRY_POINT
#define SK_IF_WANTED(name) SK_PP_CAT(SK_PP_KEEP_, SK_PP_WANTED(SK_WANT_##name))
#else
#define SK_IF_WANTED(name) SK_PP_KEEP_1
#endif
#define SK_ENTRY(name, ...) SK_IF_WANTED(name)(extern "C" __global__ void name __VA_ARGS__)
#define SK_ENTRY_BOUNDED(threads, name, ...) \
  SK_IF_WANTED(name)(extern "C" __global__ void __launch_bounds__(threads) name __VA_ARGS__)

// SK_TYPES_n(M, ...) expands M(tag, type, ...) for every storage type; the tag is the suffix the host
// composes kernel names from (shim/kernels.h: sk::kernels::type_tag). Three copies, because a
// macro cannot expand inside its own expansion and a kernel over three types nests three deep.
#define SK_TYPES_1(M, ...) M(f32, sk::f32, __VA_ARGS__) M(bf16, sk::bf16, __VA_ARGS__) M(f16, sk::f16, __VA_ARGS__)
#define SK_TYPES_2(M, ...) M(f32, sk::f32, __VA_ARGS__) M(bf16, sk::bf16, __VA_ARGS__) M(f16, sk::f16, __VA_ARGS__)
#define SK_TYPES_3(M, ...) M(f32, sk::f32, __VA_ARGS__) M(bf16, sk::bf16, __VA_ARGS__) M(f16, sk::f16, __VA_ARGS__)

#endif  // __CUDACC_RTC__
