//! speedkit's kernel layer: the kernel sources, their compilation, the kernel switch and the notes
//! of which ops ran on the kernels (`shim/kernels.cpp`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;

use super::{c_string, check, device_index, raw, raw::kernels as abi, text, Result};
use crate::error::SpeedkitError;

/// One distinct note of the kernel layer: `op` ran on its kernel (`reason` `None`) or took ATen's
/// path for `reason`, `count` times so far in the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Note {
    pub op: c_int,
    pub reason: Option<String>,
    pub count: u64,
}

/// Whether `op`'s kernels (`SK_OP_ALL`: every op's) are switched on.
pub(crate) fn setting_get(op: c_int) -> Result<bool> {
    let mut on = 0;
    // SAFETY: valid out-pointer; the shim range-checks `op`.
    check(unsafe { abi::sk_kernels_setting_get(op, &mut on) })?;
    Ok(on != 0)
}

pub(crate) fn setting_set(op: c_int, on: bool) -> Result<()> {
    // SAFETY: plain values; the shim range-checks `op`.
    check(unsafe { abi::sk_kernels_setting_set(op, c_int::from(on)) })
}

/// Why speedkit's kernels cannot run on CUDA device `index`, or `None` when they can.
pub(crate) fn unavailable_reason(index: usize) -> Result<Option<String>> {
    let mut reason: *const c_char = ptr::null();
    // SAFETY: valid out-pointer to the shim's per-thread string, copied at once.
    check(unsafe { abi::sk_kernels_unavailable_reason(device_index(index)?, &mut reason) })?;
    // SAFETY: NUL-terminated, alive until this thread's next call.
    Ok(unsafe { text(reason) })
}

/// Every distinct note so far, in order of first occurrence.
pub(crate) fn notes() -> Result<Vec<Note>> {
    let mut n = 0i64;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_kernel_note_count(&mut n) })?;
    (0..n)
        .map(|index| {
            let mut note = raw::sk_kernel_note {
                op: 0,
                reason: ptr::null(),
                count: 0,
            };
            // SAFETY: index below the count just read (notes are only ever added); `note` is the
            // header's struct.
            check(unsafe { abi::sk_kernel_note_get(index, &mut note) })?;
            Ok(Note {
                op: note.op,
                // SAFETY: reasons live as long as the process.
                reason: unsafe { text(note.reason) },
                count: note.count.max(0) as u64,
            })
        })
        .collect()
}

/// Notes that `op` ran on its kernel (`fell_back` `None`) or took ATen's path for that reason.
pub(crate) fn note(op: c_int, fell_back: Option<&str>) -> Result<()> {
    let reason = fell_back.map(c_string).transpose()?;
    let reason_ptr = reason.as_ref().map_or(ptr::null(), |r| r.as_ptr());
    // SAFETY: `reason_ptr` is null or a NUL-terminated string alive for the call (the shim copies
    // it); the shim range-checks `op`.
    check(unsafe { abi::sk_kernel_note_add(op, reason_ptr) })
}

/// The names of the registered kernel sources, in the shim's order, and how many of the first are
/// speedkit's own.
pub(crate) fn source_names() -> Result<(Vec<String>, usize)> {
    let (mut count, mut builtin) = (0, 0);
    // SAFETY: valid out-pointers.
    check(unsafe { abi::sk_kernel_source_count(&mut count, &mut builtin) })?;
    (0..count)
        .map(|index| {
            let mut name: *const c_char = ptr::null();
            // SAFETY: index in range; the shim returns a pointer to a string it never frees.
            check(unsafe { abi::sk_kernel_source_name(index, &mut name) })?;
            // SAFETY: NUL-terminated, alive for the life of the process.
            Ok(unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned())
        })
        .collect::<Result<Vec<_>>>()
        .map(|names| (names, usize::try_from(builtin).unwrap_or(0)))
}

/// Registers CUDA C++ `source` under `name`; its index in [`source_names`].
pub(crate) fn register_source(name: &str, source: &str) -> Result<usize> {
    let (name, source) = (c_string(name)?, c_string(source)?);
    let mut index = 0;
    // SAFETY: NUL-terminated strings for the call (the shim copies them), valid out-pointer.
    check(unsafe { abi::sk_kernel_source_register(name.as_ptr(), source.as_ptr(), &mut index) })?;
    Ok(usize::try_from(index).unwrap_or(0))
}

