//! FP8 quantisation of a matrix as [`Linear`](super::Linear)'s FP8 GEMMs take it: `s = FP8_MAX /
//! amax`, `q = saturate(t · s)` in e4m3 or e5m2, and optionally `qᵀ` in FP8 (what the backward GEMMs
//! take), with the scales kept on the device. The scale is per tensor ([`quantize_fp8`]) or per row
//! ([`quantize_fp8_rowwise`]: each row of `q` and each row of `qᵀ` scaled by its own amax).
//!
//! On a CUDA device where speedkit's kernels run, the cast is the fused kernel of
//! `speedkit/kernels/fp8_cast.cuh` (one pass over `t` under the delayed recipe, two under the
//! dynamic and row-wise ones, transposes from shared-memory tiles); elsewhere, or with the kernels
//! switched off ([`crate::kernels::set_enabled`]), ATen's composite ops, which give the same bytes.
//!
//! ```no_run
//! use speedkit::nn::{quantize_fp8, Fp8Format};
//! use tch::{Device, Kind, Tensor};
//! let t = Tensor::randn([256, 512], (Kind::BFloat16, Device::Cuda(0)));
//! let q = quantize_fp8(&t, Fp8Format::E4m3, None, true)?;
//! let back = q.data.to_kind(Kind::Float) * &q.inverse_scale;   // ≈ t
//! assert_eq!(q.transpose.unwrap().size(), [512, 256]);
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use tch::{Kind, Tensor};

use crate::error::{Result, SpeedkitError};
use crate::ffi;

/// Longest amax history the fused cast takes (one thread block rolls it).
///
/// ```
/// assert_eq!(speedkit::nn::MAX_AMAX_HISTORY, 1024);
/// ```
pub const MAX_AMAX_HISTORY: i64 = 1024;

/// An FP8 format of PyTorch's (`torch.float8_e4m3fn`, `torch.float8_e5m2`).
///
/// ```
/// use speedkit::nn::Fp8Format;
/// assert_eq!(Fp8Format::E4m3.max(), 448.0);
/// assert_eq!(Fp8Format::E5m2.max(), 57344.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Format {
    /// 4 exponent and 3 mantissa bits, no infinities: activations and weights.
    E4m3,
    /// 5 exponent and 2 mantissa bits: gradients.
    E5m2,
}

impl Fp8Format {
    /// The largest finite value, to which larger magnitudes saturate.
    pub fn max(self) -> f64 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }

    /// The tensor kind holding this format.
    ///
    /// ```
    /// use speedkit::nn::Fp8Format;
    /// assert_eq!(Fp8Format::E5m2.kind(), tch::Kind::Float8e5m2);
    /// ```
    pub fn kind(self) -> Kind {
        match self {
            Fp8Format::E4m3 => Kind::Float8e4m3fn,
            Fp8Format::E5m2 => Kind::Float8e5m2,
        }
    }
}

/// A matrix in FP8: `data · inverse_scale ≈` the input (row by row when the scale is per row).
///
/// ```
/// use speedkit::nn::{quantize_fp8, Fp8Format};
/// use tch::{Device, Kind, Tensor};
/// let t = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 4.0]).view([2, 2]);
/// let q = quantize_fp8(&t, Fp8Format::E4m3, None, false)?;   // ATen's composite on the CPU
/// let back = q.data.to_kind(Kind::Float) * &q.inverse_scale;
/// assert!(back.allclose(&t, 0.07, 0.0, false));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
#[derive(Debug)]
pub struct Fp8Tensor {
    /// `[rows, cols]` in the format's kind.
    pub data: Tensor,
    /// `[cols, rows]`, the input's transpose in FP8 laid out row-major, when asked for.
    pub transpose: Option<Tensor>,
    /// fp32 on the device, `1 / s`: a scalar, or `[rows]` under row-wise scaling.
    pub inverse_scale: Tensor,
    /// fp32 on the device, `transpose · transpose_inverse_scale ≈` the input's transpose: the same
    /// scalar as `inverse_scale`, or `[cols]` (one per row of the transpose) under row-wise scaling.
    /// `None` without the transpose.
    pub transpose_inverse_scale: Option<Tensor>,
}

