//! fp32 weights' copies in the autocast type, kept across steps (`shim/weight_casts.cpp`).

use super::{check, raw::weight_casts as abi, Result};

/// (bytes, count) of the kept copies whose weights are alive.
pub(crate) fn size() -> Result<(u64, u64)> {
    let (mut bytes, mut count) = (0i64, 0i64);
    // SAFETY: valid out-pointers.
    check(unsafe { abi::sk_weight_copies_size(&mut bytes, &mut count) })?;
    Ok((bytes.max(0) as u64, count.max(0) as u64))
}

/// Frees the copies of weights that no longer exist; the bytes freed.
pub(crate) fn release_expired() -> Result<u64> {
    let mut freed = 0i64;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_weight_copies_release_expired(&mut freed) })?;
    Ok(freed.max(0) as u64)
}

/// Frees every kept copy; the bytes freed.
pub(crate) fn clear() -> Result<u64> {
    let mut freed = 0i64;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_weight_copies_clear(&mut freed) })?;
    Ok(freed.max(0) as u64)
}

/// Forwards on this thread cast each weight where it is used instead of keeping copies, until
/// dropped (which restores the setting it found, on every exit path).
pub(crate) struct CastsPerUse {
    previous: i32,
}

impl CastsPerUse {
    pub(crate) fn enter() -> Result<Self> {
        let mut previous = 1;
        // SAFETY: valid out-pointer.
        check(unsafe { abi::sk_weight_copies_keep_on_this_thread(0, &mut previous) })?;
        Ok(Self { previous })
    }
}

impl Drop for CastsPerUse {
    fn drop(&mut self) {
        let mut replaced = 0;
        // SAFETY: valid out-pointer; setting a thread-local flag cannot fail.
        let _ = unsafe { abi::sk_weight_copies_keep_on_this_thread(self.previous, &mut replaced) };
    }
}
