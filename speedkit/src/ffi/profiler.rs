//! The Kineto step profiler and user-scope ranges (`shim/profiler.cpp`).

use std::ffi::{c_int, c_void, CStr};
use std::ptr;

use super::{c_string, check, raw, raw::profiler as abi, Result};

/// One event of a finished profile (times on the host clock, in ns).
#[derive(Clone, Debug)]
pub(crate) struct ProfilerEvent {
    pub name: String,
    /// c10::DeviceType: 0 = CPU, 1 = CUDA.
    pub device_type: i32,
    /// libkineto::ActivityType: 0 = CPU op, 1 = user annotation, 3 = memcpy, 4 = memset,
    /// 5 = kernel, 7 = CUDA runtime call.
    pub activity_type: i32,
    pub start_ns: u64,
    pub duration_ns: u64,
    pub thread_id: u64,
}

/// Starts libtorch's Kineto profiler on this thread (CPU ops; CUDA activity too with `with_cuda`).
pub(crate) fn start(with_cuda: bool) -> Result<()> {
    // SAFETY: plain value.
    check(unsafe { abi::sk_profiler_start(c_int::from(with_cuda)) })
}

/// A finished Kineto profile.
pub(crate) struct ProfilerResult(*mut c_void);

impl ProfilerResult {
    /// Stops the profiler started by [`start`] and takes its result.
    pub(crate) fn stop() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` receives a heap object we own and free in Drop.
        check(unsafe { abi::sk_profiler_stop(&mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn events(&self) -> Result<Vec<ProfilerEvent>> {
        let mut n = 0i64;
        // SAFETY: live profile, valid out-pointer.
        check(unsafe { abi::sk_profiler_event_count(self.0, &mut n) })?;
        (0..n).map(|i| self.event(i)).collect()
    }

    fn event(&self, index: i64) -> Result<ProfilerEvent> {
        let mut event = raw::sk_profiler_event {
            name: ptr::null(),
            device_type: 0,
            activity_type: 0,
            start_ns: 0,
            duration_ns: 0,
            correlation_id: 0,
            thread_id: 0,
            device_resource_id: 0,
        };
        // SAFETY: live profile; `event` is the header's struct; the shim range-checks `index`.
        check(unsafe { abi::sk_profiler_event_get(self.0, index, &mut event) })?;
        // SAFETY: `name` points at a NUL-terminated string owned by the live profile.
        let name = unsafe { CStr::from_ptr(event.name) }
            .to_string_lossy()
            .into_owned();
        Ok(ProfilerEvent {
            name,
            device_type: event.device_type,
            activity_type: event.activity_type,
            start_ns: event.start_ns,
            duration_ns: event.duration_ns,
            thread_id: event.thread_id,
        })
    }

    /// Writes the Chrome trace to `path`.
    pub(crate) fn save(&self, path: &std::path::Path) -> Result<()> {
        let path = c_string(&path.to_string_lossy())?;
        // SAFETY: live profile, NUL-terminated path for the call.
        check(unsafe { abi::sk_profiler_save(self.0, path.as_ptr()) })
    }
}

impl Drop for ProfilerResult {
    fn drop(&mut self) {
        // SAFETY: created by sk_profiler_stop, freed exactly once.
        unsafe { abi::sk_profiler_free(self.0) }
    }
}

/// A user-scope range recorded by an active profiler (a no-op without one), closed on drop.
pub(crate) struct RecordRange(*mut c_void);

impl RecordRange {
    pub(crate) fn open(name: &str) -> Result<Self> {
        let name = c_string(name)?;
        let mut raw = ptr::null_mut();
        // SAFETY: NUL-terminated name for the call (the shim copies it); `raw` receives the range.
        check(unsafe { abi::sk_record_range_open(name.as_ptr(), &mut raw) })?;
        Ok(Self(raw))
    }

    pub(crate) fn close(mut self) -> Result<()> {
        let raw = std::mem::replace(&mut self.0, ptr::null_mut());
        // SAFETY: raw came from sk_record_range_open; close frees it.
        check(unsafe { abi::sk_record_range_close(raw) })
    }
}

impl Drop for RecordRange {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: as in `close`; on this path (unwinding) the status has no one to go to.
            let _ = unsafe { abi::sk_record_range_close(self.0) };
        }
    }
}

/// Starts PyTorch's execution trace, written to `path` (one per process).
pub(crate) fn execution_trace_start(path: &std::path::Path) -> Result<()> {
    let path = c_string(&path.to_string_lossy())?;
    // SAFETY: NUL-terminated path for the call; the observer copies it.
    check(unsafe { abi::sk_execution_trace_start(path.as_ptr()) })
}

/// Stops the execution trace and finishes its file.
pub(crate) fn execution_trace_stop() -> Result<()> {
    // SAFETY: no arguments; stopping with no trace recording is a no-op in the observer.
    check(unsafe { abi::sk_execution_trace_stop() })
}

/// The float arguments of the last execution trace, exactly (the file rounds them to six
/// decimals): each call's RecordFunction handle (the trace's `rf_id`), the argument's position
/// among the call's arguments, and its value.
pub(crate) fn execution_trace_doubles() -> Result<Vec<(u64, usize, f64)>> {
    let mut count = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_execution_trace_double_count(&mut count) })?;
    (0..count)
        .map(|index| {
            let (mut rf_id, mut position, mut value) = (0, 0, 0.0);
            // SAFETY: index below the count just read (the list changes only when a trace
            // starts, which the recording lock rules out); valid out-pointers.
            check(unsafe {
                abi::sk_execution_trace_double(index, &mut rf_id, &mut position, &mut value)
            })?;
            Ok((rf_id, position as usize, value))
        })
        .collect()
}

/// The calling thread's id in RecordFunction's numbering (the execution trace's `tid`).
pub(crate) fn record_function_thread_id() -> Result<u64> {
    let mut id = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_record_function_thread_id(&mut id) })?;
    Ok(id)
}
