//! Linear with speedkit's cheaper backward, else ATen's (`shim/linear.cpp`).

use std::ptr;

use tch::Tensor;

use super::{check, handle, optional_handle, owned, raw::linear as abi, Result};

/// `x Wᵀ + b` in the autocast type (else x's), differentiable; on the kernel path the weight
/// gradient comes from its GEMM in the weight's type and the bias gradient from speedkit's
/// column-sum kernel.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut y = ptr::null_mut();
    // SAFETY: live handles (or null for no bias) borrowed for the call; on success the shim hands
    // over `y`.
    check(unsafe { abi::sk_linear(handle(x), handle(weight), optional_handle(bias), &mut y) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(y) })
}

/// As [`linear`], the GEMMs in `kind` whatever autocast says, each operand cast to it as
/// autocast casts it (the weight's and bias's copies kept across steps): autocast's `linear`, for
/// its override, which runs with autocast off.
pub(crate) fn linear_in(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    kind: tch::Kind,
) -> Result<Tensor> {
    let code = super::scalar_type_code(kind)?;
    let mut y = ptr::null_mut();
    // SAFETY: live handles (or null for no bias) borrowed for the call; on success the shim hands
    // over `y`.
    check(unsafe {
        abi::sk_linear_in(
            handle(x),
            handle(weight),
            optional_handle(bias),
            code,
            &mut y,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(y) })
}

/// As [`linear`], the output as `chunks` equal blocks of its last dimension, whose gradients the
/// kernel path's backward puts side by side in the pass that sums the bias gradient.
pub(crate) fn linear_chunks(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    chunks: usize,
) -> Result<Vec<Tensor>> {
    let mut y = vec![ptr::null_mut(); chunks];
    // SAFETY: live handles (or null for no bias) borrowed for the call; `y` has room for `chunks`
    // handles, which the shim fills and hands over on success.
    check(unsafe {
        abi::sk_linear_chunks(
            handle(x),
            handle(weight),
            optional_handle(bias),
            chunks as i64,
            y.as_mut_ptr(),
        )
    })?;
    // SAFETY: fresh tensors from the shim.
    Ok(y.into_iter().map(|t| unsafe { owned(t) }).collect())
}

/// Forgets the casts of activations this thread's linears remembered (a linear's input cast once
/// for every linear that reads it): once a backward has run, their sources are gone, and the
/// casts would stay allocated until the thread's next linear call.
pub(crate) fn forget_input_casts() -> Result<()> {
    // SAFETY: no arguments; clears a thread-local cache in the shim.
    check(unsafe { abi::sk_linear_forget_input_casts() })
}
