//! Token + position embedding in one kernel, else ATen's (`shim/embedding.cpp`).

use std::ffi::c_char;
use std::ptr;

use tch::Tensor;

use super::{check, handle, optional_handle, owned, raw::embedding as abi, text, Result};

/// `table[tokens]` plus `positions[t]` for `[batch, seq]` tokens, differentiable in the table and
/// the positions.
pub(crate) fn embedding(
    tokens: &Tensor,
    table: &Tensor,
    positions: Option<&Tensor>,
) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: live handles (or null for no positions) borrowed for the call; on success the shim
    // hands over `out`.
    check(unsafe {
        abi::sk_embedding(
            handle(tokens),
            handle(table),
            optional_handle(positions),
            &mut out,
        )
    })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}

/// Why [`embedding`] would take ATen's path for these inputs, or `None`.
pub(crate) fn unsupported(
    tokens: &Tensor,
    table: &Tensor,
    positions: Option<&Tensor>,
) -> Result<Option<String>> {
    let mut reason: *const c_char = ptr::null();
    // SAFETY: live handles (or null); `reason` receives the shim's per-thread string.
    check(unsafe {
        abi::sk_embedding_unsupported(
            handle(tokens),
            handle(table),
            optional_handle(positions),
            &mut reason,
        )
    })?;
    // SAFETY: NUL-terminated, alive until this thread's next call; copied at once.
    Ok(unsafe { text(reason) })
}
