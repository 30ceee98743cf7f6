//! A bias's gradient as speedkit's own operator, `speedkit::column_sums` (`shim/column_sums.cpp`).

use std::ptr;

use tch::{Kind, Tensor};

use super::{check, handle, owned, raw::column_sums as abi, scalar_type_code, Result};

/// The sum of `t` over every dimension but the last, in `kind`, through the dispatcher.
pub(crate) fn column_sums(t: &Tensor, kind: Kind) -> Result<Tensor> {
    let mut out = ptr::null_mut();
    // SAFETY: a live handle borrowed for the call; on success the shim hands over `out`.
    check(unsafe { abi::sk_column_sums(handle(t), scalar_type_code(kind)?, &mut out) })?;
    // SAFETY: a fresh tensor from the shim.
    Ok(unsafe { owned(out) })
}
