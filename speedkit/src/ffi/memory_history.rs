//! The caching allocator's recorded history and its snapshot file (`shim/memory_history.cpp`).

use std::ffi::CString;
use std::path::Path;

use super::{check, raw::memory_history as abi, Result};
use crate::error::SpeedkitError;

pub(crate) fn enabled() -> Result<bool> {
    let mut out = 0;
    // SAFETY: `out` is valid for the call.
    check(unsafe { abi::sk_cuda_memory_history_enabled(&mut out) })?;
    Ok(out != 0)
}

/// Starts recording, keeping the latest `max_events` events (at least one).
pub(crate) fn start(max_events: usize) -> Result<()> {
    let max = i64::try_from(max_events).unwrap_or(i64::MAX).max(1);
    // SAFETY: plain values.
    check(unsafe { abi::sk_cuda_memory_history_record(1, max) })
}

pub(crate) fn stop() -> Result<()> {
    // SAFETY: plain values.
    check(unsafe { abi::sk_cuda_memory_history_record(0, 0) })
}

pub(crate) fn write(path: &Path) -> Result<()> {
    let text = path
        .to_str()
        .ok_or_else(|| SpeedkitError::Misuse(format!("{} is not a UTF-8 path", path.display())))?;
    let c_path = CString::new(text)
        .map_err(|_| SpeedkitError::Misuse(format!("{} contains a NUL byte", path.display())))?;
    // SAFETY: `c_path` is NUL-terminated and alive for the call.
    check(unsafe { abi::sk_cuda_memory_history_write(c_path.as_ptr()) })
}
