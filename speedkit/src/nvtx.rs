//! NVTX ranges around the phases of a training step (forward, backward, optimizer step, GradScaler
//! update, graph warm-up/capture/replay), so an Nsight Systems (`nsys`) timeline reads like the
//! training loop. On with `profile: {nvtx: true}` in the speed config; when off, a range is one
//! branch on a bool and no call into the shim. When on but no tool is attached, NVTX itself makes
//! each push/pop a null-checked call that returns at once.

use std::ffi::CStr;

use crate::ffi;

/// An open NVTX range (or nothing, when NVTX is off), closed when dropped.
#[must_use = "the range closes when this value drops"]
pub(crate) struct NvtxRange {
    open: bool,
}

impl NvtxRange {
    /// Opens a range named `name` when `enabled`.
    pub(crate) fn push(enabled: bool, name: &'static CStr) -> Self {
        if enabled {
            ffi::nvtx::range_push(name);
        }
        Self { open: enabled }
    }

    /// A range that was never opened.
    pub(crate) fn none() -> Self {
        Self { open: false }
    }
}

impl Drop for NvtxRange {
    fn drop(&mut self) {
        if self.open {
            ffi::nvtx::range_pop();
        }
    }
}
