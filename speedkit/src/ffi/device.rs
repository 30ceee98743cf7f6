//! Versions, device properties, the caching allocator, events and streams (`shim/device.cpp`).

use std::ffi::{c_int, c_void};
use std::ptr;

use super::{check, device_index, raw, raw::device as abi, Result};

pub(crate) use raw::{sk_device_props as DeviceProps, sk_versions as Versions};

pub(crate) fn versions() -> Result<Versions> {
    let mut out = Versions {
        torch_major: 0,
        torch_minor: 0,
        torch_patch: 0,
        built_with_cuda: 0,
        cuda_runtime: 0,
        cudnn: 0,
    };
    // SAFETY: `out` is the header's struct, valid for the call.
    check(unsafe { abi::sk_versions_get(&mut out) })?;
    Ok(out)
}

pub(crate) fn cuda_device_count() -> Result<usize> {
    let mut out = 0;
    // SAFETY: `out` is valid for the call.
    check(unsafe { abi::sk_cuda_device_count(&mut out) })?;
    Ok(usize::try_from(out).unwrap_or(0))
}

pub(crate) fn cuda_device_props(index: usize) -> Result<DeviceProps> {
    let mut out = DeviceProps {
        name: [0; 256],
        major: 0,
        minor: 0,
        multiprocessors: 0,
        total_memory: 0,
        l2_cache_bytes: 0,
    };
    // SAFETY: `out` is the header's struct; the shim NUL-terminates `name`.
    check(unsafe { abi::sk_cuda_device_props(device_index(index)?, &mut out) })?;
    Ok(out)
}

/// (allocated, peak allocated since reset, reserved) bytes of the caching allocator.
pub(crate) fn cuda_memory_stats(index: usize) -> Result<(u64, u64, u64)> {
    let (mut allocated, mut peak, mut reserved) = (0i64, 0i64, 0i64);
    // SAFETY: out-pointers valid for the call.
    check(unsafe {
        abi::sk_cuda_memory_stats(
            device_index(index)?,
            &mut allocated,
            &mut peak,
            &mut reserved,
        )
    })?;
    Ok((
        allocated.max(0) as u64,
        peak.max(0) as u64,
        reserved.max(0) as u64,
    ))
}

pub(crate) fn cuda_reset_peak_memory(index: usize) -> Result<()> {
    // SAFETY: plain value.
    check(unsafe { abi::sk_cuda_reset_peak_memory(device_index(index)?) })
}

/// Peak bytes reserved by the caching allocator since the last reset.
pub(crate) fn cuda_peak_reserved_memory(index: usize) -> Result<u64> {
    let mut peak = 0i64;
    // SAFETY: out-pointer valid for the call.
    check(unsafe { abi::sk_cuda_peak_reserved_memory(device_index(index)?, &mut peak) })?;
    Ok(peak.max(0) as u64)
}

