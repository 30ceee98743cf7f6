//! The fp32 expression of each pointwise operator the generator takes, and the device helpers
//! every generated kernel starts with.

use crate::trace::TracedOp;

use super::{integer, writes_in_place};

pub(super) enum Operand {
    Value(String),
    Literal(String),
}

/// Helpers every generated kernel starts with.
pub(super) const PRELUDE: &str = r#"#include "common.cuh"
using namespace sk;
__device__ __forceinline__ float to_float_any(float v) { return v; }
// A bf16's float is its bits shifted up (exact). Written so, not as cuda_bf16.h's inline assembly,
// which the compiler cannot see through: a value read three times (SiLU's backward reads its
// input thrice) was then converted, and all that follows it computed, three times over.
__device__ __forceinline__ float to_float_any(bf16 v) { return __uint_as_float((unsigned)__bfloat16_as_ushort(v) << 16); }
__device__ __forceinline__ float to_float_any(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float_any(bool v) { return v ? 1.f : 0.f; }
template <typename T> __device__ __forceinline__ T store_as(float v) { return from_float<T>(v); }
// A vectorised kernel's group of four elements of an input, loaded at once (16 bytes of fp32, 8 of
// bf16/fp16), and element j of it: selects, not an indexed array, which would live in local memory.
__device__ __forceinline__ uint4 load_group(const float* g) { return *reinterpret_cast<const uint4*>(g); }
template <typename T> __device__ __forceinline__ uint4 load_group(const T* g) {
  const uint2 v = *reinterpret_cast<const uint2*>(g);
  return make_uint4(v.x, v.y, 0, 0);
}
__device__ __forceinline__ float group_element(const float*, uint4 g, int j) {
  return __uint_as_float(j == 0 ? g.x : j == 1 ? g.y : j == 2 ? g.z : g.w);
}
template <typename T> __device__ __forceinline__ float group_element(const T*, uint4 g, int j) {
  const unsigned w = (j & 2) ? g.y : g.x;
  const unsigned short bits = (j & 1) ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
  return to_float_any(*reinterpret_cast<const T*>(&bits));
}
// Eight 16-bit elements at once (16 bytes), where every vectorised argument of a pointwise kernel
// is bf16 or fp16: a thread's single 16-byte access keeps enough bytes in flight for HBM.
template <typename T> __device__ __forceinline__ uint4 load_group8(const T* g) { return *reinterpret_cast<const uint4*>(g); }
template <typename T> __device__ __forceinline__ float group_element8(const T*, uint4 g, int j) {
  const unsigned w = (j & 4) ? ((j & 2) ? g.w : g.z) : ((j & 2) ? g.y : g.x);
  const unsigned short bits = (j & 1) ? (unsigned short)(w >> 16) : (unsigned short)(w & 0xffffu);
  return to_float_any(*reinterpret_cast<const T*>(&bits));
}
template <> __device__ __forceinline__ bool store_as<bool>(float v) { return v != 0.f; }
// Four or eight bool results at once (a dropout's mask): one 4- or 8-byte store.
__device__ __forceinline__ unsigned bool_bytes(const float v[4]) {
  return (v[0] != 0.f ? 1u : 0u) | (v[1] != 0.f ? 0x100u : 0u) | (v[2] != 0.f ? 0x10000u : 0u) | (v[3] != 0.f ? 0x1000000u : 0u);
}
__device__ __forceinline__ void store4(bool* p, const float v[4]) { *reinterpret_cast<unsigned*>(p) = bool_bytes(v); }
__device__ __forceinline__ void store8(bool* p, const float v[8]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(bool_bytes(v), bool_bytes(v + 4));
}
// A row reduction's results as every function reads them (`red`): the reduction's value, or a
// group norm's mean and reciprocal standard deviation; none outside a row kernel.
#define NO_ROW make_float2(0.f, 0.f)
// The sum of every thread's `v` over the block, handed to every thread; `partial` holds 32 floats
// of shared scratch, free again once it returns.
__device__ __forceinline__ float block_sum(float v, float* partial) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < (blockDim.x + 31) / 32 ? partial[threadIdx.x & 31] : 0.f;
  return warp_sum(v);
}
// The sums of both of v's halves over the block (every thread gets them), in one exchange through
// shared memory where two block_sums take two.
__device__ __forceinline__ float2 block_sum2(float2 v, float2* partial) {
  v = make_float2(warp_sum(v.x), warp_sum(v.y));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < (blockDim.x + 31) / 32 ? partial[threadIdx.x & 31] : make_float2(0.f, 0.f);
  return make_float2(warp_sum(v.x), warp_sum(v.y));
}
// The sum of `v` over each run of `L` lanes of a warp (a power of two up to 32), handed to each.
template <int L> __device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(store_as<T>(v)); }
template <> __device__ __forceinline__ float round_to<bf16>(float v) { return to_float_any(store_as<bf16>(v)); }
template <> __device__ __forceinline__ float round_to<bool>(float v) { return v != 0.f ? 1.f : 0.f; }
__device__ __forceinline__ float sigmoid_of(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  return 0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(k));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float k = 0.79788456080286536f * (x + 0.044715f * x * x * x);
  const float t = tanhf(k);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.79788456080286536f * (1.f + 3.f * 0.044715f * x * x);
}
"#;

