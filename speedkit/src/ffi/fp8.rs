//! FP8 GEMMs through `_scaled_mm` and the fused casts (`shim/fp8.cpp`).

use std::ffi::c_int;
use std::ptr;

use tch::Tensor;

use super::{check, handle, optional_handle, owned, owned_or_none, raw, raw::fp8 as abi, Result};

/// How one FP8 GEMM scales its operands (the shim's `sk_fp8_option` bits).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fp8LinearOptions {
    /// One scale per row (the histories are then `None`).
    pub rowwise: bool,
    /// The output gradient in e4m3 instead of e5m2.
    pub e4m3_gradients: bool,
}

impl Fp8LinearOptions {
    fn bits(self) -> c_int {
        (if self.rowwise { raw::SK_FP8_ROWWISE } else { 0 })
            | (if self.e4m3_gradients {
                raw::SK_FP8_E4M3_GRADIENTS
            } else {
                0
            })
    }
}

/// `x Wᵀ + b` through the shim's FP8 autograd function; `histories` (x, W, grad) for the delayed
/// recipe, `None` for dynamic and row-wise scaling; the output in `out_dtype` (a ScalarType code).
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    histories: Option<[&Tensor; 3]>,
    out_dtype: c_int,
    options: Fp8LinearOptions,
) -> Result<Tensor> {
    let [hx, hw, hg] = histories.map_or([ptr::null_mut(); 3], |h| h.map(handle));
    let mut out = ptr::null_mut();
    // SAFETY: live handles (or null where the shim accepts null); `out` receives a new tensor.
    check(unsafe {
        abi::sk_fp8_linear(
            handle(x),
            handle(weight),
            optional_handle(bias),
            hx,
            hw,
            hg,
            out_dtype,
            options.bits(),
            &mut out,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}

/// The shim's FP8 cast of a matrix.
pub(crate) struct Fp8Cast {
    pub data: Tensor,
    pub transpose: Option<Tensor>,
    pub inverse_scale: Tensor,
    pub transpose_inverse_scale: Option<Tensor>,
}

/// The FP8 formats of [`quantize`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum Format {
    E4m3,
    E5m2,
}

/// The delayed recipe's `[3, length]` amax histories (x, W, gradient) kept for `weight`, a layer's
/// weight that keeps none of its own: the same tensor at every call while `weight` lives.
pub(crate) fn weight_histories(weight: &Tensor, length: i64) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: a live handle; `out` receives a new tensor.
    check(unsafe { abi::sk_fp8_weight_histories(handle(weight), length, &mut out) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}

/// Drops the histories of weights that no longer exist (`all`: every one); how many went.
pub(crate) fn release_weight_histories(all: bool) -> Result<u64> {
    let mut freed = 0i64;
    // SAFETY: a valid out-pointer.
    check(unsafe { abi::sk_fp8_weight_histories_release(c_int::from(all), &mut freed) })?;
    Ok(freed.max(0) as u64)
}

/// The shim's FP8 cast: `history` for the delayed recipe (it records t's amax); `rowwise` for one
/// scale per row (and per row of the transpose).
pub(crate) fn quantize(
    t: &Tensor,
    format: Format,
    history: Option<&Tensor>,
    rowwise: bool,
    transpose: bool,
) -> Result<Fp8Cast> {
    let format = match format {
        Format::E4m3 => raw::SK_FP8_E4M3,
        Format::E5m2 => raw::SK_FP8_E5M2,
    };
    let [mut data, mut transposed, mut inverse, mut transposed_inverse] = [ptr::null_mut(); 4];
    // SAFETY: live handles (history may be null); the out-pointers receive fresh tensors (the
    // transpose's null when not asked for).
    check(unsafe {
        abi::sk_fp8_quantize(
            handle(t),
            format,
            optional_handle(history),
            c_int::from(rowwise),
            c_int::from(transpose),
            &mut data,
            &mut transposed,
            &mut inverse,
            &mut transposed_inverse,
        )
    })?;
    // SAFETY: fresh tensors from the shim, null where not asked for.
    unsafe {
        Ok(Fp8Cast {
            data: owned(data),
            transpose: owned_or_none(transposed),
            inverse_scale: owned(inverse),
            transpose_inverse_scale: owned_or_none(transposed_inverse),
        })
    }
}
