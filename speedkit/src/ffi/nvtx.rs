//! NVTX ranges for timeline tools (`shim/nvtx.cpp`).

use std::ffi::CStr;

use super::raw::nvtx as abi;

/// Opens an NVTX range (a no-op until a tool such as Nsight Systems is attached).
pub(crate) fn range_push(name: &CStr) {
    // SAFETY: NUL-terminated name for the call; NVTX copies it.
    unsafe { abi::sk_nvtx_range_push(name.as_ptr()) }
}

/// Closes the innermost NVTX range of this thread.
pub(crate) fn range_pop() {
    // SAFETY: no arguments; popping with no open range is a no-op in NVTX.
    unsafe { abi::sk_nvtx_range_pop() }
}