/// The fp32 expression of `op` over its operands, or `None` for an operator or overload not
/// generated yet.
pub(super) fn expression(op: &TracedOp, operands: &[Operand]) -> Option<String> {
    let v = |i: usize| match operands.get(i)? {
        Operand::Value(e) => Some(format!("({e})")),
        Operand::Literal(l) => literal(l),
    };
    let name = op.name.strip_prefix("aten::")?;
    // An in-place operator computes what its out-of-place twin does, into its first argument.
    let name = match writes_in_place(op) {
        true => name.strip_suffix('_')?,
        false => name,
    };
    let scalar_alpha = || v(2).unwrap_or_else(|| "1.f".into());
    Some(match name {
        "add" => format!("{} + {} * {}", v(0)?, scalar_alpha(), v(1)?),
        "sub" => format!("{} - {} * {}", v(0)?, scalar_alpha(), v(1)?),
        "rsub" => format!("{} - {} * {}", v(1)?, scalar_alpha(), v(0)?),
        "mul" => format!("{} * {}", v(0)?, v(1)?),
        "div" if operands.len() == 2 => format!("{} / {}", v(0)?, v(1)?),
        "neg" => format!("-{}", v(0)?),
        "exp" => format!("expf({})", v(0)?),
        "log" => format!("logf({})", v(0)?),
        "sqrt" => format!("sqrtf({})", v(0)?),
        "rsqrt" => format!("rsqrtf({})", v(0)?),
        "reciprocal" => format!("1.f / {}", v(0)?),
        "tanh" => format!("tanhf({})", v(0)?),
        "sigmoid" => format!("sigmoid_of({})", v(0)?),
        "abs" => format!("fabsf({})", v(0)?),
        "sin" => format!("sinf({})", v(0)?),
        "cos" => format!("cosf({})", v(0)?),
        "erf" => format!("erff({})", v(0)?),
        "square" => format!("{0} * {0}", v(0)?),
        "relu" => format!("fmaxf({}, 0.f)", v(0)?),
        "silu" => format!("{0} * sigmoid_of({0})", v(0)?),
        "silu_backward" => format!(
            "{g} * sigmoid_of({x}) * (1.f + {x} * (1.f - sigmoid_of({x})))",
            g = v(0)?,
            x = v(1)?
        ),
        "sigmoid_backward" => format!("{g} * {y} * (1.f - {y})", g = v(0)?, y = v(1)?),
        // As ATen's kernel: `norm * (input - target) * grad`, `norm` 2 / numel for a mean.
        "mse_loss_backward" => {
            let numel = op.inputs.get(1)?.tensors().first()?.numel.max(1);
            let norm = match integer(op.inputs.get(3))? {
                1 => 2.0 / numel as f64,
                _ => 2.0,
            } as f32;
            format!("{norm:?}f * ({} - {}) * {}", v(1)?, v(2)?, v(0)?)
        }
        "tanh_backward" => format!("{g} * (1.f - {y} * {y})", g = v(0)?, y = v(1)?),
        // As ATen's kernel (masked_scale_kernel): the mask, times the gradient, times the scale.
        "native_dropout_backward" => {
            let scale = match operands.get(2)? {
                Operand::Literal(l) => super::dropout::backward_scale(l)?,
                Operand::Value(_) => return None,
            };
            format!("{} * {} * {scale:?}f", v(1)?, v(0)?)
        }
        "threshold_backward" => {
            format!("({x} <= {t}) ? 0.f : {g}", g = v(0)?, x = v(1)?, t = v(2)?)
        }
        "gelu" => match operands.get(1) {
            Some(Operand::Literal(l)) if l.contains("tanh") => format!("gelu_tanh({})", v(0)?),
            _ => format!("gelu_erf({})", v(0)?),
        },
        "gelu_backward" => match operands.get(2) {
            Some(Operand::Literal(l)) if l.contains("tanh") => {
                format!("{} * gelu_tanh_grad({})", v(0)?, v(1)?)
            }
            _ => format!("{} * gelu_erf_grad({})", v(0)?, v(1)?),
        },
        // ATen's own special cases (pow_tensor_scalar_optimized_kernel): the same values, and a
        // multiplication where powf would take a logarithm and an exponential.
        "pow" if op.schema.starts_with("aten::pow.Tensor_Scalar") => match v(1)?.as_str() {
            "1.0f" => v(0)?,
            "2.0f" => format!("{0} * {0}", v(0)?),
            "3.0f" => format!("{0} * {0} * {0}", v(0)?),
            "0.5f" => format!("sqrtf({})", v(0)?),
            "-0.5f" => format!("rsqrtf({})", v(0)?),
            "-1.0f" => format!("1.f / {}", v(0)?),
            "-2.0f" => format!("1.f / ({0} * {0})", v(0)?),
            e => format!("powf({}, {e})", v(0)?),
        },
        "maximum" => format!("fmaxf({}, {})", v(0)?, v(1)?),
        "minimum" => format!("fminf({}, {})", v(0)?, v(1)?),
        "clamp_min" => format!("fmaxf({}, {})", v(0)?, v(1)?),
        "clamp_max" => format!("fminf({}, {})", v(0)?, v(1)?),
        "where" => format!("({} != 0.f) ? {} : {}", v(0)?, v(1)?, v(2)?),
        "ge" => format!("({} >= {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "gt" => format!("({} > {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "le" => format!("({} <= {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "lt" => format!("({} < {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "eq" => format!("({} == {}) ? 1.f : 0.f", v(0)?, v(1)?),
        "ne" => format!("({} != {}) ? 1.f : 0.f", v(0)?, v(1)?),
        // A cast: the round to the result's type is the whole operator.
        "_to_copy" | "clone" => v(0)?,
        _ => return None,
    })
}

/// A traced non-tensor argument as an fp32 literal: numbers only.
fn literal(json: &str) -> Option<String> {
    let number: f64 = json.trim_matches('"').parse().ok()?;
    if !number.is_finite() {
        return None;
    }
    Some(format!("{:?}f", number as f32))
}
