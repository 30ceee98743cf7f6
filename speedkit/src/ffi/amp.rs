//! Autocast state and the GradScaler's unscale (`shim/amp.cpp`).

use std::ffi::c_int;

use tch::Tensor;

use super::{check, handle, handles, raw::amp as abi, Result};

/// (enabled, ScalarType code) for a c10::DeviceType code.
pub(crate) fn autocast_get(device_type: c_int) -> Result<(bool, c_int)> {
    let (mut enabled, mut dtype) = (0, 0);
    // SAFETY: both out-pointers are valid for the call.
    check(unsafe { abi::sk_autocast_get(device_type, &mut enabled, &mut dtype) })?;
    Ok((enabled != 0, dtype))
}

pub(crate) fn autocast_set(device_type: c_int, enabled: bool, dtype: c_int) -> Result<()> {
    // SAFETY: plain values only.
    check(unsafe { abi::sk_autocast_set(device_type, c_int::from(enabled), dtype) })
}

pub(crate) fn autocast_increment_nesting() -> Result<i32> {
    let mut depth = 0;
    // SAFETY: `depth` is valid for the call.
    check(unsafe { abi::sk_autocast_increment_nesting(&mut depth) })?;
    Ok(depth)
}

pub(crate) fn autocast_decrement_nesting() -> Result<i32> {
    let mut depth = 0;
    // SAFETY: `depth` is valid for the call.
    check(unsafe { abi::sk_autocast_decrement_nesting(&mut depth) })?;
    Ok(depth)
}

pub(crate) fn autocast_clear_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { abi::sk_autocast_clear_cache() })
}

/// `grads *= inv_scale`, `found_inf = 1` where a gradient is not finite.
pub(crate) fn unscale_(grads: &[Tensor], found_inf: &Tensor, inv_scale: &Tensor) -> Result<()> {
    let g = handles(grads);
    // SAFETY: every handle is a live tensor borrowed for the call.
    check(unsafe {
        abi::sk_amp_unscale_(
            g.as_ptr(),
            g.len() as i64,
            handle(found_inf),
            handle(inv_scale),
        )
    })
}
