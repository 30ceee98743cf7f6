//! speedkit's own CUDA kernels: the fused operations behind [`crate::nn`]'s modules, and the layer
//! they run on.
//!
//! The kernels live as CUDA C++ source in `speedkit/kernels/<op>.cuh` (one file per operation: a
//! params struct per entry point, its forward and backward, and the host launcher), embedded in
//! the binary and compiled at run time with NVRTC for the GPU in use. More sources can be
//! registered at run time ([`CudaModule::new`](crate::cuda::CudaModule::new)). speedkit's own files
//! are compiled one entry point at a time, the one a launch asks for, so that a cold start pays for
//! the kernels it runs and not for every type combination a file holds; a registered source is
//! compiled whole. Each cubin is cached on disk under a key
//! of its own (its text, the registered sources it includes, the architecture and NVRTC's version),
//! under `$SPEEDKIT_KERNEL_CACHE`, else `$XDG_CACHE_HOME/speedkit/kernels`, else
//! `~/.cache/speedkit/kernels`. NVRTC and the CUDA headers come from the torch wheel next to
//! libtorch (`nvidia/cu13`), or from `CUDA_HOME`.
//!
//! Compiling needs no GPU, so every kernel is compiled in CI ([`compile`]); loading and launching
//! use the CUDA driver library and happen on first use on a GPU, during the warm-up steps that
//! precede CUDA-graph capture. Kernels launch on PyTorch's current stream, allocate through its
//! caching allocator and never synchronise, so they can be captured.
//!
//! Every fused op takes one path: its kernel where the kernel switch allows it ([`set_enabled`],
//! the config's `kernels`, per op through [`Flag::SpeedkitKernel`](crate::flags::Flag)) and its
//! inputs pass the op's checks, ATen's composite otherwise; each outcome is counted in one channel
//! of [`notes`], which the audit, the runner and the profiler read.
//!
//! ```
//! for file in speedkit::kernels::files()? {
//!     println!("{file}");
//! }
//! # Ok::<(), speedkit::SpeedkitError>(())
//! ```

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use tch::Device;

use crate::cuda::CudaModule;

use crate::error::{Result, SpeedkitError};
use crate::ffi::{self, raw};
use crate::flags::{Flag, FlagValue};

mod notes;
mod op;

pub(crate) use notes::note;
pub use notes::{fallbacks, notes, take_ops_run, KernelNote, NoteMark, Outcome};
pub use op::KernelOp;

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

/// speedkit's own kernel files (`speedkit/kernels/*.cuh`), by file name, sorted.
///
/// ```
/// assert!(speedkit::kernels::files()?.contains(&"layernorm.cuh".to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn files() -> Result<Vec<String>> {
    let (mut names, builtin) = ffi::kernels::source_names()?;
    names.truncate(builtin);
    Ok(names)
}

/// The sources registered at run time ([`CudaModule::new`](crate::cuda::CudaModule::new)), in
/// order of registration.
///
/// ```
/// speedkit::cuda::CudaModule::new("doc_empty.cu", "// nothing yet\n")?;
/// assert!(speedkit::kernels::registered()?.contains(&"doc_empty.cu".to_string()));
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn registered() -> Result<Vec<String>> {
    let (names, builtin) = ffi::kernels::source_names()?;
    Ok(names.into_iter().skip(builtin).collect())
}

/// Registers CUDA C++ `source` under the file name `name`, to be compiled with NVRTC on first use
/// with a cache key of its own; speedkit's sources are available to it as headers by their names
/// (`#include "common.cuh"`). The same name and text again is the same source; the same name with
/// other text is an error. Public through [`CudaModule::new`](crate::cuda::CudaModule::new), the
/// one way in.
pub(crate) fn register_source(name: &str, source: &str) -> Result<()> {
    ffi::kernels::register_source(name, source).map(|_| ())
}