/// `v` as the C ABI's `int`, or why it is not one.
fn to_c_int(v: u64) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| SpeedkitError::Misuse(format!("{v} is out of range")))
}

/// Compiles source `index` with NVRTC for `sm_<major><minor>`, all of it or its one
/// `entry_point`; the cubin's size in bytes.
pub(crate) fn compile(
    index: usize,
    entry_point: Option<&str>,
    major: u32,
    minor: u32,
) -> Result<usize> {
    let entry_point = entry_point.map(c_string).transpose()?;
    let mut bytes = 0i64;
    // SAFETY: plain integers, a NUL-terminated string or NULL for the call, a valid out-pointer.
    check(unsafe {
        abi::sk_kernel_compile(
            to_c_int(index as u64)?,
            entry_point
                .as_ref()
                .map_or(std::ptr::null(), |e| e.as_ptr()),
            to_c_int(u64::from(major))?,
            to_c_int(u64::from(minor))?,
            &mut bytes,
        )
    })?;
    Ok(usize::try_from(bytes).unwrap_or(0))
}

/// Compiles source `index` (registered at run time) for `sm_<major><minor>`, or reads it from the
/// disk cache, ahead of [`load`]: whether NVRTC ran. Safe on several threads at once.
pub(crate) fn prepare(index: usize, major: u32, minor: u32) -> Result<bool> {
    let mut compiled = 0;
    // SAFETY: plain integers and a valid out-pointer.
    check(unsafe {
        abi::sk_kernel_prepare(
            to_c_int(index as u64)?,
            to_c_int(u64::from(major))?,
            to_c_int(u64::from(minor))?,
            &mut compiled,
        )
    })?;
    Ok(compiled != 0)
}

/// NVRTC's version as major * 1000 + minor * 10.
pub(crate) fn nvrtc_version() -> Result<u32> {
    let mut version = 0;
    // SAFETY: valid out-pointer.
    check(unsafe { abi::sk_nvrtc_version(&mut version) })?;
    Ok(u32::try_from(version).unwrap_or(0))
}

/// Loads kernel `name` of source `index` on CUDA device `device`: its handle (freed by [`free`]) and
/// its parameters' byte sizes, `None` when the driver cannot tell.
pub(crate) fn load(
    index: usize,
    name: &str,
    device: usize,
) -> Result<(*mut c_void, Option<Vec<usize>>)> {
    let name = c_string(name)?;
    let mut sizes = vec![0i64; 256];
    let (mut handle, mut count) = (ptr::null_mut(), 0i64);
    // SAFETY: a NUL-terminated name, valid out-pointers, `sizes` of the capacity passed.
    check(unsafe {
        abi::sk_kernel_load(
            c_int::try_from(index).unwrap_or(c_int::MAX),
            name.as_ptr(),
            device_index(device)?,
            &mut handle,
            sizes.as_mut_ptr(),
            sizes.len() as i64,
            &mut count,
        )
    })?;
    let sizes = usize::try_from(count).ok().map(|n| {
        sizes.truncate(n.min(sizes.len()));
        sizes.into_iter().map(|s| s.max(0) as usize).collect()
    });
    Ok((handle, sizes))
}

/// Launches a loaded kernel; `args` holds one pointer to each argument's bytes.
pub(crate) fn launch(
    kernel: *mut c_void,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: &mut [*mut c_void],
) -> Result<()> {
    let shared = c_int::try_from(shared_bytes)
        .map_err(|_| SpeedkitError::Misuse(format!("{shared_bytes} bytes of shared memory")))?;
    // SAFETY: a live kernel handle; `args` points at live argument bytes for the call, as many as
    // the kernel takes (checked by the caller against its declaration).
    check(unsafe {
        abi::sk_kernel_launch(
            kernel,
            grid.as_ptr(),
            block.as_ptr(),
            shared,
            args.as_mut_ptr(),
        )
    })
}

/// Frees a handle from [`load`].
pub(crate) fn free(kernel: *mut c_void) {
    // SAFETY: a handle from `load`, freed once (by its owner's Drop).
    unsafe { abi::sk_kernel_free(kernel) }
}
