//! LayerNorm on speedkit's kernel, else ATen's (`shim/layernorm.cpp`).

use std::ffi::{c_char, c_int};
use std::ptr;

use tch::Tensor;

use super::{
    check, handle, optional_handle, owned, owned_or_none, raw::layernorm as abi, text, Result,
};

/// `(LN(x [+ residual]), x + residual)`: the output in the autocast type where autocast is on for
/// x's device; without a residual the second output is x passed through when `keep_input`, else
/// none. Differentiable.
pub(crate) fn layer_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    keep_input: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (mut y, mut sum) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: live handles (or null) borrowed for the call; on success the shim hands over `y` and,
    // when there is a second output, `sum`.
    check(unsafe {
        abi::sk_layer_norm(
            handle(x),
            optional_handle(residual),
            optional_handle(weight),
            optional_handle(bias),
            eps,
            c_int::from(keep_input),
            &mut y,
            &mut sum,
        )
    })?;
    // SAFETY: fresh tensors from the shim (`sum` null when there is none).
    Ok(unsafe { (owned(y), owned_or_none(sum)) })
}

/// Why [`layer_norm`] would take ATen's path for these inputs, or `None`.
pub(crate) fn unsupported(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<Option<String>> {
    let mut reason: *const c_char = ptr::null();
    // SAFETY: live handles (or null); `reason` receives the shim's per-thread string.
    check(unsafe {
        abi::sk_layer_norm_unsupported(
            handle(x),
            optional_handle(residual),
            optional_handle(weight),
            optional_handle(bias),
            &mut reason,
        )
    })?;
    // SAFETY: NUL-terminated, alive until this thread's next call; copied at once.
    Ok(unsafe { text(reason) })
}
