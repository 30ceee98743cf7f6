//! PyTorch's global speed flags (`shim/flags.cpp`).

use std::ffi::c_int;

use super::{check, raw::flags as abi, Result};

pub(crate) fn get_bool(id: c_int) -> Result<bool> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { abi::sk_flag_get_bool(id, &mut out) })?;
    Ok(out != 0)
}

pub(crate) fn set_bool(id: c_int, value: bool) -> Result<()> {
    // SAFETY: plain values only.
    check(unsafe { abi::sk_flag_set_bool(id, c_int::from(value)) })
}

/// Writes only the flag's own field (for restoring a captured state).
pub(crate) fn restore_bool(id: c_int, value: bool) -> Result<()> {
    // SAFETY: plain values only.
    check(unsafe { abi::sk_flag_restore_bool(id, c_int::from(value)) })
}

/// 0 = highest, 1 = high, 2 = medium.
pub(crate) fn matmul_precision_get() -> Result<i32> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { abi::sk_matmul_precision_get(&mut out) })?;
    Ok(out)
}

pub(crate) fn matmul_precision_set(value: i32) -> Result<()> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { abi::sk_matmul_precision_set(value) })
}

/// Writes only the legacy matmul-precision field (for restoring a captured state).
pub(crate) fn matmul_precision_restore(value: i32) -> Result<()> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { abi::sk_matmul_precision_restore(value) })
}

/// One entry of the per-backend fp32 precision table: 0 = none, 1 = ieee, 2 = tf32, 3 = bf16.
pub(crate) fn fp32_precision_get(which: c_int) -> Result<i32> {
    let mut out = 0;
    // SAFETY: `out` is a valid pointer for the call.
    check(unsafe { abi::sk_fp32_precision_get(which, &mut out) })?;
    Ok(out)
}

pub(crate) fn fp32_precision_set(which: c_int, value: i32) -> Result<()> {
    // SAFETY: plain values only; the shim range-checks.
    check(unsafe { abi::sk_fp32_precision_set(which, value) })
}

/// Counts one write of speedkit's own state made in Rust (an override's removal), so that an
/// injected fault (below) can strike it too; fails, changing nothing, where it does.
pub(crate) fn count_write() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { abi::sk_flag_write() })
}

/// Makes the `n`-th flag write from now fail once (0 turns the fault off). Test-only.
pub(crate) fn fail_nth_write(n: u32) {
    let n = c_int::try_from(n).unwrap_or(c_int::MAX);
    // SAFETY: plain value; the shim stores it in an atomic.
    unsafe { abi::sk_test_fail_nth_flag_write(n) }
}