/// The allocator's totals and its segments grouped by (pool, stream).
pub(crate) fn cuda_memory_snapshot(
    index: usize,
) -> Result<(raw::sk_memory_totals, Vec<raw::sk_memory_pool>)> {
    let mut totals = raw::sk_memory_totals {
        allocated: 0,
        reserved: 0,
        active: 0,
        inactive_split: 0,
        peak_allocated: 0,
        peak_reserved: 0,
        alloc_retries: 0,
        ooms: 0,
        segments: 0,
    };
    let empty = raw::sk_memory_pool {
        pool_first: 0,
        pool_second: 0,
        stream: 0,
        segments: 0,
        reserved: 0,
        allocated: 0,
    };
    let mut pools = vec![empty; 64];
    loop {
        let mut count = 0i64;
        // SAFETY: `totals` and `pools` (with its capacity passed) are valid for the call.
        check(unsafe {
            abi::sk_cuda_memory_snapshot(
                device_index(index)?,
                &mut totals,
                pools.as_mut_ptr(),
                pools.len() as i64,
                &mut count,
            )
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if count <= pools.len() {
            pools.truncate(count);
            return Ok((totals, pools));
        }
        pools = vec![empty; count];
    }
}

/// Gives the caching allocator's unused blocks back to the driver.
pub(crate) fn cuda_empty_cache() -> Result<()> {
    // SAFETY: no arguments.
    check(unsafe { abi::sk_cuda_empty_cache() })
}

/// Frees the cuBLAS and cuBLASLt workspaces of every stream but device `index`'s side stream (with
/// `side_stream_too`, of every stream); how many went. Only where no captured graph uses one.
pub(crate) fn release_blas_workspaces(index: usize, side_stream_too: bool) -> Result<i64> {
    let mut freed = 0i64;
    // SAFETY: plain values and a valid out-pointer.
    check(unsafe {
        abi::sk_cuda_release_blas_workspaces(
            device_index(index)?,
            c_int::from(side_stream_too),
            &mut freed,
        )
    })?;
    Ok(freed)
}

/// Gives the cuBLAS handles that ran GEMMs on device `index`'s current stream (the forward's and
/// the backward's thread) one shared workspace there; how many share it (0: nothing done).
/// `capturing`: the stream is capturing a graph (the workspace then comes from its pool, and
/// handles that have one already keep theirs).
pub(crate) fn share_blas_workspace(index: usize, capturing: bool) -> Result<i32> {
    let mut shared: c_int = 0;
    // SAFETY: plain values and a valid out-pointer.
    check(unsafe {
        abi::sk_cuda_share_blas_workspace(device_index(index)?, c_int::from(capturing), &mut shared)
    })?;
    Ok(shared)
}

/// (entries, distinct, bytes) of the cuBLAS workspaces the process keeps.
pub(crate) fn blas_workspaces() -> Result<(u64, u64, u64)> {
    let (mut entries, mut distinct, mut bytes) = (0i64, 0i64, 0i64);
    // SAFETY: valid out-pointers.
    check(unsafe { abi::sk_cuda_blas_workspaces(&mut entries, &mut distinct, &mut bytes) })?;
    Ok((
        entries.max(0) as u64,
        distinct.max(0) as u64,
        bytes.max(0) as u64,
    ))
}

pub(crate) fn cuda_synchronize(index: usize) -> Result<()> {
    // SAFETY: plain value.
    check(unsafe { abi::sk_cuda_synchronize(device_index(index)?) })
}

/// A CUDA event with timing enabled, recorded on the current stream.
pub(crate) struct CudaEvent(*mut c_void);

impl CudaEvent {
    pub(crate) fn new() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { abi::sk_cuda_event_new(&mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn record(&self) -> Result<()> {
        // SAFETY: self.0 is a live event created by sk_cuda_event_new.
        check(unsafe { abi::sk_cuda_event_record(self.0) })
    }

    /// Milliseconds between `self` and `end` (waits for `end` to complete).
    pub(crate) fn elapsed_ms(&self, end: &CudaEvent) -> Result<f64> {
        let mut out = 0.0;
        // SAFETY: both events are live; `out` valid.
        check(unsafe { abi::sk_cuda_event_elapsed_ms(self.0, end.0, &mut out) })?;
        Ok(out)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: created by sk_cuda_event_new, freed exactly once.
        unsafe { abi::sk_cuda_event_free(self.0) }
    }
}

/// A side stream made current until [`SideStream::exit`] (or drop): ordered after the work already
/// queued, and the previous stream waits for it on exit.
pub(crate) struct SideStream(*mut c_void);

impl SideStream {
    pub(crate) fn enter(index: usize) -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object freed by sk_cuda_side_stream_exit.
        check(unsafe { abi::sk_cuda_side_stream_enter(device_index(index)?, &mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn exit(mut self) -> Result<()> {
        let raw = std::mem::replace(&mut self.0, ptr::null_mut());
        // SAFETY: raw came from sk_cuda_side_stream_enter; exit frees it.
        check(unsafe { abi::sk_cuda_side_stream_exit(raw) })
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: as in `exit`; on this path (unwinding) the status has no one to go to.
            let _ = unsafe { abi::sk_cuda_side_stream_exit(self.0) };
        }
    }
}