/// Compiles the kernel source `file` (one of [`files`] or [`registered`]) with NVRTC for `arch`,
/// bypassing the cache, and returns the size of the cubin in bytes. Needs NVRTC and the CUDA headers, not a GPU. The error carries
/// NVRTC's log when the file does not compile.
///
/// ```no_run
/// use speedkit::kernels::{compile, Arch};
/// let bytes = compile("layernorm.cuh", Arch { major: 8, minor: 0 })?;
/// assert!(bytes > 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn compile(file: &str, arch: Arch) -> Result<usize> {
    ffi::kernels::compile(source_index(file)?, None, arch.major, arch.minor)
}

/// Compiles one entry point of the kernel source `file` with NVRTC for `arch`, bypassing the
/// cache, and returns the size of the cubin in bytes: what a launch compiles, on first use, of
/// one of speedkit's own [`files`] (a cold start compiles only the kernels it launches, not every
/// type combination a file holds). An error names the entry point when `file` has none of that
/// name.
///
/// ```no_run
/// use speedkit::kernels::{compile_entry_point, Arch};
/// let bytes = compile_entry_point("layernorm.cuh", "layernorm_param_grad_f32", Arch { major: 9, minor: 0 })?;
/// assert!(bytes > 0);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn compile_entry_point(file: &str, entry_point: &str, arch: Arch) -> Result<usize> {
    ffi::kernels::compile(
        source_index(file)?,
        Some(entry_point),
        arch.major,
        arch.minor,
    )
}

/// The most threads [`compile_ahead`] compiles on: NVRTC takes a few hundred MiB a compile.
pub const MOST_COMPILE_THREADS: usize = 16;

/// What [`compile_ahead`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompiledAhead {
    /// Sources NVRTC compiled.
    pub compiled: usize,
    /// Sources already compiled: by this process, or in the disk cache.
    pub cached: usize,
    /// Sources that did not compile; a load of one of their kernels reports NVRTC's log.
    pub failed: usize,
    /// The threads that compiled.
    pub threads: usize,
    /// The wall-clock seconds it took.
    pub seconds: f64,
}

impl fmt::Display for CompiledAhead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} kernel source(s) compiled in {:.2} s on {} thread(s), {} already compiled",
            self.compiled, self.seconds, self.threads, self.cached
        )?;
        if self.failed > 0 {
            write!(f, ", {} not compiled", self.failed)?;
        }
        Ok(())
    }
}

/// Compiles `modules` (sources registered at run time, not speedkit's own files) for `arch` on as many threads as the machine
/// has, at most [`MOST_COMPILE_THREADS`], ahead of the loads of their kernels, which then find them
/// compiled: many sources cost about the longest compile rather than the sum. Each cubin also goes
/// to the disk cache. Needs NVRTC, not a GPU. A source that does not compile is counted in
/// [`CompiledAhead::failed`] and left for its load to report.
///
/// ```
/// use speedkit::cuda::CudaModule;
/// use speedkit::kernels::{compile_ahead, Arch};
///
/// let modules = [1, 2, 3].map(|k| {
///     let source = format!(
///         "extern \"C\" __global__ void scale_{k}(float* x, int n) {{\n\
///          int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
///          if (i < n) x[i] *= {k}.f;\n}}\n"
///     );
///     CudaModule::new(&format!("doc_scale_{k}.cu"), &source)
/// });
/// let modules = modules.into_iter().collect::<Result<Vec<_>, _>>()?;
/// let done = compile_ahead(&modules, Arch { major: 9, minor: 0 })?;
/// assert_eq!(done.compiled + done.cached, 3);
/// // Compiled once per process: a second call finds them all.
/// assert_eq!(compile_ahead(&modules, Arch { major: 9, minor: 0 })?.cached, 3);
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn compile_ahead(modules: &[CudaModule], arch: Arch) -> Result<CompiledAhead> {
    let start = std::time::Instant::now();
    let (registry, builtin) = ffi::kernels::source_names()?;
    let mut indices = Vec::with_capacity(modules.len());
    for module in modules {
        match registry.iter().position(|n| n == module.name()) {
            Some(index) if index >= builtin => indices.push(index),
            Some(_) => {
                return Err(SpeedkitError::Misuse(format!(
                    "{} is one of speedkit's own files, compiled one entry point at a time as its \
                     kernels launch; compile_ahead takes sources registered with CudaModule::new",
                    module.name()
                )))
            }
            None => {
                return Err(SpeedkitError::Misuse(format!(
                    "no kernel source {} is registered",
                    module.name()
                )))
            }
        }
    }
    indices.sort_unstable();
    indices.dedup();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MOST_COMPILE_THREADS)
        .min(indices.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let compile = || {
        let mut outcomes = Vec::new();
        while let Some(&index) = indices.get(next.fetch_add(1, Ordering::Relaxed)) {
            outcomes.push(ffi::kernels::prepare(index, arch.major, arch.minor));
        }
        outcomes
    };
    let outcomes: Vec<Result<bool>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads).map(|_| scope.spawn(compile)).collect();
        // A worker that panicked compiled no more; its sources compile as their kernels load.
        (workers.into_iter())
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    let mut done = CompiledAhead {
        threads,
        ..CompiledAhead::default()
    };
    for outcome in &outcomes {
        match outcome {
            Ok(true) => done.compiled += 1,
            Ok(false) => done.cached += 1,
            Err(_) => done.failed += 1,
        }
    }
    done.seconds = start.elapsed().as_secs_f64();
    Ok(done)
}