/// `t` (2-d, fp32/bf16/fp16) in FP8 `format`. With `history` (1-d fp32 on `t`'s device, at most
/// [`MAX_AMAX_HISTORY`] entries, newest first) the scale comes from its largest entry when that is
/// positive, else from `t`'s amax, and the history is shifted by one with `t`'s amax as its newest
/// entry (Transformer Engine's delayed recipe); without it, from `t`'s amax. No host
/// synchronisation. Bad input is an error that changes nothing.
///
/// ```no_run
/// use speedkit::nn::{quantize_fp8, Fp8Format};
/// use tch::{Device, Kind, Tensor};
/// let history = Tensor::zeros([16], (Kind::Float, Device::Cuda(0)));
/// let g = Tensor::randn([1024, 64], (Kind::BFloat16, Device::Cuda(0)));
/// let q = quantize_fp8(&g, Fp8Format::E5m2, Some(&history), false)?;
/// assert!(q.transpose.is_none());
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn quantize_fp8(
    t: &Tensor,
    format: Fp8Format,
    history: Option<&Tensor>,
    transpose: bool,
) -> Result<Fp8Tensor> {
    check_input(t, history)?;
    cast(t, format, history, false, transpose)
}

/// `t` (2-d, fp32/bf16/fp16) in FP8 `format` with one scale per row, `FP8_MAX / amax(row)`, and,
/// when `transpose`, `tᵀ` with one scale per row of `tᵀ` (per column of `t`): each operand of a GEMM
/// scaled along the axis the GEMM sums over, as `_scaled_mm`'s row-wise mode takes it (the
/// `rowwise` recipe). Two passes over `t` on the kernels, no host synchronisation. Bad input is an
/// error that changes nothing.
///
/// ```
/// use speedkit::nn::{quantize_fp8_rowwise, Fp8Format};
/// use tch::{Device, Kind, Tensor};
/// // Rows a thousand times apart keep their precision: each has its own scale.
/// let t = Tensor::from_slice(&[1.0f32, -0.5, 1000.0, 250.0]).view([2, 2]);
/// let q = quantize_fp8_rowwise(&t, Fp8Format::E4m3, true)?;
/// assert_eq!(q.inverse_scale.size(), [2]);
/// let back = q.data.to_kind(Kind::Float) * q.inverse_scale.unsqueeze(1);
/// assert!(back.allclose(&t, 0.07, 0.0, false));
/// assert_eq!(q.transpose_inverse_scale.unwrap().size(), [2]);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn quantize_fp8_rowwise(t: &Tensor, format: Fp8Format, transpose: bool) -> Result<Fp8Tensor> {
    check_input(t, None)?;
    cast(t, format, None, true, transpose)
}

fn cast(
    t: &Tensor,
    format: Fp8Format,
    history: Option<&Tensor>,
    rowwise: bool,
    transpose: bool,
) -> Result<Fp8Tensor> {
    let format = match format {
        Fp8Format::E4m3 => ffi::fp8::Format::E4m3,
        Fp8Format::E5m2 => ffi::fp8::Format::E5m2,
    };
    let out = ffi::fp8::quantize(t, format, history, rowwise, transpose)?;
    Ok(Fp8Tensor {
        data: out.data,
        transpose: out.transpose,
        inverse_scale: out.inverse_scale,
        transpose_inverse_scale: out.transpose_inverse_scale,
    })
}

fn check_input(t: &Tensor, history: Option<&Tensor>) -> Result<()> {
    let misuse = |what: String| Err(SpeedkitError::Misuse(format!("quantize_fp8: {what}")));
    if t.dim() != 2 {
        return misuse(format!("the tensor is {}-d, not a matrix", t.dim()));
    }
    if !matches!(t.kind(), Kind::Float | Kind::BFloat16 | Kind::Half) {
        return misuse(format!("type {:?}; it takes fp32, bf16 or fp16", t.kind()));
    }
    if let Some(h) = history {
        let entries = h.numel() as i64;
        if h.dim() != 1 || h.kind() != Kind::Float || h.device() != t.device() {
            return misuse(
                "the amax history must be a 1-d fp32 tensor on the tensor's device".into(),
            );
        }
        if !(1..=MAX_AMAX_HISTORY).contains(&entries) {
            return misuse(format!(
                "an amax history of {entries} entries; it takes 1 to {MAX_AMAX_HISTORY}"
            ));
        }
    }
    Ok(())
}
