//! The transformer MLP on cuBLASLt epilogues, else ATen's (`shim/cublaslt.cpp`).

use std::ffi::c_char;
use std::ptr;

use tch::Tensor;

use super::{check, handle, optional_handle, owned, raw::mlp as abi, text, Result};

/// `fc2(gelu_tanh(fc1(x)))`, differentiable; its GEMMs in the autocast type on cuBLASLt where the
/// fused path takes the inputs.
pub(crate) fn mlp(
    x: &Tensor,
    fc1: (&Tensor, Option<&Tensor>),
    fc2: (&Tensor, Option<&Tensor>),
) -> Result<Tensor> {
    let mut y = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `y`.
    check(unsafe {
        abi::sk_mlp(
            handle(x),
            handle(fc1.0),
            optional_handle(fc1.1),
            handle(fc2.0),
            optional_handle(fc2.1),
            &mut y,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(y) })
}

/// Why [`mlp`] would run ATen's composite for these inputs, or `None`.
pub(crate) fn unsupported(
    x: &Tensor,
    fc1: (&Tensor, Option<&Tensor>),
    fc2: (&Tensor, Option<&Tensor>),
) -> Result<Option<String>> {
    let mut reason: *const c_char = ptr::null();
    // SAFETY: live handles; `reason` receives the shim's per-thread string.
    check(unsafe {
        abi::sk_mlp_unsupported(
            handle(x),
            handle(fc1.0),
            optional_handle(fc1.1),
            handle(fc2.0),
            optional_handle(fc2.1),
            &mut reason,
        )
    })?;
    // SAFETY: NUL-terminated, alive until this thread's next call; copied at once.
    Ok(unsafe { text(reason) })
}

/// Sets the mask of MLP backward epilogues (`shim/cublaslt.cpp`'s `Fusion` bits); the previous one.
pub(crate) fn set_backward_fusion(mask: i32) -> Result<i32> {
    let mut previous = 0;
    // SAFETY: a plain value and a valid out-pointer.
    check(unsafe { abi::sk_mlp_set_backward_fusion(mask, &mut previous) })?;
    Ok(previous)
}