/// The index of the kernel source `file` in the shim's registry.
fn source_index(file: &str) -> Result<usize> {
    ffi::kernels::source_names()?
        .0
        .iter()
        .position(|name| name == file)
        .ok_or_else(|| SpeedkitError::Misuse(format!("speedkit has no kernel file {file}")))
}

/// NVRTC's version, e.g. `(13, 0)`; an error saying where NVRTC was looked for when it is missing.
///
/// ```no_run
/// let (major, minor) = speedkit::kernels::nvrtc_version()?;
/// println!("NVRTC {major}.{minor}");
/// # Ok::<(), speedkit::SpeedkitError>(())
/// ```
pub fn nvrtc_version() -> Result<(u32, u32)> {
    let version = ffi::kernels::nvrtc_version()?;
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
        Device::Cuda(index) => ffi::kernels::unavailable_reason(index),
        other => Ok(Some(format!(
            "speedkit's kernels run on CUDA devices, not on {other:?}"
        ))),
    }
}

// ----- the kernel switch -------------------------------------------------------------------------

/// The switch of every op's kernels at once (the config's `kernels`), as a flag a
/// [`FlagGuard`](crate::flags::FlagGuard) sets and restores; [`KernelOp::flag`] is one op's.
///
/// ```
/// assert_eq!(speedkit::kernels::flag().name(), "speedkit.kernels");
/// ```
pub fn flag() -> Flag {
    op::all_ops_flag()
}

/// Turns speedkit's kernels on or off for every op in the process and returns the previous
/// setting: the raw setter of [`flag`]. A [`crate::SpeedContext`] holds the config's `kernels`
/// setting in its flag guard instead, with the flags' stacking, restore and thread rule; prefer
/// that, or a [`FlagGuard`](crate::flags::FlagGuard).
///
/// ```
/// let before = speedkit::kernels::set_enabled(false);   // ATen everywhere
/// assert!(!speedkit::kernels::enabled());
/// speedkit::kernels::set_enabled(before);
/// ```
pub fn set_enabled(on: bool) -> bool {
    let before = enabled();
    // Writing the shim's switch fails only for an unknown op id, which the op table excludes.
    let _ = flag().set(FlagValue::Bool(on));
    before
}

/// Whether speedkit's kernels are switched on (see [`set_enabled`]).
///
/// ```
/// println!("kernels on: {}", speedkit::kernels::enabled());
/// ```
pub fn enabled() -> bool {
    op::switch_on(raw::SK_OP_ALL).unwrap_or(false)
}

/// Whether `op`'s kernels are switched on: the switch of every op, and the op's own.
pub(crate) fn op_enabled(op: KernelOp) -> bool {
    enabled() && op::switch_on(op.code()).unwrap_or(false)
}
