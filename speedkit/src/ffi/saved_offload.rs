//! Saved tensors parked in host memory during eager steps (`shim/saved_offload.cpp`).

use std::ffi::c_void;
use std::ptr;

use super::{check, raw::saved_offload as abi, Result};

/// An active session of the shim's; ended (libtorch's engine the default again) when dropped.
pub(crate) struct Session {
    raw: *mut c_void,
}

impl Session {
    /// Starts parking, on this thread, saved tensors of storages of at least `min_bytes`.
    pub(crate) fn begin(min_bytes: u64) -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: a valid out-pointer; the handle is ended exactly once (end or drop).
        check(unsafe {
            abi::sk_saved_offload_begin(min_bytes.min(i64::MAX as u64) as i64, &mut raw)
        })?;
        Ok(Self { raw })
    }

    /// Ends the session: (storages parked, their bytes).
    pub(crate) fn end(mut self) -> Result<(u64, u64)> {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        end(raw)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            let _ = end(self.raw);
        }
    }
}

fn end(raw: *mut c_void) -> Result<(u64, u64)> {
    let (mut parked, mut bytes) = (0i64, 0i64);
    // SAFETY: a live handle from sk_saved_offload_begin, freed by this call; valid out-pointers.
    check(unsafe { abi::sk_saved_offload_end(raw, &mut parked, &mut bytes) })?;
    Ok((parked.max(0) as u64, bytes.max(0) as u64))
}

/// Unpins the host memory sessions parked CUDA tensors in.
pub(crate) fn release_host_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { abi::sk_saved_offload_release_host_cache() })
}

/// Whether autograd's default engine is speedkit's (a session runs).
pub(crate) fn active() -> Result<bool> {
    let mut on = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { abi::sk_saved_offload_active(&mut on) })?;
    Ok(on != 0)
}
