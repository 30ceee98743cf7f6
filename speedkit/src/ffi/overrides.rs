//! Operator overrides: registering speedkit's kernels with PyTorch's dispatcher and reading its
//! tables (`shim/overrides.cpp`).

use std::ffi::{c_char, c_int};
use std::ptr;

use super::{c_string, check, raw::overrides as abi, text, Result};

/// Whether override group `which` (an `sk_override`) is registered now.
pub(crate) fn get(which: c_int) -> Result<bool> {
    let mut on = 0;
    // SAFETY: valid out-pointer; the shim range-checks `which`.
    check(unsafe { abi::sk_override_get(which, &mut on) })?;
    Ok(on != 0)
}

/// Registers or removes override group `which`.
pub(crate) fn set(which: c_int, on: bool) -> Result<()> {
    // SAFETY: plain values; the shim range-checks `which`.
    check(unsafe { abi::sk_override_set(which, c_int::from(on)) })
}

/// The dispatcher's computed table of operator `name` (overload `overload`).
pub(crate) fn dispatcher_table(name: &str, overload: &str) -> Result<String> {
    let (name, overload) = (c_string(name)?, c_string(overload)?);
    let mut out: *const c_char = ptr::null();
    // SAFETY: NUL-terminated inputs alive for the call; valid out-pointer to the shim's per-thread
    // string, copied at once.
    check(unsafe { abi::sk_dispatcher_table(name.as_ptr(), overload.as_ptr(), &mut out) })?;
    // SAFETY: NUL-terminated, alive until this thread's next call.
    Ok(unsafe { text(out) }.unwrap_or_default())
}
