//! speedkit's own CUDA kernels: the fused operations behind [`crate::nn`]'s modules.
//!
//! The kernels live as CUDA C++ source in `speedkit/kernels/<op>.cuh` (one file per operation: its
//! forward, its backward and the host launcher), embedded in the binary and compiled at run time
//! with NVRTC for the GPU in use. The cubins are cached on disk, keyed by the sources, the
//! architecture and NVRTC's version, under `$SPEEDKIT_KERNEL_CACHE`, else
//! `$XDG_CACHE_HOME/speedkit/kernels`, else `~/.cache/speedkit/kernels`. NVRTC and the CUDA headers
//! come from the torch wheel next to libtorch (`nvidia/cu13`), or from `CUDA_HOME`.
//!
//! Compiling needs no GPU, so every kernel is compiled in CI ([`compile`]); loading and launching
//! use the CUDA driver library and happen on first use on a GPU, during the warm-up steps that
//! precede CUDA-graph capture. Kernels launch on PyTorch's current stream, allocate through its
//! caching allocator and never synchronise, so they can be captured.
//!
//! ```
//! for file in speedkit::kernels::files()? {
//!     println!("{file}");
//! }
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tch::Device;

use crate::error::{Result, SpeedkitError};
use crate::ffi;

/// A GPU architecture, compiled for as `sm_<major><minor>`.
///
/// ```
/// let hopper = speedkit::kernels::Arch { major: 9, minor: 0 };
/// assert_eq!(hopper.to_string(), "sm_90");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// The compute capability's major number (8 for Ampere, 9 for Hopper).
    pub major: u32,
    /// The compute capability's minor number.
    pub minor: u32,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The embedded kernel files (`speedkit/kernels/*.cuh`), by file name, sorted.
///
/// ```
/// assert!(speedkit::kernels::files()?.contains(&"layernorm.cuh".to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn files() -> Result<Vec<String>> {
    ffi::kernel_source_names()
}

/// Compiles the kernel file `file` with NVRTC for `arch`, bypassing the cache, and returns the
/// size of the cubin in bytes. Needs NVRTC and the CUDA headers, not a GPU. The error carries
/// NVRTC's log when the file does not compile.
///
/// ```no_run
/// use speedkit::kernels::{compile, Arch};
/// let bytes = compile("layernorm.cuh", Arch { major: 8, minor: 0 })?;
/// assert!(bytes > 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn compile(file: &str, arch: Arch) -> Result<usize> {
    let index = files()?
        .iter()
        .position(|name| name == file)
        .ok_or_else(|| SpeedkitError::Misuse(format!("speedkit has no kernel file {file}")))?;
    ffi::kernel_compile(index, arch.major, arch.minor)
}

/// NVRTC's version, e.g. `(13, 0)`; an error saying where NVRTC was looked for when it is missing.
///
/// ```no_run
/// let (major, minor) = speedkit::kernels::nvrtc_version()?;
/// println!("NVRTC {major}.{minor}");
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn nvrtc_version() -> Result<(u32, u32)> {
    let version = ffi::nvrtc_version()?;
    Ok((version / 1000, (version % 1000) / 10))
}

/// Why speedkit's kernels cannot run on `device`, or `None` when they can: a CUDA device of
/// SM ≥ 8.0, with NVRTC, the CUDA headers and the CUDA driver library found.
///
/// ```
/// use tch::Device;
/// let why = speedkit::kernels::unavailable_reason(Device::Cpu)?;
/// assert!(why.is_some());
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn unavailable_reason(device: Device) -> Result<Option<String>> {
    match device {
        Device::Cuda(index) => ffi::kernels_unavailable_reason(index),
        other => Ok(Some(format!(
            "speedkit's kernels run on CUDA devices, not on {other:?}"
        ))),
    }
}

// ----- when the kernels run --------------------------------------------------------------------

