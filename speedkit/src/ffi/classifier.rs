//! The fused softmax cross-entropy, else ATen's (`shim/classifier.cpp`).

use std::ffi::c_char;
use std::ptr;

use tch::Tensor;

use super::{check, handle, optional_handle, owned, raw::classifier as abi, text, Result};

/// The mean cross-entropy of `[rows, classes]` logits, `ignore_index` rows left out; an fp32
/// scalar, differentiable in the logits.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    let mut loss = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `loss`.
    check(unsafe {
        abi::sk_cross_entropy(handle(logits), handle(targets), ignore_index, &mut loss)
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(loss) })
}

/// The cross-entropy of the logits `x Wᵀ + b` against `targets`, `block_rows` rows at a time so
/// that the logits are never whole (the mean over the rows not ignored, or with `mean` false the
/// sum); an fp32 scalar, differentiable in `x`, `weight` and `bias`. `x`: `[rows, in]`; `weight`:
/// `[vocab, in]`; the GEMMs in `kind`, the operands cast to it as autocast casts them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn chunked_cross_entropy(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    targets: &Tensor,
    ignore_index: i64,
    mean: bool,
    kind: tch::Kind,
    block_rows: i64,
) -> Result<Tensor> {
    let code = super::scalar_type_code(kind)?;
    let mut loss = ptr::null_mut();
    // SAFETY: live handles (or null for no bias) borrowed for the call; on success the shim hands
    // over `loss`.
    check(unsafe {
        abi::sk_chunked_cross_entropy(
            handle(x),
            handle(weight),
            optional_handle(bias),
            handle(targets),
            ignore_index,
            i32::from(mean),
            code,
            block_rows,
            &mut loss,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(loss) })
}

/// Why [`cross_entropy`] would take ATen's path for these inputs, or `None`.
pub(crate) fn unsupported(logits: &Tensor, targets: &Tensor) -> Result<Option<String>> {
    let mut reason: *const c_char = ptr::null();
    // SAFETY: live handles; `reason` receives the shim's per-thread string.
    check(unsafe {
        abi::sk_cross_entropy_unsupported(handle(logits), handle(targets), &mut reason)
    })?;
    // SAFETY: NUL-terminated, alive until this thread's next call; copied at once.
    Ok(unsafe { text(reason) })
}
