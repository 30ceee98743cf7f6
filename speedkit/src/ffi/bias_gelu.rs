//! Bias + tanh-GELU in one kernel, else ATen's (`shim/bias_gelu.cpp`).

use std::ptr;

use tch::Tensor;

use super::{check, handle, owned, raw::bias_gelu as abi, Result};

/// `gelu_tanh(h + bias)` in h's type, differentiable (the bias gradient from the GELU-backward
/// pass on the kernel path).
pub(crate) fn bias_gelu(h: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let mut y = ptr::null_mut();
    // SAFETY: live handles borrowed for the call; on success the shim hands over `y`.
    check(unsafe { abi::sk_bias_gelu(handle(h), handle(bias), &mut y) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(y) })
}
