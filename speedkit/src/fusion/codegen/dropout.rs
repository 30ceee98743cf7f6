//! Dropout as the generator takes it: `native_dropout`'s result and mask computed where the group
//! computes its other elements, each element kept or dropped by the very number ATen's kernel
//! draws for it.
//!
//! ATen's CUDA dropout (`Dropout.cu`) reserves a stretch of the default generator's Philox counter
//! per call and draws, per thread of its grid, curand's Philox4x32-10 numbers in a fixed pattern:
//! the vectorised kernel takes VEC neighbouring elements a thread per grid step and four numbers
//! per four elements; the plain one takes four elements a grid apart per four numbers. Which
//! number falls on which element is a function of the element's index, the grid and VEC, so a
//! generated kernel, whatever its own threads, computes each element's number directly. The
//! launch reserves the same stretch of the generator as ATen's call would (`shim/random.cpp`):
//! the masks are ATen's for the same generator state, everything drawn after the kernel draws
//! what it would have drawn, and inside a captured step every replay draws fresh numbers (the
//! generator's graph-safe state). The backward reads the mask the forward stored; a group that
//! draws is never computed again in the backward, which would draw again.

use tch::Kind;

use crate::trace::{TracedOp, TracedTensor, TracedValue};

use super::{c_type, dense, is_row_major, kind_of, Generator};

/// One dropout's draw in a generated kernel: what its launch reserves of the generator, or takes
/// again from the forward's launch.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Draw {
    /// The traced `native_dropout` call it draws for.
    pub(crate) call: u64,
    /// Whether it draws again what that call's kernel drew (a mask computed again in the
    /// backward) instead of reserving a stretch of its own.
    pub(crate) replays: bool,
    /// The elements drawn for (ATen's increment and grid follow from it).
    pub(crate) numel: u64,
    /// The elements ATen's kernel takes a thread per grid step (8, 4 or 2; 1 for its plain
    /// kernel): how its numbers fall on the elements.
    vec: u64,
    /// The keep probability as ATen's kernel compares with it (`float`), and `1 / keep` as it
    /// scales with it, as bits.
    keep: u32,
    scale: u32,
}