/// Whether speedkit's modules may use the kernels at all (the `kernels` setting); on by default,
/// so that [`crate::nn`] used without a [`crate::SpeedContext`] still takes them where they run.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Per CUDA device index: `None` when the kernels can run there, else why not (asked once).
static AVAILABILITY: Mutex<BTreeMap<usize, Option<String>>> = Mutex::new(BTreeMap::new());

/// Each distinct "op: reason" an op took the ATen path for, in order of first occurrence.
static FALLBACKS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The ops that ran on the kernels since the last [`take_ops_run`], in order of first run.
static OPS_RUN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Turns speedkit's kernels on or off for every [`crate::nn`] module in the process and returns the
/// previous setting. [`crate::apply_speedups`] sets it from the config's `kernels` key and puts
/// the previous value back when the context drops.
///
/// ```
/// let before = speedkit::kernels::set_enabled(false);   // ATen everywhere
/// assert!(!speedkit::kernels::enabled());
/// speedkit::kernels::set_enabled(before);
/// ```
pub fn set_enabled(on: bool) -> bool {
    ENABLED.swap(on, Ordering::SeqCst)
}

/// A [`crate::SpeedContext`]'s `kernels` setting, in force until dropped, when the previous
/// setting comes back (also during a panic).
#[derive(Debug)]
pub(crate) struct EnabledGuard {
    previous: bool,
}

impl EnabledGuard {
    pub(crate) fn set(on: bool) -> Self {
        Self {
            previous: set_enabled(on),
        }
    }
}

impl Drop for EnabledGuard {
    fn drop(&mut self) {
        set_enabled(self.previous);
    }
}

/// Whether speedkit's kernels are switched on (see [`set_enabled`]).
///
/// ```
/// println!("kernels on: {}", speedkit::kernels::enabled());
/// ```
pub fn enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
}

/// The distinct reasons an op ran on ATen instead of a kernel so far, each once, as
/// `"op: reason"` (the audit lists them).
///
/// ```
/// for line in speedkit::kernels::fallbacks() {
///     println!("{line}");
/// }
/// ```
pub fn fallbacks() -> Vec<String> {
    lock(&FALLBACKS).clone()
}

/// The ops (`layer_norm`, `cross_entropy`, ...) that ran on speedkit's kernels since the previous
/// call, each once, and starts counting afresh: the benchmark runner reports them per row.
///
/// ```
/// let _ = speedkit::kernels::take_ops_run();
/// assert!(speedkit::kernels::take_ops_run().is_empty());   // nothing ran in between
/// ```
pub fn take_ops_run() -> Vec<&'static str> {
    std::mem::take(&mut *lock(&OPS_RUN))
}

/// Records that `op` ran on the kernels.
pub(crate) fn note_run(op: &'static str) {
    let mut ops = lock(&OPS_RUN);
    if !ops.contains(&op) {
        ops.push(op);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Why the kernels cannot be used for a tensor on `device` now: switched off, not a CUDA device,
/// or a device they cannot run on. `None` when they can.
pub(crate) fn unusable_on(device: Device) -> Option<String> {
    if !enabled() {
        return Some("speedkit's kernels are off (kernels: false)".into());
    }
    let Device::Cuda(index) = device else {
        return Some(format!(
            "speedkit's kernels run on CUDA devices, not on {device:?}"
        ));
    };
    lock(&AVAILABILITY)
        .entry(index)
        .or_insert_with(|| match ffi::kernels_unavailable_reason(index) {
            Ok(reason) => reason,
            Err(e) => Some(e.to_string()),
        })
        .clone()
}

/// Records that `op` ran on ATen for `reason`; the first time for this op and reason only.
pub(crate) fn note_fallback(op: &str, reason: &str) {
    // Switched off, every op falls back for that one reason, which the plan already states; and a
    // later context that turns the kernels on must not list it as its own.
    if !enabled() {
        return;
    }
    let line = format!("{op}: {reason}");
    let mut notes = lock(&FALLBACKS);
    if !notes.contains(&line) {
        notes.push(line);
    }
}