/// Device code every kernel that draws starts with, after its `Args`.
pub(super) const DEVICE_CODE: &str = r#"// curand's Philox4x32-10 (curand_philox4x32_x.h), which ATen's dropout draws from: ten rounds
// over a 128-bit counter (the draw's position, then the thread's subsequence) under the seed.
__device__ __forceinline__ uint4 philox_round(uint4 c, uint2 k) {
  const unsigned hi0 = __umulhi(0xD2511F53u, c.x), hi1 = __umulhi(0xCD9E8D57u, c.z);
  return make_uint4(hi1 ^ c.y ^ k.x, 0xCD9E8D57u * c.z, hi0 ^ c.w ^ k.y, 0xD2511F53u * c.x);
}
__device__ __forceinline__ uint4 philox(unsigned long long seed, unsigned long long thread, unsigned long long counter) {
  uint4 c = make_uint4((unsigned)counter, (unsigned)(counter >> 32), (unsigned)thread, (unsigned)(thread >> 32));
  uint2 k = make_uint2((unsigned)seed, (unsigned)(seed >> 32));
#pragma unroll
  for (int r = 0; r < 9; ++r) {
    c = philox_round(c, k);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return philox_round(c, k);
}
// The four words of a thread's `call`-th curand4 after curand_init(seed, thread, offset): the
// counter's from offset / 4 + call, offset % 4 words in (0 for every offset ATen hands out).
__device__ __forceinline__ uint4 curand4_words(unsigned long long seed, unsigned long long offset, unsigned long long thread, unsigned long long call) {
  const unsigned long long counter = (offset >> 2) + call;
  const uint4 w = philox(seed, thread, counter);
  const unsigned shift = (unsigned)(offset & 3);
  if (shift == 0) return w;
  const uint4 n = philox(seed, thread, counter + 1);
  return shift == 1 ? make_uint4(w.y, w.z, w.w, n.x) : shift == 2 ? make_uint4(w.z, w.w, n.x, n.y) : make_uint4(w.w, n.x, n.y, n.z);
}
__device__ __forceinline__ unsigned word_of(uint4 w, int j) { return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w; }
// curand_uniform's number of a word, in (0, 1]; the scale is 2^-32, so the product is exact.
__device__ __forceinline__ float curand_uniform_of(unsigned x) { return (float)x * 2.3283064365386963e-10f + 1.1641532182693481e-10f; }
// The word element p draws in ATen's dropout kernels of `threads` threads (Dropout.cu):
// fused_dropout_kernel_vec<VEC> takes VEC neighbouring elements a thread per grid step, a curand4
// per four of them (VEC 2 spends one curand4 over two steps); fused_dropout_kernel (VEC 1) takes
// four elements a grid apart per curand4.
template <int VEC, typename I>
__device__ __forceinline__ unsigned dropout_word(unsigned long long seed, unsigned long long offset, I threads, I p) {
  I thread, call;
  int j;
  if (VEC >= 4) {
    const I step = threads * VEC, lane = p % step % VEC;
    thread = p % step / VEC;
    call = p / step * (VEC / 4) + lane / 4;
    j = (int)(lane % 4);
  } else if (VEC == 2) {
    const I step = threads * 2, k = p / step;
    thread = p % step / 2;
    call = k / 2;
    j = (int)(k % 2 * 2 + p % 2);
  } else {
    const I k = p / threads;
    thread = p % threads;
    call = k / 4;
    j = (int)(k % 4);
  }
  return word_of(curand4_words(seed, offset, thread, call), j);
}
// The words of the four elements from p (a multiple of four) where VEC >= 4: one thread's call.
template <int VEC, typename I>
__device__ __forceinline__ uint4 dropout_words(unsigned long long seed, unsigned long long offset, I threads, I p) {
  const I step = threads * VEC, lane = p % step % VEC;
  return curand4_words(seed, offset, p % step / VEC, p / step * (VEC / 4) + lane / 4);
}
"#;

/// `op`'s draw where it is a `native_dropout` the generator computes: training, a probability
/// below one (ATen draws nothing otherwise), of a type it stores, its result and mask laid out as
/// its input, and that input laid out so that ATen's element order is known.
pub(super) fn dropout_of(op: &TracedOp) -> Result<Draw, String> {
    let (Some(TracedValue::Tensor(input)), [TracedValue::Tensor(out), TracedValue::Tensor(mask)]) =
        (op.inputs.first(), op.outputs.as_slice())
    else {
        return Err("native_dropout without its input, result and mask".into());
    };
    let number = |i: usize| match op.inputs.get(i) {
        Some(TracedValue::Other { value, .. }) => Some(value.trim_matches('"').to_string()),
        _ => None,
    };
    let p: f64 = (number(1).and_then(|v| v.parse().ok())).ok_or("native_dropout's p unknown")?;
    if number(2).as_deref() != Some("true") {
        return Err("native_dropout outside training (ATen copies its input)".into());
    }
    if !(0.0..1.0).contains(&p) {
        return Err(format!("native_dropout with p {p} (ATen draws nothing)"));
    }
    let kind = kind_of(&input.dtype).filter(|k| *k != Kind::Bool);
    let Some(kind) = kind.filter(|_| out.dtype == input.dtype && mask.dtype == "bool") else {
        return Err(format!("native_dropout of {}", input.dtype));
    };
    let same_layout = |t: &TracedTensor| t.shape == input.shape && t.strides == input.strides;
    if !(same_layout(out) && same_layout(mask) && out.offset == 0 && mask.offset == 0) {
        return Err("native_dropout whose result is not laid out as its input".into());
    }
    let vec = aten_vector_size(input, kind).ok_or("native_dropout of a strided input")?;
    let keep = (1.0 - p) as f32;
    Ok(Draw {
        call: op.id,
        replays: false,
        numel: input.numel,
        vec,
        keep: keep.to_bits(),
        scale: ((1.0 / f64::from(keep)) as f32).to_bits(),
    })
}

/// The elements ATen's dropout takes a thread per grid step for `input` (`get_vector_size` in
/// `Dropout.cu`): from its alignment (the caching allocator aligns its blocks to 512 bytes) up to
/// 16 bytes, halved until the count divides; 1, its plain kernel, where none does. `None` where
/// the plain kernel's order of elements is not its memory's (a strided input).
fn aten_vector_size(input: &TracedTensor, kind: Kind) -> Option<u64> {
    let bytes = kind.elt_size_in_bytes() as u64;
    let address = input.offset * bytes;
    let mut vec = [8, 4, 2]
        .into_iter()
        .find(|v| address % (v * bytes) == 0)
        .unwrap_or(1)
        .min(16 / bytes);
    if !dense(input) {
        vec = 1;
    }
    while vec > 1 && input.numel % vec != 0 {
        vec /= 2;
    }
    (vec > 1 || is_row_major(input)).then_some(vec)
}

impl Draw {
    /// The fields of kernel `Args` for draw `d`, in the order [`Draw::initializers`] gives them:
    /// its seed, offset and ATen's thread count; then the four words a thread drew last and the
    /// first element they are for (`memo`), which every read of an element's draw may update.
    pub(super) fn fields(d: usize) -> String {
        format!(
            "  unsigned long long seed{d};\n  unsigned long long offset{d};\n  uidx_t threads{d};\n  mutable uidx_t memo{d};\n  mutable uint4 words{d};\n"
        )
    }

    /// The entry point's parameters of draw `d`: the shim's `sk_philox_draw`, field by field.
    pub(super) fn params(d: usize) -> [String; 5] {
        [
            format!("unsigned long long rs{d}"),
            format!("unsigned long long ro{d}"),
            format!("unsigned long long ri{d}"),
            format!("unsigned rt{d}"),
            format!("int rc{d}"),
        ]
    }

    /// `Args`' initializers of draw `d`'s fields from its parameters: inside a capture, the seed
    /// and the offset are read where the generator keeps them (ATen's `philox::unpack`); no words
    /// drawn yet (1 is no group's first element).
    pub(super) fn initializers(d: usize) -> [String; 5] {
        [
            format!("rc{d} ? (unsigned long long)*(const long long*)rs{d} : rs{d}"),
            format!("rc{d} ? (unsigned long long)*(const long long*)ro{d} + ri{d} : ro{d}"),
            format!("(uidx_t)rt{d}"),
            "(uidx_t)1".into(),
            "make_uint4(0u, 0u, 0u, 0u)".into(),
        ]
    }

    /// `dropout_keep{d}(a, p)`: 1 where element p is kept, else 0. Where four neighbouring
    /// elements draw one thread's curand4 (VEC of four or more), a thread draws the four once
    /// and keeps them for its reads of the others (a kernel's thread takes neighbouring elements
    /// one after the other); else each element draws its own word.
    pub(super) fn keep_function(&self, d: usize) -> String {
        let vec = self.vec;
        let word = match vec >= 4 {
            true => format!(
                "const uidx_t first = (uidx_t)p & ~(uidx_t)3;
  if (first != a.memo{d}) {{
    a.memo{d} = first;
    a.words{d} = dropout_words<{vec}>(a.seed{d}, a.offset{d}, a.threads{d}, first);
  }}
  const unsigned w = word_of(a.words{d}, (int)(p & 3));"
            ),
            false => format!(
                "const unsigned w = dropout_word<{vec}>(a.seed{d}, a.offset{d}, a.threads{d}, (uidx_t)p);"
            ),
        };
        format!(
            "__device__ __forceinline__ float dropout_keep{d}(const Args& a, idx_t p) {{\n  {word}\n  return curand_uniform_of(w) < __uint_as_float({:#010x}u) ? 1.f : 0.f;\n}}\n",
            self.keep
        )
    }
}

impl Generator {
    /// `native_dropout`: its mask a function of the element's index alone (ATen's draw for it),
    /// its result the input's element times the mask times `1 / keep`, in fp32 as ATen's kernel.
    /// The result only where the kernel stores it or another operator of the group reads it (a
    /// mask computed again in the backward reads no input). `results`: what the kernel stores.
    pub(super) fn dropout(&mut self, op: &TracedOp, results: &[(u64, u64)]) -> Result<(), String> {
        let mut draw = dropout_of(op)?;
        draw.replays = self.stored_statistics;
        let (
            Some(TracedValue::Tensor(input)),
            [TracedValue::Tensor(out), TracedValue::Tensor(mask)],
        ) = (op.inputs.first(), op.outputs.as_slice())
        else {
            return Err("native_dropout without its input, result and mask".into());
        };
        let out_kind = kind_of(&out.dtype).ok_or("native_dropout of an unstored type")?;
        let d = self.draws.len();
        let keep = self.function_count;
        self.define(op, mask, &format!("  return dropout_keep{d}(a, p);\n"));
        self.draws.push(draw.clone());
        let read_in_group = (self.inside.iter()).any(|&(_, storage)| storage == out.storage);
        if !read_in_group && !results.contains(&out.key()) {
            return Ok(());
        }
        self.reading_at_coordinates = true;
        self.position = 0;
        let value = self.read(input, out);
        self.reading_at_coordinates = false;
        let body = format!(
            "  return round_to<{}>(({} * v{keep}(a, p, red)) * __uint_as_float({:#010x}u));\n",
            c_type(out_kind),
            value?,
            draw.scale
        );
        self.define_at_coordinates(op, out, &body);
        Ok(())
    }
}

/// `native_dropout_backward`'s scale as ATen's kernel takes it: autograd's `1 / (1 - p)`, a
/// double, as an fp32 (the trace of a recorded step holds the double exactly).
pub(super) fn backward_scale(traced: &str) -> Option<f32> {
    let scale: f64 = traced.trim_matches('"').parse().ok()?;
    (scale > 0.0 && scale.is_finite()).then_some(scale as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::testing::{call, traced_tensor};

    fn other(value: &str, kind: &str) -> TracedValue {
        TracedValue::Other {
            value: value.into(),
            kind: kind.into(),
        }
    }

    /// A row-major tensor of `shape` and type `dtype` from element `offset` of storage `id`.
    fn laid_out(id: u64, shape: &[i64], dtype: &str, offset: u64) -> TracedTensor {
        let mut strides = vec![1i64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        TracedTensor {
            offset,
            numel: shape.iter().product::<i64>() as u64,
            dtype: dtype.into(),
            shape: shape.to_vec(),
            strides,
            ..traced_tensor(id, id)
        }
    }

    fn dropout_call(input: TracedTensor, p: &str, train: &str) -> TracedOp {
        let like = |id, dtype: &str| TracedValue::Tensor(laid_out(id, &input.shape, dtype, 0));
        let outputs = vec![like(2, &input.dtype), like(3, "bool")];
        let inputs = vec![
            TracedValue::Tensor(input),
            other(p, "Double"),
            other(train, "Bool"),
        ];
        call(1, "aten::native_dropout", inputs, outputs)
    }

    fn input(shape: &[i64], dtype: &str, offset: u64) -> TracedTensor {
        laid_out(1, shape, dtype, offset)
    }

    #[test]
    fn a_bf16_dropout_draws_as_atens_kernel_of_eight_elements_a_thread() {
        let draw = dropout_of(&dropout_call(
            input(&[6, 40], "c10::BFloat16", 0),
            "0.1",
            "true",
        ));
        let draw = draw.unwrap();
        assert_eq!((draw.vec, draw.numel), (8, 240));
        assert_eq!(f32::from_bits(draw.keep), 0.9);
        assert_eq!(f32::from_bits(draw.scale), (1.0 / f64::from(0.9f32)) as f32);
    }

    #[test]
    fn atens_elements_a_thread_follow_the_inputs_alignment_and_count() {
        let vec = |shape: &[i64], dtype, offset| {
            dropout_of(&dropout_call(input(shape, dtype, offset), "0.5", "true")).map(|d| d.vec)
        };
        assert_eq!(vec(&[6, 40], "float", 0), Ok(4));
        assert_eq!(vec(&[6, 40], "c10::BFloat16", 4), Ok(4));
        assert_eq!(vec(&[3, 6], "c10::BFloat16", 0), Ok(2));
        assert_eq!(vec(&[7, 5], "c10::Half", 0), Ok(1));
    }

    #[test]
    fn a_dropout_outside_training_or_of_probability_one_is_not_generated() {
        let x = || input(&[8, 8], "float", 0);
        assert!(dropout_of(&dropout_call(x(), "0.5", "false")).is_err());
        assert!(dropout_of(&dropout_call(x(), "1.000000", "true")).is_err());
    }

    #[test]
    fn a_backward_scale_is_the_one_autograd_passed_rounded_to_fp32() {
        let scale = |p: f64| format!("{:?}", 1.0 / (1.0 - p));
        assert_eq!(backward_scale(&scale(0.1)), Some((1.0f64 / 0.9) as f32));
        assert_eq!(backward_scale(&scale(0.5)), Some(2.0));
        let digits = 0.123_456_7;
        assert_eq!(
            backward_scale(&scale(digits)),
            Some((1.0 / (1.0 - digits)) as f32)
        );
        assert_eq!(backward_scale("0.0"), None);
    }
}
